"""Times the Triton forward under several launch configs and checks each one's
accuracy against the float32 reference (GPU only; CPU timings mean nothing).

    python -m bench.tune.tune_forward [--shape 1,8192,32] [--grid NAME] [--json PATH]

Each row: the config, the forward's median ms at the timing shape (bf16,
K = V = 128) and the relative RMS error of o and the final state against
``kda_jax.reference`` on a smaller varlen case.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.inputs import make
from bench.tune.grid import parse_grid_args, run_grid, write_records
from bench.timing import time_jax
from kda_jax import configs, reference, testing

GRIDS = {
    # Around the shipped sm90 config (each entry changes it): the prepare
    # kernel's K slice and inverse merge precision, the state kernel's V block
    # and stages.
    "prepare": [
        {},
        {"prepare.16bit.inverse_dot": "tf32"},
        {"prepare.16bit.block_k": 64},
        {"prepare.16bit.block_k": 64, "prepare.16bit.inverse_dot": "tf32"},
        {"state.16bit.block_v": 16},
        {"state.16bit.stages": 3},
    ],
    # The prepare kernel's software pipelining (its K-slice loops' loads staged
    # ahead by Triton's pipeliner) and slice width.
    "stages": [
        {"prepare.16bit.stages": 1},
        {"prepare.16bit.stages": 2},
        {"prepare.16bit.stages": 3},
        {"prepare.16bit.block_k": 64, "prepare.16bit.stages": 1},
        {"prepare.16bit.block_k": 64, "prepare.16bit.stages": 2},
    ],
    "shipped": [{}],
}


def accuracy(config: configs.ForwardConfig) -> dict:
    x = testing.make_inputs(11, T=1500, H=4, K=128, V=128, N=3, dtype=jnp.bfloat16)
    cu = np.array([0, 1, 700, 1500])
    kw = dict(initial_state=x.initial_state, output_final_state=True, cu_seqlens=cu)
    with configs.override(config):
        o, s = kda_jax.chunk_kda(*x.args(), implementation="triton", **kw)
    ro, rs = reference.naive_recurrent_kda(*x.args(), **kw)
    return {"o_rel_rms": testing.rel_rms(o, ro), "state_rel_rms": testing.rel_rms(s, rs),
            "o_max_abs": testing.max_abs(o, ro)}


def main(argv=None):
    args, (b, t, h) = parse_grid_args(__doc__, GRIDS, "prepare", argv)
    arrays = [jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32)
              for i, a in enumerate(make(b, t, h, 128, 128))]

    def measure(cfg):
        with configs.override(cfg):
            run = jax.jit(lambda *a: kda_jax.chunk_kda(*a, implementation="triton")[0])
            ms = time_jax(run, *arrays)
        return ms, accuracy(cfg)

    records = run_grid(configs.forward_config(), GRIDS[args.grid], measure,
                       (b, t, h, 128, 128))
    write_records(args.json, "bench.tune.tune_forward", argv, records)


if __name__ == "__main__":
    main()
