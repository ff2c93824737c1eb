"""The Triton decode kernel (fused_recurrent_kda, implementation="triton")
against the float32 reference.

On a GPU the kernel runs natively through jax-triton; without one, conftest.py
sets KDA_JAX_INTERPRET=1 and it runs in Triton's interpreter through the same
glue (small shapes only: the interpreter is slow).
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import api, configs, reference, testing
from kda_jax import triton as kda_triton
from kda_jax.bounds import SeqBounds, packed_metadata
from kda_jax.triton import interpret_mode, unavailable_reason
from kda_jax.triton.launch import stand_in
from guards import no_device_reads

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"Triton path unavailable: {unavailable_reason()}"
)
ON_GPU = not interpret_mode()

# (id, make_inputs kwargs, fused_recurrent_kda kwargs)
CASES = [
    ("plain-fp32", dict(T=21, K=32, V=32), dict()),
    ("plain-bf16", dict(T=21, K=32, V=48, dtype=jnp.bfloat16), dict()),
    ("fp16", dict(T=9, K=32, V=32, dtype=np.float16), dict()),
    ("decode-B8-T1", dict(B=8, T=1, K=32, V=32), dict()),
    ("awkward-KV-gva", dict(B=2, T=4, H=1, HV=2, K=60, V=100), dict()),
    ("tiny-K5-V3", dict(T=7, K=5, V=3), dict()),
    ("gva4", dict(T=12, H=1, HV=4, K=32, V=32), dict()),
    ("gva2-H2", dict(T=8, H=2, HV=4, K=16, V=24, dtype=jnp.bfloat16), dict()),
    ("l2norm-sigmoid-neg", dict(T=15, K=32, V=32, normalized_k=False, beta_logits=True),
     dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    ("l2norm-bf16", dict(T=10, K=40, V=32, normalized_k=False, dtype=jnp.bfloat16),
     dict(use_qk_l2norm_in_kernel=True)),
    ("gate-softplus", dict(T=14, K=32, V=32, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate=True)),
    ("gate-softplus-no-dt-bias", dict(T=6, K=20, V=16, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate="A_log")),
    ("gate-lower-bound", dict(T=14, K=32, V=32, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate=True, lower_bound=-5.0)),
    ("gate-lower-bound-no-A_log", dict(T=6, K=32, V=32, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate="dt_bias", lower_bound=-0.5)),
    ("v-first-scale", dict(T=11, K=32, V=64, state_v_first=True),
     dict(state_v_first=True, scale=0.3)),
    ("v-first-awkward", dict(T=5, H=1, HV=2, K=36, V=72, state_v_first=True),
     dict(state_v_first=True)),
    ("extreme-gates", dict(T=30, K=32, V=32, gate_floor=-1000.0), dict()),
    ("no-state", dict(T=10, K=32, V=32, with_state=False), dict()),
    ("K256-V256", dict(T=3, H=1, K=256, V=256, dtype=jnp.bfloat16), dict()),
]
if ON_GPU:
    CASES += [
        ("big-128-bf16", dict(B=4, T=300, H=4, HV=8, K=128, V=128, dtype=jnp.bfloat16), dict()),
        ("big-256-fp32", dict(B=2, T=100, H=2, K=256, V=256), dict()),
        ("decode-B256", dict(B=256, T=1, H=4, HV=16, K=128, V=128, dtype=jnp.bfloat16,
                             state_v_first=True), dict(state_v_first=True)),
    ]


def _gate(x, with_gate):
    if with_gate is True:
        return dict(A_log=x.A_log, dt_bias=x.dt_bias)
    if with_gate:
        return {with_gate: getattr(x, with_gate)}
    return {}


def _run(x, kw, impl, **extra):
    kw = dict(kw)
    gate = _gate(x, kw.pop("with_gate", False))
    return impl(*x.args(), initial_state=x.initial_state, output_final_state=True,
                **gate, **kw, **extra)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_recurrent_matches_reference(case, check_close):
    _, make_kw, call_kw = case
    x = testing.make_inputs(3, **make_kw)
    o, s = _run(x, call_kw, kda_jax.fused_recurrent_kda, implementation="triton")
    ro, rs = _run(x, call_kw, reference.naive_recurrent_kda)
    assert o.dtype == x.q.dtype and s.dtype == jnp.float32
    name = jnp.dtype(x.q.dtype).name
    check_close(o, ro, name, "o")
    check_close(s, rs, name, "final_state")


def test_without_final_state(check_close):
    x = testing.make_inputs(4, B=2, T=6, K=32, V=32)
    o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                       implementation="triton")
    assert s is None
    ro, _ = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state)
    check_close(o, ro, "float32", "o")


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_varlen_with_empty_and_short_sequences(dtype, check_close):
    lens = [0, 1, 0, 70, 1, 33, 0] if ON_GPU else [0, 1, 0, 23, 1, 0, 5]
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(5, T=int(cu[-1]), H=1, HV=2, K=32, V=40, N=len(lens), dtype=dtype,
                            gate_floor=-1000.0)
    o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                       output_final_state=True, cu_seqlens=cu,
                                       implementation="triton")
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, cu_seqlens=cu)
    name = jnp.dtype(dtype).name
    check_close(o, ro, name, "o")
    check_close(s, rs, name, "final_state")
    for i, n in enumerate(lens):
        if n == 0:  # an empty sequence keeps its initial state, bit for bit
            np.testing.assert_array_equal(np.asarray(s[i]), x.initial_state[i])


def test_varlen_without_initial_state(check_close):
    lens = [3, 0, 1, 8]
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(6, T=int(cu[-1]), K=16, V=16, N=len(lens), with_state=False)
    o, s = kda_jax.fused_recurrent_kda(*x.args(), output_final_state=True, cu_seqlens=cu,
                                       implementation="triton")
    ro, rs = reference.naive_recurrent_kda(*x.args(), output_final_state=True, cu_seqlens=cu)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")
    np.testing.assert_array_equal(np.asarray(s[1]), 0.0)


def test_all_sequences_empty():
    x = testing.make_inputs(1, T=0, K=32, V=32, N=3, dtype=jnp.bfloat16)
    o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                       output_final_state=True, cu_seqlens=[0, 0, 0, 0],
                                       implementation="triton")
    assert o.shape == (1, 0, 2, 32) and o.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(s), x.initial_state)


def test_config_override_and_small_v_blocks(check_close):
    """Several V blocks per head (block_v 8 < V) give the same answer."""
    x = testing.make_inputs(8, T=5, H=1, HV=2, K=24, V=40)
    small = configs.DecodeConfig(block_v=8, warps=1, stages=1)
    with configs.override(configs.RecurrentConfig(decode=dict.fromkeys(("dense", "varlen", "wide"),
                                                                       small))):
        o, s = _run(x, {}, kda_jax.fused_recurrent_kda, implementation="triton")
    ro, rs = _run(x, {}, reference.naive_recurrent_kda)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")


@pytest.mark.parametrize("form", ["host", "bucket"])
def test_single_token_decode_with_loaded_bounds(form, check_close):
    """Sequences of at most one token whose bounds the kernel loads (varlen
    host bounds with empty sequences; a decode bucket, max_len 1), in V
    blocks smaller than V."""
    lens = [1, 0, 1, 1, 0]
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(9, T=int(cu[-1]), H=1, HV=2, K=48, V=40, N=len(lens),
                            gate_floor=-1000.0)
    bounds = cu
    if form == "bucket":
        bounds = kda_jax.VarlenBatch.from_lengths(lens, kda_jax.Bucket(5, 3, max_len=1))
    cfg = configs.replace(configs.recurrent_config(), {"decode.dense.block_v": 16,
                                                       "decode.varlen.block_v": 16})
    with configs.override(cfg):
        o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, cu_seqlens=bounds,
                                           implementation="triton")
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, cu_seqlens=cu)
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(s)[:len(lens)], rs, "float32", "final_state")


def test_recurrent_config_table():
    assert set(configs.RECURRENT) == set(configs.ARCHS)
    assert configs.recurrent_config("gfx950") == configs.RECURRENT["gfx950"]
    with pytest.raises(ValueError, match=r"arch='gfx9000' has no RecurrentConfig"):
        configs.recurrent_config("gfx9000")
    with pytest.raises(ValueError, match=r"block_v=12 must be a power of two >= 8"):
        configs.replace(configs.RECURRENT["sm90"], "decode.varlen.block_v", 12)
    with pytest.raises(ValueError, match=r"warps=3 must be one of"):
        configs.replace(configs.RECURRENT["sm90"], "decode.*.warps", 3)


def test_triton_unavailable_raises_with_the_reason(monkeypatch):
    """A named backend that cannot run raises; None picks XLA there."""
    monkeypatch.setattr(kda_triton, "unavailable_reason", lambda: "no GPU in this test")
    monkeypatch.setattr(kda_triton, "available", lambda: False)
    x = testing.make_inputs(0, T=4, K=16, V=16)
    with pytest.raises(RuntimeError,
                       match=r"implementation='triton' cannot run this call: no GPU in this test"):
        kda_jax.fused_recurrent_kda(*x.args(), implementation="triton")
    assert api._choose_backend(None, x.q, x.v) == "xla"


def test_head_dim_limit():
    x = testing.make_inputs(0, T=2, H=1, K=300, V=8)
    with pytest.raises(ValueError, match=r"cannot run this call: .*K and V up to 256"):
        kda_jax.fused_recurrent_kda(*x.args(), implementation="triton")


def test_default_picks_triton_on_a_gpu(monkeypatch):
    x = testing.make_inputs(0, T=2, K=16, V=16)
    monkeypatch.setattr(kda_triton, "interpret_mode", lambda: False)
    monkeypatch.setattr(kda_triton, "available", lambda: True)
    assert api._choose_backend(None, x.q, x.v) == "triton"


def _decode_step(lens):
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(7, T=int(cu[-1]), K=32, V=32, N=len(lens), dtype=jnp.bfloat16)
    args = [jax.device_put(a) for a in (*x.args(), x.initial_state)]

    @jax.jit
    def step(q, k, v, g, beta, h0, bounds):
        return kda_jax.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, cu_seqlens=bounds,
                                           implementation="triton")

    return step, args, SeqBounds(cu)


def test_jitted_varlen_makes_no_device_to_host_transfer():
    step, args, bounds = _decode_step([1, 0, 6, 1])
    jax.block_until_ready(step(*args, bounds))  # compile outside the guard
    with no_device_reads(strict=not interpret_mode()):
        jax.block_until_ready(step(*args, bounds))
    if interpret_mode():
        return  # the interpreter path copies to the host by design
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(step(*args, bounds))


@pytest.mark.skipif(not ON_GPU, reason="inspects the jax-triton lowering (GPU only)")
def test_lowered_program_holds_metadata_as_one_int32_constant():
    step, args, bounds = _decode_step([1, 0, 6, 1])
    text = step.lower(*args, bounds).as_text()
    consts = re.findall(r"stablehlo\.constant (dense<[^>]*>) : tensor<(\d+)xi32>", text)
    meta = packed_metadata(bounds, 64).buffer
    # launch.stand_in stands for an index pointer no kernel reads.
    unread = np.asarray(stand_in(np.int32)).tolist()
    is_stand_in = lambda v: [int(x) for x in re.findall(r"-?\d+", v)] == unread
    assert [n for v, n in consts if not is_stand_in(v)] == [str(meta.size)], consts


def test_too_many_sequences_for_the_grid_is_named():
    """Sequences take the decode grid's third dimension (65535 at most)."""
    n = 65536
    x = testing.make_inputs(0, B=1, T=n, H=1, K=4, V=4)
    with pytest.raises(ValueError, match="at most 65535 .* got 65536 for 65536 sequences"):
        kda_jax.fused_recurrent_kda(*x.args(), cu_seqlens=np.arange(n + 1),
                                    implementation="triton")


