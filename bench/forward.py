"""chunk_kda forward: kda_jax (Triton, XLA) against fla's chunk_kda and cuDNN's
kimi_delta_attention (PyTorch, one child process) in one run.

    python -m bench.forward [--gates init,softplus,layer,mild,strong] [--impls triton,fla,cudnn,xla]
                            [--shapes "1,8192,32;1,65536,4"] [--varlen 1,1,1100,1300] [--json PATH]

Timed: one call of o = chunk_kda(q, k, v, g, beta) on bench.inputs.make_gated's arrays at
each gate regime (bf16 q, k, v; float32 g, beta), compilation excluded (bench.timing). Each
row also gives the fraction of the H200's roofline (the fewest bytes: inputs read once, o
written once; the chunked algorithm's matrix FLOPs) and, for every implementation after
the shipped ``triton``, the relative RMS difference of its o from triton's.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax
import numpy as np

import kda_jax
from bench import sweep
from bench.timing import time_jax

H200_BYTES_PER_S = 4.3e12  # measured device-to-device copy on this workplace's H200s
H200_BF16_FLOPS = 790e12  # measured 8192^3 bf16 matmul, random data


def roofline_ms(b, t, h, kd, vd, chunk=64):
    tokens = b * t
    bytes_ = tokens * h * (2 * kd * 2 + vd * 2 + kd * 4 + 4 + vd * 2)
    # Multiply-adds per (chunk, head): Akk and Aqk (lower halves), w and u
    # (triangular A), the state pass (w S, q S, k^T v_new) and Aqk v_new.
    macs = (chunk * chunk * kd + chunk * chunk * (kd + vd) / 2
            + 3 * chunk * kd * vd + chunk * chunk * vd / 2)
    flops = 2 * macs * (tokens / chunk) * h
    return max(bytes_ / H200_BYTES_PER_S, flops / H200_BF16_FLOPS) * 1e3, bytes_, flops


def jax_runner(impl, inputs, cu, gates="init"):
    """A timed closure of one jitted kda_jax.chunk_kda; its ``output()`` gives o (float32)."""
    arrays, params, flags = sweep.kda_jax_inputs(inputs, gates)
    bounds = None if cu is None else kda_jax.SeqBounds(cu)

    @jax.jit
    def run(arrays, params):
        return kda_jax.chunk_kda(*arrays, cu_seqlens=bounds, implementation=impl, **params,
                                 **flags)[0]

    timer = lambda: time_jax(run, arrays, params)
    timer.output = lambda: np.asarray(run(arrays, params), np.float32)
    return timer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep.add_arguments(p)
    args = p.parse_args(argv)
    sweep.run(args, argv, module="bench.forward", runner=jax_runner, mode="forward",
              roofline=roofline_ms)


if __name__ == "__main__":
    main()
