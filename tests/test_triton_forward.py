"""The Triton forward against the float32 reference.

On a GPU the kernels run natively through jax-triton; without one, conftest.py
sets KDA_JAX_INTERPRET=1 and the same kernels run in Triton's interpreter
through the same glue (small shapes only: the interpreter is slow).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import configs, reference, testing
from kda_jax.bounds import SeqBounds, packed_metadata
from kda_jax.triton import interpret_mode, unavailable_reason
from kda_jax.triton.launch import stand_in
from guards import no_device_reads

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"Triton path unavailable: {unavailable_reason()}"
)
ON_GPU = not interpret_mode()

# (id, make_inputs kwargs, chunk_kda kwargs)
CASES = [
    ("plain-fp32", dict(T=70, K=32, V=32), dict()),
    ("plain-bf16-c32", dict(T=70, K=32, V=48, dtype=jnp.bfloat16), dict(chunk_size=32)),
    ("awkward-KV-gva", dict(B=2, T=45, H=1, HV=2, K=60, V=100), dict()),
    ("gva4-c32", dict(T=40, H=1, HV=4, K=32, V=32), dict(chunk_size=32)),
    ("l2norm-sigmoid-neg", dict(T=50, K=32, V=32, normalized_k=False, beta_logits=True),
     dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    ("gate-softplus", dict(T=66, K=32, V=32, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate=True)),
    ("gate-lower-bound", dict(T=66, K=32, V=32, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate=True, lower_bound=-5.0)),
    ("v-first-scale", dict(T=33, K=32, V=64, state_v_first=True),
     dict(state_v_first=True, scale=0.3)),
    ("extreme-gates", dict(T=80, K=32, V=32, gate_floor=-1000.0), dict()),
    ("no-state", dict(T=20, K=32, V=32, with_state=False), dict()),
    # K > 64 with float32 intermediates (interpret mode's, and float32 inputs'
    # on a GPU): the state kernel holds the state as two K halves
    # (forward.split_state_k), the upper one masked at K = 100.
    ("split-K100-v-first", dict(T=70, K=100, V=24, state_v_first=True),
     dict(state_v_first=True)),
    ("split-K128-c32", dict(T=45, H=1, K=128, V=16), dict(chunk_size=32)),
]
if ON_GPU:
    CASES += [
        ("big-K256", dict(T=300, H=2, K=256, V=256, dtype=jnp.bfloat16), dict()),
        ("big-128", dict(B=2, T=1000, H=4, K=128, V=128, dtype=jnp.bfloat16), dict()),
        ("big-128-fp32-c32", dict(T=500, H=2, HV=4, K=128, V=128), dict(chunk_size=32)),
    ]


def _dtype_name(x):
    return jnp.dtype(x.dtype).name


def _run(x, kw, impl, **extra):
    kw = dict(kw)
    with_gate = kw.pop("with_gate", False)
    gate = dict(A_log=x.A_log, dt_bias=x.dt_bias) if with_gate else {}
    return impl(*x.args(), initial_state=x.initial_state, output_final_state=True,
                **gate, **kw, **extra)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_reference(case, check_close):
    _, make_kw, call_kw = case
    x = testing.make_inputs(3, **make_kw)
    o, s = _run(x, call_kw, kda_jax.chunk_kda, implementation="triton")
    ref_kw = {k: v for k, v in call_kw.items() if k != "chunk_size"}
    ro, rs = _run(x, ref_kw, reference.naive_recurrent_kda)
    assert o.dtype == x.q.dtype and s.dtype == jnp.float32
    name = _dtype_name(x.q)
    if make_kw.get("gate_floor") is not None and name == "float32":
        name = "float32-extreme-gates"
    check_close(o, ro, name, "o")
    check_close(s, rs, name, "final_state")


@pytest.mark.skipif(not ON_GPU, reason="the AMD configs' product precisions need a GPU")
@pytest.mark.parametrize("arch", ["gfx950", "gfx1250", "gfx942"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0].startswith(("big-", "gate-", "l2norm"))],
                         ids=lambda c: c[0])
def test_amd_configs_forward_on_this_gpu(arch, case, check_close):
    """An AMD arch's forward config (tiles, warps, bf16 / split-bf16 products)
    forced on this GPU meets the same bars as this device's own."""
    _, make_kw, call_kw = case
    x = testing.make_inputs(3, **make_kw)
    chunk = call_kw.get("chunk_size", 64)
    with configs.override(configs.forward_config(arch, chunk)):
        o, s = _run(x, call_kw, kda_jax.chunk_kda, implementation="triton")
    ref_kw = {k: v for k, v in call_kw.items() if k != "chunk_size"}
    ro, rs = _run(x, ref_kw, reference.naive_recurrent_kda)
    check_close(o, ro, _dtype_name(x.q), f"o {arch}", kind="o")
    check_close(s, rs, _dtype_name(x.q), f"final_state {arch}", kind="final_state")


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_varlen_with_empty_and_short_sequences(chunk_size, check_close):
    lens = [0, 1, 0, 70, 1, 33, 0] if ON_GPU else [0, 1, 0, 40, 1, 0]
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(5, T=int(cu[-1]), K=32, V=32, N=len(lens), gate_floor=-1000.0)
    o, s = kda_jax.chunk_kda(*x.args(), initial_state=x.initial_state, output_final_state=True,
                             cu_seqlens=cu, chunk_size=chunk_size, implementation="triton")
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, cu_seqlens=cu)
    check_close(o, ro, "float32-extreme-gates", "o")
    check_close(s, rs, "float32-extreme-gates", "final_state")
    for i, n in enumerate(lens):
        if n == 0:  # an empty sequence keeps its initial state, bit for bit
            np.testing.assert_array_equal(np.asarray(s[i]), x.initial_state[i])


