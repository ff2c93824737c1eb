"""The gradients' precision with the in-kernel gate: the relative RMS of every gradient of
chunk_kda (dq ... dh0, dA_log, ddt_bias) against autodiff of the float32 reference, at
fla's KDA gate grid (kda_jax.testing.GATE_PARAM_GRID), for each implementation or config
variant, in one process.

    python -m bench.diagnostics.gate_precision [--impls triton,triton:backward.FIELD=VALUE+...]
                                   [--small] [--json PATH]

The loss is the gate-grid test's, testing.weighted_loss: sum(o * w_o) + sum(final_state *
w_f), the reference's o rounded to the inputs' dtype as the API rounds its own (so both see
the same cotangent). Implementations are bench.sweep's names ("triton", "xla", "triton:PATH=VALUE"
config variants). On a GPU the grid runs natively; --small takes the interpreter's grid
(KDA_JAX_INTERPRET=1 on a CPU). The bars to hold the numbers against are fla's for its
chunk_kda (testing.GRAD_TOLERANCES, docs/kda.md section 6).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench import sweep
from bench.harness import Results
from kda_jax import testing

NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def gradients(fn, arrays, w_o, w_f, call_kw, out_dtype=None):
    """The gradients of testing.weighted_loss for every array."""
    loss = testing.weighted_loss(fn, arrays, call_kw, w_o, w_f, out_dtype=out_dtype)
    return jax.jit(jax.grad(loss))(arrays)


def run(impls, grid, add=None) -> list[dict]:
    """The rows of every (case, implementation), each passed to ``add`` as it lands (a run
    cut short keeps what it measured)."""
    rows = []
    for case in grid:
        b, t, h, kd, dtype, normalizer, l2norm = case
        arrays, w_o, w_f = testing.gate_param_inputs(3, b, t, h, kd, dtype, normalizer, l2norm)
        call_kw = dict(scale=0.1, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                       use_qk_l2norm_in_kernel=l2norm)
        ref_arrays = {n: a.astype(jnp.float32) for n, a in arrays.items()}
        ref = gradients(kda_jax.naive_recurrent_kda, ref_arrays, w_o, w_f, call_kw,
                        out_dtype=arrays["q"].dtype)
        label = "B{}-T{}-H{}-K{}-{}-n{}-l2{}".format(*case)
        for impl in impls:
            name, traced_under = sweep.implementation(impl)
            fn = functools.partial(kda_jax.chunk_kda, implementation=name)
            with traced_under:
                got = gradients(fn, arrays, w_o, w_f, call_kw)
            errors = {f"d{n}": testing.rel_rms(np.asarray(got[n], np.float32),
                                               np.asarray(ref[n], np.float32)) for n in NAMES}
            rows.append(dict(case=label, implementation=impl, **errors))
            if add is not None:
                add(rows[-1])
            print(f"{label:34} {impl:60.60} "
                  + " ".join(f"{n}={e:.2e}" for n, e in errors.items()), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", default="triton",
                   help="comma-separated implementations or config variants (bench.sweep)")
    p.add_argument("--small", action="store_true",
                   help="the interpreter's grid (testing.GATE_PARAM_GRID_SMALL)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    for impl in impls:  # a bad variant fails here, before anything runs
        sweep.implementation(impl)
    grid = testing.GATE_PARAM_GRID_SMALL if args.small else testing.GATE_PARAM_GRID
    run(impls, grid, Results("bench.diagnostics.gate_precision", argv, args.json).add)


if __name__ == "__main__":
    main()
