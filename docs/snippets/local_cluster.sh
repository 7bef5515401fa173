python -m raytrain.cli.local_cluster up cluster.yaml --idle-timeout-s 15
RAY_AUTH_MODE=token RAY_ADDRESS=ADDRESS python -m raytrain.run --config examples/digits.yaml --set scaling.num_workers=2 --set scaling.max_failures=1 --set scaling.storage_path=/tmp/raytrain-storage
RAY_AUTH_MODE=token ray status --address ADDRESS
python -m raytrain.cli.local_cluster terminate
python -m raytrain.cli.local_cluster capacity off
