"""Times chunk_kda's forward + backward under several backward configs and
checks each one's gradients against the float32 reference (GPU only).

    python -m bench.tune.tune_backward [--shape 1,8192,32] [--grid NAME] [--json PATH]

Each row: the config change, the fwd+bwd median ms at the timing shape (bf16,
K = V = 128, as bench.backward) and the relative RMS error of dq, dk, dv, dg,
dbeta against autodiff of ``kda_jax.reference`` on a small varlen case, with
bf16 and with fp16 inputs.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from bench.backward import jax_runner
from bench.inputs import make
from bench.tune.grid import parse_grid_args, run_grid, write_records
from kda_jax import configs, reference, testing

GRIDS = {
    # Around the shipped sm90 config (each entry changes it).
    "backward": [
        {},
        {"recompute.16bit.block_k": 32},
        {"recompute.16bit.wu_dot": "bf16"},
        {"intra.bf16.dot": "tf32"},
        {"intra.*.block_k": 32},
        {"intra.*.warps": 4},
        {"wy.bf16.block_k": 32, "wy.fp16.block_k": 32, "wy.*.block_v": 32},
        {"wy.*.warps": 4},
    ],
    "shipped": [{}],
    # The recompute (the forward's prepare kernel storing X^T).
    "recompute": [{}, {"recompute.16bit.block_k": 32},
                  {"recompute.16bit.block_k": 32, "recompute.16bit.inverse_dot": "tf32"},
                  {"recompute.16bit.inverse_dot": "tf32"}],
    "intra": [{}, {"intra.*.block_k": 32, "intra.*.warps": 8}],
    # The recompute's precisions: sm90's (the forward's, since f830c56) against
    # split-bf16 Akk/Aqk and merge with tf32x3 w/u, at the shipped launch and at
    # the launch of before (4 warps, one stage, Aqk and Akk in a pass each).
    "recompute_precision": [
        {},
        {"recompute.16bit.dot": "bf16x3", "recompute.16bit.wu_dot": "tf32x3",
         "recompute.16bit.inverse_dot": "bf16x3"},
        {"recompute.16bit.dot": "bf16x3", "recompute.16bit.wu_dot": "tf32x3",
         "recompute.16bit.inverse_dot": "bf16x3", "recompute.16bit.warps": 4,
         "recompute.16bit.stages": 1, "recompute.16bit.split": True},
    ],
    # The products' backward (intra kernel) and the wy kernel's dots with X^T
    # for 16-bit intermediates: sm90's (tf32, X^T rounded to bf16 for bfloat16
    # ones; split-bf16 for float16 ones), bf16 products in both, split-bf16 in
    # both (the config before), and float16 ones at bfloat16's choice.
    "product_precision": [
        {},
        {"intra.bf16.dot": "bf16", "intra.fp16.dot": "bf16", "wy.fp16.dot": "bf16"},
        {"intra.bf16.dot": "bf16x3", "wy.bf16.dot": "bf16x3"},
        {"intra.fp16.dot": "tf32", "wy.fp16.dot": "bf16"},
    ],
    # The two state passes' stages and V block (at 2 stages the reverse pass's
    # pipelined tiles take 124 KiB of shared memory on sm90: one program per SM).
    "state_passes": [
        {"dstate.16bit.stages": 2},
        {"dstate.16bit.stages": 1},
        {"dstate.16bit.stages": 1, "state.16bit.stages": 1},
        {"dstate.16bit.stages": 1, "state.16bit.block_v": 32, "dstate.16bit.block_v": 32},
    ],
}
NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def accuracy() -> dict:
    """Relative RMS error of each gradient, bf16 and fp16 inputs (keys
    NAME_rel_rms and NAME_rel_rms_fp16), against the float32 reference's
    (sequences of 1, 129 and 170 tokens, H = 4, K = V = 128)."""
    fp16 = {f"{k}_fp16": v for k, v in _accuracy(jnp.float16).items()}
    return {**_accuracy(jnp.bfloat16), **fp16}


def _accuracy(dtype) -> dict:
    x = testing.make_inputs(8, T=300, H=4, K=128, V=128, N=3, dtype=dtype)
    cu = np.array([0, 1, 130, 300])
    w = jnp.asarray(np.random.default_rng(3).standard_normal(x.v.shape), jnp.float32)

    def grads(fn, args):
        loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w)
        return jax.grad(loss, argnums=tuple(range(5)))(*args)

    got = grads(lambda *a: kda_jax.chunk_kda(*a, cu_seqlens=cu, implementation="triton")[0],
                x.args())
    ref = grads(lambda *a: reference.naive_recurrent_kda(*a, cu_seqlens=cu)[0],
                [jnp.asarray(a, jnp.float32) for a in x.args()])
    return {f"{n}_rel_rms": testing.rel_rms(a, b) for n, a, b in zip(NAMES, got, ref)}


def main(argv=None):
    args, (b, t, h) = parse_grid_args(__doc__, GRIDS, "backward", argv)
    arrays = make(b, t, h, 128, 128)

    def measure(cfg):
        with configs.override(cfg):
            return jax_runner("triton", arrays, None)(), accuracy()

    records = run_grid(configs.backward_config(), GRIDS[args.grid], measure,
                       (b, t, h, 128, 128))
    write_records(args.json, "bench.tune.tune_backward", argv, records)


if __name__ == "__main__":
    main()
