"""kda_jax's decode kernel and fla's, launched from one PyTorch process with the
same inputs, buffers and clock: separates the kernel's time from the JAX
runtime's (GPU only).

    python -m bench.decode_kernels_torch [--n 256] [--configs 64x4,32x4,32x1,64x2]
        [--json PATH]

A dense decode step as bench.serving times it: N one-token sequences, H = 32,
K = V = 128, bf16 q, k, v, float32 g and beta, a float32 initial state and a
new final state per step. kda_jax's kernel (``kda_jax/kernels``, imported as a
plain package so that neither JAX nor jax-triton loads) is launched with
Triton's own launcher at each ``--configs`` entry (BLOCK_VxWARPS), and fla's
``fused_recurrent_kda`` is called as bench.serving calls it; rows are timed
in turn, twice, in one process. Each row: median ms over the same wall-clock
harness as bench.serving (and CUDA-event time), and the largest difference of
o and of the final state from fla's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

from bench.inputs import make

KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "kda_jax", "kernels")


def kda_kernels():
    """kda_jax/kernels/fused_recurrent.py as package ``kda_kernels`` (its relative
    import of state_io resolves inside it), without kda_jax's __init__."""
    spec = importlib.util.spec_from_file_location(
        "kda_kernels", os.path.join(KERNELS_DIR, "__init__.py"),
        submodule_search_locations=[KERNELS_DIR])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["kda_kernels"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("kda_kernels.fused_recurrent")


def dense_decode_constexprs(h: int, d: int, bv: int) -> dict:
    """The kernel's constexprs for bench.serving's dense decode step (one token
    per sequence, no in-kernel transforms, initial and final state): what
    kda_jax.triton.recurrent.recurrent_constexprs derives for that call."""
    return dict(H=h, HV=h, K=d, V=d, BK=d, BV=bv, SCALE=d ** -0.5, USE_L2NORM=False,
                USE_GATE=False, HAS_A_LOG=False, HAS_DT_BIAS=False, HAS_LOWER_BOUND=False,
                LOWER_BOUND=0.0, BETA_SIGMOID=False, BETA_SCALE=1.0, USE_INITIAL_STATE=True,
                STORE_FINAL_STATE=True, STATE_V_FIRST=False, INDEXED_STATE=False,
                UNIFORM=True, SEQ_LEN=1)


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
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch
    from fla.ops.kda import fused_recurrent_kda

    fr = kda_kernels()
    n, h, d = a.n, a.heads, 128
    arrays = make(1, n, h, d, d, seed=1)
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.bfloat16).reshape(n, 1, h, d)
               for x in arrays[:3])
    g, beta = (torch.tensor(x, device="cuda").reshape((n, 1) + x.shape[2:]) for x in arrays[3:])
    h0 = torch.zeros((n, h, d, d), device="cuda")
    dummy_f = torch.zeros(4, device="cuda")
    dummy_i = torch.zeros(4, device="cuda", dtype=torch.int32)

    def ours(bv, warps):
        def call():
            o = torch.empty((n, h, d), device="cuda", dtype=torch.bfloat16)
            ht = torch.empty((n, h, d, d), device="cuda")
            fr.kda_fused_recurrent_kernel[(d // bv, h, n)](
                q, k, v, g, beta, dummy_f, dummy_f, h0, dummy_i, dummy_i, dummy_i, 0, n, n, 0,
                o, ht, **dense_decode_constexprs(h, d, bv), num_warps=warps, num_stages=2)
            return o, ht
        return call

    fla = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True)
    impls = {"fla": fla}
    for c in a.configs.split(","):
        bv, w = (int(x) for x in c.split("x"))
        impls[f"kda_jax kernel {bv}x{w}"] = ours(bv, w)

    ref_o, ref_h = fla()
    rows = []
    for rnd in range(2):
        for name, call in impls.items():
            wall, event = wall_and_event_ms(call)
            o, ht = call()
            rows.append(dict(round=rnd, impl=name, n=n, wall_ms=wall, event_ms=event,
                             o_max_diff=float((o.reshape(ref_o.shape).float() - ref_o.float())
                                              .abs().max()),
                             state_max_diff=float((ht - ref_h).abs().max())))
            print(f"{rnd} {name:24s} wall {wall:.4f} ms  events {event:.4f} ms  "
                  f"o diff {rows[-1]['o_max_diff']:.2e}  state diff {rows[-1]['state_max_diff']:.2e}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, torch=torch.__version__,
                           command="python -m bench.decode_kernels_torch " + " ".join(argv or sys.argv[1:])),
                      f, indent=1)


if __name__ == "__main__":
    main()
