"""Speculative verify: ``PoolRows`` with ``ssm_state_indices`` [N, 1 + S] and
``num_accepted_tokens`` [N] in fused_recurrent_kda_pool and chunk_kda_pool, on
both implementations.

A verify step must give what single-token decodes run one after another give
(same path, float32 pool: bit for bit, but for float32 rounding where a
backend does not promise the same bits), each sequence starting from the row of
its last accepted token and writing the state after each of its tokens to that
token's row; both are also checked against the float64 reference. Rows no
write names come back bit-identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import Bucket, PoolRows, VarlenBatch, reference, testing
from kda_jax.triton import unavailable_reason
from conftest import pool_dtype_checks

NO_TRITON = unavailable_reason()
ON_ACCELERATOR = jax.default_backend() != "cpu"
FNS = {"chunk": kda_jax.chunk_kda_pool, "recurrent": kda_jax.fused_recurrent_kda_pool}
IMPLS = [pytest.param("xla"),
         pytest.param("triton", marks=pytest.mark.skipif(
             NO_TRITON is not None, reason=f"Triton path unavailable: {NO_TRITON}"))]
H, HV, K, V, SLOTS = 1, 2, 32, 16, 20


def _pool(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (0.5 * rng.standard_normal((SLOTS, HV, K, V))).astype(dtype)


def _inputs(seed, lens):
    cu = np.cumsum([0] + list(lens))
    x = testing.make_inputs(seed, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(lens),
                            with_state=False)
    return x, cu


def _rows(seed, n, w):
    """Distinct pool rows [n, w] with a -1 (a token whose state is not kept)."""
    rng = np.random.default_rng(seed)
    rows = rng.permutation(SLOTS)[: n * w].reshape(n, w).astype(np.int32)
    if w > 1:
        rows[0, 1] = -1
    return rows


def _start_states(pool, rows, acc, has=None):
    n = rows.shape[0]
    h0 = np.zeros((n,) + pool.shape[1:], np.float32)
    for i in range(n):
        r = rows[i, acc[i] - 1]
        if r >= 0 and (has is None or has[i]):
            h0[i] = pool[r]
    return h0


def _sequential(fn_impl, x, cu, h0):
    """Single-token decodes one after another: step t decodes token t of every
    sequence still that long. Returns o [1, T, HV, V] and the states after
    each token {(n, t): state}."""
    lens = np.diff(cu)
    o = np.zeros(x.v.shape, np.float32)
    states, after = h0.copy(), {}
    for t in range(int(lens.max(initial=0))):
        live = np.flatnonzero(lens > t)
        tok = cu[live] + t
        pick = lambda a: a[:, tok]
        step_cu = np.arange(live.size + 1)
        ot, st = kda_jax.fused_recurrent_kda(
            *(pick(a) for a in x.args()), cu_seqlens=step_cu, initial_state=states[live],
            output_final_state=True, implementation=fn_impl)
        o[:, tok] = np.asarray(ot)
        states[live] = np.asarray(st)
        for j, n in enumerate(live):
            after[(int(n), t)] = np.asarray(st[j])
    return o, after


def _reference_states(x, cu, h0):
    """float64-reference o and the state after each token {(n, t): state}."""
    ro = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=h0)[0]
    after = {}
    for n in range(len(cu) - 1):
        for t in range(int(cu[n + 1] - cu[n])):
            sl = slice(int(cu[n]), int(cu[n]) + t + 1)
            _, s = reference.naive_recurrent_kda(*(a[:, sl] for a in x.args()),
                                                 initial_state=h0[n:n + 1],
                                                 output_final_state=True)
            after[(n, t)] = np.asarray(s[0])
    return ro, after


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,drafts,lens,acc", [
    ("recurrent", 0, [1, 1, 1], [1, 1, 1]),          # no drafts: a plain decode step
    ("recurrent", 1, [2, 2, 2, 2], [1, 2, 2, 1]),
    ("recurrent", 3, [4, 1, 0, 3], [4, 1, 2, 3]),    # shorter and empty sequences
    ("chunk", 3, [4, 1, 0, 3], [4, 1, 2, 3]),        # chunk_kda_pool runs the same kernel
], ids=["S0", "S1", "S3-varlen", "S3-varlen-chunk"])
def test_verify_equals_sequential_decodes(fn, impl, drafts, lens, acc, check_close):
    w = drafts + 1
    x, cu = _inputs(drafts, lens)
    n = len(lens)
    rows, acc = _rows(drafts + 10, n, w), np.array(acc, np.int32)
    has = np.ones(n, bool)
    has[-1] = False  # starts from zeros, never reads its row
    pool = _pool(drafts)
    pool[rows[-1, acc[-1] - 1]] = np.nan  # the row it does not read
    o, new = FNS[fn](*x.args(), pool, PoolRows(rows, num_accepted_tokens=acc,
                                               has_initial_state=has),
                     cu_seqlens=cu, implementation=impl)
    new = np.asarray(new)
    h0 = _start_states(pool, rows, acc, has)
    so, s_after = _sequential(impl, x, cu, h0)
    ro, r_after = _reference_states(x, cu, h0)
    # The Triton kernel takes the state's two reductions over K in one pass
    # when every sequence has the same length, in sequence when bounds are
    # loaded (kda_jax/kernels/fused_recurrent.py): varlen verifies then differ from
    # one-token decodes by float32 rounding only.
    # XLA promises the same bits only on the CPU: on a GPU its fusions of the
    # verify's token scan and of a one-token step contract multiplies and adds
    # differently (float32 rounding apart, 2e-8 seen on an H100).
    same = np.testing.assert_array_equal
    if (impl == "triton" and len(set(lens)) > 1) or (impl == "xla" and ON_ACCELERATOR):
        same = lambda a, b, **kw: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7, **kw)
    same(np.asarray(o), so)
    check_close(o, ro, "float32", "o")
    written = set()
    for (i, t), state in s_after.items():
        if rows[i, t] >= 0:
            same(new[rows[i, t]], state, err_msg=f"row of ({i}, {t})")
            check_close(new[rows[i, t]], r_after[(i, t)], "float32", "state")
            written.add(int(rows[i, t]))
    for r in set(range(SLOTS)) - written:
        np.testing.assert_array_equal(new[r], pool[r], err_msg=f"row {r} changed")


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_without_counts_starts_from_column_0(impl, check_close):
    lens = [3, 2]
    x, cu = _inputs(3, lens)
    rows, pool = _rows(4, 2, 3), _pool(5)
    o, new = kda_jax.fused_recurrent_kda_pool(*x.args(), pool, PoolRows(rows), cu_seqlens=cu,
                                              implementation=impl)
    h0 = _start_states(pool, rows, np.ones(2, np.int32))
    ro, r_after = _reference_states(x, cu, h0)
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(new)[rows[1, 1]], r_after[(1, 1)], "float32", "state")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_verify_16_bit_pool_rounds_each_written_state_once(impl, dtype, check_close):
    """The states stay float32 between a verify's tokens (unlike decodes
    through a 16-bit pool, which round after each): each written row is the
    float32 pool's row rounded once."""
    lens, acc = [3, 3, 2], np.array([2, 3, 1], np.int32)
    x, cu = _inputs(7, lens)
    rows = _rows(8, 3, 3)
    pool32 = np.asarray(jnp.asarray(_pool(9)).astype(dtype).astype(jnp.float32))
    o16, new16 = kda_jax.fused_recurrent_kda_pool(
        *x.args(), jnp.asarray(pool32, dtype), PoolRows(rows, num_accepted_tokens=acc),
        cu_seqlens=cu, implementation=impl)
    o32, new32 = kda_jax.fused_recurrent_kda_pool(
        *x.args(), pool32, PoolRows(rows, num_accepted_tokens=acc), cu_seqlens=cu,
        implementation=impl)
    assert new16.dtype == dtype
    same, same_rows = pool_dtype_checks(impl, dtype)
    same(np.asarray(o16), np.asarray(o32))
    same_rows(np.asarray(new16), np.asarray(jnp.asarray(new32).astype(dtype)))
    ro, _ = _reference_states(x, cu, _start_states(pool32, rows, acc))
    check_close(o16, ro, "float32", "o")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", list(FNS))