# --------------------------------------------------------------------------- #
# Non-finite inputs (docs/kda.md section 6): the kernel puts NaN where the
# reference does (tests/test_nonfinite.py holds the reference to the rule) in
# every V block of a head, in both token-loop forms (UNIFORM: dense rows;
# bounds loaded: varlen), and in a pool's rows.
# --------------------------------------------------------------------------- #

# (one V block: the block is the whole row; five blocks of 8 over V = 40: each
# program must see the other blocks' columns of v)
V_BLOCKS = [pytest.param(24, None, id="one-v-block"),
            pytest.param(40, configs.replace(configs.RECURRENT["default"],
                                             {"decode.dense.block_v": 8,
                                              "decode.varlen.block_v": 8}),
                         id="five-v-blocks")]


def _spoil(x, at):
    """x with a +inf in v's last column (head 1) at at[0], a NaN in k (head 0:
    both value heads) at at[1], a -inf in q at at[2] and a +inf in beta
    (head 0) at at[3]; each ``at`` entry is (row, token)."""
    x.v[at[0] + (1, x.v.shape[-1] - 1)] = np.inf
    x.k[at[1] + (0, 3)] = np.nan
    x.q[at[2] + (0, 1)] = -np.inf
    x.beta[at[3] + (0,)] = np.inf
    return x


