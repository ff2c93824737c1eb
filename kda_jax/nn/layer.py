"""Kimi Delta Attention as a Flax NNX layer (the layer of Kimi Linear, fla's
``fla.layers.kda.KimiDeltaAttention``): projections, short convolutions, the
in-kernel gate, KDA, a gated RMS norm and the output projection.

For x ``[B, T, hidden]`` (or packed ``[1, T, hidden]`` with ``cu_seqlens``)::

    q, k = silu(conv(x @ Wq)), silu(conv(x @ Wk))         [.., H, K]
    v    = silu(conv(x @ Wv))                             [.., HV, V]
    g    = (x @ Wf1) @ Wf2                                [.., HV, K]  raw gate
    beta = x @ Wb                                         [.., HV]     logit
    o    = KDA(q, k, v, g, beta; l2norm(q, k), gate -exp(A_log) softplus(g + dt_bias),
               sigmoid(beta))                             [.., HV, V]
    y    = rms_norm(o) * weight * sigmoid((x @ Wg1) @ Wg2 + bg) -> [.., HV * V] @ Wo

Shapes follow fla's layer: K = head_dim, V = head_dim * expand_v, HV =
num_v_heads (GVA: HV a multiple of H), f_proj and g_proj low rank through V.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kda_jax
from kda_jax.batch import VarlenBatch
from kda_jax.bounds import SeqBounds, as_seq_bounds
from kda_jax import pool as state_pool
from kda_jax.checks import _int_vector
from kda_jax.nn.cache import KDACache, conv_pool
from kda_jax.nn.conv import ShortConvolution, max_seq_len, token_layout
from kda_jax.nn.norm import RMSNormGated

__all__ = ["KimiDeltaAttention", "RECURRENT_MAX_TOKENS"]

# With a cache, inputs whose sequences have at most this many tokens (known on
# the host) run token by token, as fla's layer does outside training.
RECURRENT_MAX_TOKENS = 64
MODES = ("chunk", "fused_recurrent")
_FLOAT = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def _positive(value, name: str, *, least: int = 1) -> int:
    """``value`` as an int >= ``least`` (1: positive, 0: non-negative), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name}={value!r} must be a "
                         f"{'positive' if least == 1 else 'non-negative'} int")
    return int(value)


