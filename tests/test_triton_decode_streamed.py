"""The decode kernel's two-pass form (RecurrentConfig.stream_block_k): a dense
step of one token per sequence streams the state through [stream_block_k,
block_v] tiles. Checked against the float32 reference on every option, with K
not a multiple of the tile, and with the paged pool (padding and fresh slots).

On a GPU it runs natively; without one, in Triton's interpreter (small shapes).
"""

from __future__ import annotations

import numpy as np
import pytest

import kda_jax
from kda_jax import configs, reference, testing
from kda_jax.options import KdaOptions
from kda_jax.triton import unavailable_reason
from kda_jax.triton.recurrent import recurrent_constexprs

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"Triton path unavailable: {unavailable_reason()}"
)

STREAMED = configs.RecurrentConfig(block_v=16, warps=2, stages=1, stream_block_k=16)

# (id, make_inputs kwargs, fused_recurrent_kda kwargs); T = 1: one token each.
CASES = [
    ("plain", dict(B=5, K=32, V=32), dict()),
    ("bf16-awkward-K", dict(B=3, K=60, V=40, dtype=np.dtype("float32")), dict()),
    ("gva", dict(B=4, H=1, HV=4, K=32, V=24), dict()),
    ("l2norm-sigmoid-neg", dict(B=3, K=40, V=32, normalized_k=False, beta_logits=True),
     dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    ("gate-softplus", dict(B=3, K=32, V=32, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate=True)),
    ("gate-lower-bound", dict(B=3, K=48, V=16, raw_gate=True),
     dict(use_gate_in_kernel=True, with_gate=True, lower_bound=-5.0)),
    ("v-first", dict(B=3, K=36, V=72, state_v_first=True), dict(state_v_first=True)),
    ("no-state", dict(B=4, K=32, V=32, with_state=False), dict()),
    ("extreme-gates", dict(B=7, K=32, V=32, gate_floor=-1000.0), dict()),
]


def _gate(x, with_gate):
    return dict(A_log=x.A_log, dt_bias=x.dt_bias) if with_gate else {}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_streamed_decode_matches_reference(case, check_close):
    _, make_kw, call_kw = case
    call_kw = dict(call_kw)
    x = testing.make_inputs(11, T=1, **make_kw)
    gate = _gate(x, call_kw.pop("with_gate", False))
    h0 = x.initial_state
    with configs.override_recurrent(STREAMED):
        o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True,
                                           implementation="triton", **gate, **call_kw)
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True,
                                           **gate, **call_kw)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")


def test_streamed_decode_without_final_state(check_close):
    x = testing.make_inputs(12, B=3, T=1, K=32, V=32)
    with configs.override_recurrent(STREAMED):
        o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           implementation="triton")
    assert s is None
    ro, _ = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state)
    check_close(o, ro, "float32", "o")


def test_streamed_decode_with_the_pool(check_close):
    """Pool rows: read and written by index; fresh slots start from zeros; a
    padding slot (-1) reads and writes nothing; rows not named stay as they were."""
    n, hv, kd, vd, slots = 4, 2, 32, 32, 6
    x = testing.make_inputs(13, B=n, T=1, H=1, HV=hv, K=kd, V=vd, with_state=False)
    pool = (0.5 * np.random.default_rng(3).standard_normal((slots, hv, kd, vd))).astype(np.float32)
    idx = np.array([4, -1, 0, 2], np.int32)
    has = np.array([True, True, False, True])
    with configs.override_recurrent(STREAMED):
        o, new = kda_jax.fused_recurrent_kda(*x.args(), state_cache=pool, state_indices=idx,
                                             has_initial_state=has, implementation="triton")
    h0 = np.zeros((n, hv, kd, vd), np.float32)
    read = (idx >= 0) & has
    h0[read] = pool[idx[read]]
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True)
    check_close(o, ro, "float32", "o")
    new = np.asarray(new)
    for i, row in enumerate(idx):
        if row >= 0:
            check_close(new[row], rs[i], "float32", "final_state")
    for row in (1, 3, 5):  # named by no sequence (1, 3, 5) or by the padding slot
        np.testing.assert_array_equal(new[row], pool[row], err_msg=f"row {row} changed")


def test_streaming_applies_to_one_token_per_sequence_only(check_close):
    kw = dict(h=2, hv=2, kd=100, vd=64, opts=KdaOptions(scale=0.1), config=STREAMED,
              has_a_log=False, has_dt_bias=False, has_initial_state=True, indexed_state=False)
    one = recurrent_constexprs(uniform_len=1, **kw)
    assert one["STREAM"] and one["BKS"] == 16 and one["BK"] == 128
    for uniform_len in (None, 3):
        assert not recurrent_constexprs(uniform_len=uniform_len, **kw)["STREAM"]
    # Two tokens per sequence under the streamed config: the whole-state form.
    x = testing.make_inputs(14, B=2, T=2, K=32, V=32)
    with configs.override_recurrent(STREAMED):
        o, s = kda_jax.fused_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, implementation="triton")
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")


def test_stream_block_k_is_validated():
    with pytest.raises(ValueError, match=r"stream_block_k=24 must be a power of two >= 8"):
        configs.RecurrentConfig(stream_block_k=24)


def test_a_decode_bucket_streams_with_empty_slots_and_padding(check_close):
    """A bucket with max_len=1 (every sequence at most one token): the batch's
    bounds are device data, empty sequences pass their state through, padded
    slots touch nothing, and token rows past the end get o = 0."""
    hv, kd, vd, slots = 2, 40, 24, 7
    lens = [1, 0, 1, 1, 0]
    bucket = kda_jax.Bucket(8, 8, max_len=1)
    batch = kda_jax.VarlenBatch.from_lengths(lens, bucket)
    x = testing.make_inputs(15, T=bucket.max_tokens, H=1, HV=hv, K=kd, V=vd, N=len(lens),
                            with_state=False, raw_gate=True)
    pool = (0.5 * np.random.default_rng(4).standard_normal((slots, hv, kd, vd))).astype(np.float32)
    idx = np.array([3, 0, 5, 2, 6, -1, -1, -1], np.int32)
    kw = dict(use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias,
              use_beta_sigmoid_in_kernel=True)
    assert recurrent_constexprs(
        h=1, hv=hv, kd=kd, vd=vd, opts=KdaOptions(scale=0.1), config=STREAMED, has_a_log=True,
        has_dt_bias=True, has_initial_state=False, indexed_state=True, max_len=1)["STREAM"]
    with configs.override_recurrent(STREAMED):
        o, new = kda_jax.fused_recurrent_kda(*x.args(), cu_seqlens=batch, state_cache=pool,
                                             state_indices=idx, implementation="triton", **kw)
    t = sum(lens)
    cu = np.cumsum([0] + lens)
    args = [a[:, :t] for a in x.args()]
    ro, rs = reference.naive_recurrent_kda(*args, cu_seqlens=cu, initial_state=pool[idx[:5]],
                                           output_final_state=True, **kw)
    check_close(o[:, :t], ro, "float32", "o")
    np.testing.assert_array_equal(np.asarray(o[:, t:]), 0)
    new = np.asarray(new)
    for i, row in enumerate(idx[:5]):
        check_close(new[row], rs[i], "float32", "final_state")
    np.testing.assert_array_equal(new[0], pool[0])  # the empty sequence's row: as it was
    for row in (1, 4):  # named by no sequence
        np.testing.assert_array_equal(new[row], pool[row], err_msg=f"row {row} changed")
    with pytest.raises(ValueError, match=r"longer than the bucket's max_len=1"):
        kda_jax.VarlenBatch.from_lengths([1, 2], bucket)
