python -m raytrain.run --config examples/digits.yaml
python -m raytrain.report runs/digits
