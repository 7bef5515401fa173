python -m raytrain.run --config examples/grpo.yaml
