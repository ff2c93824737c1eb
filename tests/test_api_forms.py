"""One return type per public function: each form of the API (plain, pool,
checkpoints) is its own entry point whose result has the same structure
whatever its arguments, and the keywords of another form are refused by
Python instead of changing what comes back. PoolRows is a pytree: new index
values reuse one compiled program.

Against the float32 reference (kda_jax.reference); tiny shapes, XLA path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import PoolRows, reference, testing

H, HV, K, V, SLOTS = 1, 2, 8, 8, 6
LENS = [5, 0, 9]


def _inputs(seed=0):
    cu = np.cumsum([0] + LENS)
    x = testing.make_inputs(seed, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(LENS))
    return x, cu


def _pool(seed=3):
    return np.random.default_rng(seed).standard_normal((SLOTS, HV, K, V)).astype(np.float32)


@pytest.mark.parametrize("fn", [kda_jax.chunk_kda, kda_jax.fused_recurrent_kda])
def test_plain_forms_return_o_and_final_state(fn):
    x, cu = _inputs()
    with_final = fn(*x.args(), cu_seqlens=cu, output_final_state=True, implementation="xla")
    without = fn(*x.args(), cu_seqlens=cu, implementation="xla")
    assert len(with_final) == len(without) == 2 and without[1] is None
    assert with_final[1].shape == (len(LENS), HV, K, V) and with_final[1].dtype == jnp.float32


@pytest.mark.parametrize("fn", [kda_jax.chunk_kda_pool, kda_jax.fused_recurrent_kda_pool])
def test_pool_forms_return_o_and_the_pool(fn, check_close):
    x, cu = _inputs()
    pool = _pool()
    rows = np.array([4, -1, 1], np.int32)
    o, new = fn(*x.args(), jnp.asarray(pool), PoolRows(rows), cu_seqlens=cu,
                implementation="xla")
    assert new.shape == pool.shape and new.dtype == pool.dtype
    h0 = np.zeros((len(LENS), HV, K, V), np.float32)
    h0[[0, 2]] = pool[[4, 1]]
    o_ref, finals = reference.naive_recurrent_kda(*x.args(), initial_state=h0,
                                                  output_final_state=True, cu_seqlens=cu)
    check_close(np.asarray(o), np.asarray(o_ref), "float32", "o")
    want = pool.copy()
    want[[4, 1]] = np.asarray(finals)[[0, 2]]
    check_close(np.asarray(new), want, "float32", "state")
    untouched = [r for r in range(SLOTS) if r not in (4, 1)]
    np.testing.assert_array_equal(np.asarray(new)[untouched], pool[untouched])


def test_checkpoints_form_returns_three_whatever_the_flags():
    x, cu = _inputs()
    for final in (False, True):
        out = kda_jax.chunk_kda_checkpoints(*x.args(), cu_seqlens=cu, checkpoint_every=64,
                                            output_final_state=final, implementation="xla")
        assert len(out) == 3 and (out[1] is None) == (not final)
        # ceil(5 / 64) + 0 + ceil(9 / 64) checkpoints: each sequence's initial state
        assert out[2].shape == (2, HV, K, V)


@pytest.mark.parametrize("fn, keyword, value", [
    (kda_jax.chunk_kda, "state_cache", None),
    (kda_jax.chunk_kda, "state_indices", None),
    (kda_jax.chunk_kda, "checkpoint_every", 64),
    (kda_jax.fused_recurrent_kda, "state_cache", None),
    (kda_jax.fused_recurrent_kda, "num_accepted_tokens", None),
    (kda_jax.chunk_kda_pool, "initial_state", None),
    (kda_jax.fused_recurrent_kda_pool, "initial_state", None),
    (kda_jax.fused_recurrent_kda_pool, "output_final_state", True),
    (kda_jax.chunk_kda_pool, "output_final_state", True),
    (kda_jax.chunk_kda_pool, "context_axis", "x"),
    (kda_jax.fused_recurrent_kda_pool, "checkpoint_every", 64),
    (kda_jax.chunk_kda_checkpoints, "context_axis", "x"),
])
def test_another_forms_keywords_are_refused(fn, keyword, value):
    x, cu = _inputs()
    pool_args = (jnp.asarray(_pool()), PoolRows(np.array([0, 1, 2], np.int32)))
    args = x.args() + (pool_args if fn in (kda_jax.chunk_kda_pool,
                                           kda_jax.fused_recurrent_kda_pool) else ())
    extra = dict(checkpoint_every=64) if fn is kda_jax.chunk_kda_checkpoints else {}
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        fn(*args, cu_seqlens=cu, implementation="xla", **{keyword: value}, **extra)


def test_pool_rows_are_a_pytree_through_jit():
    x, cu = _inputs()
    traces = []

    @jax.jit
    def step(pool, rows, *args):
        traces.append(1)
        return kda_jax.fused_recurrent_kda_pool(*args, pool, rows, cu_seqlens=cu,
                                                implementation="xla")

    pool = jnp.asarray(_pool())
    for idx in ([0, 1, 2], [5, 3, 4]):
        rows = PoolRows(jnp.asarray(idx, jnp.int32),
                        has_initial_state=jnp.asarray([True, False, True]))
        o, new = step(pool, rows, *x.args())
    assert len(traces) == 1
    assert len(jax.tree.leaves(PoolRows(np.zeros(3, np.int32)))) == 1  # None fields: no leaf


def test_a_sequence_without_initial_state_reads_no_row():
    """has_initial_state False (NumPy): the sequence reads nothing, so a row
    another sequence writes in the same call is not a clash for it (host
    check), as with checkpoint rows. Device flags are unknown on the host:
    then every named row counts as read and the clash is refused."""
    x, cu = _inputs()
    pool = jnp.asarray(_pool())
    read = np.array([5, 1, 2], np.int32)
    write = np.array([3, 5, 4], np.int32)
    has = np.array([False, True, True])
    kda_jax.chunk_kda_pool(*x.args(), pool, PoolRows(read, write_indices=write,
                                                     has_initial_state=has),
                           cu_seqlens=cu, implementation="xla")
    for flags in (None, jnp.asarray(has)):
        with pytest.raises(ValueError,
                           match=r"rows\.ssm_state_indices\[0\]=5 is the row sequence 1"):
            kda_jax.chunk_kda_pool(*x.args(), pool, PoolRows(read, write_indices=write,
                                                             has_initial_state=flags),
                                   cu_seqlens=cu, implementation="xla")
