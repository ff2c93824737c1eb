"""chunk_kda forward + backward: kda_jax (Triton, XLA) against fla's chunk_kda
(PyTorch autograd) in one run, on a GPU.

    python -m bench.backward [--impls triton,xla,fla] [--varlen 1,1,1100,1300]
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
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.forward import fla_times
from bench.inputs import make
from bench.timing import time_jax, versions
from kda_jax.testing import DENSE_SWEEP


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
    p.add_argument("--impls", default="triton,xla,fla")
    p.add_argument("--varlen", default=None, help="comma-separated lengths: one B=1 call")
    p.add_argument("--heads", type=int, default=32, help="H for --varlen")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shapes", default=None,
                   help="'B,T,H;B,T,H': these rows instead of the dense sweep")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    kd = vd = args.head_dim
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        raise SystemExit("bench.backward times GPU kernels; JAX's default backend here is "
                         f"{jax.default_backend()!r}")

    if args.varlen:
        lens = [int(x) for x in args.varlen.split(",")]
        rows = [(1, sum(lens), args.heads, np.cumsum([0] + lens))]
    else:
        sweep = DENSE_SWEEP if not args.shapes else [
            tuple(int(x) for x in row.split(",")) for row in args.shapes.split(";")]
        rows = [(b, t, h, None) for b, t, h in sweep]

    fla_ms, fla_versions = ([None] * len(rows), {})
    if "fla" in impls:
        fla_ms, fla_versions = fla_times(rows, kd, vd, mode="backward")
    meta = versions()
    meta.update(fla_versions)
    meta["command"] = "python -m bench.backward " + " ".join(
        argv if argv is not None else sys.argv[1:])
    records = []
    print(f"{'B':>2} {'T':>6} {'H':>3} " + " ".join(f"{i:>10}" for i in impls)
          + "  triton/fla")
    for row, (b, t, h, cu) in enumerate(rows):
        arrays = make(b, t, h, kd, vd)
        times = {}
        for impl in impls:
            if impl == "fla":
                times[impl] = fla_ms[row]
                continue
            try:
                times[impl] = jax_runner(impl, arrays, cu)()
            except Exception as e:  # noqa: BLE001 - record and go on to the next peer
                times[impl] = None
                print(f"  {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        fla = times.get("fla")
        for impl in impls:
            ms = times[impl]
            records.append(dict(
                B=b, T=t, H=h, K=kd, V=vd, dtype="bfloat16", passes="forward+backward",
                varlen=None if cu is None else [int(x) for x in np.diff(cu)],
                implementation="fla" if impl == "fla" else f"kda_jax-{impl}", ms=ms,
                ratio_to_fla=(ms / fla) if (ms and fla) else None, **meta,
            ))
        ratio = times.get("triton") / fla if times.get("triton") and fla else float("nan")
        print(f"{b:>2} {t:>6} {h:>3} " + " ".join(
            f"{times[i]:>10.3f}" if times[i] else f"{'-':>10}" for i in impls)
            + f"  {ratio:>10.3f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
