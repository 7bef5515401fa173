python -m raytrain.run --config examples/lora.yaml --search search_spaces/lora.yaml
