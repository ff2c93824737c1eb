"""A 16-bit state pool over a long decode against a float32 pool
(bench/diagnostics/pool_drift.py; recorded in bench/results/pool16-drift.json): every
step's o within the pool dtype's tolerance of the float32 pool's o, the final
states too, and no growth of the difference over the steps.

The XLA path runs 4096 steps; the Triton kernels (in Triton's interpreter
without a GPU, whose bfloat16 store rounds in kda_jax/kernels/state_io._rounded) run
fewer.
"""

from __future__ import annotations

import pytest

from bench.diagnostics.pool_drift import drift
from kda_jax.testing import TOLERANCES
from kda_jax.triton import interpret_mode, unavailable_reason


def _check(rows, growth=False):
    for r in rows:
        tol = TOLERANCES[r["pool_dtype"]]["rel_rms"]
        what = f"{r['pool_dtype']} pool over {r['steps']} steps: {r}"
        assert r["o_rel_rms_max"] <= tol, what
        assert r["state_rel_rms"] <= tol, what
        if not growth:
            continue
        # Rounding errors do not pile up: each step's state forgets old ones
        # (the decay and the delta rule's projection) as fast as new ones come.
        # (Over a few steps the first ones, from zero states, weigh too much.)
        assert r["o_rel_rms_mean_last_tenth"] <= 1.5 * r["o_rel_rms_mean_first_tenth"], what


def test_16_bit_pool_drift_over_4096_decode_steps_xla():
    _check(drift(steps=4096, seqs=4, heads=2, head_dim=32, impl="xla"), growth=True)


@pytest.mark.skipif(unavailable_reason() is not None,
                    reason=f"Triton path unavailable: {unavailable_reason()}")
def test_bf16_pool_drift_triton():
    long = not interpret_mode()  # the interpreter takes about 0.4 s a launch
    _check(drift(steps=4096 if long else 12, seqs=2, heads=2, head_dim=32, impl="triton",
                 dtypes=("bfloat16",)), growth=long)
