"""kda_jax's decode kernel and fla's, launched from one PyTorch process with the
same inputs, buffers and clock: separates the kernel's time from the JAX
runtime's (GPU only).

    python -m bench.decode_kernels_torch [--n 256] [--configs 64x4,32x4,32x1,64x2]
        [--form dense|pool] [--variants NAME=DIR,...] [--json PATH]

A decode step as bench.serving times it: N one-token sequences, H = 32,
K = V = 128, bf16 q, k, v, float32 g and beta. --form dense: a float32 initial
state and a new final state per step, against fla's ``fused_recurrent_kda``;
--form pool: the serving decode, bounds from a device cu_seqlens and the states
read from and written to a pool's rows in place, against fla's serving decode
(bench.serving.fla_pool_decode_call). kda_jax's kernel (``kda_jax/kernels``,
imported as a plain package so that neither JAX nor jax-triton loads) is
launched with Triton's own launcher at each ``--configs`` entry
(BLOCK_VxWARPS); ``--variants`` adds other copies of the kernels directory
(e.g. a past commit's: ``git archive C kernels | tar x -C .variants/C``) timed
in the same process, to compare kernel versions in one run. Rows are timed in
turn, twice. Each row: median ms over the same wall-clock harness as
bench.serving (and CUDA-event time), and the largest difference of o and of
the final state from fla's after one step from the same states.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time

from bench.inputs import make

KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "kda_jax", "kernels")
FORMS = ("dense", "pool")


def kda_kernels(directory: str = KERNELS_DIR, name: str = "kda_kernels"):
    """``directory``/fused_recurrent.py as package ``name`` (its relative import of
    state_io resolves inside it), without kda_jax's __init__."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(directory, "__init__.py"), submodule_search_locations=[directory])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{name}.fused_recurrent")


def decode_constexprs(h: int, d: int, bv: int, form: str = "dense", stages: int = 2) -> dict:
    """The kernel's constexprs for bench.serving's decode step (one token per
    sequence, no in-kernel transforms, initial and final state): what
    kda_jax.triton.recurrent.recurrent_constexprs derives for the dense call
    (uniform host bounds) or the serving call (a pool, bounds from metadata)."""
    if form not in FORMS:
        raise ValueError(f"{form=} must be one of {FORMS}")
    pool = form == "pool"
    return dict(H=h, HV=h, K=d, V=d, BK=d, BV=bv, SCALE=d ** -0.5, USE_L2NORM=False,
                USE_GATE=False, HAS_A_LOG=False, HAS_DT_BIAS=False, HAS_LOWER_BOUND=False,
                LOWER_BOUND=0.0, BETA_SIGMOID=False, BETA_SCALE=1.0, USE_INITIAL_STATE=True,
                STORE_FINAL_STATE=True, STATE_V_FIRST=False, INDEXED_STATE=pool,
                UNIFORM=not pool, SEQ_LEN=0 if pool else 1, LOOP_STAGES=stages)


def kernel_constexprs(kernel, consts: dict) -> dict:
    """``consts`` less those ``kernel`` does not take: a variant from a past
    commit may predate a constexpr (LOOP_STAGES came in session 10)."""
    names = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    return {k: x for k, x in consts.items() if k in names}


def variants_of(text: str | None) -> dict:
    """'NAME=DIR,...' -> {name: kernels directory}, the checkout's first."""
    out = {"kda_jax": KERNELS_DIR}
    for item in filter(None, (text or "").split(",")):
        name, sep, directory = item.partition("=")
        if not sep or not name or name in out:
            raise ValueError(f"variant {item!r} must be NAME=DIR with a new NAME")
        if not os.path.isfile(os.path.join(directory, "fused_recurrent.py")):
            raise ValueError(f"variant {name}: {directory!r} holds no fused_recurrent.py")
        out[name] = directory
    return out


def wall_and_event_ms(call, iters=50, repeats=5):
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    wall, event = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(iters):
            call()
        end.record()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3 / iters)
        event.append(start.elapsed_time(end) / iters)
    return statistics.median(wall), statistics.median(event)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--configs", default="64x4,32x4,32x1,64x2")
    p.add_argument("--form", default="dense", choices=FORMS)
    p.add_argument("--variants", default=None,
                   help="NAME=DIR,...: other kernels directories timed beside the checkout's")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    variants = variants_of(a.variants)

    import torch
    from fla.ops.kda import fused_recurrent_kda

    from bench.serving import fla_pool_decode_call

    n, h, d = a.n, a.heads, 128
    arrays = make(1, n, h, d, d, seed=1)
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.bfloat16).reshape(n, 1, h, d)
               for x in arrays[:3])
    g, beta = (torch.tensor(x, device="cuda").reshape((n, 1) + x.shape[2:]) for x in arrays[3:])
    dummy_f = torch.zeros(4, device="cuda")
    dummy_i = torch.zeros(4, device="cuda", dtype=torch.int32)
    cu = torch.arange(n + 1, device="cuda", dtype=torch.int32)  # the metadata: cu_seqlens at 0
    rows_idx = torch.arange(n, device="cuda", dtype=torch.int32)
    pool = a.form == "pool"

    def ours(kernel, bv, warps):
        """A fresh step: its own zero states (a pool updated in place by each call)."""
        consts = kernel_constexprs(kernel, decode_constexprs(h, d, bv, a.form))
        h0 = torch.zeros((n, h, d, d), device="cuda")
        meta, idx, slots = (cu, rows_idx, n) if pool else (dummy_i, dummy_i, 0)

        def call():
            o = torch.empty((n, h, d), device="cuda", dtype=torch.bfloat16)
            ht = h0 if pool else torch.empty((n, h, d, d), device="cuda")
            kernel[(d // bv, h, n)](
                q, k, v, g, beta, dummy_f, dummy_f, h0, idx, idx, meta, 0, n, n, slots,
                o, ht, **consts, num_warps=warps, num_stages=2)
            return o, ht
        return call

    def fla():
        if pool:
            return fla_pool_decode_call(*(x.reshape((1, n) + x.shape[2:])
                                          for x in (q, k, v, g, beta)))
        h0 = torch.zeros((n, h, d, d), device="cuda")
        return lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True)

    impls = {"fla": fla}
    for vname, directory in variants.items():
        kernel = kda_kernels(directory, f"kda_kernels_{len(impls)}").kda_fused_recurrent_kernel
        for c in a.configs.split(","):
            bv, w = (int(x) for x in c.split("x"))
            impls[f"{vname} kernel {bv}x{w}"] = (
                lambda kernel=kernel, bv=bv, w=w: ours(kernel, bv, w))

    ref_o, ref_h = (x.clone() for x in fla()())  # one step from zero states
    rows = []
    for rnd in range(2):
        for name, make_call in impls.items():
            wall, event = wall_and_event_ms(make_call())
            o, ht = make_call()()
            rows.append(dict(round=rnd, impl=name, n=n, form=a.form, wall_ms=wall,
                             event_ms=event,
                             o_max_diff=float((o.reshape(ref_o.shape).float() - ref_o.float())
                                              .abs().max()),
                             state_max_diff=float((ht - ref_h).abs().max())))
            print(f"{rnd} {name:28s} wall {wall:.4f} ms  events {event:.4f} ms  "
                  f"o diff {rows[-1]['o_max_diff']:.2e}  state diff {rows[-1]['state_max_diff']:.2e}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, torch=torch.__version__, variants=variants,
                           command="python -m bench.decode_kernels_torch " + " ".join(argv or sys.argv[1:])),
                      f, indent=1)


if __name__ == "__main__":
    main()
