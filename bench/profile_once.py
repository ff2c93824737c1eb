"""One chunk_kda call at (1, 8192, 32), K = V = 128, bf16, for a profiler
(e.g. ncu --print-summary per-kernel) to split the time between kernels.

    python -m bench.profile_once [--backward]

--backward: forward and backward (jax.grad of a sum of o), as bench.backward times it.
"""

import sys

import jax
import jax.numpy as jnp

import kda_jax
from bench.inputs import make

q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
                    for i, a in enumerate(make(1, 8192, 32, 128, 128)))


def forward(*a):
    return kda_jax.chunk_kda(*a, implementation="triton")[0]


if "--backward" in sys.argv[1:]:
    run = jax.jit(jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4)))
else:
    run = jax.jit(forward)
for _ in range(3):
    jax.block_until_ready(run(q, k, v, g, beta))
