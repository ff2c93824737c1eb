"""The paged state pool of serving: states read from and written to rows of one
buffer by index (float32, or bfloat16 / float16: read into float32, computed in
float32, rounded once to the pool's dtype on write-back).

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

__all__ = ["PoolRows", "StatePool", "narrow_indices", "start_rows", "read_index", "write_index",
           "token_rows", "read_states", "write_states", "write_rows", "gather_run_scatter"]


class PoolRows(NamedTuple):
    """Which rows of a state pool each sequence of a call reads and writes: the
    ``rows`` argument of :func:`kda_jax.chunk_kda_pool` and
    :func:`kda_jax.fused_recurrent_kda_pool` (a pytree: it passes through
    ``jax.jit`` as an argument; ``None`` fields are absent).

    N is the call's sequence slots: the sequences of ``cu_seqlens``, B
    without it, or a VarlenBatch's ``max_seqs``. Integer arrays are NumPy
    (checked on the host where the bounds are known) or jax (traced allowed;
    not checked, which would need a device read). Indices wider than int32
    are narrowed with every entry outside [0, slots) made -1 first, so none
    wraps onto a row.

    ssm_state_indices: int32 ``[N]``: sequence n starts from pool row
      ``ssm_state_indices[n]`` and, without ``write_indices``, writes its
      final state back to it; negative is a padding slot (nothing read, o
      from a zero state; nothing written). Or int32 ``[N, W]``, W = 1 +
      drafts (speculative verify, fla's ``ssm_state_indices`` with
      ``num_accepted_tokens``): row ``[n, t]`` receives the state after
      token t of sequence n (-1: none), and no other final state is written.
    num_accepted_tokens: int32 ``[N]``, only with ``[N, W]`` indices: the
      accepted tokens of each sequence's last verify, in [1, W]; sequence n
      starts from row ``ssm_state_indices[n, num_accepted_tokens[n] - 1]``
      (column 0 without them). A device count outside [1, W] reads no row.
    write_indices: int32 ``[N]``: the row each sequence writes its final
      state to, where it is not the row it reads (prefix caching: a cached
      prefix read and left as it is); ``ssm_state_indices`` are then the
      rows read, and several sequences may read one row. -1 writes nothing.
    has_initial_state: bool ``[N]``: False starts the sequence from zeros
      without reading its row (which may hold garbage); its state is still
      written. None: every sequence reads its row.
    checkpoint_indices: int32 ``[N, J]``, with ``checkpoint_every`` of
      :func:`kda_jax.chunk_kda_pool`: checkpoint j of sequence n (the state
      before its j-th interval of ``checkpoint_every`` tokens) is written to
      row ``checkpoint_indices[n, j]``; -1 skips it, columns past a
      sequence's intervals are ignored.

    A row is owned by one sequence within a call: written rows are distinct
    over the whole call (final states, verify rows and checkpoints), and no
    sequence reads a row that another one writes. NumPy indices that break
    this are refused, naming the rows; with device indices it is undefined
    (the sequences run in no order on a GPU).
    """

    ssm_state_indices: object
    num_accepted_tokens: object = None
    write_indices: object = None
    has_initial_state: object = None
    checkpoint_indices: object = None


class StatePool(NamedTuple):
    """A pool and how a call's sequences map onto it (a pytree of arrays).

    cache: ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` when V-first), float32,
      bfloat16 or float16.
    indices: int32 ``[N]``, the row each sequence reads (and writes, without
      write_indices); negative = padding slot.
    has_initial_state: bool ``[N]``, or None (every sequence reads its row).
    write_indices: int32 ``[N]``, the row each sequence writes when it is not
      the one it reads (read / write slots, e.g. a cached prefix read and
      left as it is), negative = none; or int32 ``[N, W]`` (speculative
      verify): row ``[n, t]`` receives the state after token t of sequence
      n, for t < W, and no final state is written separately; or None.
    """

    cache: jax.Array
    indices: jax.Array
    has_initial_state: jax.Array | None
    write_indices: jax.Array | None = None


def narrow_indices(indices, slots: int):
    """int32 ``[N]`` pool rows from integer ``indices`` ``[N]`` of any width.

    An index outside ``[0, slots)`` becomes -1 (padding) before the cast, so a
    wide index (int64 under ``jax_enable_x64``, uint32, ...) such as 2**32 + 1
    cannot wrap onto a real row. NumPy in, NumPy out (on the host); jax in, jax
    out (on the device, nothing read back). int32 passes unchanged: the kernels
    and :func:`read_states` / :func:`write_states` treat its out-of-range
    entries as padding themselves.
    """
    xp = np if isinstance(indices, np.ndarray) else jnp
    dtype = np.dtype(indices.dtype)
    if dtype == np.int32:
        return indices
    if dtype.itemsize < 4:  # int8/16, uint8/16: the cast is exact
        return indices.astype(xp.int32)
    inside = (indices >= 0) & (indices < slots)
    # Entries inside [0, slots) cast exactly; the others wrap but are replaced.
    return xp.where(inside, indices.astype(xp.int32), -1).astype(xp.int32)


def start_rows(rows, num_accepted_tokens) -> jax.Array:
    """int32 ``[N]``: the row each verifying sequence starts from,
    ``rows[n, num_accepted_tokens[n] - 1]`` (``rows`` ``[N, W]``, the rows of
    the states after each token of the previous step), and -1 (zeros) where
    the count is outside [1, W]. Device data: a gather, nothing read back.

    The range test runs in the counts' own dtype, before any cast (NumPy
    counts on the host, so that int64 ones never meet JAX's int32 default),
    as :func:`narrow_indices` does: a wide count such as 2**32 + 2 reads no
    row instead of wrapping onto column 1."""
    w = rows.shape[1]
    xp = np if isinstance(num_accepted_tokens, np.ndarray) else jnp
    acc = xp.asarray(num_accepted_tokens)
    inside = (acc >= 1) & (acc <= w)
    col = xp.where(inside, acc - 1, 0).astype(xp.int32)
    start = jnp.take_along_axis(jnp.asarray(rows), jnp.asarray(col)[:, None], axis=1)[:, 0]
    return jnp.where(jnp.asarray(inside), start, -1).astype(jnp.int32)


def read_index(pool: StatePool) -> jax.Array:
    """int32 ``[N]``: the row each sequence starts from, -1 where it starts from zeros."""
    if pool.has_initial_state is None:
        return pool.indices
    return jnp.where(pool.has_initial_state, pool.indices, -1)


def write_index(pool: StatePool) -> jax.Array:
    """int32 ``[N]``: the row each sequence's final state goes to, negative for
    none; or a verify's ``[N, W]`` rows of the states after each token."""
    return pool.indices if pool.write_indices is None else pool.write_indices


def token_rows(pool: StatePool | None) -> jax.Array | None:
    """int32 ``[N, W]``: the rows of the states after each token (speculative
    verify), or None when each sequence writes only its final state."""
    if pool is None or pool.write_indices is None or pool.write_indices.ndim != 2:
        return None
    return pool.write_indices


def _out_of_range(index: jax.Array, slots: int) -> jax.Array:
    # jnp indexing wraps negative indices before any mode applies; mapping
    # them (and any index past the end) to `slots` makes fill/drop see them.
    return jnp.where((index < 0) | (index >= slots), slots, index)


def read_states(pool: StatePool) -> jax.Array:
    """float32 ``[N, HV, ., .]`` (the pool's layout): the initial states, zeros
    where a sequence reads no row. A row not read is never touched (it may hold NaN)."""
    slots = pool.cache.shape[0]
    rows = _out_of_range(read_index(pool), slots)
    return jnp.take(pool.cache, rows, axis=0, mode="fill", fill_value=0).astype(jnp.float32)


def write_states(pool: StatePool, finals: jax.Array) -> jax.Array:
    """The new cache: ``finals`` ``[N, HV, ., .]`` written to each sequence's row;
    padding slots drop their final state."""
    return write_rows(pool.cache, write_index(pool), finals)


def write_rows(cache: jax.Array, rows: jax.Array, states: jax.Array) -> jax.Array:
    """``cache`` with ``states`` ``[M, HV, ., .]`` (float32) written to rows
    ``rows`` int32 ``[M]``, each rounded once to the cache's dtype; an entry
    outside [0, slots) writes nothing."""
    rows = _out_of_range(rows, cache.shape[0])
    return cache.at[rows].set(states.astype(cache.dtype), mode="drop")


def gather_run_scatter(forward, pool: StatePool, q, k, v, g, beta, A_log, dt_bias, *, opts,
                       **kwargs):
    """Runs ``forward(q, k, v, g, beta, initial_state, A_log, dt_bias, opts=..., **kwargs)``
    with the pool's rows gathered as initial states and its final states
    scattered back; returns ``(o, new_cache)``, followed by any further
    outputs of ``forward`` as they are."""
    h0 = read_states(pool)
    rows = token_rows(pool)
    if rows is not None:
        # Verify: the forward writes the state after each token into the cache.
        return forward(q, k, v, g, beta, h0, A_log, dt_bias, opts=opts,
                       token_writes=(pool.cache, rows), **kwargs)
    opts = dataclasses.replace(opts, output_final_state=True)
    o, finals, *rest = forward(q, k, v, g, beta, h0, A_log, dt_bias, opts=opts, **kwargs)
    return (o, write_states(pool, finals), *rest)
