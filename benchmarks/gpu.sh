#!/usr/bin/env bash
# One prepared run on a GPU machine (docs/benchmarks.md, "The GPU script"): install what raytrain needs
# from carried wheels, run the GPU tests (pytest -m gpu), then benchmarks/gpu_train.py; results under $OUT.
# Without a CUDA device it is a dry run: it says so, the GPU tests are collected and skip, and the
# benchmark runs its tiny CPU mode (the code path, no figures).
#
#   bash benchmarks/gpu.sh --fetch-wheels     # on a machine with network: fill benchmarks/wheels/ (ignored)
#   OUT=/some/dir bash benchmarks/gpu.sh      # on the GPU machine (benchmarks/wheels carried with the tree)
#
# Budget: under 8 minutes on an H100; each stage has its own time limit so that later ones still run.
# Context parallelism (cp_size 2: torch's ring attention under FSDP2) is tests/strategies/test_sp.py's gpu test: it
# needs 2 GPUs and skips on one.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=benchmarks/wheels
# What a one-process raytrain run imports and that machine lacks: pydantic (raytrain/config/) and its
# needs. Ray, Optuna, MLflow, plotly and cmaes are not imported by a one-process run or these tests.
# Ray does not fit the 64 MiB carry limit: its Python 3.12 wheel alone is 79.3 MB (ray 2.60.0).
PINS="pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0"

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $PINS || exit 1
    ls -l "$WHEELS"
    echo "wheels: $(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1) bytes; the tree that travels: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes (limit 67108864 together)"
    exit 0
fi

OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

main() {
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    export CUBLAS_WORKSPACE_CONFIG=:4096:8  # full_determinism's cuBLAS setting, before any process starts one
    echo "gpu.sh $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?'); results in $OUT"

    CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
    {
        date -u; uname -a; "$PY" --version
        "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
        command -v nvidia-smi >/dev/null && nvidia-smi
        "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|peft|pyarrow|safetensors|pydantic|numpy|xxhash|pytest) "
    } > "$OUT/env.txt" 2>&1

    SITE=/tmp/raytrain-site
    if [ "$CUDA" = 1 ]; then
        if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
                || { echo "installing the carried wheels failed"; return 1; }
            export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
        else
            echo "no wheels in $WHEELS: carry it (filled by 'bash benchmarks/gpu.sh --fetch-wheels'), or pydantic must be installed"
            export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        fi
    else
        echo "DRY RUN: no CUDA device here (torch.cuda.is_available() is False): the GPU tests are collected and skip,"
        echo "and the benchmark runs its tiny CPU mode; no figures. The carried wheels (Python 3.12) are not installed here."
        ls -l "$WHEELS" 2>/dev/null || echo "($WHEELS is empty: 'bash benchmarks/gpu.sh --fetch-wheels' fills it)"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import raytrain, pydantic; from raytrain import Trainer; print('raytrain imports; pydantic', pydantic.VERSION)" \
        || { echo "raytrain does not import: see above"; return 1; }

    # The GPU tests: every test file that marks one (other files import Ray or Optuna, absent there).
    FILES=$(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include="test_*.py" | sort)
    echo "== CUDA devices: $("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0) (cp_size 2 needs 2)"
    echo "== pytest -m gpu: $(echo $FILES)"
    timeout 240 "$PY" -m pytest -m gpu -n 0 -p no:cacheprovider --timeout 150 -v -rfEs --durations=0 \
        --junitxml "$OUT/junit.xml" $FILES 2>&1 | tee "$OUT/pytest.log" | tail -60
    TESTS_RC=${PIPESTATUS[0]}
    echo "== pytest exit status: $TESTS_RC (124: stopped at its 240 s limit; pytest.log has each test as it ended)"

    echo "== benchmarks/gpu_train.py"
    if [ "$CUDA" = 1 ]; then BENCH=(); else BENCH=(--tiny); fi
    timeout 180 "$PY" benchmarks/gpu_train.py "${BENCH[@]}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" \
        | grep -vE "Warning|warnings.warn|^\s*$" | tail -40
    BENCH_RC=${PIPESTATUS[0]}
    echo "== benchmark exit status: $BENCH_RC (124: stopped at its 180 s limit; bench.json holds the parts that ended)"
    echo "== benchmarks/trl.py --script async: AsyncGRPOTrainer (1 rollout actor on half the GPU) vs GRPOTrainer"
    if "$PY" -c "import ray, trl" 2>/dev/null; then
        timeout 150 "$PY" benchmarks/trl.py --script async --hidden 512 --layers 8 --batch 16 --generations 8 \
            --completion-length 128 --steps 6 --rounds 2 --threads 2 --trainer-threads 1 --json "$OUT/async.json" \
            2>&1 | tee "$OUT/async.log" | grep -E "^round|^async" | tail -5
    else
        echo "skipped: Ray or trl does not import here (the rollout actors need Ray)"
    fi
    echo "== done: tests $TESTS_RC, benchmark $BENCH_RC; files: $(ls "$OUT" | tr '\n' ' ')"
    [ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
}

main 2>&1 | tee "$OUT/gpu.log"  # a pipe, not exec > >(tee): the log is complete when the script returns
exit "${PIPESTATUS[0]}"
