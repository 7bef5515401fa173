python -m raytrain.run --config examples/lora.yaml
