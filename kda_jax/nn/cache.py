"""The layer's cache: conv states and KDA states of N sequences, or of a pool.

Two forms, one pytree (:class:`KDACache`, a NamedTuple of arrays):

* dense: ``state_indices`` is None and row n of every array is sequence n
  (N = B for a dense input, the number of sequences of host ``cu_seqlens``,
  or the bucket's ``max_seqs`` for a :class:`kda_jax.VarlenBatch`). The layer
  returns a new cache with each sequence's final states.
* serving (a pool): the arrays have ``slots`` rows and ``state_indices``
  int32 ``[N]`` names each sequence's row (negative: a padding slot, nothing
  read or written); ``has_initial_state`` bool ``[N]`` (None: all True) makes
  a sequence start from zeros without reading its row. The layer returns the
  pools with each sequence's row replaced (other rows unchanged), the same
  ``state_indices``, and ``has_initial_state`` all True (every named row now
  holds a state), so a decode loop can feed the cache back as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda_jax import pool as state_pool
from kda_jax.batch import VarlenBatch, mask_padding

__all__ = ["KDACache"]


class KDACache(NamedTuple):
    """Conv and KDA states of one :class:`kda_jax.nn.KimiDeltaAttention` layer.

    conv_q, conv_k: ``[rows, W - 1, H * K]``; conv_v: ``[rows, W - 1, HV * V]``,
      in the layer's compute dtype: the last W - 1 projected inputs of each
      sequence, oldest first (None without short convolutions).
    recurrent: ``[rows, HV, K, V]`` (``[rows, HV, V, K]`` with
      ``state_v_first``): the KDA state, float32, bfloat16 or float16
      (``init_cache(n, state_dtype=...)``): computed on in float32, a 16-bit
      one rounded once per call as it is written back (the kernels round a
      pool's rows; the layer rounds a dense cache's final states).
    state_indices: None (dense form: rows = N sequences), int32 ``[N]``
      (serving form: rows = pool slots), or int32 ``[N, 1 + S]`` for
      :meth:`KimiDeltaAttention.verify` (the rows of each token's states).
    has_initial_state: bool ``[N]`` or None; serving form only.
    """

    conv_q: jax.Array | None
    conv_k: jax.Array | None
    conv_v: jax.Array | None
    recurrent: jax.Array
    state_indices: jax.Array | None = None
    has_initial_state: jax.Array | None = None

    @property
    def rows(self) -> int:
        return int(self.recurrent.shape[0])

    @property
    def is_pool(self) -> bool:
        return self.state_indices is not None

    def at(self, state_indices, has_initial_state=None) -> "KDACache":
        """This cache's arrays as a pool, read and written at ``state_indices``."""
        return self._replace(state_indices=state_indices, has_initial_state=has_initial_state)

    def dense(self) -> "KDACache":
        """This cache's arrays as N sequences (no indices)."""
        return self._replace(state_indices=None, has_initial_state=None)


def conv_pool(cache: KDACache, conv: jax.Array, bounds) -> state_pool.StatePool:
    """A conv-state pool as the KDA pool is read: padded slots of a bucketed
    batch masked, indices narrowed like the API's."""
    idx = state_pool.narrow_indices(jnp.asarray(cache.state_indices), conv.shape[0])
    pool = state_pool.StatePool(conv, idx, cache.has_initial_state)
    return mask_padding(pool, bounds) if isinstance(bounds, VarlenBatch) else pool
