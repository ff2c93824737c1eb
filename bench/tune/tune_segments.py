"""Times chunk_kda's Triton path with the segmented state chain under several
segment lengths and map-kernel launches, against one pass, and checks each
against the one pass (GPU only; CPU timings mean nothing).

    python -m bench.tune.tune_segments [--shapes "1,65536,4;1,32768,8"]
        [--configs 64,128,128x64x8] [--backward] [--json PATH]

A config is SEGMENT_CHUNKS[xMAP_BLOCK_VxMAP_WARPS]. Each row: the shape, the
config (none: one pass), the median ms of the forward (and with --backward of
the forward + backward of sum(o * do)), and the relative RMS of o against the
one pass. bf16 q, k, v; K = V = --head-dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.backward import forward_backward
from bench.inputs import make
from bench.timing import time_jax
from bench.tune.grid import write_records
from kda_jax import configs, testing

SHAPES = "1,65536,4;1,131072,4;1,32768,8;1,65536,12"
CONFIGS = "32,64,128,64x64x4,128x64x8"


def _configs_of(text: str) -> tuple:
    """'128' -> 128-chunk segments; '128x64x8' -> also the map kernel at 64 columns, 8 warps
    (every variant); every other value the device's configs. (SegmentConfig, ForwardConfig)."""
    parts = text.split("x")
    if len(parts) not in (1, 3) or not all(x.isdigit() for x in parts):
        raise ValueError(f"config {text!r} must be CHUNKS or CHUNKSxMAP_BLOCK_VxMAP_WARPS")
    values = [int(x) for x in parts]
    forward = configs.forward_config()
    if len(values) == 3:
        forward = configs.replace(forward, {"map.*.block_v": values[1], "map.*.warps": values[2]})
    return dataclasses.replace(configs.segment_config(), segment_chunks=values[0]), forward


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    d = args.head_dim
    records = []
    for shape in args.shapes.split(";"):
        b, t, h = (int(x) for x in shape.split(","))
        x = [jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
             for i, a in enumerate(make(b, t, h, d, d))]
        do = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, h, d)), jnp.bfloat16)
        one_pass = None
        for text in ["none"] + args.configs.split(","):
            chosen = ((configs.SegmentConfig(), configs.forward_config()) if text == "none"
                      else _configs_of(text))
            rec = {"shape": [b, t, h], "config": text}
            with configs.override(*chosen):
                fwd = jax.jit(lambda *a: kda_jax.chunk_kda(*a, implementation="triton")[0])
                o = fwd(*x)
                rec["forward_ms"] = time_jax(fwd, *x)
                if args.backward:
                    step = jax.jit(forward_backward("triton", None, {}))
                    step(tuple(x), {}, do)
                    rec["forward_backward_ms"] = time_jax(step, tuple(x), {}, do)
            one_pass = o if one_pass is None else one_pass
            rec["o_rel_rms_vs_one_pass"] = testing.rel_rms(o, one_pass)
            records.append(rec)
            print(rec, flush=True)
    write_records(args.json, "bench.tune.tune_segments", argv, records)


if __name__ == "__main__":
    main()
