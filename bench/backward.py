"""chunk_kda forward + backward: kda_jax (Triton, XLA) against fla's chunk_kda
(PyTorch autograd) in one run, on a GPU.

    python -m bench.backward [--impls triton,fla,xla] [--varlen 1,1,1100,1300]
                             [--json bench/results/h200-backward.json]

Each step computes o = chunk_kda(q, k, v, g, beta) (bf16 q, k, v; float32 g,
beta; K = V = --head-dim) and the gradients of sum(o * do) for q, k, v, g and
beta: jax.grad inside jax.jit for kda_jax, torch.autograd.backward for fla
(timed in a child process, bench.fla_peer, since torch's Triton and jax-triton
clash in one process). Times are medians in ms, compilation excluded; the
table and the JSON records give the ratio to fla.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench import sweep
from bench.timing import time_jax


def jax_runner(impl, arrays, cu):
    """A timed closure: one jitted forward + backward of kda_jax.chunk_kda."""
    q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
                        for i, a in enumerate(arrays))
    bounds = None if cu is None else kda_jax.SeqBounds(cu)
    do = jnp.asarray(np.random.default_rng(1).standard_normal(v.shape), jnp.bfloat16)

    @jax.jit
    def step(q, k, v, g, beta, do):
        def loss(q, k, v, g, beta):
            o = kda_jax.chunk_kda(q, k, v, g, beta, cu_seqlens=bounds, implementation=impl)[0]
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    return lambda: time_jax(step, q, k, v, g, beta, do)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep.add_arguments(p)
    args = p.parse_args(argv)
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        raise SystemExit("bench.backward times GPU kernels; JAX's default backend here is "
                         f"{jax.default_backend()!r}")
    sweep.run(args, argv, module="bench.backward", runner=jax_runner, mode="backward",
              extra=lambda b, t, h: {"passes": "forward+backward"})


if __name__ == "__main__":
    main()
