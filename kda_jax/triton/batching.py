"""jax.vmap of the Triton launches: the mapped axis folded into one launch.

The kernels already run many sequences and many heads in one launch, so a
mapped axis of size M needs no loop: :func:`foldable` gives a kernel-level
function a ``jax.custom_batching.custom_vmap`` rule that reshapes the mapped
call into one unmapped call of the same function and splits the results.

Two folds, chosen per call (both free of host work beyond the bounds):

- sequences (the default): copy m of every token array ``[M, B, T, ...]``
  becomes rows ``m * B ..`` of ``[M * B, T, ...]`` (for packed tokens
  ``[M, T, ...]``, tokens ``m * T ..``), each state ``[M, N, ...]`` rows
  ``m * N ..``, and the host bounds are repeated M times back to back
  (:func:`repeat_bounds`; dense bounds stay B * M equal rows). Reshapes only:
  no data moves.
- heads, when a per-head parameter (A_log, dt_bias) is mapped, which no
  sequence can take: copy m's heads become heads ``m * H ..`` of q, k and
  ``m * HV ..`` of v, g, beta, the states and the parameters, so every
  value head keeps its q/k head (the GVA group ``hv // (HV // H)`` maps to
  ``m * H + hv // (HV // H)``). The bounds stay; inputs and outputs are
  transposed around the launch.

Unmapped arguments are broadcast along the mapped axis first (an unmapped
initial_state gives every copy the same states). The rule calls the wrapped
function itself, so nested vmap folds again, and jax.vmap over a non-leading
axis works (custom_vmap hands the rule the mapped axis in front).

custom_vmap functions are not differentiable: the rule sits on the kernel-level
functions under chunk_kda's ``jax.custom_vjp`` (its forward and the kernel
part of its backward, which JAX batches separately), and on the decode launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax.bounds import SeqBounds

__all__ = ["Role", "ROWS", "PACKED", "STATE", "HEAD_PARAM", "BOUNDS", "foldable",
           "repeat_bounds"]


@dataclasses.dataclass(frozen=True)
class Role:
    """How one argument or result of a foldable function is laid out.

    ``kind``: "array" (sequences, rows or packed tokens, on axis 0 and heads
    on axis ``heads``), "head" (a per-head parameter ``[heads * size]``,
    head-major) or "bounds" (the call's SeqBounds)."""

    kind: str
    heads: int = 0


ROWS = Role("array", heads=2)  # [B, T, heads, ...]: q, k, v, g, beta, o
PACKED = Role("array", heads=1)  # [T, heads, ...]: tokens packed along T
STATE = Role("array", heads=1)  # [N, HV, K, V] or V-first
HEAD_PARAM = Role("head")  # A_log [HV], dt_bias [HV * K]
BOUNDS = Role("bounds")


def repeat_bounds(bounds: SeqBounds, copies: int) -> SeqBounds:
    """``copies`` times ``bounds``, back to back: sequence ``m * N + i`` is
    copy m's sequence i, over tokens ``m * T ..`` (T = bounds' token count)."""
    cu = np.asarray(bounds.cu_seqlens, np.int64)
    total = int(cu[-1])
    starts = (cu[:-1][None, :] + total * np.arange(copies)[:, None]).reshape(-1)
    return SeqBounds(np.concatenate([starts, [total * copies]]))


def _front(x, batched: bool, size: int):
    """``x`` with the mapped axis in front, broadcast there when unmapped."""
    return x if batched else jnp.broadcast_to(x[None], (size,) + x.shape)


def _fold_sequences(x, size: int):
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _unfold_sequences(x, size: int):
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def _fold_heads(x, size: int, axis: int):
    """``[M, ..., heads (at axis + 1), ...]`` -> ``[..., M * heads, ...]``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (size * x.shape[axis + 1],) + x.shape[axis + 2:])


def _unfold_heads(x, size: int, axis: int):
    x = x.reshape(x.shape[:axis] + (size, x.shape[axis] // size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def foldable(fn: Callable, inputs: Sequence[Role], outputs: Sequence[Role]) -> Callable:
    """``fn`` with a batching rule that folds a mapped axis into one call of ``fn``.

    ``fn(*args)`` takes positional arguments laid out as ``inputs`` says
    (arrays or None; exactly one SeqBounds where a fold by sequences may be
    needed) and returns a tuple laid out as ``outputs`` (arrays or None).
    Same value as ``fn`` unmapped; under jax.vmap every array result is
    mapped along axis 0.
    """
    inputs, outputs = tuple(inputs), tuple(outputs)

    @jax.custom_batching.custom_vmap
    def call(*args):
        return fn(*args)

    @call.def_vmap
    def rule(size, in_batched, *args):
        mapped = [isinstance(b, bool) and b for b in in_batched]
        by_heads = any(m for role, m in zip(inputs, mapped) if role.kind == "head")
        folded = []
        for role, x, m in zip(inputs, args, mapped):
            if role.kind == "bounds":
                folded.append(x if by_heads else repeat_bounds(x, size))
            elif x is None:
                folded.append(None)
            elif role.kind == "head":
                folded.append(_front(x, m, size).reshape(-1) if by_heads else x)
            elif by_heads:
                folded.append(_fold_heads(_front(x, m, size), size, role.heads))
            else:
                folded.append(_fold_sequences(_front(x, m, size), size))
        # The wrapped function again: under an outer vmap it folds once more.
        results = call(*folded)
        out = tuple(
            None if y is None
            else _unfold_heads(y, size, role.heads) if by_heads
            else _unfold_sequences(y, size)
            for role, y in zip(outputs, results))
        return out, tuple(None if y is None else True for y in out)

    return call
