"""Public entry points: argument checks, backend choice, docstrings.

Every bad input raises ``ValueError`` or ``TypeError`` naming the argument and
its value before any backend runs. Backends never fall back silently.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax.batch import VarlenBatch, mask_padding, num_seqs
from kda_jax.bounds import SeqBounds, as_seq_bounds
from kda_jax.options import KdaOptions
from kda_jax import configs, xla
from kda_jax import pool as state_pool
from kda_jax import triton as kda_triton

__all__ = ["chunk_kda", "fused_recurrent_kda", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("xla", "triton")
CHUNK_SIZES = (32, 64)

# SeqBounds is a pytree without leaves: it can be passed to a jitted function
# as an ordinary argument and keys the compilation cache on its contents.
jax.tree_util.register_static(SeqBounds)


# --------------------------------------------------------------------------- #
# Checks.
# --------------------------------------------------------------------------- #


def _shape(x, name: str, ndim: int, layout: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be rank {ndim} {layout}, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point (bf16/fp16/fp32), got dtype {x.dtype}")
    return tuple(int(d) for d in x.shape)


def _expect(x, name: str, expected: tuple[int, ...], layout: str):
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} {layout}, got {tuple(x.shape)}")


def _flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _check_static_number(value, name: str):
    if isinstance(value, jax.Array):  # tracers are jax.Arrays too
        raise TypeError(
            f"{name} must be a Python number (it is fixed at trace time), got a {type(value).__name__}"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _resolve_bounds(cu_seqlens, b: int, t: int) -> SeqBounds | VarlenBatch:
    """Host bounds over the flattened B * T tokens, or the bucketed batch."""
    if cu_seqlens is None:
        return SeqBounds.from_lengths(np.full(b, t, np.int64))
    if isinstance(cu_seqlens, VarlenBatch):
        bucket = cu_seqlens.bucket
        if b != 1 or t != bucket.max_tokens:
            raise ValueError(
                f"with a VarlenBatch as cu_seqlens, q, k, v, g, beta must be [1, "
                f"max_tokens={bucket.max_tokens}, ...] (tokens packed along T, padded to the "
                f"bucket), got B={b}, T={t}; pad them with batch.pad_tokens(x)"
            )
        return cu_seqlens
    bounds = as_seq_bounds(cu_seqlens)
    if b != 1:
        raise ValueError(
            f"with cu_seqlens the batch must be packed along T with B == 1, got B={b}; "
            "reshape q, k, v, g, beta to [1, B * T, ...]"
        )
    if bounds.total_tokens != t:
        raise ValueError(
            f"cu_seqlens[-1]={bounds.total_tokens} must equal the number of tokens T={t}"
        )
    return bounds


def _int_vector(x, name: str, n: int, what: str, kind: str):
    """Checks an index-like array ``[N]``; ``kind`` is "int" or "bool"."""
    wanted = "an int32" if kind == "int" else "a bool"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name} must be {wanted} array [N] (NumPy or jax), got {type(x).__name__}; "
            f"pass np.asarray({name}, {'np.int32' if kind == 'int' else 'bool'})"
        )
    if tuple(x.shape) != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) [N], one entry per sequence with N = {what} = {n}, "
            f"got {tuple(x.shape)}"
        )
    dtype = np.dtype(x.dtype)
    ok = dtype == np.bool_ if kind == "bool" else (np.issubdtype(dtype, np.integer)
                                                   and dtype != np.bool_)
    if not ok:
        raise TypeError(f"{name} must be {wanted} array [N], got dtype {dtype}")


def _check_pool(state_cache, state_indices, has_initial_state, *, initial_state,
                output_final_state, n, hv, kd, vd, state_v_first, what):
    """Validates the paged-state arguments; returns a StatePool or None."""
    if state_cache is None:
        for name, value in (("state_indices", state_indices),
                            ("has_initial_state", has_initial_state)):
            if value is not None:
                raise ValueError(
                    f"{name} is only used with state_cache (the paged state pool), got "
                    f"{name} without state_cache; pass state_cache too, or drop {name}"
                )
        return None
    if initial_state is not None:
        raise ValueError(
            "initial_state and state_cache were both passed; with state_cache the initial "
            "states are read from state_cache[state_indices]: write them into the pool's "
            "rows and drop initial_state (or drop state_cache)"
        )
    if output_final_state:
        raise ValueError(
            "output_final_state=True and state_cache were both passed; with state_cache the "
            "final states are written into the pool and the call returns "
            "(o, new_state_cache): drop output_final_state"
        )
    layout = "[slots, HV, V, K] (state_v_first)" if state_v_first else "[slots, HV, K, V]"
    _shape(state_cache, "state_cache", 4, layout)
    row = (hv, vd, kd) if state_v_first else (hv, kd, vd)
    if tuple(state_cache.shape[1:]) != row or state_cache.shape[0] < 1:
        raise ValueError(
            f"state_cache must have shape (slots, {', '.join(map(str, row))}) {layout} with "
            f"slots >= 1, got {tuple(state_cache.shape)}"
        )
    if np.dtype(state_cache.dtype) != np.float32:
        raise TypeError(
            f"state_cache must be float32 (states are kept and written in float32), got dtype "
            f"{np.dtype(state_cache.dtype)}; allocate the pool with dtype=float32"
        )
    if state_indices is None:
        raise ValueError(
            "state_cache needs state_indices: an int32 array [N] naming each sequence's row "
            "of the pool (negative for a padding slot)"
        )
    _int_vector(state_indices, "state_indices", n, what, "int")
    slots = int(state_cache.shape[0])
    if isinstance(state_indices, np.ndarray):
        # Host data: checked here, at no cost to the device.
        idx = state_indices.astype(np.int64)
        past = np.flatnonzero(idx >= slots)
        if past.size:
            i = int(past[0])
            raise ValueError(
                f"state_indices[{i}]={int(idx[i])} is >= slots={slots} (state_cache.shape[0]); "
                "use a row in [0, slots), or -1 for a padding slot"
            )
        rows, counts = np.unique(idx, return_counts=True)
        shared = np.flatnonzero((rows >= 0) & (counts > 1))
        if shared.size:
            row = int(rows[shared[0]])
            at = np.flatnonzero(idx == row)[:4].tolist()
            raise ValueError(
                f"state_indices names row {row} more than once (at positions {at}); two "
                "sequences cannot share a pool row (which final state lands there would be "
                "undefined): give each sequence its own row, or -1 for padding"
            )
        state_indices = np.where(idx < 0, -1, idx).astype(np.int32)
    elif np.dtype(state_indices.dtype) != np.int32:
        state_indices = state_indices.astype(jnp.int32)
    if has_initial_state is not None:
        _int_vector(has_initial_state, "has_initial_state", n, what, "bool")
    return state_pool.StatePool(state_cache, state_indices, has_initial_state)


def _check_call(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, chunk_size,
                cu_seqlens, implementation, state_cache=None, state_indices=None,
                has_initial_state=None):
    """Validates one call; returns (options, bounds, pool or None)."""
    b, t, h, kd = _shape(q, "q", 4, "[B, T, H, K]")
    _shape(k, "k", 4, "[B, T, H, K]")
    _expect(k, "k", (b, t, h, kd), "[B, T, H, K] like q")
    _, _, hv, vd = _shape(v, "v", 4, "[B, T, HV, V]")
    _expect(v, "v", (b, t, hv, vd), "[B, T, HV, V] (B, T as q)")
    if hv % h:
        raise ValueError(
            f"the value heads HV={hv} (v.shape[2]) must be a multiple of the q/k heads H={h}"
        )
    _shape(g, "g", 4, "[B, T, HV, K]")
    _expect(g, "g", (b, t, hv, kd), "[B, T, HV, K]")
    _shape(beta, "beta", 3, "[B, T, HV]")
    _expect(beta, "beta", (b, t, hv), "[B, T, HV]")

    flags = {
        name: _flag(value, name)
        for name, value in dict(
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first,
        ).items()
    }

    if isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size={chunk_size!r} must be 32 or 64")
    if scale is None:
        scale = kd**-0.5
    else:
        scale = _check_static_number(scale, "scale")
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale={scale} must be a positive finite number")

    if use_gate_in_kernel:
        if lower_bound is not None:
            lower_bound = _check_static_number(lower_bound, "lower_bound")
            if not -5.0 <= lower_bound < 0.0:
                raise ValueError(f"lower_bound={lower_bound} must lie in [-5, 0)")
        elif A_log is None:
            raise ValueError(
                "use_gate_in_kernel=True with lower_bound=None needs A_log [HV] "
                "(g_eff = -exp(A_log) * softplus(g + dt_bias)); pass A_log or set lower_bound"
            )
        if A_log is not None:
            _shape(A_log, "A_log", 1, "[HV]")
            _expect(A_log, "A_log", (hv,), "[HV]")
        if dt_bias is not None:
            _shape(dt_bias, "dt_bias", 1, "[HV * K]")
            _expect(dt_bias, "dt_bias", (hv * kd,), "[HV * K]")
    else:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(
                    f"{name} is only used with use_gate_in_kernel=True, got {name}="
                    f"{value if name == 'lower_bound' else 'an array'} with "
                    "use_gate_in_kernel=False; drop it or enable the in-kernel gate"
                )

    bounds = _resolve_bounds(cu_seqlens, b, t)
    n = num_seqs(bounds)
    if isinstance(bounds, VarlenBatch):
        what = "the bucket's max_seqs"
    else:
        what = "the number of sequences in cu_seqlens" if cu_seqlens is not None else "B"
    if initial_state is not None:
        state_shape = (n, hv, vd, kd) if flags["state_v_first"] else (n, hv, kd, vd)
        layout = "[N, HV, V, K] (state_v_first)" if flags["state_v_first"] else "[N, HV, K, V]"
        _shape(initial_state, "initial_state", 4, layout)
        if tuple(initial_state.shape) != state_shape:
            raise ValueError(
                f"initial_state must have shape {state_shape} {layout} with N = {what} = {n}, "
                f"got {tuple(initial_state.shape)}"
            )

    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is unknown; use None (best available), "
            f"{' or '.join(repr(i) for i in IMPLEMENTATIONS)}"
        )

    pool = _check_pool(
        state_cache, state_indices, has_initial_state, initial_state=initial_state,
        output_final_state=flags["output_final_state"], n=n, hv=hv, kd=kd,
        vd=vd, state_v_first=flags["state_v_first"], what=what,
    )
    opts = KdaOptions(
        scale=float(scale),
        lower_bound=lower_bound if use_gate_in_kernel else None,
        chunk_size=int(chunk_size),
        **flags,
    )
    return opts, bounds, pool


TRITON_MAX_HEAD_DIM = 256


def _triton_limits(q, v) -> str | None:
    kd, vd = q.shape[-1], v.shape[-1]
    if kd > TRITON_MAX_HEAD_DIM or vd > TRITON_MAX_HEAD_DIM:
        return (
            f"the Triton kernels hold K and V up to {TRITON_MAX_HEAD_DIM}, got K={kd}, V={vd}; "
            "use implementation='xla'"
        )
    return None


def _choose_backend(implementation: str | None, q, v) -> str:
    """Picks the backend at trace time (never at import); a named backend that
    cannot serve the call raises with the reason."""
    if implementation == "xla":
        return "xla"
    if implementation == "triton":
        reason = kda_triton.unavailable_reason() or _triton_limits(q, v)
        if reason is not None:
            raise RuntimeError(f"implementation='triton' cannot run this call: {reason}")
        return "triton"
    # None: Triton on a GPU where it can serve the call, else XLA.
    if (not kda_triton.interpret_mode() and kda_triton.available()
            and _triton_limits(q, v) is None):
        return "triton"
    return "xla"


# The backends. `pool` is a kda_jax.pool.StatePool or None; with a pool they
# return (o, new_state_cache). None of them donates: the caller's jit decides
# whether the pool is updated in place (donate_argnums there). `bounds` is a
# pytree in either form: SeqBounds has no leaves (it keys the jit cache on its
# contents, as a static argument would); a VarlenBatch's one leaf is traced
# and its bucket keys the cache. A batch's padded sequence slots leave the pool
# alone (mask_padding).


@functools.partial(jax.jit, static_argnames=("opts",))
def _chunk_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, pool=None, *, opts, bounds):
    pool = mask_padding(pool, bounds)
    if pool is not None:
        return state_pool.gather_run_scatter(xla.chunk_kda_xla, pool, q, k, v, g, beta, A_log,
                                             dt_bias, opts=opts, bounds=bounds)
    return xla.chunk_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias,
                             opts=opts, bounds=bounds)


@functools.partial(jax.jit, static_argnames=("opts", "config", "bwd_config"))
def _chunk_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, pool=None, *, opts,
                  bounds, config, bwd_config=None):
    if pool is not None or isinstance(bounds, VarlenBatch):
        # The serving forms, forward only: with a pool the state kernel reads
        # and writes its rows in place (no gather/scatter); a bucketed batch's
        # grids come from its bucket.
        return kda_triton.chunk_kda_triton(q, k, v, g, beta, initial_state, A_log, dt_bias,
                                           opts=opts, bounds=bounds, config=config,
                                           pool=mask_padding(pool, bounds))
    # Differentiable (jax.custom_vjp, kda_jax.triton.backward); the serving
    # branch above is not: gradients with state_cache or a VarlenBatch are
    # unsupported on this backend.
    return kda_triton.chunk_kda_triton_grad(q, k, v, g, beta, initial_state, A_log, dt_bias,
                                            opts=opts, bounds=bounds, config=config,
                                            bwd_config=bwd_config)


@functools.partial(jax.jit, static_argnames=("opts",))
def _recurrent_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, pool=None, *, opts,
                   bounds):
    pool = mask_padding(pool, bounds)
    if pool is not None:
        return state_pool.gather_run_scatter(xla.fused_recurrent_kda_xla, pool, q, k, v, g,
                                             beta, A_log, dt_bias, opts=opts, bounds=bounds)
    return xla.fused_recurrent_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias,
                                       opts=opts, bounds=bounds)


@functools.partial(jax.jit, static_argnames=("opts", "config"))
def _recurrent_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, pool=None, *, opts,
                      bounds, config):
    # With a pool the kernel reads and writes its rows in place (no gather/scatter).
    return kda_triton.fused_recurrent_kda_triton(q, k, v, g, beta, initial_state, A_log,
                                                 dt_bias, opts=opts, bounds=bounds,
                                                 config=config,
                                                 pool=mask_padding(pool, bounds))


_ARGS_DOC = """
    Args:
      q: ``[B, T, H, K]`` queries (bf16, fp16 or fp32).
      k: ``[B, T, H, K]`` keys.
      v: ``[B, T, HV, V]`` values; HV % H == 0 (value head ``hv`` reads q/k head
        ``hv // (HV // H)``).
      g: ``[B, T, HV, K]`` per-channel log-decay (natural log, <= 0), or the raw
        gate with ``use_gate_in_kernel``.
      beta: ``[B, T, HV]`` delta-rule strength (a logit with
        ``use_beta_sigmoid_in_kernel``).
      scale: query scale; default ``K ** -0.5``.
      initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
        ``state_v_first``), N = B, or the number of sequences in cu_seqlens.
        Read only: the final state is a new array. Donating initial_state to
        the enclosing jit does not make a step in place (XLA copies the new
        state into the donated buffer; a 256-sequence decode step on the H200
        took 0.53 ms instead of 0.28): for in-place updates keep the states
        in a ``state_cache``.
      output_final_state: also return the state after each sequence.
      use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6, float32).
      use_gate_in_kernel: g is raw; g_eff = -exp(A_log) * softplus(g + dt_bias),
        or with ``lower_bound`` lower_bound * sigmoid(exp(A_log) * (g + dt_bias)).
      A_log: ``[HV]`` float32; required with the gate unless ``lower_bound``.
      dt_bias: ``[HV * K]`` float32, optional.
      lower_bound: Python float in [-5, 0): the safe-gate form.
      use_beta_sigmoid_in_kernel: beta = sigmoid(beta).
      allow_neg_eigval: beta is doubled (eigenvalues of the transition in [-1, 1]).
      state_v_first: states are ``[N, HV, V, K]``.
      cu_seqlens: host bounds ``[N + 1]`` of sequences packed along T (B == 1):
        a NumPy array, a list/tuple or :class:`kda_jax.SeqBounds`. A jax.Array is
        refused (it would need a device read-back). Hashable bounds key the jit
        cache: equal bounds reuse a compiled program, new bounds retrace.
        Or a :class:`kda_jax.VarlenBatch`, the bucketed serving form: padded
        metadata as a runtime argument, one executable per bucket. Then q..beta
        are ``[1, bucket.max_tokens, ...]`` (rows past the real tokens get
        o = 0 and touch no state) and N = ``bucket.max_seqs`` (slots past the
        real sequences are empty; their pool indices are ignored).
      state_cache: a paged state pool (serving), float32 ``[slots, HV, K, V]``
        (``[slots, HV, V, K]`` with ``state_v_first``). Sequence n starts from
        row ``state_indices[n]`` and its final state is written back to that
        row; the call returns ``(o, new_state_cache)``, with every row no
        sequence names bit-identical. Not together with ``initial_state`` or
        ``output_final_state``. Donate the pool to the enclosing ``jax.jit``
        (``donate_argnums``) and the update happens in place on a GPU.
      state_indices: int32 ``[N]`` (NumPy or jax, traced allowed; other integer
        types are cast): each sequence's pool row. A negative index is a padding
        slot: nothing is read (o is computed from a zero state) or written.
        Required with ``state_cache``. NumPy indices are checked on the host:
        an index >= slots, or a row named twice, raises ValueError. Device
        indices are not checked (that would need a device read): an index >=
        slots acts as padding, and a row named twice is undefined (either
        sequence's final state may land there).
      has_initial_state: bool ``[N]`` or None (all True). False: the sequence
        starts from zeros and never reads its row (which may hold garbage);
        the row still receives its final state.
      implementation: None (best available), ``"xla"`` or ``"triton"``.

    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32
      ``[N, HV, K, V]`` (or V-first), or None unless ``output_final_state``.
      With ``state_cache``: ``(o, new_state_cache)``, the pool's shape and dtype.
"""


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, chunk_size=64, cu_seqlens=None, state_cache=None, state_indices=None,
    has_initial_state=None, implementation=None,
):
    opts, bounds, pool = _check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, implementation=implementation,
        state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state,
    )
    if isinstance(bounds, VarlenBatch) and bounds.bucket.chunk_size != opts.chunk_size:
        raise ValueError(
            f"chunk_size={opts.chunk_size} differs from the VarlenBatch's bucket chunk_size="
            f"{bounds.bucket.chunk_size} (its chunk table is built for that size); pass "
            f"chunk_size={bounds.bucket.chunk_size} or build the batch with "
            f"kda_jax.Bucket(..., chunk_size={opts.chunk_size})"
        )
    backend = _choose_backend(implementation, q, v)
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, pool)
    if backend == "triton":
        config = configs.forward_config(chunk_size=opts.chunk_size)
        return _chunk_triton(*args, opts=opts, bounds=bounds, config=config,
                             bwd_config=configs.backward_config(chunk_size=opts.chunk_size))
    return _chunk_xla(*args, opts=opts, bounds=bounds)


chunk_kda.__doc__ = (
    """Kimi Delta Attention, chunked (prefill and training).

    Computes the gated delta rule with per-channel decay of KDA_SPEC section 1
    in chunks of ``chunk_size`` (32 or 64) tokens. Call it inside ``jax.jit``;
    with ``cu_seqlens`` the varlen metadata is built on the host at trace time.
"""
    + _ARGS_DOC
    + """      chunk_size: 32 or 64.
"""
)


def fused_recurrent_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, cu_seqlens=None, state_cache=None, state_indices=None,
    has_initial_state=None, implementation=None,
):
    opts, bounds, pool = _check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        chunk_size=64, cu_seqlens=cu_seqlens, implementation=implementation,
        state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state,
    )
    backend = _choose_backend(implementation, q, v)
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, pool)
    if backend == "triton":
        return _recurrent_triton(*args, opts=opts, bounds=bounds,
                                 config=configs.recurrent_config())
    return _recurrent_xla(*args, opts=opts, bounds=bounds)


fused_recurrent_kda.__doc__ = (
    """Kimi Delta Attention, token by token (decode).

    The same function as :func:`chunk_kda`, computed one token at a time: the
    form for one-token decode steps and short sequences.
"""
    + _ARGS_DOC
)
