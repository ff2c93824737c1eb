"""How the pool rows' ssm_state_indices are read: on the host (NumPy) only the real
sequences' entries are checked and padded bucket slots are ignored; indices
wider than int32 (int64 under jax_enable_x64) are saturated before they are
narrowed, so an out-of-range index is padding and never wraps onto a row.

Against the float32 reference; pool rows no real sequence names are compared
bit for bit. Tiny shapes (the Triton cases run in Triton's interpreter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import Bucket, PoolRows, VarlenBatch, reference, testing
from kda_jax.pool import narrow_indices
from kda_jax.triton import unavailable_reason

NO_TRITON = unavailable_reason()
FNS = {"chunk": kda_jax.chunk_kda_pool, "recurrent": kda_jax.fused_recurrent_kda_pool}
COMBOS = [pytest.param("chunk", "xla", id="chunk-xla"),
          pytest.param("recurrent", "xla", id="recurrent-xla"),
          pytest.param("recurrent", "triton", id="recurrent-triton", marks=pytest.mark.skipif(
              NO_TRITON is not None, reason=f"Triton path unavailable: {NO_TRITON}"))]
H, HV, K, V, SLOTS = 1, 1, 8, 8, 4
LENS = [3, 2]
BUCKET = Bucket(max_seqs=4, max_tokens=16)
BIG = 2**32 + 1  # int32(BIG) == 1 and int32(-2**32 + 1) == 1: both would hit row 1


def _pool(seed=7):
    return np.random.default_rng(seed).standard_normal((SLOTS, HV, K, V)).astype(np.float32)


def _inputs():
    cu = np.cumsum([0] + LENS)
    return testing.make_inputs(3, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(LENS)), cu


def _expected(x, cu, pool, rows):
    """(o, new pool) of the contract: sequence n starts from pool[rows[n]] (zeros
    for a row outside [0, slots)) and writes its final state back there."""
    rows = np.asarray(rows, np.int64)
    live = (rows >= 0) & (rows < SLOTS)
    h0 = np.zeros((len(rows), HV, K, V), np.float32)
    h0[live] = pool[rows[live]]
    o, finals = reference.naive_recurrent_kda(*x.args(), initial_state=h0,
                                              output_final_state=True, cu_seqlens=cu)
    new = pool.copy()
    new[rows[live]] = np.asarray(finals)[live]
    return np.asarray(o), new


def _check(o, new, x, cu, pool, rows, check_close, t=None):
    o_ref, new_ref = _expected(x, cu, pool, rows)
    t = int(cu[-1]) if t is None else t
    check_close(np.asarray(o)[:, :t], o_ref, "float32", "o")
    live = {int(r) for r in rows if 0 <= r < SLOTS}
    for r in range(SLOTS):
        if r in live:
            check_close(np.asarray(new[r]), new_ref[r], "float32", f"final_state row {r}")
        else:
            np.testing.assert_array_equal(np.asarray(new[r]), pool[r], err_msg=f"row {r} changed")


def _padded(x, batch):
    return [batch.pad_tokens(a) for a in x.args()]


@pytest.mark.parametrize("fn,impl", COMBOS)
def test_padded_bucket_slots_indices_are_ignored_on_the_host(fn, impl, check_close):
    """A NumPy batch says 2 real sequences of 4 slots: the padded slots' indices
    (a row named again, an index >= slots, one past int32) are not checked and
    nothing is read or written through them."""
    x, cu = _inputs()
    batch = VarlenBatch.build(cu, BUCKET)
    assert isinstance(batch.metadata, np.ndarray)
    pool = _pool()
    idx = np.array([2, 0, 0, BIG], np.int64)
    o, new = FNS[fn](*_padded(x, batch), pool, PoolRows(idx), cu_seqlens=batch,
                     implementation=impl)
    _check(o, new, x, cu, pool, [2, 0], check_close)


@pytest.mark.parametrize("idx,match", [
    ([0, 4, -1, -1], r"rows\.ssm_state_indices\[1\]=4 is >= slots=4"),
    ([0, BIG, -1, -1], rf"rows\.ssm_state_indices\[1\]={BIG} is >= slots=4"),
    ([3, 3, -1, -1],
     r"rows\.ssm_state_indices names row 3 more than once \(at \[0\], \[1\]\)"),
])
def test_real_slots_are_still_checked_on_the_host(idx, match):
    x, cu = _inputs()
    batch = VarlenBatch.build(cu, BUCKET)
    with pytest.raises(ValueError, match=match):
        kda_jax.fused_recurrent_kda_pool(*_padded(x, batch), _pool(),
                                         PoolRows(np.array(idx, np.int64)), cu_seqlens=batch,
                                         implementation="xla")


@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("rows", [np.array([2, 0], np.int32), (np.array([2, 0], np.int32),)],
                         ids=["array", "tuple"])
def test_rows_must_be_pool_rows(fn, rows):
    """The indices themselves, or a plain tuple in PoolRows' order, are refused
    with the fix: which rows a sequence reads and writes is named by field."""
    x, cu = _inputs()
    with pytest.raises(TypeError, match=r"rows must be a kda_jax\.PoolRows .* got "
                                        rf"{type(rows).__name__}"):
        FNS[fn](*x.args(), _pool(), rows, cu_seqlens=cu, implementation="xla")


def test_a_device_batch_leaves_numpy_indices_unchecked(check_close):
    """A batch on the device hides its real count from the host (reading it would
    be a transfer): NumPy indices then act as device indices do, an index >=
    slots (here at real slot 1) is padding, and nothing raises."""
    x, cu = _inputs()
    batch = jax.device_put(VarlenBatch.build(cu, BUCKET))
    pool = _pool()
    idx = np.array([2, 9, 0, BIG], np.int64)
    o, new = kda_jax.chunk_kda_pool(*_padded(x, batch), pool, PoolRows(idx), cu_seqlens=batch,
                                    implementation="xla")
    _check(o, new, x, cu, pool, [2, -1], check_close)


@pytest.mark.parametrize("fn,impl", COMBOS)
@pytest.mark.parametrize("wide", [BIG, -(2**32) + 1], ids=["2**32+1", "-2**32+1"])
def test_int64_device_indices_out_of_range_are_padding(wide, fn, impl, check_close):
    """Under jax_enable_x64 an int64 device index outside [0, slots) is padding,
    not narrowed to int32 first (2**32 + 1 would become row 1 and overwrite it)."""
    x, cu = _inputs()
    pool = _pool()
    with jax.enable_x64(True):
        idx = jnp.asarray([wide, 0], jnp.int64)
        assert idx.dtype == jnp.int64
        step = jax.jit(lambda pool, rows: FNS[fn](*x.args(), pool, rows, cu_seqlens=cu,
                                                  implementation=impl))
        o, new = step(pool, PoolRows(idx))
        o, new = np.asarray(o), np.asarray(new)
    _check(o, new, x, cu, pool, [-1, 0], check_close)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64, np.uint32, np.uint64],
                         ids=str)
@pytest.mark.parametrize("where", ["host", "device"])
def test_narrow_indices_keeps_every_row_and_every_padding(dtype, where):
    """int32 out, each index in [0, slots) kept, each other one still outside
    [0, slots) (padding): -1 where the cast could wrap, itself where it is exact."""
    info = np.iinfo(dtype)
    raw = np.array([0, 3, 4, 100, info.max, info.min, -1 if info.min < 0 else 5], dtype)
    with jax.enable_x64(True):
        got = narrow_indices(raw if where == "host" else jnp.asarray(raw), 4)
        assert isinstance(got, np.ndarray) == (where == "host")
        assert got.dtype == np.int32
        got = np.asarray(got)
    inside = (raw >= 0) & (raw < 4)
    np.testing.assert_array_equal(got[inside], raw[inside])
    assert np.all((got[~inside] < 0) | (got[~inside] >= 4)), got
