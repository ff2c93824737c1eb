#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU test tier and the
# forward benchmarks, and leave logs and JSON under $OUT.
# Usage on the GPU machine (from the repo root): bash bench/run_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# fla and torch's Triton need a writable cache directory.
export HOME=/tmp TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest tests/test_triton_forward.py -q -ra -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
timeout 150 ncu --clock-control none --print-summary per-kernel python3 -m bench.profile_once 2>&1 | grep -E "kda_fwd|Duration|Registers|Local" | head -40 | tee "$OUT/ncu.log"
python3 -m kda_jax.demo --serving 2>&1 | tee "$OUT/demo_serving.log" | tail -15
python3 -m bench.forward --json "$OUT/h200-forward.json" "$@" 2>&1 | tee "$OUT/bench_forward.log"
python3 -m bench.forward --varlen "$(python3 -c 'from kda_jax.testing import SERVING_LENGTHS as s; print(",".join(map(str, s)))')" \
  --json "$OUT/h200-forward-varlen.json" 2>&1 | tee -a "$OUT/bench_forward.log"
# Serving: the bucketed form and the state pool natively, the example, then the serving benchmark.
python3 -m pytest tests/test_bucketed.py tests/test_state_pool.py -q -ra -p no:cacheprovider 2>&1 | tee "$OUT/pytest_serving.log" | tail -15
python3 examples/serve_loop.py --steps 200 --check 3 2>&1 | tee "$OUT/serve_loop.log" | tail -8
python3 -m bench.serving --json "$OUT/h200-serving.json" 2>&1 | tee "$OUT/bench_serving.log"
