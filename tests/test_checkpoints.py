"""Prefill checkpoints (chunk_kda_checkpoints, and chunk_kda_pool's
checkpoint_every with rows.checkpoint_indices) on both implementations: each
checkpoint is the state before an interval of checkpoint_every tokens,
checked against the final states of a prefix-only call on the same path and
against the float32 reference; the pool form (rows by
rows.checkpoint_indices, -1 skips, a bfloat16 pool, the bucketed form);
and the argument errors.

A prefix-only call here is one varlen call whose sequences are the prefixes:
checkpoint j of sequence n is the final state of the first j * n tokens of
sequence n from its initial state, an empty prefix (j = 0) giving the
initial state itself. Without a GPU the Triton cases run in Triton's
interpreter (small shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import configs, reference, testing
from kda_jax.triton import unavailable_reason

NO_TRITON = unavailable_reason()
IMPLS = [pytest.param("xla", id="xla"),
         pytest.param("triton", id="triton",
                      marks=pytest.mark.skipif(NO_TRITON is not None,
                                               reason=f"Triton path unavailable: {NO_TRITON}"))]
H, HV, K, V, CHUNK, SLOTS = 1, 2, 16, 16, 32, 24
# Empty, one token, shorter than an interval, exactly two intervals of 64,
# and a partial last interval.
LENS = [70, 0, 1, 20, 128, 33]


def _inputs(seed, lens, **kw):
    cu = np.cumsum([0] + list(lens))
    return testing.make_inputs(seed, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(lens), **kw), cu


def _prefixes(x, cu, every, initial):
    """The inputs, bounds and initial states of the prefix-only call: one
    sequence per checkpoint (in checkpoint order), the first j * every tokens
    of its sequence from that sequence's initial state."""
    parts, lens, h0 = [], [], []
    for n in range(len(cu) - 1):
        for j in range(-(-int(cu[n + 1] - cu[n]) // every)):
            parts.append([a[:, cu[n]:cu[n] + j * every] for a in x.args()])
            lens.append(j * every)
            h0.append(initial[n])
    args = [np.concatenate([p[i] for p in parts], axis=1) for i in range(5)]
    return args, np.cumsum([0] + lens), np.stack(h0)


def _prefix_finals(x, cu, every, initial, impl, v_first=False):
    """(the prefix-only call's final states on ``impl``, the reference's)."""
    args, pcu, h0 = _prefixes(x, cu, every, initial)
    kw = dict(cu_seqlens=pcu, initial_state=h0, output_final_state=True, state_v_first=v_first)
    # Unsegmented, as the call with checkpoints runs (on sm90 long prefixes
    # could otherwise take the segmented state chain, which rounds otherwise).
    with configs.override(configs.SegmentConfig()):
        _, same = kda_jax.chunk_kda(*args, chunk_size=CHUNK, implementation=impl, **kw)
    _, ref = reference.naive_recurrent_kda(*args, **kw)
    return np.asarray(same), np.asarray(ref)


def _assert_same_path(actual, expected, impl):
    """Checkpoints against the prefix-only call's final states on the same path.

    Triton: bit for bit. The state pass stores the state tile it carries, and
    the prefix call computes the same chunks in the same kernels.
    XLA: to float32 rounding (about 1 ulp). Its scan batches each step's
    products over lanes, and XLA's CPU dot rounds differently at different
    batch sizes; the prefix-only call packs its sequences into another number
    of lanes (with the same lanes the results are bitwise: see
    test_xla_checkpoints_bitwise_with_the_same_lanes)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if impl == "triton":
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("every", [CHUNK, 2 * CHUNK], ids=["n=chunk", "n=2chunk"])
@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoints_equal_prefix_runs(impl, every, check_close):
    x, cu = _inputs(1, LENS)
    o, final, ckpt = kda_jax.chunk_kda_checkpoints(
        *x.args(), cu_seqlens=cu, initial_state=x.initial_state, output_final_state=True,
        checkpoint_every=every, chunk_size=CHUNK, implementation=impl)
    counts = -(-np.array(LENS) // every)
    assert ckpt.shape == (counts.sum(), HV, K, V) and ckpt.dtype == jnp.float32
    same, ref = _prefix_finals(x, cu, every, x.initial_state, impl)
    _assert_same_path(ckpt, same, impl)
    check_close(ckpt, ref, "float32", "checkpoints")
    # The first checkpoint of each non-empty sequence is its initial state.
    firsts = np.cumsum(counts) - counts
    np.testing.assert_array_equal(np.asarray(ckpt)[firsts[counts > 0]],
                                  x.initial_state[counts > 0])
    # o and the final state are those of the call without checkpoints.
    o2, final2 = kda_jax.chunk_kda(*x.args(), cu_seqlens=cu, initial_state=x.initial_state,
                                   output_final_state=True, chunk_size=CHUNK,
                                   implementation=impl)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final2))


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_batch_v_first_without_initial_state(impl, check_close):
    """B = 2 dense rows of T = 70 (C = 2 x 3 at n = 32), V-first states, no
    initial state (the first checkpoints are zeros), no final state."""
    x = testing.make_inputs(2, B=2, T=70, H=H, HV=HV, K=K, V=V, with_state=False)
    o, final, ckpt = kda_jax.chunk_kda_checkpoints(*x.args(), state_v_first=True,
                                                   checkpoint_every=CHUNK, chunk_size=CHUNK,
                                                   implementation=impl)
    assert final is None and ckpt.shape == (6, HV, V, K)
    flat = testing.KdaInputs(*(a.reshape((1, -1) + a.shape[2:]) for a in x.args()), None)
    zeros = np.zeros((2, HV, V, K), np.float32)
    same, ref = _prefix_finals(flat, np.array([0, 70, 140]), CHUNK, zeros, impl, v_first=True)
    _assert_same_path(ckpt, same, impl)
    check_close(ckpt, ref, "float32", "checkpoints")
    np.testing.assert_array_equal(np.asarray(ckpt)[[0, 3]], 0.0)


@pytest.mark.skipif(NO_TRITON is not None, reason=f"Triton path unavailable: {NO_TRITON}")
def test_triton_state_in_k_halves(check_close):
    """K = 100 with float32 intermediates (the interpreter's): the state pass
    holds the state as two K halves (SPLIT_K), and stores both."""
    from kda_jax.triton.forward import split_state_k

    assert split_state_k(jnp.float32, 100)
    cu = np.array([0, 70, 103])
    x = testing.make_inputs(10, T=103, H=H, HV=1, K=100, V=V, N=2)
    _, _, ckpt = kda_jax.chunk_kda_checkpoints(*x.args(), cu_seqlens=cu,
                                               initial_state=x.initial_state,
                                               checkpoint_every=CHUNK, chunk_size=CHUNK,
                                               implementation="triton")
    same, ref = _prefix_finals(x, cu, CHUNK, x.initial_state, "triton")
    _assert_same_path(ckpt, same, "triton")
    check_close(ckpt, ref, "float32", "checkpoints")


def test_xla_checkpoints_bitwise_with_the_same_lanes():
    """One sequence in one lane, as its prefixes: the XLA path's checkpoints
    are the prefix calls' final states bit for bit."""
    x, cu = _inputs(3, [100])
    _, _, ckpt = kda_jax.chunk_kda_checkpoints(*x.args(), initial_state=x.initial_state,
                                               checkpoint_every=CHUNK, chunk_size=CHUNK,
                                               implementation="xla")
    for j in range(1, 4):
        part = [a[:, :j * CHUNK] for a in x.args()]
        _, final = kda_jax.chunk_kda(*part, initial_state=x.initial_state,
                                     output_final_state=True, chunk_size=CHUNK,
                                     implementation="xla")
        np.testing.assert_array_equal(np.asarray(ckpt[j]), np.asarray(final[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_poisoned_sequence_checkpoints_match_prefix_runs(impl):
    """A NaN in v at token 40 of the first sequence: its checkpoints from 64
    on are NaN, as the prefix runs' final states are; other sequences keep
    finite checkpoints."""
    x, cu = _inputs(4, [100, 70])
    x.v[0, 40, 1, 3] = np.nan
    _, _, ckpt = kda_jax.chunk_kda_checkpoints(*x.args(), cu_seqlens=cu,
                                               initial_state=x.initial_state,
                                               checkpoint_every=CHUNK, chunk_size=CHUNK,
                                               implementation=impl)
    same, _ = _prefix_finals(x, cu, CHUNK, x.initial_state, impl)
    ckpt = np.asarray(ckpt)
    np.testing.assert_array_equal(np.isnan(ckpt), np.isnan(same))
    assert np.isnan(ckpt[2:4, 1]).all() and np.isfinite(ckpt[:2]).all()
    assert np.isfinite(ckpt[4:]).all()
    _assert_same_path(np.nan_to_num(ckpt), np.nan_to_num(same), impl)


def _pool(seed, dtype=np.float32):
    """A pool whose values bfloat16 holds exactly (so a bfloat16 pool and a
    float32 one start from the same states)."""
    rng = np.random.default_rng(seed)
    pool = (0.5 * rng.standard_normal((SLOTS, HV, K, V))).astype(np.float32)
    return np.asarray(jnp.asarray(jnp.asarray(pool, jnp.bfloat16), dtype))


# Sequence n's row, and its checkpoints' rows at n = 64 (LENS has at most 2
# intervals; a third column is ignored), -1 skips.
IDX = np.array([0, 1, 2, 3, 4, 5], np.int32)
CKPT_IDX = np.array([[6, 7, 20], [-1, -1, -1], [8, -1, 21], [-1, -1, -1], [9, 10, -1],
                     [11, -1, -1]], np.int32)
WRITTEN = {6: 0, 7: 1, 8: 2, 9: 4, 10: 5, 11: 6}  # pool row -> index into the [C] checkpoints


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_pool_form_writes_checkpoint_rows(impl, dtype, check_close):
    """Checkpoints into pool rows: each written row is the [C] output's
    checkpoint (the same path with initial_state), rounded once to the pool's
    dtype; -1 and columns past a sequence's checkpoints write nothing; final
    states still go to their rows; every other row comes back bit-identical."""
    x, cu = _inputs(5, LENS, with_state=False)
    pool = _pool(6, dtype)
    o, new = kda_jax.chunk_kda_pool(*x.args(), jnp.asarray(pool),
                                    kda_jax.PoolRows(IDX, checkpoint_indices=CKPT_IDX),
                                    cu_seqlens=cu, checkpoint_every=64, chunk_size=CHUNK,
                                    implementation=impl)
    assert new.dtype == jnp.dtype(dtype) and new.shape == pool.shape
    h0 = np.asarray(pool[IDX], np.float32)
    o2, final, ckpt = kda_jax.chunk_kda_checkpoints(*x.args(), cu_seqlens=cu, initial_state=h0,
                                                    output_final_state=True, checkpoint_every=64,
                                                    chunk_size=CHUNK, implementation=impl)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    rounded = lambda a: np.asarray(jnp.asarray(a, dtype))
    new = np.asarray(new)
    rows = list(WRITTEN)
    np.testing.assert_array_equal(new[rows], rounded(np.asarray(ckpt)[list(WRITTEN.values())]))
    np.testing.assert_array_equal(new[IDX], rounded(final))
    untouched = [r for r in range(SLOTS) if r not in rows and r not in IDX]
    np.testing.assert_array_equal(new[untouched], pool[untouched])
    _, ref = _prefix_finals(x, cu, 64, h0, impl)
    check_close(np.asarray(new[rows], np.float32), ref[list(WRITTEN.values())], dtype,
                "checkpoints")


@pytest.mark.parametrize("impl", IMPLS)
def test_bucketed_pool_form_in_jit(impl):
    """The serving form: a VarlenBatch, the pool and device checkpoint indices
    as arguments of one jitted step. New index values and new bounds of the
    bucket reuse the executable; the rows equal the host-bounds call's."""
    pool = _pool(8).copy()
    # The two padded slots name rows of their own, NaN: they must read and
    # write none of them.
    pad_idx, pad_ckpt = np.array([14, 15], np.int32), np.array([[16, 17, 18], [19, 13, 23]],
                                                              np.int32)
    pool[np.r_[pad_idx, pad_ckpt.ravel()]] = np.nan
    pool = jnp.asarray(pool)
    bucket = kda_jax.Bucket(8, 256, CHUNK)
    pad = lambda a, rows: np.concatenate([a, rows])

    @jax.jit
    def step(pool, idx, ckpt_idx, batch, q, k, v, g, beta):
        return kda_jax.chunk_kda_pool(q, k, v, g, beta, pool,
                                      kda_jax.PoolRows(idx, checkpoint_indices=ckpt_idx),
                                      cu_seqlens=batch, checkpoint_every=64, chunk_size=CHUNK,
                                      implementation=impl)

    expected = {}
    for shift, lens in ((0, LENS), (1, LENS[::-1])):
        x, cu = _inputs(7, lens, with_state=False)
        ckpt_idx = np.where(CKPT_IDX >= 0, CKPT_IDX + shift, -1).astype(np.int32)
        batch = kda_jax.VarlenBatch.build(cu, bucket)
        args = [batch.pad_tokens(a) for a in x.args()]
        _, new = step(pool, jnp.asarray(pad(IDX, pad_idx)), jnp.asarray(pad(ckpt_idx, pad_ckpt)),
                      batch, *args)
        for r in np.r_[pad_idx, pad_ckpt.ravel()]:
            np.testing.assert_array_equal(np.asarray(new[r]), np.asarray(pool[r]))
        _, host = kda_jax.chunk_kda_pool(*x.args(), pool,
                                         kda_jax.PoolRows(IDX, checkpoint_indices=ckpt_idx),
                                         cu_seqlens=cu, checkpoint_every=64, chunk_size=CHUNK,
                                         implementation=impl)
        # XLA: the bucketed form's one lane rounds as one lane does (see
        # _assert_same_path); Triton: the same kernels, bit for bit.
        _assert_same_path(new, host, impl)
        expected[shift] = np.asarray(new)
    assert step._cache_size() == 1
    assert not np.array_equal(expected[0], expected[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients(impl):
    """XLA: checkpoints are differentiable (JAX autodiff of the scan), equal
    to the gradient of the reference's prefix finals. Triton: the call with
    checkpoints is forward only and says so."""
    x, cu = _inputs(9, [40, 25])
    every = CHUNK

    def loss(v):
        _, _, ckpt = kda_jax.chunk_kda_checkpoints(x.q, x.k, v, x.g, x.beta, cu_seqlens=cu,
                                                   initial_state=x.initial_state,
                                                   checkpoint_every=every, chunk_size=CHUNK,
                                                   implementation=impl)
        return jnp.sum(ckpt ** 2)

    if impl == "triton":
        with pytest.raises(kda_jax.NotDifferentiableError,
                           match="chunk_kda_checkpoints on the Triton path"):
            jax.grad(loss)(jnp.asarray(x.v))
        return
    # Checkpoints at 32: sequence 0's initial state and its state after 32
    # tokens, sequence 1's initial state: prefixes of 0, 32 and 0 tokens.
    args, pcu, h0 = _prefixes(x, cu, every, x.initial_state)
    assert list(np.diff(pcu)) == [0, 32, 0]

    def ref_loss(v):
        _, final = reference.naive_recurrent_kda(
            args[0], args[1], v[:, :32], args[3], args[4], cu_seqlens=pcu, initial_state=h0,
            output_final_state=True)
        return jnp.sum(final ** 2)

    got, want = jax.grad(loss)(jnp.asarray(x.v)), jax.grad(ref_loss)(jnp.asarray(x.v))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_no_sequence_and_all_empty():
    """B = 0: no checkpoint ([0, HV, K, V]); bounds of empty sequences only: none."""
    x = testing.make_inputs(0, B=0, T=4, H=H, HV=HV, K=K, V=V, with_state=False)
    _, final, ckpt = kda_jax.chunk_kda_checkpoints(*x.args(), checkpoint_every=CHUNK,
                                                   chunk_size=CHUNK, implementation="xla")
    assert final is None and ckpt.shape == (0, HV, K, V)
    y, cu = _inputs(0, [0, 0])
    for impl in ("xla",) + (("triton",) if NO_TRITON is None else ()):
        _, final, ckpt = kda_jax.chunk_kda_checkpoints(*y.args(), cu_seqlens=cu,
                                                       initial_state=y.initial_state,
                                                       output_final_state=True,
                                                       checkpoint_every=CHUNK, chunk_size=CHUNK,
                                                       implementation=impl)
        assert ckpt.shape == (0, HV, K, V)
        np.testing.assert_array_equal(np.asarray(final), y.initial_state)


# --------------------------------------------------------------------------- #
# Argument errors: raised by the checks, before any backend runs.
# --------------------------------------------------------------------------- #


@pytest.fixture
def no_backend(monkeypatch):
    from kda_jax import api

    def ran(*args, **kwargs):
        raise AssertionError("the backend ran before the bad input was rejected")

    for name in ("_chunk_xla", "_chunk_triton"):
        monkeypatch.setattr(api, name, ran)


def _bad(rows=None, **kw):
    """chunk_kda_pool on CACHE when ``rows`` are given, else chunk_kda_checkpoints."""
    x, cu = _inputs(0, [40, 0, 70])
    base = dict(cu_seqlens=cu, chunk_size=CHUNK, implementation="xla")
    if rows is None:
        return kda_jax.chunk_kda_checkpoints(*x.args(), **{**base, **kw})
    return kda_jax.chunk_kda_pool(*x.args(), CACHE, rows, **{**base, **kw})


CACHE = np.zeros((SLOTS, HV, K, V), np.float32)
ROWS = np.array([[3, 4, 5], [-1, -1, -1], [6, 7, 8]], np.int32)


def _rows(checkpoint_indices=None, indices=(0, 1, 2), **kw):
    """PoolRows of _bad's three sequences (rows 0, 1, 2 unless ``indices``)."""
    return kda_jax.PoolRows(np.array(indices, np.int32), checkpoint_indices=checkpoint_indices,
                            **kw)


@pytest.mark.parametrize("kw,error,match", [
    (dict(checkpoint_every=48), ValueError,
     r"checkpoint_every=48 must be a positive multiple of chunk_size=32 .* pass "
     r"checkpoint_every=32 or 64"),
    (dict(checkpoint_every=48, rows=_rows(ROWS)), ValueError,
     r"checkpoint_every=48 must be a positive multiple of chunk_size=32"),
    (dict(checkpoint_every=-64), ValueError,
     r"checkpoint_every=-64 must be a positive multiple of chunk_size=32"),
    (dict(checkpoint_every=0), ValueError, r"checkpoint_every=0 must be a positive multiple"),
    (dict(checkpoint_every=64.0), TypeError, r"checkpoint_every must be a Python int.* got 64.0"),
    (dict(checkpoint_every=True), TypeError, r"checkpoint_every must be a Python int.* got True"),
    (dict(checkpoint_every=np.array(64)), TypeError, r"checkpoint_every must be a Python int"),
    (dict(checkpoint_every=None), TypeError,
     r"chunk_kda_checkpoints needs checkpoint_every.* call kda_jax.chunk_kda"),
    (dict(rows=_rows(ROWS)), ValueError,
     r"rows\.checkpoint_indices was passed without checkpoint_every"),
    (dict(checkpoint_every=64, rows=_rows()), ValueError,
     r"checkpoint_every=64 with a pool writes the checkpoints into pool rows: pass "
     r"rows\.checkpoint_indices"),
    (dict(checkpoint_every=64, rows=_rows(ROWS[:2])), ValueError,
     r"rows\.checkpoint_indices must have shape \(3, J\) .* J >= 2 columns .* got \(2, 3\)"),
    (dict(checkpoint_every=32, rows=_rows(ROWS[:, :2])), ValueError,
     r"J >= 3 columns \(the most intervals of checkpoint_every=32 tokens .* got \(3, 2\)"),
    (dict(checkpoint_every=64, rows=_rows(ROWS[:, :1])), ValueError,
     r"J >= 2 columns .* got \(3, 1\)"),
    (dict(checkpoint_every=64, rows=_rows(ROWS.astype(np.float32))), TypeError,
     r"rows\.checkpoint_indices must be an int32 array \[N, J\], got dtype float32"),
    (dict(checkpoint_every=64, rows=_rows([[3, 4]] * 3)), TypeError,
     r"rows\.checkpoint_indices must be an int32 array \[N, J\] \(NumPy or jax\), got list"),
    (dict(checkpoint_every=64, rows=_rows(np.where(ROWS == 7, SLOTS, ROWS))),
     ValueError, r"rows\.checkpoint_indices\[2, 1\]=24 is >= slots=24"),
    (dict(checkpoint_every=64, rows=_rows(np.where(ROWS == 7, 3, ROWS))),
     ValueError,
     r"rows\.checkpoint_indices names row 3 more than once \(at \[0, 0\], \[2, 1\]\)"),
    (dict(checkpoint_every=64, rows=_rows(np.where(ROWS == 6, 2, ROWS))),
     ValueError, r"rows\.checkpoint_indices\[2, 0\]=2 is also the row sequence 2's final state"),
    # A checkpoint row another sequence reads in the same call (its own read row is fine).
    (dict(checkpoint_every=64, rows=_rows(np.where(ROWS == 6, 9, ROWS), indices=[9, 10, 11],
                                          write_indices=np.array([0, 1, 2], np.int32))),
     ValueError, r"rows\.ssm_state_indices\[0\]=9 is the row sequence 2 writes in the same "
                 r"call \(rows\.checkpoint_indices\[2, 0\]=9\)"),
])
def test_argument_errors(no_backend, kw, error, match):
    with pytest.raises(error, match=match):
        _bad(**kw)


@pytest.mark.parametrize("fn,kw,refused", [
    # The old chunk_kda(..., checkpoint_every=n) returned three outputs: it now
    # raises rather than quietly returning two.
    ("chunk_kda", dict(checkpoint_every=64), "checkpoint_every"),
    ("chunk_kda", dict(checkpoint_indices=ROWS), "checkpoint_indices"),
    # Checkpoint rows belong to the pool form (rows.checkpoint_indices).
    ("chunk_kda_checkpoints", dict(checkpoint_every=64, checkpoint_indices=ROWS),
     "checkpoint_indices"),
    # Checkpoints are not taken with context parallelism.
    ("chunk_kda_checkpoints", dict(checkpoint_every=64, context_axis="cp"), "context_axis"),
])
def test_old_checkpoint_keywords_are_refused(no_backend, fn, kw, refused):
    x, cu = _inputs(0, [40, 0, 70])
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{refused}'"):
        getattr(kda_jax, fn)(*x.args(), cu_seqlens=cu, chunk_size=CHUNK, **kw)


def test_argument_errors_name_the_fixes(no_backend):
    # Unused entries (past a sequence's checkpoints) are not checked: [0, 2]
    # and the empty sequence's row may hold anything.
    ok = np.where(ROWS == 5, SLOTS + 5, ROWS)
    ok[1] = [0, 0, 99]
    with pytest.raises(AssertionError, match="the backend ran"):
        _bad(checkpoint_every=64, rows=_rows(ok))
    x, cu = _inputs(0, [40, 70])
    batch = kda_jax.VarlenBatch.build(cu, kda_jax.Bucket(4, 128, CHUNK))
    args = [batch.pad_tokens(a) for a in x.args()]
    with pytest.raises(ValueError, match=r"with a VarlenBatch as cu_seqlens needs the pool form"):
        kda_jax.chunk_kda_checkpoints(*args, cu_seqlens=batch, checkpoint_every=64,
                                      chunk_size=CHUNK)
    # A NumPy batch's real bounds are known: J is checked against them.
    with pytest.raises(ValueError, match=r"must have shape \(4, J\) .* J >= 3 .* got \(4, 2\)"):
        kda_jax.chunk_kda_pool(*args, CACHE,
                               _rows(np.full((4, 2), -1, np.int32), indices=[0, 1, -1, -1]),
                               cu_seqlens=batch, checkpoint_every=32, chunk_size=CHUNK)
    # The token-by-token pool form takes no checkpoints.
    with pytest.raises(ValueError, match=r"rows\.checkpoint_indices with fused_recurrent_kda_pool"):
        kda_jax.fused_recurrent_kda_pool(*args, CACHE,
                                         _rows(np.full((4, 2), -1, np.int32),
                                               indices=[0, 1, -1, -1]),
                                         cu_seqlens=batch, implementation="xla")
