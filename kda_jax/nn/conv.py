"""The causal short convolution of the layer (depthwise, kernel W, SiLU), in jax.numpy.

Every token sees the W - 1 inputs before it *in its own sequence*: in a packed
varlen batch the window stops at the sequence's first token, where the
sequence's conv state (the W - 1 inputs that came before it, e.g. the end of
its prefill) or zeros take over. The math runs in float32; the output is in
the input's dtype.

Layouts (channels last, as the projections produce them):
  x: ``[R, C]`` token rows (a dense ``[B, T, C]`` is B sequences of T rows).
  kernel: ``[W, C]``; tap ``W - 1`` multiplies the current token, tap
    ``W - 1 - s`` the token s steps back (fla's ``weight[c, 0, w]`` is
    ``kernel[w, c]``).
  conv state: ``[N, W - 1, C]``, the last W - 1 inputs of each sequence,
    oldest first (fla keeps ``[N, C, W]``, the last W inputs; see
    :mod:`kda_jax.nn.convert`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kda_jax.batch import VarlenBatch
from kda_jax.bounds import SeqBounds

__all__ = ["TokenLayout", "token_layout", "causal_conv", "max_seq_len", "ShortConvolution"]


class TokenLayout(NamedTuple):
    """Where each token row sits, for N sequences packed along R rows.

    pos: int32 ``[R]``, the row's offset in its sequence.
    seq: int32 ``[R]``, its sequence (rows past the last sequence, the padding
      of a bucketed batch, get the last slot: their outputs are never used).
    bos, eos: int32 ``[N]``, each sequence's first row and one past its last.
    NumPy for host bounds (constants of the program), jax arrays for a
    :class:`kda_jax.VarlenBatch` (from its metadata on the device).
    """

    pos: np.ndarray | jax.Array
    seq: np.ndarray | jax.Array
    bos: np.ndarray | jax.Array
    eos: np.ndarray | jax.Array

    @property
    def on_host(self) -> bool:
        return isinstance(self.pos, np.ndarray)


def token_layout(bounds: SeqBounds | VarlenBatch, rows: int) -> TokenLayout:
    """The layout of ``rows`` token rows under host bounds or a bucketed batch."""
    if isinstance(bounds, VarlenBatch):
        n = bounds.bucket.max_seqs
        cu = bounds.table("cu_seqlens")[: n + 1]  # padded slots: empty, at the real end
        r = jnp.arange(rows, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(cu[1:], r, side="right"), 0, n - 1).astype(jnp.int32)
        return TokenLayout(r - cu[seq], seq, cu[:-1], cu[1:])
    cu = bounds.cu_seqlens.astype(np.int64)
    lengths = np.diff(cu)
    seq = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(rows) - cu[seq]
    return TokenLayout(pos.astype(np.int32), seq.astype(np.int32), cu[:-1].astype(np.int32),
                       cu[1:].astype(np.int32))


def max_seq_len(bounds: SeqBounds | VarlenBatch) -> int:
    """The most tokens any sequence can have, known on the host."""
    if isinstance(bounds, VarlenBatch):
        b = bounds.bucket
        return b.max_tokens if b.max_len is None else min(b.max_len, b.max_tokens)
    return int(bounds.lengths.max(initial=0))


def _where_rows(mask, a, b):
    """``where(mask[:, None], a, b)``, folded on the host where the mask is constant."""
    if isinstance(mask, np.ndarray):
        if mask.all():
            return a
        if not mask.any():
            return b
    return jnp.where(mask[:, None], a, b)


def causal_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, layout: TokenLayout,
                initial_state: jax.Array | None = None, *, activation: bool = True,
                output_final_state: bool = False):
    """Depthwise causal convolution over packed sequences, then SiLU.

    Args:
      x: ``[R, C]`` token rows, any float dtype.
      kernel: ``[W, C]``. bias: ``[C]`` or None.
      layout: the rows' :class:`TokenLayout` (N sequences).
      initial_state: ``[N, W - 1, C]`` inputs before each sequence, or None (zeros).
      activation: apply SiLU.
      output_final_state: also return the state after each sequence.

    Returns:
      ``(y, final_state)``: y ``[R, C]`` in x's dtype; final_state
      ``[N, W - 1, C]`` in x's dtype (exact copies of inputs), or None.
    """
    rows, channels = x.shape
    w = kernel.shape[0]
    n = layout.bos.shape[0]
    xf = x.astype(jnp.float32)
    kf = kernel.astype(jnp.float32)
    init = None if initial_state is None else initial_state.astype(jnp.float32)
    y = xf * kf[w - 1]
    for s in range(1, w):
        inside = layout.pos >= s  # the token s back is in the same sequence
        shifted = jnp.pad(xf, ((s, 0), (0, 0)))[:rows]
        if init is None:
            before = jnp.zeros((), jnp.float32)
        else:
            # Token s back lies (s - pos) before the sequence: state row W-1-(s-pos).
            xp = np if layout.on_host else jnp
            row = xp.where(inside, 0, layout.seq * (w - 1) + (w - 1) - s + layout.pos)
            before = jnp.take(init.reshape(n * (w - 1), channels), row, axis=0)
        y = y + _where_rows(inside, shifted, before) * kf[w - 1 - s]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation:
        y = jax.nn.silu(y)
    y = y.astype(x.dtype)
    if not output_final_state:
        return y, None
    return y, _final_state(x, init, layout, w)


def _final_state(x, init, layout: TokenLayout, w: int):
    """``[N, W - 1, C]``: each sequence's last W - 1 inputs, its initial state
    (or zeros) in front where it has fewer tokens."""
    rows, channels = x.shape
    n = layout.bos.shape[0]
    xp = np if layout.on_host else jnp
    j = xp.arange(w - 1)[None, :]
    bos, eos = layout.bos[:, None], layout.eos[:, None]
    at = eos - (w - 1) + j  # the row of slot j
    from_state = rows + xp.arange(n)[:, None] * (w - 1) + j + (eos - bos)
    index = xp.where(at >= bos, at, from_state)
    prev = (jnp.zeros((n * (w - 1), channels), x.dtype) if init is None
            else init.reshape(n * (w - 1), channels).astype(x.dtype))
    return jnp.take(jnp.concatenate([x, prev]), index.reshape(-1), axis=0).reshape(
        n, w - 1, channels)


class ShortConvolution(nnx.Module):
    """A depthwise causal convolution of ``channels`` channels, kernel ``conv_size``.

    Parameters: ``kernel`` ``[conv_size, channels]`` and, with ``bias``,
    ``bias`` ``[channels]``; initialized as PyTorch's Conv1d (uniform in
    +-1/sqrt(conv_size)). ``__call__(x, layout, state=None, *,
    output_final_state=False)`` is :func:`causal_conv` with SiLU.
    """

    def __init__(self, channels: int, conv_size: int, *, bias: bool = False,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        bound = 1.0 / np.sqrt(conv_size)
        init = lambda shape: jax.random.uniform(rngs.params(), shape, param_dtype, -bound, bound)
        self.kernel = nnx.Param(init((conv_size, channels)))
        self.bias = nnx.Param(init((channels,))) if bias else None

    def __call__(self, x, layout: TokenLayout, state=None, *, output_final_state=False):
        bias = None if self.bias is None else self.bias[...]
        return causal_conv(x, self.kernel[...], bias, layout, state,
                           output_final_state=output_final_state)
