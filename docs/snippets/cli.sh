python -m raytrain.run --config examples/digits.yaml --set learning_rate=1e-3 --set model.hidden_size=256
python -m raytrain.run --help        # every field with its help text
