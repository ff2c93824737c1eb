"""chunk_kda forward: kda_jax (Triton, XLA) against fla's chunk_kda (PyTorch) in one run.

    python -m bench.forward [--varlen 1,1,1100,1300] [--impls triton,xla,fla] [--json PATH]

Times exclude compilation. Each row also gives the fraction of the H200's
roofline: the model below counts the fewest bytes (inputs read once, o written
once) and the chunked algorithm's matrix FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.inputs import make
from bench.timing import time_jax, versions
from kda_jax.testing import DENSE_SWEEP

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


def jax_runner(impl, arrays, cu):
    q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
                        for i, a in enumerate(arrays))
    bounds = None if cu is None else kda_jax.SeqBounds(cu)

    @jax.jit
    def run(q, k, v, g, beta):
        return kda_jax.chunk_kda(q, k, v, g, beta, cu_seqlens=bounds, implementation=impl)[0]

    return lambda: time_jax(run, q, k, v, g, beta)


def fla_times(rows, kd, vd, mode="forward"):
    """fla's chunk_kda times for ``rows`` (mode "forward", or "backward": forward
    plus autograd's backward), measured in a child process (see bench.fla_peer)."""
    spec = [[b, t, h, kd, vd, None if cu is None else [int(x) for x in cu]] for b, t, h, cu in rows]
    proc = subprocess.run([sys.executable, "-m", "bench.fla_peer", json.dumps(spec), mode],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  fla failed: {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return [None] * len(rows), {}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["ms"], {"torch": result["torch"], "fla": result["fla"]}


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

    if args.varlen:
        lens = [int(x) for x in args.varlen.split(",")]
        rows = [(1, sum(lens), args.heads, np.cumsum([0] + lens))]
    else:
        sweep = DENSE_SWEEP if not args.shapes else [
            tuple(int(x) for x in row.split(",")) for row in args.shapes.split(";")]
        rows = [(b, t, h, None) for b, t, h in sweep]

    fla_ms, fla_versions = fla_times(rows, kd, vd) if "fla" in impls else ([None] * len(rows), {})
    meta = versions()
    meta.update(fla_versions)
    meta["command"] = "python -m bench.forward " + " ".join(argv if argv is not None else sys.argv[1:])
    records = []
    print(f"{'B':>2} {'T':>6} {'H':>3} " + " ".join(f"{i:>10}" for i in impls)
          + "  triton/fla  roofline%")
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
        roof, nbytes, flops = roofline_ms(b, t, h, kd, vd)
        fla = times.get("fla")
        for impl in impls:
            ms = times[impl]
            records.append(dict(
                B=b, T=t, H=h, K=kd, V=vd, dtype="bfloat16",
                varlen=None if cu is None else [int(x) for x in np.diff(cu)],
                implementation="fla" if impl == "fla" else f"kda_jax-{impl}", ms=ms,
                ratio_to_fla=(ms / fla) if (ms and fla) else None,
                roofline_ms=roof, roofline_fraction=(roof / ms) if ms else None,
                model_bytes=nbytes, model_flops=flops, **meta,
            ))
        ratio = times.get("triton") / fla if times.get("triton") and fla else float("nan")
        frac = roof / times["triton"] if times.get("triton") else float("nan")
        print(f"{b:>2} {t:>6} {h:>3} " + " ".join(
            f"{times[i]:>10.3f}" if times[i] else f"{'-':>10}" for i in impls)
            + f"  {ratio:>10.3f}  {100 * frac:>8.1f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