def test_verify_in_a_bucket_compiles_once(fn, impl, check_close):
    """The bucketed form with device indices and counts: one trace for every
    acceptance pattern; padded slots (their rows NaN) read and write nothing."""
    bucket = Bucket(max_seqs=4, max_tokens=16, chunk_size=64)
    lens, w = [3, 1, 3], 3
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(11, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, with_state=False)
    batch = jax.device_put(VarlenBatch.build(cu, bucket))
    padded = [batch.pad_tokens(a) for a in x.args()]
    rows = np.arange(4 * w, dtype=np.int32).reshape(4, w)
    pool = _pool(12)
    pool[rows[3]] = np.nan  # the padded slot's rows
    traces = []

    @jax.jit
    def step(pool, rows, acc):
        traces.append(1)
        return FNS[fn](*padded, pool, PoolRows(rows, num_accepted_tokens=acc),
                       cu_seqlens=batch, implementation=impl)

    for acc in ([1, 1, 3, 2], [3, 1, 2, 1]):
        acc = np.array(acc, np.int32)
        o, new = step(jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(acc))
        new = np.asarray(new)
        h0 = _start_states(pool, rows[:3], acc[:3])
        ro, r_after = _reference_states(x, cu, h0)
        check_close(np.asarray(o)[:, :cu[-1]], ro, "float32", "o")
        np.testing.assert_array_equal(np.asarray(o, np.float32)[:, cu[-1]:], 0.0)
        check_close(new[rows[0, 2]], r_after[(0, 2)], "float32", "state")
        check_close(new[rows[1, 0]], r_after[(1, 0)], "float32", "state")
        np.testing.assert_array_equal(new[rows[1, 1:]], pool[rows[1, 1:]])  # past its 1 token
        np.testing.assert_array_equal(new[rows[3]], pool[rows[3]])
    assert len(traces) == 1


