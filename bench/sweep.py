"""The sweep driver shared by bench.forward and bench.backward: the command
line for the rows, and one loop that times kda_jax's implementations and reads
fla's times (measured in a child process, bench.fla_peer), printing a table and
collecting one JSON record per (row, implementation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from bench.inputs import make
from bench.timing import versions
from kda_jax.testing import DENSE_SWEEP


def add_arguments(p):
    """The options every sweep takes."""
    p.add_argument("--impls", default="triton,xla,fla")
    p.add_argument("--varlen", default=None, help="comma-separated lengths: one B=1 call")
    p.add_argument("--heads", type=int, default=32, help="H for --varlen")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shapes", default=None,
                   help="'B,T,H;B,T,H': these rows instead of the dense sweep")
    p.add_argument("--json", default=None)


def rows_of(args) -> list[tuple]:
    """(B, T, H, cu_seqlens or None) per row: --varlen, --shapes or the dense sweep."""
    if args.varlen:
        lens = [int(x) for x in args.varlen.split(",")]
        return [(1, sum(lens), args.heads, np.cumsum([0] + lens))]
    sweep = DENSE_SWEEP if not args.shapes else [
        tuple(int(x) for x in row.split(",")) for row in args.shapes.split(";")]
    return [(b, t, h, None) for b, t, h in sweep]


def fla_times(rows, kd, vd, mode="forward"):
    """fla's chunk_kda times for ``rows`` ("forward" or "backward": forward +
    autograd backward), measured in a child process (see bench.fla_peer)."""
    spec = [[b, t, h, kd, vd, None if cu is None else [int(x) for x in cu]] for b, t, h, cu in rows]
    proc = subprocess.run([sys.executable, "-m", "bench.fla_peer", json.dumps(spec), mode],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  fla failed: {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return [None] * len(rows), {}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["ms"], {"torch": result["torch"], "fla": result["fla"]}


def run(args, argv, *, module: str, runner, mode: str, extra=None, roofline=None):
    """Times every row: ``runner(impl, arrays, cu)`` gives a timing closure for
    a kda_jax implementation; ``extra(b, t, h)`` adds fields to each record;
    ``roofline(b, t, h, kd, vd)`` -> (ms, bytes, flops) adds the roofline
    columns. Prints the table and writes ``args.json``."""
    impls = args.impls.split(",")
    kd = vd = args.head_dim
    rows = rows_of(args)
    fla_ms, fla_versions = ([None] * len(rows), {})
    if "fla" in impls:
        fla_ms, fla_versions = fla_times(rows, kd, vd, mode=mode)
    meta = versions()
    meta.update(fla_versions)
    meta["command"] = f"python -m {module} " + " ".join(
        argv if argv is not None else sys.argv[1:])
    records = []
    print(f"{'B':>2} {'T':>6} {'H':>3} " + " ".join(f"{i:>10}" for i in impls)
          + "  triton/fla" + ("  roofline%" if roofline else ""))
    for row, (b, t, h, cu) in enumerate(rows):
        arrays = make(b, t, h, kd, vd)
        times = {}
        for impl in impls:
            if impl == "fla":
                times[impl] = fla_ms[row]
                continue
            try:
                times[impl] = runner(impl, arrays, cu)()
            except Exception as e:  # noqa: BLE001 - record and go on to the next peer
                times[impl] = None
                print(f"  {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        fla = times.get("fla")
        fields = dict(extra(b, t, h)) if extra else {}
        roof = roofline(b, t, h, kd, vd) if roofline else None
        for impl in impls:
            ms = times[impl]
            if roof:
                fields.update(roofline_ms=roof[0], roofline_fraction=(roof[0] / ms) if ms else None,
                              model_bytes=roof[1], model_flops=roof[2])
            records.append(dict(
                B=b, T=t, H=h, K=kd, V=vd, dtype="bfloat16",
                varlen=None if cu is None else [int(x) for x in np.diff(cu)],
                implementation="fla" if impl == "fla" else f"kda_jax-{impl}", ms=ms,
                ratio_to_fla=(ms / fla) if (ms and fla) else None, **fields, **meta,
            ))
        ratio = times.get("triton") / fla if times.get("triton") and fla else float("nan")
        line = f"{b:>2} {t:>6} {h:>3} " + " ".join(
            f"{times[i]:>10.3f}" if times[i] else f"{'-':>10}" for i in impls) + f"  {ratio:>10.3f}"
        if roof:
            frac = roof[0] / times["triton"] if times.get("triton") else float("nan")
            line += f"  {100 * frac:>8.1f}"
        print(line, flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records
