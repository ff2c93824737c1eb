"""The paged state pool of serving: states read from and written to rows of one
float32 buffer by index.

A call with a pool computes each sequence from ``cache[indices[n]]`` (zeros
where ``has_initial_state[n]`` is False or the index is negative) and writes its
final state back to that row; a negative index is a padding slot, neither read
nor written. Other rows are left as they were.

The Triton kernels (decode and chunk_kda's state pass) read and write the rows
themselves; the portable XLA path gathers the rows before the call and
scatters the finals after it, with the helpers here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["StatePool", "read_index", "read_states", "write_states", "gather_run_scatter",
           "KernelStates", "kernel_states"]


class StatePool(NamedTuple):
    """A pool and how a call's sequences map onto it (a pytree of arrays).

    cache: float32 ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` when V-first).
    indices: int32 ``[N]``, one row per sequence; negative = padding slot.
    has_initial_state: bool ``[N]``, or None (every sequence reads its row).
    """

    cache: jax.Array
    indices: jax.Array
    has_initial_state: jax.Array | None


def read_index(pool: StatePool) -> jax.Array:
    """int32 ``[N]``: the row each sequence starts from, -1 where it starts from zeros."""
    if pool.has_initial_state is None:
        return pool.indices
    return jnp.where(pool.has_initial_state, pool.indices, -1)


def _out_of_range(index: jax.Array, slots: int) -> jax.Array:
    # jnp indexing wraps negative indices before any mode applies; mapping
    # them (and any index past the end) to `slots` makes fill/drop see them.
    return jnp.where((index < 0) | (index >= slots), slots, index)


def read_states(pool: StatePool) -> jax.Array:
    """float32 ``[N, HV, ., .]`` (the pool's layout): the initial states, zeros
    where a sequence reads no row. A row not read is never touched (it may hold NaN)."""
    slots = pool.cache.shape[0]
    rows = _out_of_range(read_index(pool), slots)
    return jnp.take(pool.cache, rows, axis=0, mode="fill", fill_value=0)


def write_states(pool: StatePool, finals: jax.Array) -> jax.Array:
    """The new cache: ``finals`` ``[N, HV, ., .]`` written to each sequence's row;
    padding slots drop their final state."""
    slots = pool.cache.shape[0]
    rows = _out_of_range(pool.indices, slots)
    return pool.cache.at[rows].set(finals.astype(pool.cache.dtype), mode="drop")


def gather_run_scatter(forward, pool: StatePool, q, k, v, g, beta, A_log, dt_bias, *, opts,
                       **kwargs):
    """Runs ``forward(q, k, v, g, beta, initial_state, A_log, dt_bias, opts=..., **kwargs)``
    with the pool's rows gathered as initial states and its final states
    scattered back; returns ``(o, new_cache)``."""
    h0 = read_states(pool)
    opts = dataclasses.replace(opts, output_final_state=True)
    o, finals = forward(q, k, v, g, beta, h0, A_log, dt_bias, opts=opts, **kwargs)
    return o, write_states(pool, finals)


class KernelStates(NamedTuple):
    """The state arguments of a Triton kernel that reads initial and writes
    final states (kernels/state_io.py): ``h0, read_idx, write_idx, slots``,
    the state output's shape, and whether that output is h0's buffer (a pool,
    aliased) or a fresh array."""

    h0: jax.Array
    read_idx: jax.Array
    write_idx: jax.Array
    slots: int
    ht_shape: tuple
    aliased: bool


def kernel_states(pool: StatePool | None, initial_state, state_shape: tuple,
                  output_final_state: bool) -> KernelStates:
    """With a pool: the pool itself, its read and write indices, aliased to the
    output. Without: the initial state (or a stand-in) and a fresh
    ``state_shape`` output (a stand-in without ``output_final_state``)."""
    # NumPy zeros are constants of the program (jnp.zeros would launch a kernel).
    stand_in = jnp.asarray(np.zeros((4,), np.float32))
    no_index = jnp.asarray(np.zeros((4,), np.int32))
    if pool is not None:
        return KernelStates(pool.cache, read_index(pool), pool.indices, pool.cache.shape[0],
                            tuple(pool.cache.shape), True)
    h0 = stand_in if initial_state is None else initial_state.astype(jnp.float32)
    return KernelStates(h0, no_index, no_index, 0,
                        tuple(state_shape) if output_final_state else (4,), False)
