"""kda_jax's public exceptions (a leaf module: it imports nothing of kda_jax).

Bad arguments raise the builtin ``ValueError`` or ``TypeError`` naming the
argument, its value and the fix (:mod:`kda_jax.checks`); the classes here are
for JAX transformations that a form does not support
(:mod:`kda_jax.triton.forward_only` raises them at trace time).
"""

from __future__ import annotations

__all__ = ["UnsupportedTransformError", "NotDifferentiableError", "NotBatchableError"]


class UnsupportedTransformError(NotImplementedError):
    """A JAX transformation that a kda_jax form does not support."""


class NotDifferentiableError(UnsupportedTransformError):
    """jax.grad / jax.jvp / jax.vjp of a forward-only form."""


class NotBatchableError(UnsupportedTransformError):
    """jax.vmap of a form without a batching rule."""
