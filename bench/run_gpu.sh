#!/usr/bin/env bash
# GPU work in stages, each with its own time limit, logs and JSON under $OUT.
# Usage on the GPU machine (from the repo root): bash bench/run_gpu.sh STAGE...
#   tests     the Triton tiers natively (forward, decode, pool, bucketed, gradients)
#   fwdtests  the forward and decode tiers alone (about a minute)
#   forward   bench.forward, Triton and fla, over the dense sweep
#   fvarlen   bench.forward, Triton and fla, on the serving batch (varlen)
#   xla       bench.forward for the XLA path alone (its compiles are slow: minutes)
#   backward  bench.backward, Triton and fla
#   serving   bench.serving (SERVING_TIMEOUT)
#   serveloop the serving example (examples/serve_loop.py)
#   profile   Nsight Compute per-kernel times at (1, 8192, 32)
#   bprofile  the same for forward + backward
#   tune      bench.tune_forward's grid
#   dprofile  Nsight Compute per kernel of a dense decode step (N = 256), kda_jax and fla
#   dtrace    profiler timelines of 20 decode steps (N = 256), kda_jax (one
#             step and 8 chained steps per program) and fla, dense and with a
#             pool, and kda_jax's serving bounds without a pool: GPU busy and
#             idle time per step (bench.trace_decode)
#   source    Nsight Compute source-level stall samples of the prepare kernel
#   decode    bench.tune_decode's grid
#   dtorch    kda_jax's decode kernel and fla's launched from one PyTorch process
#             (bench.decode_kernels_torch): the kernel's time without JAX's runtime;
#             DTORCH_FORM=pool for the serving decode, DTORCH_VARIANTS="NAME=DIR,..."
#             for other kernels directories in the same run (carry them, e.g.
#             .variants/<commit>/kernels from `git archive <commit> kernels`)
#   drounds   bench.decode_rounds: the decode step (N = 256) and fla's taking
#             turns, kda_jax here and fla in a child kept alive (ROUNDS rounds)
#   donation  bench.decode_donation: a dense decode step kept, dropped or donated
#   dmemory   bench.decode_memory: the dense decode step against the copy ceiling,
#             a pipelined V-loop form, and the state buffers' placement (jit vs Triton);
#             DMEMORY_ARGS adds its options (--copies, --persistent, --no-placement...)
#   ptxas     the decode kernel built by Triton's bundled ptxas and by the CUDA
#             13 toolkit's (jaxlib compiles jax-triton's PTX itself, with its
#             CUDA's compiler; JAX_PTXAS names another): the ptxas versions,
#             bench.decode_memory's kernel rows under each, and the two cubins'
#             resource use and instruction counts
#   tuneb     bench.tune_backward's grid (fwd+bwd time and gradient errors per config)
#   savecache Triton's autotuning results (fla's kernels) into $OUT/autotune.tgz
#   pack      every log under $OUT into $OUT/logs.tgz (a call returns 8 files at most)
# SHAPES="B,T,H;B,T,H" limits `forward` and `backward` to those rows.
# GRID=NAME picks bench.tune_backward's grid; DECODE_CONFIGS ("16x1,32x4":
# block_v x warps) limits bench.tune_decode's and bench.decode_kernels_torch's
# configs, DECODE_BATCHES ("256") tune_decode's batch sizes. FORWARD_TIMEOUT, VARLEN_TIMEOUT, BACKWARD_TIMEOUT,
# SERVING_TIMEOUT and TESTS_TIMEOUT (seconds) replace those stages' limits.
# IMPLS (default "triton,fla") picks the implementations of `forward` and
# `backward` (and `fvarlen`), e.g.
# "triton,fla,xla" for the XLA column in the same run, last (its compiles take minutes).
# Measured on the H200: fla's first call per shape autotunes for minutes (more
# than 110 s for three shapes), and a machine starts without a Triton cache, so
# give `forward` and `backward` most of a call.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# fla and torch's Triton need a writable cache directory. fla's first call per
# shape autotunes for minutes: Triton keeps the winners on disk
# (TRITON_CACHE_AUTOTUNING), and a machine starts bare, so the `savecache`
# stage sends them back and a later call brings them (carry .triton-autotune).
# TRITON_CACHE_DIR is Triton's default under HOME: importing jax-triton empties
# the variable, and bench.sweep's fla child then falls back to that default.
export HOME=/tmp TRITON_CACHE_DIR=/tmp/.triton/cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-autotune/autotune.tgz ]; then
  tar xzf .triton-autotune/autotune.tgz -C "$TRITON_CACHE_DIR"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader > "$OUT/gpu.txt"
