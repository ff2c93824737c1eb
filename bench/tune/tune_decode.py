"""Times the decode kernel (fused_recurrent_kda, one token per sequence) under
several launch configs and checks each one against the float32 reference
(GPU only; CPU timings mean nothing).

    python -m bench.tune.tune_decode [--batches 256,1024] [--heads 32] [--configs 16x1,32x4]
        [--json PATH]

Each row: the config, the median ms of a dense [N, 1] decode step with an
initial and final state (bf16 q, k, v; K = V = 128) per batch size, of the
serving form at the first batch size (a decode bucket with max_len 1 and a
donated state pool, updated in place; a float32 and a bfloat16 pool), and
the relative RMS error of o
and the final state at the first batch size.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.inputs import make
from bench.timing import time_jax
from bench.tune.grid import write_records
from kda_jax import configs, reference, testing

# Around the shipped sm90 config: the V block of both forms (the dense and the
# varlen variant: the pools load bounds), fewer and larger programs or
# more and smaller ones for the memory-bound state read and write, and the
# warps per program.
def _change(bv: int, warps: int) -> dict:
    """The dense and varlen variants at V block ``bv`` and ``warps``."""
    return {f"decode.{form}.{name}": value for form in ("dense", "varlen")
            for name, value in (("block_v", bv), ("warps", warps))}


GRID = [_change(bv, w) for bv in (32, 64, 128) for w in (2, 4, 8)]


def _config_of(text: str) -> dict:
    """'64x4' -> the dense and varlen variants at V block 64, 4 warps."""
    parts = text.split("x")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        raise ValueError(f"config {text!r} must be BLOCK_VxWARPS, e.g. 32x4")
    bv, warps = (int(x) for x in parts)
    return _change(bv, warps)


def decode_inputs(n: int, h: int, d: int):
    """[N, 1, ...] inputs and an [N, H, d, d] float32 initial state."""
    arrays = make(1, n, h, d, d, seed=1)
    x = [jnp.asarray(a.reshape((n, 1) + a.shape[2:]), jnp.bfloat16 if i < 3 else jnp.float32)
         for i, a in enumerate(arrays)]
    h0 = jnp.asarray(np.random.default_rng(2).standard_normal((n, h, d, d)) * 0.1, jnp.float32)
    return x, h0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="256,1024")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--configs", default=None,
                   help="'BLOCK_VxWARPS,...' (e.g. 32x4,64x2): these configs instead of "
                   "the grid")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    grid = GRID if not args.configs else [_config_of(c) for c in args.configs.split(",")]
    batches = [int(n) for n in args.batches.split(",")]
    inputs = {n: decode_inputs(n, args.heads, args.head_dim) for n in batches}
    base = configs.recurrent_config()
    x0, h00 = inputs[batches[0]]
    ro, rs = reference.naive_recurrent_kda(*x0, initial_state=h00, output_final_state=True)
    records = []
    for change in [{}] + grid:
        cfg = configs.replace(base, change)
        rec = {"config": configs.as_dict(cfg), "shipped": not change}
        try:
            with configs.override(cfg):
                step = jax.jit(lambda h0, *a: kda_jax.fused_recurrent_kda(
                    *a, initial_state=h0, output_final_state=True, implementation="triton"))
                for n, (x, h0) in inputs.items():
                    rec[f"ms_N{n}"] = time_jax(step, h0, *x)
                # The serving form: a decode bucket (max_len 1) and a donated pool.
                n = batches[0]
                x, h0 = inputs[n]
                batch = jax.device_put(kda_jax.VarlenBatch.from_lengths(
                    [1] * n, kda_jax.Bucket(n, n, max_len=1)))
                pooled = jax.jit(lambda pool, idx, batch, *a: kda_jax.fused_recurrent_kda_pool(
                    *(y.reshape((1, n) + y.shape[2:]) for y in a), pool, kda_jax.PoolRows(idx),
                    cu_seqlens=batch, implementation="triton")[1],
                    donate_argnums=0)  # in place: the pool goes round
                idx = jnp.arange(n, dtype=jnp.int32)
                for dtype, suffix in ((jnp.float32, ""), (jnp.bfloat16, "_bf16")):
                    state = {"pool": jnp.array(h0, dtype=dtype, copy=True)}  # donated

                    def pool_step(state=state, pooled=pooled, idx=idx, batch=batch, x=x):
                        state["pool"] = pooled(state["pool"], idx, batch, *x)
                        return state["pool"]

                    rec[f"ms_N{n}_bucket_pool{suffix}"] = time_jax(pool_step)
                o, s = step(h00, *x0)
            rec.update(o_rel_rms=testing.rel_rms(o, ro), state_rel_rms=testing.rel_rms(s, rs))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "config"} | {"change": change}),
              flush=True)
    for rec in records:
        rec.update(heads=args.heads, head_dim=args.head_dim)
    write_records(args.json, "bench.tune.tune_decode", argv, records)


if __name__ == "__main__":
    main()
