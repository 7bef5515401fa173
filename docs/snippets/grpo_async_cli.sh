python -m raytrain.run --config examples/grpo_async.yaml
