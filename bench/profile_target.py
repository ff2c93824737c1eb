"""The program `bash bench/run_gpu.sh profile` runs under Nsight Compute: chunk_kda on
bench.inputs at one shape, jitted, called a few times (the first call compiles).

    python -m bench.profile_target B,T,H [--backward] [--calls N]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.inputs import make


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", help="B,T,H (K = V = --head-dim, bf16)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backward", action="store_true", help="the gradient of sum(o * do) too")
    p.add_argument("--calls", type=int, default=2)
    args = p.parse_args(argv)
    b, t, h = (int(x) for x in args.shape.split(","))
    d = args.head_dim
    x = [jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
         for i, a in enumerate(make(b, t, h, d, d))]
    fwd = lambda *a: kda_jax.chunk_kda(*a, scale=d ** -0.5)[0]
    step = jax.jit(fwd)
    if args.backward:
        do = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, h, d)), jnp.bfloat16)
        loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) * do)
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    for _ in range(args.calls):
        jax.block_until_ready(step(*x))


if __name__ == "__main__":
    main()