def _check_rule(o, s, ro, rs, check_close):
    """NaN (and other non-finite values) exactly where the reference has them,
    close to it elsewhere."""
    o, s, ro, rs = (np.asarray(a, np.float32) for a in (o, s, ro, rs))
    for got, want, what in ((o, ro, "o"), (s, rs, "final_state")):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaN in {what}")
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
        ok = np.isfinite(want)
        check_close(got[ok], want[ok], "float32", what)


@pytest.mark.parametrize("vd, config", V_BLOCKS)
@pytest.mark.parametrize("form", ["dense", "varlen"])
def test_nonfinite_inputs_poison_the_whole_head(form, vd, config, check_close):
    if form == "dense":  # B rows of one length: the UNIFORM kernel form
        x = testing.make_inputs(21, B=4, T=5, H=1, HV=2, K=16, V=vd)
        at, kw = [(0, 1), (1, 3), (2, 2), (3, 0)], {}
    else:
        cu = np.cumsum([0, 6, 0, 5, 1, 7])
        x = testing.make_inputs(21, T=int(cu[-1]), H=1, HV=2, K=16, V=vd, N=5)
        at, kw = [(0, 1), (0, 9), (0, 11), (0, 12)], dict(cu_seqlens=cu)
    x = _spoil(x, at)
    with configs.override(config) if config else contextlib.nullcontext():
        o, s = _run(x, kw, kda_jax.fused_recurrent_kda, implementation="triton")
    ro, rs = _run(x, kw, reference.naive_recurrent_kda)
    # The reference's NaNs are the rule's: v's head, every column, from the
    # token to the end of its sequence (of 5 or 6 tokens), and its state.
    ro_, rs_ = np.asarray(ro), np.asarray(rs)
    row, t = at[0]
    assert np.isnan(ro_[row, t:(5 if form == "dense" else 6), 1]).all()
    assert np.isfinite(ro_[row, :t]).all()
    assert np.isnan(rs_[row, 1]).all()
    _check_rule(o, s, ro, rs, check_close)