def test_all_sequences_empty():
    x = testing.make_inputs(1, T=0, K=32, V=32, N=3)
    o, s = kda_jax.chunk_kda(*x.args(), initial_state=x.initial_state, output_final_state=True,
                             cu_seqlens=[0, 0, 0, 0], implementation="triton")
    assert o.shape == (1, 0, 2, 32)
    np.testing.assert_array_equal(np.asarray(s), x.initial_state)


@pytest.mark.parametrize("v_first", [False, True])
def test_split_state_with_a_pool(v_first, check_close):
    """The two K halves of the state read from and written to a pool's rows
    (a padding index reads zeros and writes nothing)."""
    hv, kd, vd, slots = 2, 100, 16, 4
    x = testing.make_inputs(11, B=2, T=40, H=1, HV=hv, K=kd, V=vd, with_state=False)
    rng = np.random.default_rng(12)
    pool = (0.5 * rng.standard_normal((slots, hv) + ((vd, kd) if v_first else (kd, vd)))
            ).astype(np.float32)
    idx = np.array([2, -1])
    o, new = kda_jax.chunk_kda(*x.args(), state_cache=pool, state_indices=idx,
                               state_v_first=v_first, implementation="triton")
    h0 = np.zeros((2,) + pool.shape[1:], np.float32)
    h0[0] = pool[2]
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True,
                                           state_v_first=v_first)
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(new)[2], rs[0], "float32", "final_state")
    for r in (0, 1, 3):
        np.testing.assert_array_equal(np.asarray(new[r]), pool[r], err_msg=f"row {r} changed")


def _varlen_step(lens):
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(7, T=int(cu[-1]), K=32, V=32, N=len(lens), dtype=jnp.bfloat16)
    args = [jax.device_put(a) for a in (*x.args(), x.initial_state)]

    @jax.jit
    def step(q, k, v, g, beta, h0, bounds):
        return kda_jax.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 cu_seqlens=bounds, implementation="triton")

    return step, args, SeqBounds(cu), x


def test_jitted_varlen_makes_no_device_to_host_transfer():
    step, args, bounds, _ = _varlen_step([3, 0, 40, 1])
    jax.block_until_ready(step(*args, bounds))  # compile outside the guard
    with no_device_reads(strict=not interpret_mode()):
        o, s = step(*args, bounds)
        jax.block_until_ready((o, s))
    if interpret_mode():
        return  # the interpreter path copies to the host by design
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(step(*args, bounds))


@pytest.mark.skipif(not ON_GPU, reason="inspects the jax-triton lowering (GPU only)")
def test_lowered_program_holds_metadata_as_one_int32_constant():
    lens = [3, 0, 40, 1]
    step, args, bounds, _ = _varlen_step(lens)
    text = step.lower(*args, bounds).as_text()
    consts = re.findall(r"stablehlo\.constant (dense<[^>]*>) : tensor<(\d+)xi32>", text)
    meta = packed_metadata(bounds, 64).buffer
    # launch.stand_in stands for an index pointer no kernel reads.
    unread = np.asarray(stand_in(np.int32)).tolist()
    is_stand_in = lambda v: [int(x) for x in re.findall(r"-?\d+", v)] == unread
    assert [n for v, n in consts if not is_stand_in(v)] == [str(meta.size)], consts
