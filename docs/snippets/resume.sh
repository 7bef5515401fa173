python -m raytrain.run --config examples/digits.yaml --set max_steps=45     # stopped after one epoch: checkpoint-45
python -m raytrain.run --config examples/digits.yaml --set max_steps=90     # the same output_dir: continues from step 45
python -m raytrain.run --config examples/digits.yaml --set max_steps=135 --resume runs/digits/checkpoint-90
