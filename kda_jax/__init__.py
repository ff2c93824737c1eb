"""kda_jax: Kimi Delta Attention for JAX.

``chunk_kda`` (prefill, training) and ``fused_recurrent_kda`` (decode), with
variable-length bounds as host data (:class:`SeqBounds`); ``kda_jax.reference``
holds the float32 ground truth.
"""

from kda_jax import reference
from kda_jax.api import IMPLEMENTATIONS, chunk_kda, fused_recurrent_kda
from kda_jax.bounds import SeqBounds
from kda_jax.reference import naive_recurrent_kda

__all__ = [
    "IMPLEMENTATIONS",
    "SeqBounds",
    "chunk_kda",
    "fused_recurrent_kda",
    "naive_recurrent_kda",
    "reference",
]
__version__ = "0.1.0"
