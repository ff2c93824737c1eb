"""The bucketed varlen form (kda_jax.VarlenBatch) through chunk_kda and
fused_recurrent_kda (and their pool forms), on both implementations, against the static form and the
float32 reference.

Padded token rows hold NaN (they must never be read; their o must be exactly
0), padded sequence slots are empty sequences, and with a state pool their
indices are ignored. A jitted step compiles once for many bounds of one
bucket and reads nothing back from the device. Without a GPU the Triton cases
run in Triton's interpreter (small shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import Bucket, VarlenBatch, reference, testing
from kda_jax.triton import interpret_mode, unavailable_reason
from guards import no_device_reads

NO_TRITON = unavailable_reason()
ON_GPU = NO_TRITON is None and not interpret_mode()
FNS = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}
POOL_FNS = {"chunk": kda_jax.chunk_kda_pool, "recurrent": kda_jax.fused_recurrent_kda_pool}
PoolRows = kda_jax.PoolRows
IMPLS = [pytest.param("xla"),
         pytest.param("triton", marks=pytest.mark.skipif(
             NO_TRITON is not None, reason=f"Triton path unavailable: {NO_TRITON}"))]
H, HV, K, V, SLOTS = 1, 2, 32, 32, 8
BUCKET = Bucket(max_seqs=8, max_tokens=128)
# Distinct bounds per compile-once test: 128 on a GPU; 16 on a CPU
# for the XLA path; 4 for the Triton path in the interpreter (seconds a call):
# one trace over several bounds of one bucket is the property, and 4 lists
# already mix decodes and prefills of different counts.
N_BOUND_SETS = 128 if ON_GPU else 16
N_BOUND_SETS_INTERPRETED = 4


def _pool(seed, slots=SLOTS):
    rng = np.random.default_rng(seed)
    return (0.5 * rng.standard_normal((slots, HV, K, V))).astype(np.float32)


def _case(seed, lens, bucket=BUCKET):
    """Real inputs, the same padded to the bucket (NaN rows past the end), the batch."""
    cu = np.cumsum([0] + list(lens))
    x = testing.make_inputs(seed, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(lens))
    batch = VarlenBatch.build(cu, bucket)
    padded = []
    for a in x.args():
        p = batch.pad_tokens(a)
        p[:, cu[-1]:] = np.nan
        padded.append(p)
    return x, cu, padded, jax.device_put(batch)


def _check_tail(o, t):
    tail = np.asarray(o, np.float32)[:, t:]
    np.testing.assert_array_equal(tail, 0.0, err_msg="o past the real tokens must be 0")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", FNS)
def test_equals_static_with_states(fn, impl, check_close):
    lens = [5, 0, 1, 70, 1]
    x, cu, padded, batch = _case(1, lens)
    n, t = len(lens), int(cu[-1])
    h0 = _pool(2, BUCKET.max_seqs)  # slots 5..7 are padding: empty sequences
    h0[:n] = x.initial_state
    o, final = FNS[fn](*padded, cu_seqlens=batch, initial_state=h0, output_final_state=True,
                       implementation=impl)
    so, sfinal = FNS[fn](*x.args(), cu_seqlens=cu, initial_state=x.initial_state,
                         output_final_state=True, implementation=impl)
    np.testing.assert_allclose(np.asarray(o)[:, :t], np.asarray(so), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(final)[:n], np.asarray(sfinal), rtol=1e-5, atol=1e-6)
    _check_tail(o, t)
    np.testing.assert_array_equal(np.asarray(final)[n:], h0[n:])  # empty: initial state kept
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu,
                                           initial_state=x.initial_state, output_final_state=True)
    check_close(np.asarray(o)[:, :t], ro, "float32", "o")
    check_close(np.asarray(final)[:n], rs, "float32", "final_state")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", FNS)
def test_equals_static_with_a_pool(fn, impl, check_close):
    """Padded slots carry in-range indices that real sequences also name, and
    a NaN row: all ignored (device indices are not checked on the host)."""
    lens = [3, 1, 0, 66]
    x, cu, padded, batch = _case(3, lens)
    t = int(cu[-1])
    pool = _pool(4)
    pool[7] = np.nan  # named by a padded slot only: never read or written
    real_idx = np.array([5, 0, 2, 6], np.int32)
    idx = jnp.asarray(np.concatenate([real_idx, [0, 7, 5, -1]]), jnp.int32)
    has = np.array([True, False, True, True] + [True] * 4)
    o, new = POOL_FNS[fn](*padded, pool, PoolRows(idx, has_initial_state=has),
                          cu_seqlens=batch, implementation=impl)
    so, snew = POOL_FNS[fn](*x.args(), pool, PoolRows(real_idx, has_initial_state=has[:4]),
                            cu_seqlens=cu, implementation=impl)
    new, snew = np.asarray(new), np.asarray(snew)
    np.testing.assert_allclose(np.asarray(o)[:, :t], np.asarray(so), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new[real_idx], snew[real_idx], rtol=1e-5, atol=1e-6)
    _check_tail(o, t)
    for row in (1, 3, 4, 7):  # no real sequence names them
        np.testing.assert_array_equal(new[row], pool[row], err_msg=f"row {row} changed")
    h0 = np.where(has[:4, None, None, None], pool[real_idx], 0.0)
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=h0,
                                           output_final_state=True)
    check_close(np.asarray(o)[:, :t], ro, "float32", "o")
    check_close(new[real_idx], rs, "float32", "final_state")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", FNS)
def test_read_and_write_slots_in_a_bucket(fn, impl, check_close):
    """Read / write slots in the bucketed form: the padded slots' read and
    write indices (in range, a NaN row among them) are ignored; the real
    sequences read shared and own rows and write others."""
    lens = [3, 1, 0, 66]
    x, cu, padded, batch = _case(5, lens)
    t = int(cu[-1])
    pool = _pool(6)
    pool[7] = np.nan  # named by padded slots only
    read = np.array([2, 2, -1, 6, 7, 7, 0, 1], np.int32)
    write = np.array([5, 0, 3, 6, 7, 1, 4, 2], np.int32)
    rows = PoolRows(jnp.asarray(read), write_indices=jnp.asarray(write))
    o, new = POOL_FNS[fn](*padded, pool, rows, cu_seqlens=batch, implementation=impl)
    new = np.asarray(new)
    h0 = np.where((read[:4] >= 0)[:, None, None, None], pool[np.maximum(read[:4], 0)], 0.0)
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu, initial_state=h0,
                                           output_final_state=True)
    check_close(np.asarray(o)[:, :t], ro, "float32", "o")
    check_close(new[write[:4]], rs, "float32", "final_state")
    _check_tail(o, t)
    for row in (1, 2, 4, 7):  # read only, or named by padded slots only
        np.testing.assert_array_equal(new[row], pool[row], err_msg=f"row {row} changed")


def _rotating_lengths(count, bucket, seed=0):
    """``count`` different length lists of one bucket: one-token decodes and
    prefills, perturbed, N <= max_seqs and T <= max_tokens."""
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    while len(out) < count:
        decodes = int(rng.integers(0, 5))
        prefills = rng.integers(0, 40, size=int(rng.integers(1, 4))).tolist()
        lens = [1] * decodes + prefills
        rng.shuffle(lens)
        lens = lens[: bucket.max_seqs]
        if sum(lens) <= bucket.max_tokens and tuple(lens) not in seen:
            seen.add(tuple(lens))
            out.append(lens)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", FNS)
def test_many_bounds_compile_once_without_reading_back(fn, impl, check_close):
    """A jitted serving step over a donated pool: N_BOUND_SETS different bounds
    of one bucket trace and compile once, and every call runs with
    device-to-host transfers refused (and, off the interpreter, any implicit
    transfer: the batch moves by an explicit device_put)."""
    bucket = Bucket(max_seqs=8, max_tokens=64)
    sets = N_BOUND_SETS_INTERPRETED if impl == "triton" and interpret_mode() else N_BOUND_SETS
    traces = []

    def step(pool, idx, q, k, v, g, beta, batch):
        traces.append(batch.bucket)
        return POOL_FNS[fn](q, k, v, g, beta, pool, PoolRows(idx), cu_seqlens=batch,
                            implementation=impl)

    jitted = jax.jit(step, donate_argnums=0)
    pool0 = _pool(5)
    pool = jax.device_put(pool0).copy()
    idx = jax.device_put(np.arange(bucket.max_seqs, dtype=np.int32))
    x = testing.make_inputs(6, T=bucket.max_tokens, H=H, HV=HV, K=K, V=V)
    args = [jax.device_put(a) for a in x.args()]
    checked = []
    strict = impl == "xla" or not interpret_mode()  # the interpreter copies to the host
    for i, lens in enumerate(_rotating_lengths(sets, bucket)):
        batch = jax.device_put(VarlenBatch.from_lengths(lens, bucket))
        before = np.asarray(pool) if i in (0, sets - 1) else None
        with no_device_reads(strict=strict):
            if strict:
                with jax.transfer_guard("disallow"):
                    o, pool = jitted(pool, idx, *args, batch)
            else:
                o, pool = jitted(pool, idx, *args, batch)
            jax.block_until_ready(pool)
        if before is not None:  # spot-check two steps against the reference
            t, n = sum(lens), len(lens)
            real = [a[:, :t] for a in x.args()]
            ro, rs = reference.naive_recurrent_kda(*real, cu_seqlens=np.cumsum([0] + lens),
                                                   initial_state=before[:n],
                                                   output_final_state=True)
            check_close(np.asarray(o)[:, :t], ro, "float32", "o")
            check_close(np.asarray(pool)[:n], rs, "float32", "final_state")
            _check_tail(o, t)
            checked.append(i)
    assert len(traces) == 1, f"{len(traces)} traces for {sets} bound sets"
    assert jitted._cache_size() == 1
    assert checked == [0, sets - 1]


def test_a_numpy_batch_goes_to_jit_as_it_is():
    """The batch passed without device_put (jit's dispatch copies the buffer):
    one compile over many bounds, no read back, the device_put result."""
    bucket = Bucket(max_seqs=8, max_tokens=64)
    def step(pool, idx, batch, *x):
        return kda_jax.chunk_kda_pool(*x, pool, PoolRows(idx), cu_seqlens=batch,
                                      implementation="xla")

    # A NumPy and a device argument are two cache entries: the device_put
    # comparison runs through its own function.
    jitted, jitted_put = jax.jit(step), jax.jit(lambda *a: step(*a))
    pool, idx = _pool(7), np.arange(bucket.max_seqs, dtype=np.int32)
    x = [jax.device_put(a) for a in testing.make_inputs(
        8, T=bucket.max_tokens, H=H, HV=HV, K=K, V=V).args()]
    for lens in _rotating_lengths(4, bucket):
        batch = VarlenBatch.from_lengths(lens, bucket)
        assert isinstance(batch.metadata, np.ndarray)
        with no_device_reads():
            o, new = jitted(pool, idx, batch, *x)
            jax.block_until_ready(new)
        o_put, new_put = jitted_put(pool, idx, jax.device_put(batch), *x)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_put))
        np.testing.assert_array_equal(np.asarray(new), np.asarray(new_put))
    assert jitted._cache_size() == 1


@pytest.mark.parametrize("fn", FNS)
def test_program_does_not_depend_on_the_bounds(fn):
    """Two bounds of one bucket give the same jaxpr, and it holds no bounds-sized constant."""
    def jaxpr(lens):
        _, _, padded, batch = _case(7, lens)
        f = lambda *a: FNS[fn](*a[:5], cu_seqlens=a[5], implementation="xla")[0]
        return str(jax.make_jaxpr(f)(*padded, batch))

    a, b = jaxpr([5, 0, 1, 70]), jaxpr([1, 1, 1, 1, 1, 1, 1, 100])
    assert a == b


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", FNS)
def test_mixed_batch_equals_separate_calls(fn, impl, check_close):
    """Decodes of one token and prefills in one bucketed call == one static call per sequence."""
    lens = [1, 1, 12, 1, 7]
    idx = np.array([2, 5, 0, 3, 1], np.int32)
    has = np.array([True, True, False, True, False])
    x, cu, padded, batch = _case(8, lens)
    pool = _pool(9)
    nb = BUCKET.max_seqs
    idx_b = np.concatenate([idx, np.full(nb - len(lens), -1, np.int32)])
    has_b = np.concatenate([has, np.zeros(nb - len(lens), bool)])
    o, new = POOL_FNS[fn](*padded, pool, PoolRows(idx_b, has_initial_state=has_b),
                          cu_seqlens=batch, implementation=impl)
    chained, outs = pool, []
    for i, n in enumerate(lens):
        part = [a[:, cu[i]:cu[i + 1]] for a in x.args()]
        o_i, chained = POOL_FNS[fn](*part, chained,
                                    PoolRows(idx[i:i + 1], has_initial_state=has[i:i + 1]),
                                    cu_seqlens=[0, n], implementation=impl)
        outs.append(np.asarray(o_i))
    t = int(cu[-1])
    check_close(np.asarray(o)[:, :t], np.concatenate(outs, axis=1), "float32", "o")
    check_close(new, chained, "float32", "final_state")
    _check_tail(o, t)
    np.testing.assert_array_equal(np.asarray(new)[[4, 6, 7]], pool[[4, 6, 7]])


EDGES = {
    # No padded sequence or token, but a padded chunk row (3 chunks of 4): its
    # prepare program sees rows past the end of the buffers, all masked.
    "full-bucket": ([64, 64, 2], Bucket(3, 130)),
    "all-empty": ([0, 0, 0], Bucket(4, 16)),  # no token at all, T_b > 0
    "one-token": ([1], Bucket(1, 1)),
    "empty-first-and-last": ([0, 65, 1, 0], Bucket(8, 128, chunk_size=32)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("edge", EDGES)
def test_edge_bounds(edge, fn, impl, check_close):
    lens, bucket = EDGES[edge]
    x, cu, padded, batch = _case(10, lens, bucket)
    n, t = len(lens), int(cu[-1])
    h0 = _pool(11, bucket.max_seqs)
    h0[:n] = x.initial_state
    kw = dict(chunk_size=bucket.chunk_size) if fn == "chunk" else {}
    o, final = FNS[fn](*padded, cu_seqlens=batch, initial_state=h0, output_final_state=True,
                       implementation=impl, **kw)
    assert o.shape == (1, bucket.max_tokens, HV, V)
    _check_tail(o, t)
    np.testing.assert_array_equal(np.asarray(final)[n:], h0[n:])
    ro, rs = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu,
                                           initial_state=x.initial_state, output_final_state=True)
    if t:
        check_close(np.asarray(o)[:, :t], ro, "float32", "o")
    check_close(np.asarray(final)[:n], rs, "float32", "final_state")
    for i, length in enumerate(lens):
        if length == 0:  # an empty sequence keeps its initial state, bit for bit
            np.testing.assert_array_equal(np.asarray(final)[i], x.initial_state[i])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_empty_with_a_pool(impl):
    """No token: rows with state come back as they were, rows without become
    zeros, padding and padded slots write nothing."""
    _, _, padded, batch = _case(12, [0, 0], Bucket(4, 8))
    pool = _pool(13)
    pool[2] = np.nan
    # Slots 2, 3 are padded: ignored (unmasked, slot 2 would zero row 6).
    idx = jnp.asarray([4, 2, 6, 1], jnp.int32)
    rows = PoolRows(idx, has_initial_state=np.array([True, False, False, True]))
    o, new = kda_jax.chunk_kda_pool(*padded, pool, rows, cu_seqlens=batch, implementation=impl)
    new = np.asarray(new)
    np.testing.assert_array_equal(new[2], 0.0)
    for row in (0, 1, 3, 4, 5, 6, 7):
        np.testing.assert_array_equal(new[row], pool[row])
    _check_tail(o, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_bucketed_step_updates_a_donated_pool_in_place(impl):
    lens = [1, 9, 1]
    _, _, padded, batch = _case(14, lens)
    step = jax.jit(lambda pool, idx, *a: kda_jax.chunk_kda_pool(
        *a[:5], pool, PoolRows(idx), cu_seqlens=a[5], implementation=impl),
        donate_argnums=0)
    pool = jax.device_put(_pool(15)).copy()
    idx = jnp.asarray([3, 1, 6, -1, -1, -1, -1, -1], jnp.int32)
    args = [jax.device_put(a) for a in padded]
    where = pool.unsafe_buffer_pointer()
    _, new = step(pool, idx, *args, batch)
    jax.block_until_ready(new)
    assert pool.is_deleted()
    if impl == "xla" or not interpret_mode():  # the interpreter's callback returns a new buffer
        assert new.unsafe_buffer_pointer() == where, "the pool was copied, not updated"


# (id, how to break the call, error, message); a state_cache in the keywords
# makes it the pool form's call, with rows.
ERRORS = [
    ("tokens-not-the-bucket", lambda a, kw: ([x[:, :100] for x in a], kw), ValueError,
     r"with a VarlenBatch as cu_seqlens, q, k, v, g, beta must be \[1, max_tokens=128, "
     r"\.\.\.\].*got B=1, T=100; pad them with batch.pad_tokens"),
    ("initial-state-real-N", lambda a, kw: (a, dict(kw, initial_state=np.zeros(
        (4, HV, K, V), np.float32))), ValueError,
     r"initial_state must have shape \(8, 2, 32, 32\).*N = the bucket's max_seqs = 8"),
    ("indices-real-N", lambda a, kw: (a, dict(kw, state_cache=_pool(0), rows=PoolRows(
        np.arange(4, dtype=np.int32)))), ValueError,
     r"rows\.ssm_state_indices must have shape \(8,\) \[N\].*N = the bucket's max_seqs = 8"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
@pytest.mark.parametrize("fn", FNS)
def test_bad_bucketed_calls(fn, case):
    _, change, error, match = case
    _, _, padded, batch = _case(0, [5, 0, 1, 70])
    args, kw = change(padded, dict(cu_seqlens=batch, implementation="xla"))
    with pytest.raises(error, match=match):
        if "state_cache" in kw:
            pool, rows = kw.pop("state_cache"), kw.pop("rows")
            POOL_FNS[fn](*args, pool, rows, **kw)
        else:
            FNS[fn](*args, **kw)


def test_chunk_size_must_match_the_bucket():
    _, _, padded, batch = _case(0, [5, 70])
    with pytest.raises(ValueError, match=r"chunk_size=32 differs from the VarlenBatch's bucket "
                                         r"chunk_size=64.*Bucket\(\.\.\., chunk_size=32\)"):
        kda_jax.chunk_kda(*padded, cu_seqlens=batch, chunk_size=32, implementation="xla")
    # fused_recurrent_kda reads only the bounds: any bucket chunk size serves.
    _, _, padded, batch = _case(0, [5, 70], Bucket(8, 128, chunk_size=32))
    kda_jax.fused_recurrent_kda(*padded, cu_seqlens=batch, implementation="xla")


def test_xla_path_is_differentiable_with_a_batch(check_rel_rms):
    """The XLA path's bucketed form keeps JAX autodiff (the metadata is an int leaf)."""
    lens = [3, 0, 20]
    x, cu, padded, batch = _case(16, lens, Bucket(4, 32))
    padded = [np.nan_to_num(a) for a in padded]  # zeros in the tail: finite cotangents
    t = int(cu[-1])

    def loss_b(q):
        o, _ = kda_jax.chunk_kda(q, *padded[1:], cu_seqlens=batch, implementation="xla")
        return jnp.sum(o[:, :t] ** 2)

    def loss_s(q):
        o, _ = kda_jax.chunk_kda(q, *x.args()[1:], cu_seqlens=cu, implementation="xla")
        return jnp.sum(o ** 2)

    gb = jax.grad(loss_b)(jnp.asarray(padded[0]))
    gs = jax.grad(loss_s)(jnp.asarray(x.q))
    check_rel_rms(gb[:, :t], gs, 1e-5, "dq bucketed vs static")
    np.testing.assert_array_equal(np.asarray(gb)[:, t:], 0.0)