serving_lengths=$(python3 -c 'from kda_jax.testing import SERVING_LENGTHS as s; print(",".join(map(str, s)))')

for stage in "$@"; do
  echo "== $stage"
  case "$stage" in
    tests)
      # pytest-xdist (in the machine's image): the tiers are compile-bound.
      timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest tests/test_triton_forward.py tests/test_triton_recurrent.py \
        tests/test_state_pool.py tests/test_bucketed.py tests/test_triton_grad.py \
        tests/test_example_train.py -q -ra -p no:cacheprovider -n 6 > "$OUT/pytest_gpu.log" 2>&1
      tail -25 "$OUT/pytest_gpu.log" ;;
    fwdtests)
      timeout 150 python3 -m pytest tests/test_triton_forward.py tests/test_triton_recurrent.py \
        -q -ra -p no:cacheprovider > "$OUT/pytest_gpu_forward.log" 2>&1
      tail -12 "$OUT/pytest_gpu_forward.log" ;;
    forward)
      timeout "${FORWARD_TIMEOUT:-420}" python3 -m bench.forward --impls "${IMPLS:-triton,fla}" \
        ${SHAPES:+--shapes "$SHAPES"} --json "$OUT/h200-forward.json" > "$OUT/bench_forward.log" 2>&1
      tail -12 "$OUT/bench_forward.log" ;;
    fvarlen)
      timeout "${VARLEN_TIMEOUT:-120}" python3 -m bench.forward --impls "${IMPLS:-triton,fla}" \
        --varlen "$serving_lengths" --json "$OUT/h200-forward-varlen.json" \
        > "$OUT/bench_forward_varlen.log" 2>&1
      tail -4 "$OUT/bench_forward_varlen.log" ;;
    xla)
      timeout 500 python3 -m bench.forward --impls xla --json "$OUT/h200-forward-xla.json" \
        > "$OUT/bench_xla.log" 2>&1
      tail -12 "$OUT/bench_xla.log" ;;
    backward)
      timeout "${BACKWARD_TIMEOUT:-500}" python3 -m bench.backward --impls "${IMPLS:-triton,fla}" \
        ${SHAPES:+--shapes "$SHAPES"} \
        --json "$OUT/h200-backward.json" > "$OUT/bench_backward.log" 2>&1
      tail -12 "$OUT/bench_backward.log" ;;
    serving)
      timeout "${SERVING_TIMEOUT:-300}" python3 -m bench.serving --json "$OUT/h200-serving.json" \
        > "$OUT/bench_serving.log" 2>&1
      tail -16 "$OUT/bench_serving.log" ;;
    serveloop)
      timeout 120 python3 examples/serve_loop.py --steps 200 --check 3 > "$OUT/serve_loop.log" 2>&1
      tail -6 "$OUT/serve_loop.log" ;;
    profile)
      timeout 150 ncu --clock-control none --print-summary per-kernel python3 -m bench.profile_once 2>&1 \
        | grep -E "kda_|Duration|Registers" | head -24 | tee "$OUT/ncu.log" ;;
    bprofile)
      timeout 200 ncu --clock-control none --print-summary per-kernel python3 -m bench.profile_once \
        --backward 2>&1 | grep -E "^  [a-z_]|Duration|Registers" | tee "$OUT/ncu_backward.log" ;;
    dprofile)
      for peer in "bench.profile_once --decode 256" "bench.fla_profile --decode 256"; do
        echo "# $peer"
        timeout 150 ncu --clock-control none --print-summary per-kernel python3 -m $peer 2>&1 \
          | grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Registers|Achieved Occupancy"
      done | tee "$OUT/ncu_decode.log" ;;
    dtrace)
      for run in "kda_jax 1 dense" "kda_jax 8 dense" "fla 1 dense" "kda_jax 1 pool" "fla 1 pool" \
                 "kda_jax 1 varlen"; do
        read -r peer chain form <<< "$run"
        name="trace_decode_${peer}_${form}_$chain"
        timeout 120 python3 -m bench.trace_decode --peer "$peer" --chain "$chain" --form "$form" \
          --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        head -12 "$OUT/$name.log"
      done
      (cd "$OUT" && tar czf traces.tgz --remove-files trace_decode_*.json) ;;
    source)
      timeout 240 ncu --kernel-name kda_fwd_prepare_kernel --launch-count 1 --set full \
        --import-source yes -o "$OUT/prepare" python3 -m bench.profile_once > "$OUT/ncu_source.log" 2>&1
      ncu --import "$OUT/prepare.ncu-rep" --page source --csv --print-source cuda,sass \
        > "$OUT/prepare_source.csv" 2>> "$OUT/ncu_source.log"
      ncu --import "$OUT/prepare.ncu-rep" --page details --csv > "$OUT/prepare_details.csv" 2>> "$OUT/ncu_source.log"
      tail -3 "$OUT/ncu_source.log"; wc -l "$OUT"/prepare_*.csv ;;
    decode)
      timeout 240 python3 -m bench.tune_decode ${DECODE_CONFIGS:+--configs "$DECODE_CONFIGS"} \
        ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} --json "$OUT/tune_decode.json" 2>&1 \
        | grep -v Warning | tail -14 ;;
    dtorch)
      timeout 150 python3 -m bench.decode_kernels_torch ${DECODE_CONFIGS:+--configs "$DECODE_CONFIGS"} \
        ${DTORCH_FORM:+--form "$DTORCH_FORM"} ${DTORCH_VARIANTS:+--variants "$DTORCH_VARIANTS"} \
        --json "$OUT/decode_kernels_torch.json" > "$OUT/decode_kernels_torch.log" 2>&1
      grep -v Warning "$OUT/decode_kernels_torch.log" | tail -12 ;;
    drounds)
      timeout 240 python3 -m bench.decode_rounds --rounds "${ROUNDS:-8}" \
        --json "$OUT/decode_rounds.json" > "$OUT/decode_rounds.log" 2>&1
      grep -v Warning "$OUT/decode_rounds.log" | tail -6 ;;
    donation)
      timeout 150 python3 -m bench.decode_donation --json "$OUT/decode_donation.json" \
        > "$OUT/decode_donation.log" 2>&1
      grep -v Warning "$OUT/decode_donation.log" | tail -3 ;;
    dmemory)
      timeout 240 python3 -m bench.decode_memory --rounds "${ROUNDS:-3}" ${DMEMORY_ARGS:-} \
        --json "$OUT/decode_memory.json" > "$OUT/decode_memory.log" 2>&1
      grep -v Warning "$OUT/decode_memory.log" | tail -40 ;;
    ptxas)
      site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      { for p in $(find "$site" /usr/local/cuda*/bin -name ptxas -type f 2>/dev/null); do
          echo "$p: $($p --version | tail -1)"; done; } | tee "$OUT/ptxas_versions.txt"
      jax_ptxas=${JAX_PTXAS:-$(grep -v '/triton/' "$OUT/ptxas_versions.txt" | grep cuda_13 | head -1 | cut -d: -f1)}
      for which in triton jax; do
        cache=/tmp/ptxas-cache-$which; rm -rf "$cache"; mkdir -p "$cache"
        if [ "$which" = jax ]; then export TRITON_PTXAS_PATH="$jax_ptxas"; else unset TRITON_PTXAS_PATH; fi
        echo "# $which ptxas: ${TRITON_PTXAS_PATH:-bundled}"
        TRITON_CACHE_DIR=$cache timeout 150 python3 -m bench.decode_memory --no-jax --no-placement \
          --rounds "${ROUNDS:-2}" --vloop= ${DMEMORY_ARGS:-} --json "$OUT/decode_memory_ptxas_$which.json" \
          2>&1 | grep -v Warning | grep -E "^1 " | tee "$OUT/decode_memory_ptxas_$which.log"
        for c in $(find "$cache" -name 'kda_fused_recurrent_kernel.cubin'); do
          cuobjdump -sass "$c" > "$OUT/sass_full_$which.txt" 2>&1
          echo "## $c"; cuobjdump -res-usage "$c" | grep -i -E "REG|STACK|SHARED" | head -3
          cuobjdump -sass "$c" | grep -oE '^\s+/\*[0-9a-f]+\*/\s+[A-Z][A-Z0-9_.]*' | awk '{print $2}' \
            | sed 's/\..*//' | sort | uniq -c | sort -rn | head -25
        done > "$OUT/sass_$which.txt" 2>&1
      done
      unset TRITON_PTXAS_PATH ;;
    tuneb)
      timeout 300 python3 -m bench.tune_backward ${GRID:+--grid "$GRID"} --json "$OUT/tune_backward.json" 2>&1 \
        | grep -v Warning | tail -8 ;;
    tune)
      timeout 400 python3 -m bench.tune_forward --json "$OUT/tune_forward.json" 2>&1 \
        | grep -v Warning | tail -16 ;;
    savecache)
      (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
      ls -l "$OUT/autotune.tgz" ;;
    pack)
      (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log *.txt *.csv 2>/dev/null))
      tar tzf "$OUT/logs.tgz" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
