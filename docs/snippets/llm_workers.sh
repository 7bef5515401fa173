python -m raytrain.run --config examples/lora.yaml --set scaling.num_workers=2 --set output_dir=runs/lora-2w
