pip install -e ".[peft]" && python -m raytrain.run --config examples/lora.yaml
