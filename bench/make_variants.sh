#!/usr/bin/env bash
# Copies of kernels/ as of past commits, for bench.decode_kernels_torch --variants:
# several versions of the decode kernel timed in one process beside fla's.
# Usage (repo root): bash bench/make_variants.sh NAME=COMMIT [NAME=COMMIT ...]
# Writes .variants/NAME/kernels (git-ignored; carry .variants to the GPU machine)
# and prints the DTORCH_VARIANTS value for bench/run_gpu.sh's dtorch stage, e.g.
#   DTORCH_VARIANTS=$(bash bench/make_variants.sh mask=12869ff even=ba4262f)
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 NAME=COMMIT [NAME=COMMIT ...]" >&2; exit 2; }
out=()
for spec in "$@"; do
  name=${spec%%=*} commit=${spec#*=}
  if [ -z "$name" ] || [ "$name" = "$spec" ]; then
    echo "variant '$spec' must be NAME=COMMIT" >&2; exit 2
  fi
  rm -rf ".variants/$name" && mkdir -p ".variants/$name"
  git archive "$commit" kernels | tar x -C ".variants/$name"
  out+=("$name=.variants/$name/kernels")
done
(IFS=,; echo "${out[*]}")
