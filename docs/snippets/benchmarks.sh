python benchmarks/loop_overhead.py --steps 300 --rounds 3 --threads 1
python benchmarks/checkpoint.py --mb 64 --parts a,b,c,e
python benchmarks/ingest.py --rows 2000000 --part all
python benchmarks/hpo.py --seeds 3 --trials 20 --target 0.98
python benchmarks/ddp_vs_torchrun.py --steps 60
python benchmarks/threads.py --steps 200 --big-steps 40
python benchmarks/distributed.py --mb 32 --steps 40 --rounds 2 --parts saves,recovery
python benchmarks/distributed.py --parts layouts --steps 12 --hidden 512 --rounds 2
python benchmarks/distributed.py --parts recovery,elastic --health-checks default,fast
python benchmarks/local_cluster.py --health-checks cluster.yaml,default
python benchmarks/llm.py --hidden 384 --layers 4 --batch 4 --seq 256 --warmup 3 --steps 12 --rounds 3 --threads 1
python benchmarks/trl.py --hidden 256 --layers 4 --batch 4 --max-length 512 --warmup 2 --steps 10 --rounds 3
python benchmarks/trl.py --script grpo --batch 8 --generations 4 --completion-length 32 --steps 20 --rounds 4 --threads 1
python benchmarks/trl.py --script async --threads 2 --trainer-threads 1 --rollout-workers 1 --steps 40 --warmup 3 --rounds 5
python benchmarks/gpu_train.py --batch 16 --seq 1024 --warmup 10 --steps 40 --rounds 2
bash benchmarks/gpu.sh --fetch-wheels
OUT=gpu-results bash benchmarks/gpu.sh
python benchmarks/hf_trainer_tests.py --tests ../transformers/tests --all --json hf-tests.json
python benchmarks/trl_async_tests.py --tests ../trl/tests/experimental/test_async_grpo_trainer.py pr5911_test_async_grpo_trainer.py --json trl-async-tests.json
