#!/usr/bin/env bash
# Runs the GPU test tiers and the benchmarks in stages, from the repository root:
#
#   bash bench/run_gpu.sh [STAGE...]        (no stage: tests forward backward serving decode plot)
#
#   tests     the GPU test tiers natively, in three stages that each run alone as well:
#     tests-1   the correctness suite (outputs and the gradient cases), decode kernel,
#               forward-only forms, extreme gates, non-finite inputs
#     tests-2   serving (state pools, bucketed batches, pool indices, verify, checkpoints,
#               16-bit pool drift)
#     tests-3   gradients beyond the suite's cases (configs, gate parameters at fla's grid,
#               gate regimes, the training example)
#             each under pytest-xdist with TEST_WORKERS processes (default 8: Triton's compiles,
#             which dominate, run side by side), its log in $OUT/pytest-<stage>.log
#   forward   bench.forward over SHAPES (default the dense sweep) at every regime of GATES, then
#             the serving batch (varlen): $OUT/forward.json, $OUT/forward-varlen.json
#   backward  bench.backward (forward + backward), the same rows: $OUT/backward.json
#   layer     bench.layer: the Flax layer's forward, training step and decode against fla's
#             layer at the softplus and safe gates (LAYER_GATES): $OUT/layer.json
#   serving   bench.serving: the mixed serving step, bucketed and static, against fla
#   decode    bench.decode: dense, float32 / bf16 pool and verify steps against fla, with
#             alternating rounds; then bench.diagnostics.pool_drift on the Triton path: $OUT/pool16-drift.json
#   precision bench.diagnostics.gate_precision: every gradient's relative RMS against the float32
#             reference at fla's gate grid, for PRECISION_IMPLS (default "triton"; config
#             variants as bench.sweep names them; "fla" for fla's own kernels on the same
#             arrays, which autotune each new shape for minutes): $OUT/gate-precision.json
#   plot      bench.plot: PNG charts of the JSON written here
#   tune-forward, tune-backward, tune-decode   the config tuners (bench/tune/)
#   profile   Nsight Compute on one chunk_kda call (bench.diagnostics.profile_target at PROFILE_SHAPE,
#             default 1,65536,4; PROFILE_ARGS=--backward for its gradient too): each kernel's
#             duration, occupancy and warp stalls ($OUT/profile-details.txt), and the stall
#             samples per SASS instruction, summarised by bench.diagnostics.stalls ($OUT/profile-stalls.txt)
#
# Needs a CUDA or ROCm GPU, the package's dependencies (pip install ".[cuda,test,bench]" or
# ".[rocm,test,bench]") and, for the peers' columns, the "peers" extra: torch, fla-core and
# flash-linear-attention (fla), nvidia-cudnn-frontend and apache-tvm-ffi (cuDNN's KDA; its
# sm90 engine compiles with NVRTC and the CUDA headers). A peer that is missing gives rows
# that say "unavailable"; the others still run.
# Results go to $OUT (default $TMPDIR/kda_jax-results); copy the files of record into
# bench/results/ under their names there (h100-forward.json ...).
#
# Settings (environment):
#   OUT         where logs and JSON go
#   IMPLS       the sweeps' implementations, in order (default "triton,fla,cudnn"; add ",xla"
#               for the XLA path last: its compiles take minutes)
#   GATES       the sweeps' gate regimes (bench.inputs; default "init softplus layer mild strong"): one JSON
#               per benchmark holds them all, each row with its "gates"
#   LAYER_GATES bench.layer's gate forms (default "softplus safe")
#   BASELINE    optional: a kda_jax source tree (`git archive REV kda_jax | tar -x -C
#               DIR`, DIR named by REV, carried to the machine) whose Triton path the forward
#               and backward sweeps also time, as implementation "tree:DIR" (bench/sweep.py)
#   SHAPES      "B,T,H;B,T,H": these rows instead of the dense sweep (forward, backward)
#   ROUNDS      bench.decode's alternating rounds (default 6)
#   TEST_WORKERS  pytest-xdist processes of the test stages (default 8; 0: none)
#   TIMEOUT     seconds per stage (default 900). fla's first call per shape autotunes for
#               minutes; Triton keeps the results in its cache (TRITON_CACHE_DIR, default
#               ~/.triton/cache), so a second run is much faster.
#   AUTOTUNE_IN optional: a .tar.gz of Triton autotune results (fla's kernels autotune), unpacked
#               into the Triton cache first. Every run packs the cache's results into
#               $OUT/autotune.tar.gz, so a machine that keeps no cache between commands (a fresh
#               device machine) pays fla's autotuning once: pass that file back as AUTOTUNE_IN.
#               TRITON_CACHE_AUTOTUNING=1 is set unless the environment sets it.
#   WHEELS      optional: a directory of .whl files to install first, for a machine with no
#               package index (pip install --no-index --no-deps --target into $OUT/site,
#               put first on PYTHONPATH). Without it the environment's packages are used.
set -uo pipefail
OUT=${OUT:-${TMPDIR:-/tmp}/kda_jax-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$OUT/site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$OUT/site:$PYTHONPATH
fi
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -n "${AUTOTUNE_IN:-}" ]; then
  mkdir -p "$triton_cache" && tar -xzf "$AUTOTUNE_IN" -C "$triton_cache" || exit 1
