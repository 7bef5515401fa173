python -m raytrain.run --config examples/chargpt.yaml
