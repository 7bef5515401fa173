python -m raytrain.run --config examples/digits.yaml --set scaling.num_workers=2 --set distributed.strategy=fsdp
