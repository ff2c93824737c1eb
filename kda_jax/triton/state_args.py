"""The state arguments of the Triton kernels that read initial and write final
states (kda_jax/kernels/state_io.py): a pool's rows by index, or one state per sequence."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax.pool import StatePool, read_index, write_index
from kda_jax.triton.launch import stand_in

__all__ = ["KernelStates", "kernel_states"]


class KernelStates(NamedTuple):
    """The state arguments of a Triton kernel that reads initial and writes
    final states (kda_jax/kernels/state_io.py): ``h0, read_idx, write_idx, slots``,
    the state output's shape and dtype (a pool's own, which may be 16-bit:
    kda_jax/kernels/state_io.py computes in float32 and rounds once on the store), and
    whether that output is h0's buffer (a pool, aliased) or a fresh array.
    ``write_columns``: W when ``write_idx`` is a verify's ``[N, W]`` rows of
    the states after each token (flattened), else 0."""

    h0: jax.Array
    read_idx: jax.Array
    write_idx: jax.Array
    slots: int
    ht_shape: tuple
    ht_dtype: np.dtype
    aliased: bool
    write_columns: int = 0


def kernel_states(pool: StatePool | None, initial_state, state_shape: tuple,
                  output_final_state: bool) -> KernelStates:
    """With a pool: the pool itself, its read and write indices, aliased to the
    output. Without: the initial state (or a stand-in) and a fresh
    ``state_shape`` output (a stand-in without ``output_final_state``)."""
    no_index = stand_in(np.int32)
    if pool is not None:
        write = write_index(pool)
        return KernelStates(pool.cache, read_index(pool), write.reshape(-1), pool.cache.shape[0],
                            tuple(pool.cache.shape), np.dtype(pool.cache.dtype), True,
                            write.shape[1] if write.ndim == 2 else 0)
    h0 = stand_in() if initial_state is None else initial_state.astype(jnp.float32)
    return KernelStates(h0, no_index, no_index, 0,
                        tuple(state_shape) if output_final_state else (4,),
                        np.dtype(np.float32), False)
