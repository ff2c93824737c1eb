"""kda_jax: Kimi Delta Attention for JAX.

``chunk_kda`` (prefill, training) and ``fused_recurrent_kda`` (decode), their
serving forms on a paged state pool (``chunk_kda_pool``,
``fused_recurrent_kda_pool``, rows as a :class:`PoolRows`) and prefill
checkpoints (``chunk_kda_checkpoints``), with
variable-length bounds as host data (:class:`SeqBounds`: one constant per
bounds) or in the bucketed serving form (:class:`VarlenBatch` in a
:class:`Bucket`: one runtime buffer, one executable per bucket);
``kda_jax.reference`` holds the float32 ground truth.
"""

from kda_jax import reference
from kda_jax.api import (IMPLEMENTATIONS, chunk_kda, chunk_kda_checkpoints, chunk_kda_pool,
                         fused_recurrent_kda, fused_recurrent_kda_pool)
from kda_jax.batch import VarlenBatch
from kda_jax.bounds import Bucket, SeqBounds
from kda_jax.pool import PoolRows
from kda_jax.reference import naive_recurrent_kda
from kda_jax.errors import NotBatchableError, NotDifferentiableError, UnsupportedTransformError

__all__ = [
    "IMPLEMENTATIONS",
    "Bucket",
    "NotBatchableError",
    "NotDifferentiableError",
    "PoolRows",
    "SeqBounds",
    "UnsupportedTransformError",
    "VarlenBatch",
    "chunk_kda",
    "chunk_kda_checkpoints",
    "chunk_kda_pool",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
    "naive_recurrent_kda",
    "reference",
]
__version__ = "0.1.0"