def _call(**fields):
    """fused_recurrent_kda_pool of two sequences with ``PoolRows(**fields)``."""
    x, cu = _inputs(0, [2, 2])
    return kda_jax.fused_recurrent_kda_pool(*x.args(), _pool(0), PoolRows(**fields),
                                            cu_seqlens=cu, implementation="xla")


VERIFY_ROWS = np.array([[0, 1], [2, 3]])


@pytest.mark.parametrize("kw,err,match", [
    (dict(ssm_state_indices=VERIFY_ROWS, num_accepted_tokens=np.array([1, 3])),
     ValueError, r"rows\.num_accepted_tokens\[1\]=3 is outside \[1, 2\]"),
    (dict(ssm_state_indices=VERIFY_ROWS, num_accepted_tokens=np.array([0, 1])),
     ValueError, r"rows\.num_accepted_tokens\[0\]=0 is outside \[1, 2\]"),
    (dict(ssm_state_indices=np.array([[0], [2]])),
     ValueError, r"sequence 0 has 2 tokens but rows\.ssm_state_indices has 1 columns"),
    (dict(ssm_state_indices=np.array([[0, 1], [1, 3]])), ValueError,
     r"rows\.ssm_state_indices names row 1 more than once"),
    (dict(ssm_state_indices=np.array([[0, 1], [2, 99]])), ValueError,
     r"rows\.ssm_state_indices\[1, 1\]=99 is >= slots=20"),
    (dict(ssm_state_indices=np.array([[0, 1], [2, 3], [4, 5]])), ValueError,
     r"rows\.ssm_state_indices \[N, 1 \+ drafts\] .* N = .* = 2 rows"),
    (dict(ssm_state_indices=np.array([0, 1]), num_accepted_tokens=np.array([1, 1])),
     ValueError, r"rows\.num_accepted_tokens is only used with a speculative-verify"),
    (dict(ssm_state_indices=VERIFY_ROWS, write_indices=np.array([4, 5])),
     ValueError, r"rows\.write_indices with a speculative-verify rows\.ssm_state_indices"),
    (dict(ssm_state_indices=VERIFY_ROWS, num_accepted_tokens=np.array([1.0, 1.0])),
     TypeError, r"rows\.num_accepted_tokens must be an int32 array"),
    (dict(ssm_state_indices=VERIFY_ROWS.astype(np.float32)), TypeError,
     r"rows\.ssm_state_indices must be an int32 array"),
])
def test_verify_argument_errors(kw, err, match):
    with pytest.raises(err, match=match):
        _call(**kw)