fi
pack_autotune() {
  [ -d "$triton_cache" ] || return 0
  (cd "$triton_cache" && find . -name '*.autotune.json' | tar -czf "$OUT/autotune.tar.gz" -T -)
}
trap pack_autotune EXIT
limit=${TIMEOUT:-900}
impls=${IMPLS:-triton,fla,cudnn}${BASELINE:+,tree:$BASELINE}
gates=${GATES:-init softplus layer mild strong}
gates=${gates// /,}
layer_gates=${LAYER_GATES:-softplus safe}
serving_lengths=$(python3 -c 'from kda_jax.testing import SERVING_LENGTHS as s; print(",".join(map(str, s)))')
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests forward backward serving decode plot)
expanded=()
for stage in "${stages[@]}"; do
  if [ "$stage" = tests ]; then expanded+=(tests-1 tests-2 tests-3); else expanded+=("$stage"); fi
done
stages=("${expanded[@]}")
workers=${TEST_WORKERS:-8}
declare -A test_files=(
  [tests-1]="tests/test_triton_forward.py tests/test_triton_recurrent.py tests/test_forward_only.py
             tests/test_gate_extremes.py tests/test_nonfinite.py"
  [tests-2]="tests/test_state_pool.py tests/test_bucketed.py tests/test_pool_indices.py
             tests/test_verify.py tests/test_checkpoints.py tests/test_pool_drift.py"
  [tests-3]="tests/test_triton_grad.py tests/test_gate_regimes.py tests/test_example_train.py"
)

for stage in "${stages[@]}"; do
  echo "== $stage"
  case "$stage" in
    tests-1|tests-2|tests-3)
      xdist=()
      [ "$workers" -gt 0 ] && xdist=(-n "$workers")
      # shellcheck disable=SC2086  # the file list splits on purpose
      timeout "$limit" python3 -m pytest ${test_files[$stage]} "${xdist[@]}" -q -ra \
        -p no:cacheprovider > "$OUT/pytest-$stage.log" 2>&1
      echo "exit $? after $SECONDS s"
      tail -25 "$OUT/pytest-$stage.log" ;;
    forward)
      timeout "$limit" python3 -m bench.forward --impls "$impls" --gates "$gates" \
        ${SHAPES:+--shapes "$SHAPES"} --json "$OUT/forward.json" 2>&1 | tee "$OUT/forward.log" \
        | tail -40
      timeout "$limit" python3 -m bench.forward --impls "$impls" --gates "$gates" \
        --varlen "$serving_lengths" --json "$OUT/forward-varlen.json" 2>&1 \
        | tee "$OUT/forward-varlen.log" | tail -8 ;;
    backward)
      timeout "$limit" python3 -m bench.backward --impls "$impls" --gates "$gates" \
        ${SHAPES:+--shapes "$SHAPES"} --json "$OUT/backward.json" 2>&1 \
        | tee "$OUT/backward.log" | tail -40 ;;
    layer)
      timeout "$limit" python3 -m bench.layer --skip-parity --gates "${layer_gates// /,}" \
        --json "$OUT/layer.json" 2>&1 | tee "$OUT/layer.log" | tail -20 ;;
    serving)
      timeout "$limit" python3 -m bench.serving --json "$OUT/serving.json" 2>&1 \
        | tee "$OUT/serving.log" | tail -10 ;;
    decode)
      timeout "$limit" python3 -m bench.decode --rounds "${ROUNDS:-6}" --json "$OUT/decode.json" 2>&1 \
        | tee "$OUT/decode.log" | tail -20
      timeout "$limit" python3 -m bench.diagnostics.pool_drift --implementation triton \
        --json "$OUT/pool16-drift.json" 2>&1 | tail -6 ;;
    precision)
      timeout "$limit" python3 -m bench.diagnostics.gate_precision --impls "${PRECISION_IMPLS:-triton}" \
        --json "$OUT/gate-precision.json" 2>&1 | tee "$OUT/gate-precision.log" | tail -12 ;;
    plot)
      python3 -m bench.plot --results "$OUT" ;;
    tune-forward|tune-backward|tune-decode)
      name=${stage#tune-}
      timeout "$limit" python3 -m "bench.tune.tune_$name" --json "$OUT/tune-$name.json" 2>&1 \
        | tee "$OUT/tune-$name.log" | tail -16 ;;
    profile)
      # Clocks left as they are (--clock-control none), as the rest of the benchmarks run.
      timeout "$limit" ncu --clock-control none --kernel-name "regex:${PROFILE_KERNELS:-kda_}" \
        --launch-skip "${PROFILE_SKIP:-0}" --launch-count "${PROFILE_COUNT:-12}" \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section SourceCounters --import-source yes -f \
        -o "$OUT/profile" python3 -m bench.diagnostics.profile_target "${PROFILE_SHAPE:-1,65536,4}" \
        ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
      ncu --import "$OUT/profile.ncu-rep" --page details > "$OUT/profile-details.txt"
      ncu --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/profile-sass.csv"
      python3 -m bench.diagnostics.stalls "$OUT/profile-sass.csv" > "$OUT/profile-stalls.txt"
      grep -E '^  [a-z_]+.*\(|Duration' "$OUT/profile-details.txt" | head -40
      head -60 "$OUT/profile-stalls.txt" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