class KimiDeltaAttention(nnx.Module):
    """The KDA layer; ``__call__(x, *, cu_seqlens=None, cache=None)``.

    Args:
      hidden_size: model width.
      num_heads: H, the q/k heads. head_dim: K.
      num_v_heads: HV (default H); a multiple of H (grouped value attention).
      expand_v: V = head_dim * expand_v, an integer.
      conv_size: the short convolutions' kernel W. conv_bias: their bias.
      use_short_conv: False replaces each convolution by a plain SiLU.
      allow_neg_eigval: beta in [0, 2] (doubled after the sigmoid).
      lower_bound: the gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
        in [lower_bound, 0), lower_bound in [-5, 0); None: ``-exp(A_log) *
        softplus(g + dt_bias)``.
      safe_gate: fla's flag for its lower-bounded kernels; here it only starts
        A_log at zeros, as fla does, and needs ``lower_bound``.
      mode: "chunk" (default) or "fused_recurrent" (always token by token).
        In "chunk" mode a call with a cache whose sequences have at most
        ``RECURRENT_MAX_TOKENS`` tokens (known on the host: T of a dense
        input, the longest of host bounds, a bucket's ``max_len`` or
        ``max_tokens``) runs token by token too (decode).
      norm_eps: the output norm's epsilon.
      chunk_size: chunk_kda's chunk (32 or 64); a VarlenBatch's own wins.
      state_v_first: KDA states ``[.., HV, V, K]`` (fla's layout) instead of
        ``[.., HV, K, V]``.
      implementation: None (best available), "xla" or "triton", passed to
        :func:`kda_jax.chunk_kda` / :func:`kda_jax.fused_recurrent_kda` and their
        ``*_pool`` forms.
      dtype: the compute dtype of the projections (None: from inputs and
        parameters); the convolutions, gate, KDA state and norm compute in
        float32 inside. param_dtype: the parameters' dtype (A_log and dt_bias
        are float32 always).
      rngs: ``nnx.Rngs`` for the initializers.

    fla's ``layer_idx`` has no counterpart (the cache is an argument here);
    fla's ``**kwargs`` are not accepted: an unknown option raises TypeError.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *,
                 num_v_heads: int | None = None, expand_v: float = 1.0, conv_size: int = 4,
                 conv_bias: bool = False, use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, lower_bound: float | None = None,
                 safe_gate: bool = False, mode: str = "chunk", norm_eps: float = 1e-5,
                 chunk_size: int = 64, state_v_first: bool = False,
                 implementation: str | None = None, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        hidden_size = _positive(hidden_size, "hidden_size")
        num_heads = _positive(num_heads, "num_heads")
        head_dim = _positive(head_dim, "head_dim")
        num_v_heads = num_heads if num_v_heads is None else _positive(num_v_heads,
                                                                      "num_v_heads")
        if num_v_heads % num_heads:
            raise ValueError(
                f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads} "
                "(each value head reads one q/k head)")
        head_v_dim = head_dim * expand_v
        if not (isinstance(expand_v, (int, float)) and head_v_dim > 0
                and math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-5)):
            raise ValueError(
                f"expand_v={expand_v!r} must make head_dim * expand_v = {head_v_dim} a "
                "positive integer (the value head size)")
        conv_size = _positive(conv_size, "conv_size")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES}")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True needs lower_bound (a float in [-5, 0)); pass "
                             "lower_bound=-5.0, or drop safe_gate")
        if lower_bound is not None and not -5.0 <= float(lower_bound) < 0.0:
            raise ValueError(f"lower_bound={lower_bound} must lie in [-5, 0)")
        if chunk_size not in (32, 64) or isinstance(chunk_size, bool):
            raise ValueError(f"chunk_size={chunk_size!r} must be 32 or 64")
        if implementation not in (None, *kda_jax.IMPLEMENTATIONS):
            raise ValueError(f"implementation={implementation!r} must be None, 'xla' or "
                             "'triton'")
        for name, flag in (("use_short_conv", use_short_conv), ("conv_bias", conv_bias),
                           ("allow_neg_eigval", allow_neg_eigval), ("safe_gate", safe_gate),
                           ("state_v_first", state_v_first)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {flag!r}")

        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_v_heads, self.head_v_dim = num_v_heads, int(round(head_v_dim))
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.gate_dim = num_v_heads * head_dim
        self.conv_size, self.use_short_conv = conv_size, bool(use_short_conv)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.mode, self.chunk_size = mode, int(chunk_size)
        self.state_v_first, self.implementation = bool(state_v_first), implementation
        self.dtype, self.param_dtype = dtype, param_dtype

        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, dtype=dtype,
                                                    param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(hidden_size, self.key_dim)
        self.k_proj = linear(hidden_size, self.key_dim)
        self.v_proj = linear(hidden_size, self.value_dim)
        if self.use_short_conv:
            conv = lambda c: ShortConvolution(c, conv_size, bias=bool(conv_bias),
                                              param_dtype=param_dtype, rngs=rngs)
            self.q_conv1d = conv(self.key_dim)
            self.k_conv1d = conv(self.key_dim)
            self.v_conv1d = conv(self.value_dim)
        else:
            self.q_conv1d = self.k_conv1d = self.v_conv1d = None
        self.f_proj = nnx.Sequential(linear(hidden_size, self.head_v_dim),
                                     linear(self.head_v_dim, self.gate_dim))
        self.b_proj = linear(hidden_size, num_v_heads)
        # fla's initialization: A = exp(A_log) uniform in [1, 16] (zeros with
        # safe_gate); dt_bias the inverse softplus of dt log-uniform in [1e-3, 0.1].
        if safe_gate:
            a_log = jnp.zeros((num_v_heads,), jnp.float32)
        else:
            a_log = jnp.log(jax.random.uniform(rngs.params(), (num_v_heads,), jnp.float32,
                                               1.0, 16.0))
        self.A_log = nnx.Param(a_log)
        dt = jnp.exp(jax.random.uniform(rngs.params(), (self.gate_dim,), jnp.float32,
                                        math.log(1e-3), math.log(0.1)))
        dt = jnp.maximum(dt, 1e-4)
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        self.g_proj = nnx.Sequential(linear(hidden_size, self.head_v_dim),
                                     linear(self.head_v_dim, self.value_dim, bias=True))
        self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, param_dtype=param_dtype)
        self.o_proj = linear(self.value_dim, hidden_size)

    # ------------------------------------------------------------------ caches

    def _state_shape(self, rows: int) -> tuple[int, ...]:
        kd, vd = self.head_dim, self.head_v_dim
        return (rows, self.num_v_heads) + ((vd, kd) if self.state_v_first else (kd, vd))

    def init_cache(self, num_seqs: int, *, dtype=None, state_dtype=jnp.float32) -> KDACache:
        """An empty (zero) dense cache of ``num_seqs`` sequences; the same
        arrays serve as a pool of ``num_seqs`` slots through
        ``cache.at(state_indices)``. ``num_seqs = 0`` gives the empty cache of
        a B = 0 input.

        Args:
          dtype: the conv states' dtype (default: the layer's compute dtype,
            else its parameters').
          state_dtype: the KDA states' (``recurrent``): float32 (default),
            bfloat16 or float16. A 16-bit state holds twice the sequences in
            the same memory; the layer computes on it in float32 and rounds
            each new state once (to nearest even) as it writes it back.
        """
        num_seqs = _positive(num_seqs, "num_seqs", least=0)
        try:
            # None is no dtype here (NumPy would read it as float64).
            ok = state_dtype is not None and np.dtype(state_dtype) in _FLOAT
        except TypeError as e:
            raise TypeError(f"state_dtype={state_dtype!r} is not a dtype; pass jnp.float32, "
                            "jnp.bfloat16 or jnp.float16") from e
        if not ok:
            raise TypeError(f"state_dtype={state_dtype!r} must be float32, bfloat16 or float16 "
                            "(the KDA state's storage; it is computed on in float32)")
        dtype = dtype or self.dtype or self.param_dtype
        conv = lambda c: (jnp.zeros((num_seqs, self.conv_size - 1, c), dtype)
                          if self.use_short_conv else None)
        return KDACache(conv(self.key_dim), conv(self.key_dim), conv(self.value_dim),
                        jnp.zeros(self._state_shape(num_seqs), state_dtype))

    def _check_cache(self, cache, n: int, what: str):
        if not isinstance(cache, KDACache):
            raise TypeError(f"cache must be a kda_jax.nn.KDACache (layer.init_cache(n)), got "
                            f"{type(cache).__name__}")
        rows = cache.recurrent.shape[0] if hasattr(cache.recurrent, "shape") else None
        if cache.state_indices is None:
            if cache.has_initial_state is not None:
                raise ValueError(
                    "cache.has_initial_state is only used with cache.state_indices (the pool "
                    "form); drop it, or use cache.at(state_indices, has_initial_state)")
            if rows != n:
                raise ValueError(
                    f"cache holds {rows} sequences (recurrent.shape[0]) but the input has "
                    f"N = {what} = {n}; make it with layer.init_cache({n}), or use a pool: "
                    "cache.at(state_indices)")
        expected = {"recurrent": self._state_shape(rows)}
        if self.use_short_conv:
            w = self.conv_size - 1
            expected.update(conv_q=(rows, w, self.key_dim), conv_k=(rows, w, self.key_dim),
                            conv_v=(rows, w, self.value_dim))
        for name in ("conv_q", "conv_k", "conv_v", "recurrent"):
            value = getattr(cache, name)
            if name not in expected:
                if value is not None:
                    raise ValueError(f"cache.{name} must be None: the layer has "
                                     "use_short_conv=False")
                continue
            if not hasattr(value, "shape") or tuple(value.shape) != expected[name]:
                got = tuple(value.shape) if hasattr(value, "shape") else type(value).__name__
                raise ValueError(f"cache.{name} must have shape {expected[name]}, got {got}; "
                                 "make the cache with layer.init_cache(n)")
            if np.dtype(value.dtype) not in _FLOAT:
                raise TypeError(f"cache.{name} must be bf16, fp16 or fp32, got "
                                f"{np.dtype(value.dtype)}")

    # ------------------------------------------------------------------ forward

    def _bounds(self, x, cu_seqlens):
        """(bounds for the convolution, bounds for KDA, N, what N is). A dense
        x of B = 0 has no sequences: its conv bounds are None (bounds hold at
        least one sequence), and the layer returns empty results."""
        b, t, _ = x.shape
        if cu_seqlens is None:
            if b == 0:
                return None, None, 0, "B"
            return SeqBounds.from_lengths(np.full(b, t, np.int64)), None, b, "B"
        if b != 1:
            raise ValueError(f"with cu_seqlens, x must be packed [1, T, hidden], got B={b}; "
                             "reshape it to [1, B * T, hidden]")
        if isinstance(cu_seqlens, VarlenBatch):
            if t != cu_seqlens.bucket.max_tokens:
                raise ValueError(
                    f"with a VarlenBatch, x must be [1, max_tokens={cu_seqlens.bucket.max_tokens}"
                    f", hidden], got T={t}; pad it with batch.pad_tokens(x)")
            return cu_seqlens, cu_seqlens, cu_seqlens.bucket.max_seqs, "the bucket's max_seqs"
        bounds = as_seq_bounds(cu_seqlens)
        if bounds.total_tokens != t:
            raise ValueError(f"cu_seqlens[-1]={bounds.total_tokens} must equal T={t} "
                             "(x.shape[1])")
        return bounds, bounds, bounds.num_seqs, "the number of sequences in cu_seqlens"

    def _convolve(self, conv, x_rows, layout, cache, field, bounds):
        """(activated rows, new conv state or pool or None) of one projection.

        x_rows ``[R, C]``; layout None only without sequences (B = 0, R = 0):
        the rows' activation in x_rows' dtype, as the convolution gives, and
        the cache's states unchanged."""
        if conv is None:
            return jax.nn.silu(x_rows), None
        if layout is None:
            return jax.nn.silu(x_rows), None if cache is None else getattr(cache, field)
        if cache is None:
            return conv(x_rows, layout)[0], None
        states = getattr(cache, field)
        if not cache.is_pool:
            # The cache keeps its dtype step after step (a jitted loop's carry).
            y, final = conv(x_rows, layout, states, output_final_state=True)
            return y, final.astype(states.dtype)
        pool = conv_pool(cache, states, bounds)
        y, finals = conv(x_rows, layout, state_pool.read_states(pool), output_final_state=True)
        return y, state_pool.write_states(pool, finals)

    def __call__(self, x: jax.Array, *, cu_seqlens=None, cache: KDACache | None = None):
        """The layer on ``x``.

        Args:
          x: ``[B, T, hidden]`` (B sequences of T tokens), or ``[1, T, hidden]``
            packed with ``cu_seqlens``.
          cu_seqlens: host bounds (``kda_jax.SeqBounds``, NumPy, list) or a
            :class:`kda_jax.VarlenBatch` (x then ``[1, max_tokens, hidden]``).
            The convolutions never reach across a sequence's start.
          cache: None, or a :class:`KDACache` (dense: N rows; a pool:
            ``cache.at(state_indices)``); each sequence starts from its conv
            and KDA states.

        Returns:
          y ``[B, T, hidden]``; with a cache ``(y, new_cache)``.
        """
        self._check_x(x)
        conv_bounds, kda_bounds, n, what = self._bounds(x, cu_seqlens)
        if cache is not None:
            self._check_cache(cache, n, what)
            idx = cache.state_indices
            if idx is not None and getattr(idx, "ndim", 1) != 1:
                raise ValueError(
                    f"cache.state_indices of shape {tuple(idx.shape)} are a speculative "
                    "verify's [N, 1 + S] rows; run the step with layer.verify, or give this "
                    "call one row per sequence: cache.at(rows[n, num_accepted[n] - 1])")
        b, t, _ = x.shape
        layout = (token_layout(conv_bounds, b * t)
                  if self.use_short_conv and conv_bounds is not None else None)
        convolve = lambda conv, rows, field: self._convolve(conv, rows, layout, cache, field,
                                                            kda_bounds)
        kw = dict(cu_seqlens=kda_bounds)
        pooled = cache is not None and cache.is_pool
        if pooled:
            kw.update(state_cache=cache.recurrent, rows=kda_jax.PoolRows(
                cache.state_indices, has_initial_state=cache.has_initial_state))
        elif cache is not None:
            kw.update(initial_state=cache.recurrent, output_final_state=True)
        longest = t if conv_bounds is None else max_seq_len(conv_bounds)
        recurrent = self.mode == "fused_recurrent" or (
            cache is not None and longest <= RECURRENT_MAX_TOKENS)
        if recurrent:
            kda = kda_jax.fused_recurrent_kda_pool if pooled else kda_jax.fused_recurrent_kda
        else:
            chunk = (kda_bounds.bucket.chunk_size if isinstance(kda_bounds, VarlenBatch)
                     else self.chunk_size)
            form = kda_jax.chunk_kda_pool if pooled else kda_jax.chunk_kda
            kda = lambda *a, **k: form(*a, chunk_size=chunk, **k)
        y, convs, state = self._mix(x, convolve, kda, kw)
        if cache is None:
            return y
        if not cache.is_pool:
            # The final states come back float32; a 16-bit dense cache keeps its
            # dtype (a jitted loop's carry), rounded once here, as a pool's
            # rows are in the kernels.
            state = state.astype(cache.recurrent.dtype)
        has = cache.has_initial_state
        return y, KDACache(*convs, state, cache.state_indices,
                           None if has is None else jnp.ones_like(has))

    def verify(self, x: jax.Array, *, cache: KDACache, num_accepted_tokens=None):
        """A speculative-verify step: N sequences of 1 + S tokens each (the last
        accepted token and S drafts), token by token.

        Args:
          x: ``[N, 1 + S, hidden]``.
          cache: a pool, ``cache.at(state_indices)`` with ``state_indices``
            int32 ``[N, 1 + S]``: sequence n starts from the conv and KDA
            states of row ``state_indices[n, num_accepted_tokens[n] - 1]``
            and the states after its token t go to row ``state_indices[n,
            t]`` (-1: not kept), in every array of the cache. So the conv
            states roll back with the KDA state: each row holds the last W - 1
            inputs up to its token.
          num_accepted_tokens: int32 ``[N]`` in [1, 1 + S] (None: column 0),
            as :class:`kda_jax.PoolRows` holds it.

        Returns:
          ``(y [N, 1 + S, hidden], new_cache)``; y is what 1 + S one-token
          steps in turn give.
        """
        self._check_x(x)
        n, w, _ = x.shape
        idx = cache.state_indices if isinstance(cache, KDACache) else None
        if getattr(idx, "ndim", None) != 2 or tuple(idx.shape) != (n, w):
            got = None if idx is None else tuple(getattr(idx, "shape", ()))
            raise ValueError(
                f"verify needs a pool cache whose state_indices are [N, 1 + S] = ({n}, {w}) for "
                f"x of shape {tuple(x.shape)}, got state_indices of shape {got}; pass "
                "cache.at(state_indices) with one row per token's states")
        self._check_cache(cache, n, "B")
        if num_accepted_tokens is not None:
            # Before the conv rows use them (the kernels check them again).
            _int_vector(num_accepted_tokens, "num_accepted_tokens", n, "N (x's first dimension)",
                        "int")
        if n == 0:  # no sequence: __call__'s empty y, and nothing written
            return self(x), cache
        layout = (token_layout(SeqBounds.from_lengths(np.full(n, w, np.int64)), n * w)
                  if self.use_short_conv else None)
        # The conv rows narrowed as the kernels narrow theirs (an index past
        # the pool is none, whatever its integer width).
        rows = state_pool.narrow_indices(jnp.asarray(idx), cache.recurrent.shape[0])
        start = (rows[:, 0] if num_accepted_tokens is None
                 else state_pool.start_rows(rows, num_accepted_tokens))

        def convolve(conv, x_rows, field):
            if conv is None:
                return jax.nn.silu(x_rows), None
            states = getattr(cache, field)
            read = state_pool.StatePool(states, start, cache.has_initial_state)
            init = state_pool.read_states(read).astype(x_rows.dtype)
            y = conv(x_rows, layout, init)[0]
            # Each token's conv state: the W - 1 inputs up to it, oldest first.
            full = jnp.concatenate([init, x_rows.reshape(n, w, -1)], axis=1)
            span = states.shape[1]
            windows = jnp.stack([full[:, i + 1:i + 1 + span] for i in range(w)], axis=1)
            return y, state_pool.write_rows(states, rows.reshape(-1),
                                            windows.reshape((n * w,) + states.shape[1:]))

        kw = dict(state_cache=cache.recurrent, rows=kda_jax.PoolRows(
            idx, num_accepted_tokens=num_accepted_tokens,
            has_initial_state=cache.has_initial_state))
        y, convs, state = self._mix(x, convolve, kda_jax.fused_recurrent_kda_pool, kw)
        has = cache.has_initial_state
        return y, KDACache(*convs, state, idx, None if has is None else jnp.ones_like(has))

    def _check_x(self, x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"x must be an array [B, T, hidden], got {type(x).__name__}")
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [B, T, hidden_size={self.hidden_size}], got shape "
                             f"{tuple(x.shape)}")
        if np.dtype(x.dtype) not in _FLOAT:
            raise TypeError(f"x must be bf16, fp16 or fp32, got {np.dtype(x.dtype)}")

    def _mix(self, x, convolve, kda, kw):
        """(y, (conv_q, conv_k, conv_v), KDA state): the projections, each
        through ``convolve(conv, rows, field) -> (rows, new conv state)``,
        then ``kda(q, k, v, g, beta, **the layer's options, **kw)``."""
        b, t, _ = x.shape
        rows = b * t
        flat = x.reshape(rows, self.hidden_size)
        q, conv_q = convolve(self.q_conv1d, self.q_proj(flat), "conv_q")
        k, conv_k = convolve(self.k_conv1d, self.k_proj(flat), "conv_k")
        v, conv_v = convolve(self.v_conv1d, self.v_proj(flat), "conv_v")
        # Head counts spelled out: a reshape with -1 cannot infer them when
        # B * T = 0.
        heads = lambda a, n, d: a.reshape(b, t, n, d)
        q, k = heads(q, self.num_heads, self.head_dim), heads(k, self.num_heads, self.head_dim)
        v = heads(v, self.num_v_heads, self.head_v_dim)
        g = heads(self.f_proj(flat), self.num_v_heads, self.head_dim)
        beta = self.b_proj(flat).reshape(b, t, self.num_v_heads)
        o, state = kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       A_log=self.A_log[...], dt_bias=self.dt_bias[...],
                       lower_bound=self.lower_bound, use_beta_sigmoid_in_kernel=True,
                       allow_neg_eigval=self.allow_neg_eigval,
                       state_v_first=self.state_v_first, implementation=self.implementation,
                       **kw)
        gate = heads(self.g_proj(flat), self.num_v_heads, self.head_v_dim)
        o = self.o_norm(o, gate).reshape(rows, self.value_dim)
        return self.o_proj(o).reshape(b, t, self.hidden_size), (conv_q, conv_k, conv_v), state
