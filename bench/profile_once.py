"""One chunk_kda call at (1, 8192, 32), K = V = 128, bf16, for a profiler
(e.g. ncu --print-summary per-kernel) to split the time between kernels.

    python -m bench.profile_once [--backward | --decode N]

--backward: forward and backward (jax.grad of a sum of o), as bench.backward times it.
--decode N: instead, a dense decode step of N one-token sequences with an initial
and a final state (fused_recurrent_kda, as bench.tune_decode times it), so the
profiler lists every kernel of the step, XLA's included.
"""

import sys

import jax
import jax.numpy as jnp

import kda_jax
from bench.inputs import make

def forward(*a):
    return kda_jax.chunk_kda(*a, implementation="triton")[0]


if "--decode" in sys.argv[1:]:
    from bench.tune_decode import decode_inputs

    x, h0 = decode_inputs(int(sys.argv[sys.argv.index("--decode") + 1]), 32, 128)
    step = jax.jit(lambda h0, *a: kda_jax.fused_recurrent_kda(
        *a, initial_state=h0, output_final_state=True, implementation="triton"))
    for _ in range(3):
        jax.block_until_ready(step(h0, *x))
    sys.exit(0)
q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
                    for i, a in enumerate(make(1, 8192, 32, 128, 128)))
if "--backward" in sys.argv[1:]:
    run = jax.jit(jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4)))
else:
    run = jax.jit(forward)
for _ in range(3):
    jax.block_until_ready(run(q, k, v, g, beta))
