python -m raytrain.run --config examples/digits.yaml --set num_train_epochs=2    # 90 steps: checkpoint-45, checkpoint-90
python -m raytrain.run --config examples/digits.yaml --set num_train_epochs=4    # the same output_dir: continues from step 90
python -m raytrain.run --config examples/digits.yaml --set num_train_epochs=6 --resume runs/digits/checkpoint-180
