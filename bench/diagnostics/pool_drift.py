"""Drift of a 16-bit state pool over a long decode, against a float32 pool.

    python -m bench.diagnostics.pool_drift [--steps 4096] [--seqs 4] [--heads 2] [--head-dim 32]
        [--implementation xla] [--json bench/results/pool16-drift.json]

N sequences decode one token per step from zero states held in a pool of
float32, bfloat16 or float16 (``fused_recurrent_kda_pool``,
every step in one jitted ``lax.scan`` with the pool donated), on the same
inputs: bench/inputs.py's "layer" regime (raw q, k, beta and gate; the q/k L2
norm, the beta sigmoid and the safe gate at lower bound -5 computed in the
kernel) with the strong regime's gate parameters (exp(A_log) ~ U(1, 16),
dt_bias ~ U(-0.5, 0.5)). At the init gate's parameters (long memory) a bf16
pool's worst step reads 8e-3 over 4096 steps, past the bf16 bar: this
record is the strong gates'. A 16-bit pool rounds every state it writes, so
its rounding errors enter every later step; the row of each 16-bit dtype
records o's relative RMS difference from the float32 pool's o at every step
(the largest and the last) and the final states' relative RMS difference. Numerics, not timing: on a CPU
the XLA path measures the same arithmetic the GPU does, only slower.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.inputs import make_gated, options
from bench.harness import Results
from kda_jax.testing import rel_rms

DTYPES = ("bfloat16", "float16")


@functools.partial(jax.jit, static_argnames="impl", donate_argnums=0)
def _decode(pool, idx, xs, gate, impl):
    """o ``[steps, N, 1, H, V]`` and the final pool of ``steps`` one-token steps."""
    def step(pool, x):
        o, pool = kda_jax.fused_recurrent_kda_pool(*x, pool, kda_jax.PoolRows(idx), **gate,
                                                   **options("layer", "kda_jax"),
                                                   implementation=impl)
        return pool, o

    pool, o = jax.lax.scan(step, pool, xs)
    return o, pool


def drift(steps=4096, seqs=4, heads=2, head_dim=32, impl="xla", dtypes=DTYPES, seed=0):
    """One row per 16-bit dtype: o's relative RMS difference from the float32
    pool's o, step by step (``o_rel_rms_max``, at ``o_rel_rms_max_step``;
    ``o_rel_rms_final``; the means over the first and the last tenth of the
    steps), and ``state_rel_rms``, the final pool rows' (written by the last
    step, read back in float32)."""
    x = make_gated(seqs, steps, heads, head_dim, head_dim, gates="layer", seed=seed)
    rng = np.random.default_rng(seed + 1)  # the strong regime's gate parameters
    x["A_log"] = np.log(rng.uniform(1, 16, heads)).astype(np.float32)
    x["dt_bias"] = rng.uniform(-0.5, 0.5, (heads, head_dim)).astype(np.float32)
    # [steps, N, 1, ...]: one token of every sequence per scan step.
    xs = tuple(jnp.asarray(np.swapaxes(x[n], 0, 1)[:, :, None])
               for n in ("q", "k", "v", "g", "beta"))
    gate = dict(A_log=jnp.asarray(x["A_log"]), dt_bias=jnp.asarray(x["dt_bias"].reshape(-1)))
    slots = seqs + 2  # two rows no sequence names; rows in reverse order
    idx = jnp.arange(seqs, 0, -1, dtype=jnp.int32)
    shape = (slots, heads, head_dim, head_dim)
    runs = {}
    for dtype in ("float32",) + tuple(dtypes):
        o, pool = _decode(jnp.zeros(shape, dtype), idx, xs, gate, impl)
        runs[dtype] = np.asarray(o, np.float32), np.asarray(pool[idx], np.float32)
    o32, s32 = runs["float32"]
    rows = []
    for dtype in dtypes:
        o, s = runs[dtype]
        per_step = np.array([rel_rms(o[t], o32[t]) for t in range(steps)])
        tenth = max(1, steps // 10)
        rows.append(dict(pool_dtype=dtype, implementation=impl, steps=steps, seqs=seqs,
                         heads=heads, head_dim=head_dim, gates="strong, in the kernel",
                         o_rel_rms_max=float(per_step.max()),
                         o_rel_rms_max_step=int(per_step.argmax()),
                         o_rel_rms_final=float(per_step[-1]),
                         # Growth, if any: the mean over the first and the last tenth.
                         o_rel_rms_mean_first_tenth=float(per_step[:tenth].mean()),
                         o_rel_rms_mean_last_tenth=float(per_step[-tenth:].mean()),
                         state_rel_rms=rel_rms(s, s32)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.diagnostics.pool_drift",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--implementation", default="xla", choices=kda_jax.IMPLEMENTATIONS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = drift(args.steps, args.seqs, args.heads, args.head_dim, args.implementation)
    for r in rows:
        print(f"{r['pool_dtype']:9} o rel_rms max {r['o_rel_rms_max']:.3e} (step "
              f"{r['o_rel_rms_max_step']}), final {r['o_rel_rms_final']:.3e}; state rel_rms "
              f"{r['state_rel_rms']:.3e}")
    measured = (f"numerics, not timing ({jax.default_backend().upper()}, "
                f"{args.implementation} path)")
    Results("bench.diagnostics.pool_drift", argv, args.json, measured=measured).add(*rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
