"""One chunk_kda forward at (1, 8192, 32), K = V = 128, bf16, for a profiler
(e.g. ncu --print-summary per-kernel) to split the time between kernels."""

import jax
import jax.numpy as jnp

import kda_jax
from bench.inputs import make

q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
                    for i, a in enumerate(make(1, 8192, 32, 128, 128)))
run = jax.jit(lambda *a: kda_jax.chunk_kda(*a, implementation="triton")[0])
for _ in range(3):
    jax.block_until_ready(run(q, k, v, g, beta))