def test_verify_refuses_checkpoints():
    x, cu = _inputs(0, [2, 2])
    with pytest.raises(ValueError, match="a verify already keeps the state after every token"):
        kda_jax.chunk_kda_pool(*x.args(), _pool(0),
                               PoolRows(np.array([[0, 1], [2, 3]], np.int32),
                                        checkpoint_indices=np.array([[5], [6]], np.int32)),
                               cu_seqlens=cu, checkpoint_every=64, implementation="xla")


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_device_count_outside_the_columns_reads_zeros(impl, check_close):
    """A device count outside [1, W] cannot be checked on the host: the
    sequence reads no row (zeros), as a padding index does, and still writes
    its tokens' states; has_initial_state False reads none either."""
    lens, w = [2, 2, 2], 2
    x, cu = _inputs(21, lens)
    rows, pool = _rows(22, 3, w), _pool(23)
    acc = jnp.asarray(np.array([0, 3, 2], np.int32))
    has = jnp.asarray(np.array([True, True, False]))
    o, new = jax.jit(lambda p, a, h: kda_jax.fused_recurrent_kda_pool(
        *x.args(), p, PoolRows(rows, num_accepted_tokens=a, has_initial_state=h),
        cu_seqlens=cu, implementation=impl))(pool, acc, has)
    ro, r_after = _reference_states(x, cu, np.zeros((3, HV, K, V), np.float32))
    check_close(o, ro, "float32", "o")
    for i in range(3):
        for t in range(w):
            if rows[i, t] >= 0:
                check_close(np.asarray(new)[rows[i, t]], r_after[(i, t)], "float32", "state")


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_wide_counts_read_no_row(impl):
    """Counts wider than int32 never wrap onto a column: NumPy int64 counts
    with a VarlenBatch on the device (no host check: the bucketed form), where
    2**32 + 3 would be 3 after a cast, read no row, as a count of 0 does."""
    lens, w = [3, 3], 3
    x, cu = _inputs(31, lens)
    rows, pool = _rows(32, 2, w), _pool(33)
    batch = jax.device_put(VarlenBatch.build(cu, Bucket(max_seqs=2, max_tokens=8)))
    args = [np.concatenate([a, np.zeros((1, 8 - a.shape[1]) + a.shape[2:], a.dtype)], axis=1)
            for a in x.args()]

    def run(acc):
        return kda_jax.fused_recurrent_kda_pool(*args, pool,
                                                PoolRows(rows, num_accepted_tokens=acc),
                                                cu_seqlens=batch, implementation=impl)[0]

    wide = run(np.array([2**32 + 3, 1], np.int64))
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(run(np.array([0, 1], np.int32))))
    assert not np.array_equal(np.asarray(wide), np.asarray(run(np.array([3, 1], np.int32))))
