"""The gated RMS norm of the layer's output (fla's ``FusedRMSNormGated`` with a
sigmoid gate): per head, ``o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate)``,
computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["rms_norm_gated", "RMSNormGated"]


def rms_norm_gated(x: jax.Array, gate: jax.Array, weight: jax.Array | None,
                   eps: float) -> jax.Array:
    """x, gate ``[..., D]``; weight ``[D]`` or None. float32 inside; returns x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class RMSNormGated(nnx.Module):
    """``weight`` ``[D]`` (ones at init) and ``eps``; ``__call__(x, gate)``."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return rms_norm_gated(x, gate, self.weight[...], self.eps)
