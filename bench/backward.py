"""chunk_kda forward + backward: kda_jax (Triton, XLA) against fla's chunk_kda and cuDNN's
kimi_delta_attention (PyTorch autograd, one child process) in one run, on a GPU.

    python -m bench.backward [--gates init,softplus,layer,mild,strong] [--impls triton,fla,cudnn,xla]
                             [--shapes "1,8192,32"] [--varlen 1,1,1100,1300] [--json PATH]

Timed: one step computing o = chunk_kda(q, k, v, g, beta) on bench.inputs.make_gated's
arrays (bf16 q, k, v; float32 g, beta; K = V = --head-dim) and the gradients of sum(o * do)
for q, k, v, g and beta (and A_log, dt_bias at the layer regime): jax.vjp inside jax.jit for
kda_jax, returning o with the gradients, and torch.autograd.backward for the peers (timed in
a child process, bench.fla_peer, since torch's Triton and jax-triton clash in one process).
The step returns o: the gradient of a loss linear in o does not need o, and XLA would drop
the forward's kernels from a step that returned the gradients alone, where the peers'
autograd runs their forward (kda_jax rows of record before 2026-12-08 were timed that way:
the backward without the forward). cuDNN's sm90 backward declines
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
    step = jax.jit(forward_backward(impl, bounds, flags))
    return lambda: time_jax(step, arrays, params, do)


def forward_backward(impl, bounds, flags):
    """(arrays, params, do) -> (o, (d arrays, d params)): chunk_kda's output and the
    gradients of sum(o * do), as a training step has them. o is returned so that
    the forward runs (module docstring)."""
    def step(arrays, params, do):
        def f(arrays, params):
            return kda_jax.chunk_kda(*arrays, cu_seqlens=bounds, implementation=impl, **params,
                                     **flags)[0]
        o, vjp = jax.vjp(f, arrays, params)
        return o, vjp(do.astype(o.dtype))
    return step


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
