"""Forward-only Triton forms: jax.grad, jax.jvp and jax.vmap of them raise a
kda_jax error that names the form and the alternative.

The Triton launches (jax-triton's custom call, or ``jax.pure_callback`` in
interpret mode) have neither a JVP nor a batching rule, so JAX would fail deep
inside with its own message ("Pure callbacks do not support JVP", a missing
batching rule). :func:`not_differentiable` wraps a form in a
``jax.custom_jvp`` whose rule raises :class:`kda_jax.errors.NotDifferentiableError`;
:func:`unbatchable` in a ``jax.custom_batching.custom_vmap`` whose rule raises
:class:`NotBatchableError`; :func:`forward_only` does both (the serving forms:
a pool or a VarlenBatch). fused_recurrent_kda with host bounds is
not_differentiable around a batching rule (:mod:`kda_jax.triton.batching`);
chunk_kda with host bounds has both rules.
The rules run at trace time only; the forward value and ``jax.jit`` are
unchanged (the primal is the wrapped function itself).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from kda_jax.errors import NotBatchableError, NotDifferentiableError

__all__ = ["forward_only", "not_differentiable", "unbatchable", "GRAD_ALTERNATIVE",
           "VMAP_ALTERNATIVE"]

GRAD_ALTERNATIVE = (
    "differentiable are chunk_kda's Triton path with host bounds (cu_seqlens None, a list, a "
    "NumPy array or a SeqBounds), and implementation='xla' in every form (every function, "
    "a pool, a VarlenBatch)"
)
VMAP_ALTERNATIVE = (
    "on the Triton path jax.vmap folds the mapped axis into one launch with host bounds "
    "(cu_seqlens None, a list, a NumPy array or a SeqBounds) in chunk_kda and "
    "fused_recurrent_kda; with this form use implementation='xla' under jax.vmap, or fold the "
    "mapped axis into the call (more sequences in the batch and in the pool rows)"
)


def unbatchable(fn: Callable, form: str) -> Callable:
    """``fn`` (positional pytree arguments of arrays, SeqBounds or VarlenBatch)
    with the same value, whose batching raises :class:`NotBatchableError`.

    ``form`` names the call in the message, e.g.
    ``"fused_recurrent_kda on the Triton path"``.
    """

    @jax.custom_batching.custom_vmap
    def unbatched(*args):
        return fn(*args)

    @unbatched.def_vmap
    def _no_vmap(axis_size, in_batched, *args):
        raise NotBatchableError(
            f"jax.vmap of {form} is not supported: the serving forms have no batching rule; "
            f"{VMAP_ALTERNATIVE}"
        )

    return unbatched


def forward_only(fn: Callable, form: str) -> Callable:
    """:func:`unbatchable` ``fn`` whose differentiation (jax.grad, jax.jvp,
    jax.vjp) also raises, with :class:`NotDifferentiableError`."""
    return not_differentiable(unbatchable(fn, form), form)


def not_differentiable(fn: Callable, form: str) -> Callable:
    """``fn`` with the same value (and batching) whose differentiation
    (jax.grad, jax.jvp, jax.vjp) raises :class:`NotDifferentiableError`."""

    @jax.custom_jvp
    def primal(*args):
        return fn(*args)

    @primal.defjvp
    def _no_jvp(primals, tangents):
        raise NotDifferentiableError(
            f"jax.grad / jax.jvp of {form} is not supported: it is forward only (no backward "
            f"kernels); {GRAD_ALTERNATIVE}"
        )

    return primal
