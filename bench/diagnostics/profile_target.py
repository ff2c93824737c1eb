"""The program `bash bench/run_gpu.sh profile` runs under Nsight Compute: chunk_kda on
bench.inputs at one shape, jitted, called a few times (the first call compiles).

    python -m bench.diagnostics.profile_target B,T,H [--backward] [--calls N] [--impls triton,triton:F=V]
        [--gates REGIME]

With several --impls (bench.sweep's names: "triton", "triton:FIELD=VALUE", ...) each is
compiled and called in turn, in that order: Nsight Compute lists their kernels in it.
Without --gates the inputs are bench.inputs.make's (mild gates); with it, the sweeps'
inputs and options at that regime (bench.inputs.make_gated: the layer regime's gate runs
in the kernel).
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench import sweep
from bench.backward import forward_backward
from bench.inputs import GATES, make, make_gated


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", help="B,T,H (K = V = --head-dim, bf16)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backward", action="store_true",
                   help="the gradient of sum(o * do) too, with o (bench.backward.forward_backward)")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--gates", choices=GATES, help="a gate regime (default: make's inputs)")
    p.add_argument("--impls", default="triton",
                   help="comma-separated kda_jax implementations or variants (bench.sweep)")
    args = p.parse_args(argv)
    b, t, h = (int(x) for x in args.shape.split(","))
    d = args.head_dim
    params, flags = {}, {}
    if args.gates:
        x, params, flags = sweep.kda_jax_inputs(make_gated(b, t, h, d, d, args.gates),
                                                args.gates)
    else:
        x = [jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
             for i, a in enumerate(make(b, t, h, d, d))]
    do = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, h, d)), jnp.bfloat16)
    for impl in args.impls.split(","):
        name, traced = sweep.implementation(impl)
        fwd = lambda x, p: kda_jax.chunk_kda(*x, scale=d ** -0.5, implementation=name, **p,
                                             **flags)[0]
        step = fwd
        if args.backward:
            step = functools.partial(forward_backward(name, None, flags), do=do)
        with traced:
            step = jax.jit(step).lower(tuple(x), params).compile()
        for _ in range(args.calls):
            jax.block_until_ready(step(tuple(x), params))


if __name__ == "__main__":
    main()
