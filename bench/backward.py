"""chunk_kda forward + backward: kda_jax (Triton, XLA) against fla's chunk_kda and cuDNN's
kimi_delta_attention (PyTorch autograd, one child process) in one run, on a GPU.

    python -m bench.backward [--gates init,softplus,layer,mild,strong] [--impls triton,fla,cudnn,xla]
                             [--shapes "1,8192,32"] [--varlen 1,1,1100,1300] [--json PATH]

Timed: one step computing o = chunk_kda(q, k, v, g, beta) on bench.inputs.make_gated's
arrays (bf16 q, k, v; float32 g, beta; K = V = --head-dim) and the gradients of sum(o * do)
for q, k, v, g and beta (and A_log, dt_bias at the layer regime): jax.grad inside jax.jit for
kda_jax, torch.autograd.backward for the peers (timed in a child process, bench.fla_peer,
since torch's Triton and jax-triton clash in one process). cuDNN's sm90 backward declines
in-kernel gates and norms: those rows say "refused". Times are medians in ms, compilation
excluded; the table and the JSON records give the ratios to the peers.
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


def jax_runner(impl, inputs, cu, gates="init"):
    """A timed closure: one jitted forward + backward of kda_jax.chunk_kda."""
    arrays, params, flags = sweep.kda_jax_inputs(inputs, gates)
    bounds = None if cu is None else kda_jax.SeqBounds(cu)
    do = jnp.asarray(np.random.default_rng(1).standard_normal(arrays[2].shape), jnp.bfloat16)

    @jax.jit
    def step(arrays, params, do):
        def loss(arrays, params):
            o = kda_jax.chunk_kda(*arrays, cu_seqlens=bounds, implementation=impl, **params,
                                  **flags)[0]
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(arrays, params)

    return lambda: time_jax(step, arrays, params, do)


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
