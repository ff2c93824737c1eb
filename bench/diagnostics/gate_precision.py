"""The gradients' precision with the in-kernel gate: the relative RMS of every gradient of
chunk_kda (dq ... dh0, dA_log, ddt_bias) against autodiff of the float32 reference, at
fla's KDA gate grid (kda_jax.testing.GATE_PARAM_GRID), for each implementation or config
variant, in one process, and for fla's chunk_kda on the same arrays (implementation
"fla", in the PyTorch child bench.fla_peer): its own error is the scale the bars are read
against.

    python -m bench.diagnostics.gate_precision [--impls triton,triton:backward.FIELD=VALUE+...,fla]
                                   [--small] [--dtypes bfloat16] [--json PATH]

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
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench import sweep
from bench.fla_peer import GRADIENT_INPUTS as NAMES
from bench.harness import Peers, Results
from kda_jax import testing

FLA = "fla"


def gradients(fn, arrays, w_o, w_f, call_kw, out_dtype=None):
    """The gradients of testing.weighted_loss for every array."""
    loss = testing.weighted_loss(fn, arrays, call_kw, w_o, w_f, out_dtype=out_dtype)
    return jax.jit(jax.grad(loss))(arrays)


def fla_gradients(peers: Peers, arrays, w_o, w_f, scale: float, l2norm: bool):
    """fla's gradients of the same loss on the same arrays (float32 NumPy by name), or
    {"error" / "unavailable": why}."""
    with tempfile.TemporaryDirectory(prefix="kda-gate-precision-") as tmp:
        inputs, out = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "grads.npz")
        np.savez(inputs, w_o=w_o, w_f=w_f,
                 **{n: np.asarray(arrays[n], np.float32) for n in NAMES})
        job = dict(job="gradients", inputs=inputs, out=out, scale=scale, l2norm=bool(l2norm),
                   dtype=jnp.dtype(arrays["q"].dtype).name)
        for row in list(peers.rows(job)):  # to the job's end: the child then takes the next
            if "out" not in row:
                return {k: v for k, v in row.items() if k != "ms"}
            with np.load(row["out"]) as got:
                return {n: got[n] for n in NAMES}
    return {"error": "the child gave no row"}


def run(impls, grid, add=None, peers: Peers | None = None) -> list[dict]:
    """The rows of every (case, implementation), each passed to ``add`` as it lands (a run
    cut short keeps what it measured). "fla" runs in ``peers``' child (a run of its own
    where none is given)."""
    if peers is None:
        with Peers() as own:
            return run(impls, grid, add, own)
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
            if impl == FLA:
                got = fla_gradients(peers, arrays, w_o, w_f, call_kw["scale"], l2norm)
                if set(got) != set(NAMES):
                    rows.append(dict(case=label, implementation=impl, **got))
                    if add is not None:
                        add(rows[-1])
                    print(f"{label:34} {impl:60.60} {got}", flush=True)
                    continue
            else:
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
    p.add_argument("--dtypes", help="comma-separated input dtypes: the grid's cases of these "
                                    "only (default: every case)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    for impl in impls:  # a bad variant fails here, before anything runs
        if impl != FLA:
            sweep.implementation(impl)
    grid = testing.GATE_PARAM_GRID_SMALL if args.small else testing.GATE_PARAM_GRID
    if args.dtypes:
        wanted, present = args.dtypes.split(","), sorted({case[4] for case in grid})
        missing = [d for d in wanted if d not in present]
        if missing:
            p.error(f"--dtypes {args.dtypes!r}: the grid has no case of {missing} (its "
                    f"dtypes: {present})")
        grid = tuple(case for case in grid if case[4] in wanted)
    with Peers() as peers:
        results = Results("bench.diagnostics.gate_precision", argv, args.json, peers=peers)
        run(impls, grid, results.add, peers)


if __name__ == "__main__":
    main()
