python -m raytrain.run --config examples/grpo.yaml --set scaling.num_workers=2
python -m raytrain.run --config examples/grpo.yaml --set scaling.num_workers=2 --set distributed.strategy=fsdp
python -m raytrain.run --config examples/grpo.yaml --search search_spaces/grpo.yaml
