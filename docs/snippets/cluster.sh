ray get-auth-token --generate                  # once: creates ~/.ray/auth_token if missing
ray up cluster.yaml
ray dashboard cluster.yaml &                   # forwards the dashboard to http://127.0.0.1:8265
RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
    python -m raytrain.run --config examples/digits.yaml \
    --set scaling.num_workers=4 --set scaling.use_gpu=true --set scaling.max_failures=3 \
    --set scaling.storage_path=s3://YOUR-BUCKET/raytrain --set output_dir=/tmp/raytrain/runs/digits
