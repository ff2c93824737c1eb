"""kda_jax.nn: the Kimi Delta Attention layer for Flax NNX (``pip install "kda_jax[nn]"``).

:class:`KimiDeltaAttention` (fla's layer, in NNX), its cache
:class:`KDACache` (dense or a pool), and the conversion of fla's weights and
caches (:func:`from_fla_state_dict`, :func:`cache_from_fla`). docs/nn.md.
"""

try:
    import flax.nnx  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kda_jax.nn needs Flax (NNX); install the extra: pip install \"kda_jax[nn]\""
    ) from e

from kda_jax.nn.cache import KDACache
from kda_jax.nn.conv import ShortConvolution, causal_conv
from kda_jax.nn.convert import cache_from_fla, cache_to_fla, from_fla_state_dict, to_fla_state_dict
from kda_jax.nn.layer import RECURRENT_MAX_TOKENS, KimiDeltaAttention
from kda_jax.nn.norm import RMSNormGated, rms_norm_gated

__all__ = [
    "KimiDeltaAttention",
    "KDACache",
    "ShortConvolution",
    "RMSNormGated",
    "RECURRENT_MAX_TOKENS",
    "causal_conv",
    "rms_norm_gated",
    "from_fla_state_dict",
    "to_fla_state_dict",
    "cache_from_fla",
    "cache_to_fla",
]