@pytest.mark.parametrize("form", ["dense", "varlen"])
def test_poisoned_sequence_writes_nan_to_its_pool_row(form, check_close):
    """Sequence 1 (a -inf in v's last column, head 0) and sequence 3 (a NaN in
    g, head 1, its last token) write NaN to their pool rows' heads."""
    slots, idx = 6, np.array([4, 0, 2, 5], np.int32)
    if form == "dense":  # the UNIFORM kernel form
        x = testing.make_inputs(22, B=4, T=5, H=1, HV=2, K=16, V=40)
        x.v[1, 1, 0, 39] = -np.inf
        x.g[3, 4, 1, 2] = np.nan
        kw = {}
    else:
        cu = np.cumsum([0, 4, 3, 0, 5])
        x = testing.make_inputs(22, T=int(cu[-1]), H=1, HV=2, K=16, V=40, N=4)
        x.v[0, cu[1] + 1, 0, 39] = -np.inf
        x.g[0, cu[3] + 4, 1, 2] = np.nan
        kw = dict(cu_seqlens=cu)
    rng = np.random.default_rng(3)
    pool = (0.5 * rng.standard_normal((slots, 2, 16, 40))).astype(np.float32)
    with configs.override(configs.replace(configs.RECURRENT["default"],
                                          {"decode.dense.block_v": 8, "decode.varlen.block_v": 8})):
        o, new = kda_jax.fused_recurrent_kda_pool(*x.args(), pool, kda_jax.PoolRows(idx),
                                                  implementation="triton", **kw)
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=pool[idx],
                                           output_final_state=True, **kw)
    new = np.asarray(new)
    assert np.isnan(new[0, 0]).all() and np.isfinite(new[0, 1]).all()  # sequence 1's row
    assert np.isnan(new[5, 1]).all() and np.isfinite(new[5, 0]).all()  # sequence 3's row
    _check_rule(o, new[idx], ro, rs, check_close)
    for r in (1, 3):  # rows no sequence names
        np.testing.assert_array_equal(new[r], pool[r])
