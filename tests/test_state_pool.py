"""The paged state pool (state_cache and kda_jax.PoolRows: ssm_state_indices,
write_indices, has_initial_state) of chunk_kda_pool and
fused_recurrent_kda_pool, on both implementations, against the float32
reference and against chunk_kda / fused_recurrent_kda with initial_state /
output_final_state.

Pool rows are compared bit for bit where the contract says "untouched".
Without a GPU the Triton cases run in Triton's interpreter (small shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import reference, testing
from kda_jax.triton import interpret_mode, unavailable_reason
from conftest import pool_dtype_checks

NO_TRITON = unavailable_reason()
FNS = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}
POOL_FNS = {"chunk": kda_jax.chunk_kda_pool, "recurrent": kda_jax.fused_recurrent_kda_pool}
PoolRows = kda_jax.PoolRows
COMBOS = [
    pytest.param(fn, impl, id=f"{fn}-{impl}",
                 marks=[pytest.mark.skipif(impl == "triton" and NO_TRITON is not None,
                                           reason=f"Triton path unavailable: {NO_TRITON}")])
    for fn in FNS for impl in ("xla", "triton")
]
H, HV, K, V, SLOTS = 1, 2, 32, 32, 6


def _pool(seed, v_first=False, slots=SLOTS):
    rng = np.random.default_rng(seed)
    shape = (slots, HV, V, K) if v_first else (slots, HV, K, V)
    return (0.5 * rng.standard_normal(shape)).astype(np.float32)


def _inputs(seed, lens=None, B=1, T=None, **kw):
    """Inputs and cu_seqlens (None for the dense batch of B sequences of T tokens)."""
    if lens is None:
        return testing.make_inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, **kw), None
    cu = np.cumsum([0] + list(lens))
    x = testing.make_inputs(seed, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(lens), **kw)
    return x, cu


def _expected_h0(pool, idx, has=None):
    """The initial states the contract gives: pool rows, zeros for padding or no state."""
    idx = np.asarray(idx)
    read = (idx >= 0) & (idx < pool.shape[0])
    if has is not None:
        read &= np.asarray(has)
    h0 = np.zeros((idx.size,) + pool.shape[1:], np.float32)
    h0[read] = pool[idx[read]]
    return h0


def _untouched(new, old, rows):
    for r in rows:
        np.testing.assert_array_equal(np.asarray(new[r]), old[r], err_msg=f"row {r} changed")


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_round_trip_equals_initial_and_final_state(fn, impl, check_close):
    lens, idx = [5, 0, 1, 9], np.array([4, 0, 2, 5], np.int32)
    x, cu = _inputs(1, lens, with_state=False)
    pool = _pool(2)
    o, new = POOL_FNS[fn](*x.args(), pool, PoolRows(idx), cu_seqlens=cu, implementation=impl)
    assert new.shape == pool.shape and new.dtype == jnp.float32
    h0 = _expected_h0(pool, idx)
    # The same implementation with initial_state / output_final_state.
    o2, final = FNS[fn](*x.args(), cu_seqlens=cu, initial_state=h0, output_final_state=True,
                        implementation=impl)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new)[idx], np.asarray(final), rtol=1e-6, atol=1e-6)
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=h0,
                                           output_final_state=True)
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(new)[idx], rs, "float32", "final_state")
    np.testing.assert_array_equal(np.asarray(new[0]), pool[0])  # empty sequence: kept
    _untouched(new, pool, [1, 3])


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_read_and_write_slots(fn, impl, check_close):
    """PoolRows with write_indices (ssm_state_indices the rows read): two sequences
    start from one cached row (read, not written: it comes back bit-identical),
    one reads and writes the same row, one reads nothing (-1: zeros), one
    writes nothing; finals against the reference from the rows read."""
    lens = [4, 7, 0, 3, 5]
    read = np.array([2, 2, -1, 4, 1], np.int32)
    write = np.array([0, 5, 3, 4, -1], np.int32)
    x, cu = _inputs(21, lens, with_state=False)
    pool = _pool(22)
    o, new = POOL_FNS[fn](*x.args(), pool, PoolRows(read, write_indices=jnp.asarray(write)),
                          cu_seqlens=cu, implementation=impl)
    h0 = _expected_h0(pool, read)
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=h0,
                                           output_final_state=True)
    check_close(o, ro, "float32", "o")
    new = np.asarray(new)
    check_close(new[[0, 5, 3, 4]], np.asarray(rs)[[0, 1, 2, 3]], "float32", "final_state")
    np.testing.assert_array_equal(new[3], h0[2])  # the empty sequence writes zeros it read
    _untouched(new, pool, [1, 2])


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_device_indices_sharing_a_row_within_a_call(fn, impl):
    """What happens where device indices break the ownership rule (host ones
    are refused, below): sequence 1 reads row 0, which sequence 0 writes in the
    same call. The XLA path reads every row before it writes any, so
    sequence 1 starts from the old state. The Triton kernels run the
    sequences' programs in no order, one per (sequence, value head, V block),
    and the delta rule keeps every V column of the state apart: each column of
    sequence 1's output follows the old row or the new one, undefined which
    (docs/api.md). Either way sequence 0's output and every written row's
    final state are those of a start from the old row."""
    lens = [6, 5]
    x, cu = _inputs(31, lens, with_state=False)
    pool = _pool(32)
    read = jnp.asarray(np.array([0, 0], np.int32))
    write = jnp.asarray(np.array([0, 3], np.int32))
    o, new = POOL_FNS[fn](*x.args(), pool, PoolRows(read, write_indices=write),
                          cu_seqlens=cu, implementation=impl)
    o, new = np.asarray(o), np.asarray(new)
    old = np.stack([pool[0], pool[0]])
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=old,
                                           output_final_state=True)
    ro, rs = np.asarray(ro), np.asarray(rs)
    # Sequence 1 from the row sequence 0 wrote.
    from_new = np.stack([pool[0], rs[0]])
    ro_new, rs_new = (np.asarray(a) for a in reference.naive_recurrent_kda(
        *x.args(), cu_seqlens=cu, initial_state=from_new, output_final_state=True))
    close = lambda a, b: np.isclose(a, b, rtol=1e-4, atol=1e-4).all(axis=0)
    np.testing.assert_allclose(o[0, :6], ro[0, :6], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new[0], rs[0], rtol=1e-4, atol=1e-4)
    seq1_old, seq1_new = close(o[0, 6:], ro[0, 6:]), close(o[0, 6:], ro_new[0, 6:])
    if impl == "xla":
        assert seq1_old.all(), "the XLA path reads every row before writing any"
    assert (seq1_old | seq1_new).all(), "a column of sequence 1 followed neither row"
    # Its final state, column by column, as its output.
    fin_old = np.isclose(new[3], rs[1], rtol=1e-4, atol=1e-4).all(axis=-2)
    fin_new = np.isclose(new[3], rs_new[1], rtol=1e-4, atol=1e-4).all(axis=-2)
    np.testing.assert_array_equal(fin_old | fin_new, True)
    np.testing.assert_array_equal(fin_old, seq1_old)
    _untouched(new, pool, [1, 2, 4, 5])


@pytest.mark.parametrize("fn", FNS)
def test_read_and_write_slot_errors(fn):
    x, _ = _inputs(0, B=3, T=2, with_state=False)
    pool = _pool(1)
    call = lambda read, write: POOL_FNS[fn](*x.args(), pool, PoolRows(read, write_indices=write),
                                            implementation="xla")
    idx = np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match=r"rows\.write_indices names row 1 more than once"):
        call(idx, np.array([1, -1, 1], np.int32))
    with pytest.raises(ValueError, match=r"rows\.ssm_state_indices\[2\]=6 is >= slots=6"):
        call(np.array([0, 1, 6], np.int32), idx)
    with pytest.raises(ValueError, match=r"rows\.write_indices\[1\]=6 is >= slots=6"):
        call(idx, np.array([-1, 6, 3], np.int32))
    # A row one sequence writes is its own in the call: another reading it is refused
    # (on a GPU it would see the old or the new state), naming both.
    with pytest.raises(ValueError, match=r"rows\.ssm_state_indices\[0\]=1 is the row sequence 1 "
                                         r"writes in the same call "
                                         r"\(rows\.write_indices\[1\]=1\)"):
        call(np.array([1, 1, 1], np.int32), idx)
    with pytest.raises(ValueError,
                       match=r"rows\.ssm_state_indices\[1\]=0 is the row sequence 0 writes"):
        call(np.array([3, 0, 2], np.int32), idx)  # a chain 0 -> 1
    o, new = call(np.array([1, 1, 1], np.int32), np.array([3, 4, 5], np.int32))
    assert new.shape == pool.shape  # a row read by every sequence and written by none is fine


@pytest.mark.parametrize("dtype,v_first", [("bfloat16", False), ("bfloat16", True),
                                           ("float16", True)])
@pytest.mark.parametrize("fn,impl", COMBOS)
def test_16_bit_pool_rounds_once_on_write_back(fn, impl, dtype, v_first, check_close):
    """A bfloat16 / float16 pool: rows are read into float32 and computed on in
    float32, and each written row is the float32 pool's final state rounded
    once to the pool's dtype, bit for bit (the same inputs and float32 initial
    values, which the 16-bit rows hold exactly; within float32 rounding where
    the two pools run different native binaries); o equals the float32 pool's;
    rows no sequence names, padding and a has_initial_state False row (NaN,
    never read) come back untouched; o and the rows against the reference."""
    lens, idx = [5, 0, 9, 1], np.array([4, 0, -1, 2], np.int32)
    x, cu = _inputs(11, lens, with_state=False, state_v_first=v_first)
    has = np.array([True, True, True, False])
    wide = np.array(jnp.asarray(_pool(12, v_first), dtype).astype(jnp.float32))
    wide[2] = np.nan  # has_initial_state False: never read
    narrow = jnp.asarray(wide, dtype)
    rows = PoolRows(idx, has_initial_state=has)
    kw = dict(cu_seqlens=cu, state_v_first=v_first, implementation=impl)
    o, new = POOL_FNS[fn](*x.args(), narrow, rows, **kw)
    o32, new32 = POOL_FNS[fn](*x.args(), wide, rows, **kw)
    assert new.dtype == jnp.dtype(dtype) and new.shape == wide.shape
    same, same_rows = pool_dtype_checks(impl, dtype)
    same(np.asarray(o), np.asarray(o32))
    same_rows(np.asarray(new[idx[has & (idx >= 0)]]),
              np.asarray(jnp.asarray(new32, dtype)[idx[has & (idx >= 0)]]))
    same_rows(np.asarray(new[2]), np.asarray(jnp.asarray(new32[2], dtype)))
    _untouched(np.asarray(new), np.asarray(narrow), [1, 3, 5])
    h0 = _expected_h0(np.nan_to_num(wide), idx, has)
    swap = (lambda a: np.swapaxes(a, -1, -2)) if v_first else (lambda a: a)
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=h0,
                                           output_final_state=True, state_v_first=v_first)
    check_close(o, ro, "float32", "o")
    written = np.asarray(jnp.asarray(new, jnp.float32))
    check_close(swap(written[[4, 0, 2]]), swap(np.asarray(rs)[[0, 1, 3]]), dtype, "final_state")


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_padding_slots_and_has_initial_state(fn, impl, check_close):
    """Padding (negative, or a device index past the end) reads and writes nothing;
    has_initial_state False never reads its row (NaN there) but writes it."""
    x, _ = _inputs(3, B=5, T=3, with_state=False)
    pool = _pool(4)
    pool[3] = np.nan  # has_initial_state False: must never be read
    pool[5] = np.nan  # unnamed: must come back as it was, NaN included
    idx = jnp.asarray([-1, 3, 1, -7, 9], jnp.int32)  # device indices: not checked on the host
    has = np.array([True, False, True, True, True])
    o, new = POOL_FNS[fn](*x.args(), pool, PoolRows(idx, has_initial_state=has),
                          implementation=impl)
    h0 = _expected_h0(pool, idx, has)
    assert np.all(np.isfinite(h0))
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True)
    check_close(o, ro, "float32", "o")
    new = np.asarray(new)
    check_close(new[[3, 1]], rs[1:3], "float32", "final_state")
    _untouched(new, pool, [0, 2, 4, 5])


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_v_first_pool(fn, impl, check_close):
    x, _ = _inputs(5, B=2, T=7, with_state=False)
    pool = _pool(6, v_first=True)
    idx = np.array([5, 1])
    o, new = POOL_FNS[fn](*x.args(), pool, PoolRows(idx), state_v_first=True,
                          implementation=impl)
    h0 = _expected_h0(pool, idx)
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True,
                                           state_v_first=True)
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(new)[idx], rs, "float32", "final_state")
    _untouched(new, pool, [0, 2, 3, 4])


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_mixed_batch_equals_separate_calls(fn, impl, check_close):
    """Decodes of one token and prefills in one varlen call == one call per sequence."""
    lens = [1, 1, 12, 1, 7]
    idx = np.array([2, 5, 0, 3, 1], np.int32)
    has = np.array([True, True, False, True, False])
    x, cu = _inputs(7, lens, with_state=False)
    pool = _pool(8)
    call = POOL_FNS[fn]
    o, new = call(*x.args(), pool, PoolRows(idx, has_initial_state=has), cu_seqlens=cu,
                  implementation=impl)
    chained, outs = pool, []
    for i, n in enumerate(lens):
        part = [a[:, cu[i]:cu[i + 1]] for a in x.args()]
        o_i, chained = call(*part, chained,
                            PoolRows(idx[i:i + 1], has_initial_state=has[i:i + 1]),
                            cu_seqlens=[0, n], implementation=impl)
        outs.append(np.asarray(o_i))
    check_close(o, np.concatenate(outs, axis=1), "float32", "o")
    check_close(new, chained, "float32", "final_state")
    _untouched(new, pool, [4])
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, output_final_state=True,
                                           initial_state=_expected_h0(pool, idx, has))
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(new)[idx], rs, "float32", "final_state")


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_decode_loop_in_jit_with_the_pool_donated(fn, impl, check_close):
    """Three one-token steps through a jitted step that donates the pool; the
    indices are a traced argument. Equals the reference over the three tokens."""
    steps, b = 3, 3
    x, _ = _inputs(9, B=b, T=steps, with_state=False)
    pool0 = _pool(10)
    idx = jnp.asarray([4, 0, 1], jnp.int32)

    @jax.jit
    def _step(pool, idx, q, k, v, g, beta):
        return POOL_FNS[fn](q, k, v, g, beta, pool, PoolRows(idx), implementation=impl)

    step = jax.jit(_step, donate_argnums=0)
    # .copy(): an XLA-owned buffer (a device_put of NumPy data may share the
    # host array's memory on CPU, which donation cannot reuse).
    pool, outs = jax.device_put(pool0).copy(), []
    # In place: the new pool lives in the donated buffer. Not so for the
    # interpreter, whose callback returns a fresh buffer.
    in_place = impl == "xla" or not interpret_mode()
    for t in range(steps):
        old, where = pool, pool.unsafe_buffer_pointer()
        o_t, pool = step(pool, idx, *(a[:, t:t + 1] for a in x.args()))
        outs.append(np.asarray(o_t))
        assert old.is_deleted()
        if in_place:
            assert pool.unsafe_buffer_pointer() == where, "the pool was copied, not updated"
    h0 = _expected_h0(pool0, np.asarray(idx))
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True)
    check_close(np.concatenate(outs, axis=1), ro, "float32", "o")
    pool = np.asarray(pool)
    check_close(pool[[4, 0, 1]], rs, "float32", "final_state")
    _untouched(pool, pool0, [2, 3, 5])


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_empty_sequences_still_write_their_rows(fn, impl):
    """No tokens at all: a row with state is written back unchanged, a row
    without (has_initial_state False) becomes zeros, padding writes nothing."""
    x, cu = _inputs(11, [0, 0, 0], with_state=False)
    pool = _pool(12)
    pool[2] = np.nan
    rows = PoolRows(np.array([4, 2, -1]), has_initial_state=np.array([True, False, True]))
    o, new = POOL_FNS[fn](*x.args(), pool, rows, cu_seqlens=cu, implementation=impl)
    assert o.shape == (1, 0, HV, V)
    np.testing.assert_array_equal(np.asarray(new[2]), 0.0)
    _untouched(new, pool, [0, 1, 3, 4, 5])


@pytest.mark.parametrize("impl", ["xla", pytest.param("triton", marks=pytest.mark.skipif(
    NO_TRITON is not None, reason=f"Triton path unavailable: {NO_TRITON}"))])
def test_decode_bucket_with_empty_slots_and_padding(impl, check_close):
    """The serving decode step: a bucket with max_len=1 (bench.serving's), the
    bounds device data, an empty sequence (its row written back as it was),
    padded slots (nothing touched) and token rows past the end (o = 0)."""
    lens = [1, 0, 1, 1, 1]
    bucket = kda_jax.Bucket(8, 8, max_len=1)
    batch = kda_jax.VarlenBatch.from_lengths(lens, bucket)
    x = testing.make_inputs(15, T=bucket.max_tokens, H=H, HV=HV, K=K, V=V, N=len(lens),
                            with_state=False, raw_gate=True)
    pool = _pool(16, slots=7)
    idx = np.array([3, 0, 5, 2, 6, -1, -1, -1], np.int32)
    kw = dict(use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias,
              use_beta_sigmoid_in_kernel=True)
    o, new = jax.jit(lambda pool, batch, *a: kda_jax.fused_recurrent_kda_pool(
        *a, pool, PoolRows(idx), cu_seqlens=batch, implementation=impl,
        **kw))(pool, jax.device_put(batch), *x.args())
    t = sum(lens)
    args = [a[:, :t] for a in x.args()]
    ro, rs = reference.naive_recurrent_kda(*args, cu_seqlens=np.cumsum([0] + lens),
                                           initial_state=pool[idx[:5]], output_final_state=True,
                                           **kw)
    check_close(o[:, :t], ro, "float32", "o")
    np.testing.assert_array_equal(np.asarray(o[:, t:]), 0)
    new = np.asarray(new)
    for i, row in enumerate(idx[:5]):
        check_close(new[row], rs[i], "float32", "final_state")
    np.testing.assert_array_equal(new[0], pool[0])  # the empty sequence's row: as it was
    _untouched(new, pool, [1, 4])  # rows named by no sequence
    with pytest.raises(ValueError, match=r"longer than the bucket's max_len=1"):
        kda_jax.VarlenBatch.from_lengths([1, 2], bucket)


# (id, changes to the pool form's state_cache / rows, error, message)
x0, _ = _inputs(0, B=3, T=2, with_state=False)
P0 = _pool(0)
ROWS0 = PoolRows(np.array([0, 1, 2], np.int32))
GOOD = dict(state_cache=P0, rows=ROWS0)
_rows = ROWS0._replace
ERROR_CASES = [
    ("rows-not-PoolRows", dict(rows=np.array([0, 1, 2], np.int32)), TypeError,
     r"rows must be a kda_jax\.PoolRows .*got ndarray"),
    ("rows-without-indices", dict(rows=PoolRows(None)), ValueError,
     r"rows\.ssm_state_indices is None: a pool call needs the row each sequence starts from"),
    ("cache-float64", dict(state_cache=np.zeros((6, HV, K, V), np.float64)), TypeError,
     r"state_cache must be floating point \(bf16, fp16 or fp32\), got dtype float64"),
    ("cache-int", dict(state_cache=np.zeros((6, HV, K, V), np.int32)), TypeError,
     r"state_cache must be floating point"),
    ("cache-rank3", dict(state_cache=np.zeros((HV, K, V), np.float32)), ValueError,
     r"state_cache must be rank 4 \[slots, HV, K, V\], got shape \(2, 32, 32\)"),
    ("cache-heads", dict(state_cache=np.zeros((6, 4, K, V), np.float32)), ValueError,
     r"state_cache must have shape \(slots, 2, 32, 32\) \[slots, HV, K, V\].*got \(6, 4, 32, 32\)"),
    ("cache-no-slots", dict(state_cache=np.zeros((0, HV, K, V), np.float32)), ValueError,
     r"with slots >= 1, got \(0, 2, 32, 32\)"),
    ("indices-length", dict(rows=_rows(ssm_state_indices=np.array([0, 1], np.int32))), ValueError,
     r"rows\.ssm_state_indices must have shape \(3,\) \[N\].*N = B = 3, got \(2,\)"),
    ("indices-rank3", dict(rows=_rows(ssm_state_indices=np.zeros((3, 1, 1), np.int32))),
     ValueError, r"rows\.ssm_state_indices must have shape \(3,\)"),
    ("indices-float", dict(rows=_rows(ssm_state_indices=np.array([0.0, 1.0, 2.0]))), TypeError,
     r"rows\.ssm_state_indices must be an int32 array \[N\], got dtype float64"),
    ("indices-bool", dict(rows=_rows(ssm_state_indices=np.array([True, False, True]))),
     TypeError, r"rows\.ssm_state_indices must be an int32 array \[N\], got dtype bool"),
    ("indices-list", dict(rows=_rows(ssm_state_indices=[0, 1, 2])), TypeError,
     r"rows\.ssm_state_indices must be an int32 array \[N\] or \[N, 1 \+ drafts\] "
     r"\(NumPy or jax\), got list"),
    ("indices-past-end", dict(rows=_rows(ssm_state_indices=np.array([0, 6, 1]))), ValueError,
     r"rows\.ssm_state_indices\[1\]=6 is >= slots=6 \(state_cache.shape\[0\]\); "
     r"use a row in \[0, slots\)"),
    ("indices-duplicate", dict(rows=_rows(ssm_state_indices=np.array([2, -1, 2]))), ValueError,
     r"rows\.ssm_state_indices names row 2 more than once \(at \[0\], \[2\]\)"),
    ("has-int", dict(rows=_rows(has_initial_state=np.ones(3, np.int32))), TypeError,
     r"rows\.has_initial_state must be a bool array \[N\], got dtype int32"),
    ("has-length", dict(rows=_rows(has_initial_state=np.ones(4, bool))), ValueError,
     r"rows\.has_initial_state must have shape \(3,\) \[N\]"),
    ("v-first-cache-without-flag", dict(state_cache=np.zeros((6, HV, V + 8, K), np.float32)),
     ValueError, r"state_cache must have shape \(slots, 2, 32, 32\)"),
]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_pool_arguments(fn, case):
    _, change, error, match = case
    kw = {**GOOD, **change}
    with pytest.raises(error, match=match):
        POOL_FNS[fn](*x0.args(), kw["state_cache"], kw["rows"], implementation="xla")


@pytest.mark.parametrize("fn", FNS)
def test_varlen_error_names_the_sequences(fn):
    x, cu = _inputs(0, [1, 1])
    with pytest.raises(ValueError, match=r"N = the number of sequences in cu_seqlens = 2"):
        POOL_FNS[fn](*x.args(), P0, PoolRows(np.array([0, 1, 2])), cu_seqlens=cu)


@pytest.mark.parametrize("fn", FNS)
def test_repeated_padding_indices_are_fine(fn):
    o, new = POOL_FNS[fn](*x0.args(), P0, PoolRows(np.array([-1, -1, 2])),
                          implementation="xla")
    _untouched(new, P0, [0, 1, 3, 4, 5])
    assert o.shape == (3, 2, HV, V)
