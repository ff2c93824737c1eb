"""Public entry points: backend choice, dispatch, docstrings.

Every call is checked first (kda_jax.checks: a bad input raises ``ValueError``
or ``TypeError`` naming the argument and its value before any backend runs).
Backends never fall back silently.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kda_jax.batch import VarlenBatch, mask_padding
from kda_jax.checks import IMPLEMENTATIONS, check_call, check_checkpoints, check_chunk_size
from kda_jax.options import KdaOptions
from kda_jax import configs, context_parallel, segmented, xla
from kda_jax import pool as state_pool
from kda_jax import triton as kda_triton

__all__ = ["chunk_kda", "chunk_kda_checkpoints", "chunk_kda_pool", "fused_recurrent_kda",
           "fused_recurrent_kda_pool", "IMPLEMENTATIONS"]

def _no_sequence(q, v, opts: KdaOptions, pool):
    """The exact result of a call with B = 0 (no sequence): empty o and, as
    asked, an empty final state or the pool unchanged."""
    b, t, _, _ = q.shape
    hv, vd = v.shape[-2:]
    o = jnp.zeros((b, t, hv, vd), q.dtype)
    if pool is not None:
        return o, jnp.asarray(pool.cache)
    if not opts.output_final_state:
        return o, None
    kd = q.shape[-1]
    shape = (0, hv, vd, kd) if opts.state_v_first else (0, hv, kd, vd)
    return o, jnp.zeros(shape, jnp.float32)


def _no_checkpoints(q, v, opts: KdaOptions):
    """The checkpoints of a call with no sequence: none, ``[0, HV, ., .]``."""
    kd = q.shape[-1]
    hv, vd = v.shape[-2:]
    return jnp.zeros((0, hv, vd, kd) if opts.state_v_first else (0, hv, kd, vd), jnp.float32)


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
        # The machine lacks Triton: RuntimeError; the call's shapes exceed the
        # kernels: ValueError, as for any other bad argument.
        reason = kda_triton.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"implementation='triton' cannot run this call: {reason}")
        reason = _triton_limits(q, v)
        if reason is not None:
            raise ValueError(f"implementation='triton' cannot run this call: {reason}")
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


@functools.partial(jax.jit, static_argnames=("opts", "checkpoint_every"))
def _chunk_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, pool=None, *, opts, bounds,
               checkpoint_every=None, checkpoint_indices=None):
    pool = mask_padding(pool, bounds)
    # Prefill checkpoints: the scan's states at interval starts (a third output).
    ckpt = ({} if checkpoint_every is None else
            dict(checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices))
    if pool is not None:
        out = state_pool.gather_run_scatter(xla.chunk_kda_xla, pool, q, k, v, g, beta, A_log,
                                            dt_bias, opts=opts, bounds=bounds, **ckpt)
        if checkpoint_every is None:
            return out
        o, cache, (rows, starts) = out
        return o, state_pool.write_rows(cache, rows, starts)
    return xla.chunk_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias,
                             opts=opts, bounds=bounds, **ckpt)


@functools.partial(jax.jit,
                   static_argnames=("opts", "config", "bwd_config", "segments", "checkpoint_every"))
def _chunk_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, pool=None, *, opts,
                  bounds, config, bwd_config=None, segments=None, checkpoint_every=None,
                  checkpoint_indices=None):
    if pool is not None or isinstance(bounds, VarlenBatch) or checkpoint_every is not None:
        # The serving forms, forward only: with a pool the state kernel reads
        # and writes its rows in place (no gather/scatter); a bucketed batch's
        # grids come from its bucket; checkpoints are stored by the state
        # pass, unsegmented.
        # Forward only: jax.grad and jax.vmap of it raise kda_jax's error.
        return kda_triton.chunk_kda_triton_serving(q, k, v, g, beta, initial_state, A_log,
                                                   dt_bias, opts=opts, bounds=bounds,
                                                   config=config,
                                                   pool=mask_padding(pool, bounds),
                                                   checkpoint_every=checkpoint_every,
                                                   checkpoint_indices=checkpoint_indices)
    # Differentiable (jax.custom_vjp, kda_jax.triton.backward).
    return kda_triton.chunk_kda_triton_grad(q, k, v, g, beta, initial_state, A_log, dt_bias,
                                            opts=opts, bounds=bounds, config=config,
                                            bwd_config=bwd_config, segments=segments)


def _core(backend: str, config=None, bwd_config=None):
    """A backend's chunk_kda as ``core(q, k, v, g, beta, h0, A_log, dt_bias, *, opts,
    bounds)``, for the compositions of kda_jax.segmented and kda_jax.context_parallel."""
    if backend == "triton":
        return functools.partial(_chunk_triton, config=config, bwd_config=bwd_config)
    return _chunk_xla


@functools.partial(jax.jit, static_argnames=("opts", "plan", "backend", "config", "bwd_config"))
def _chunk_segmented(q, k, v, g, beta, initial_state, A_log, dt_bias, *, opts, plan, backend,
                     config=None, bwd_config=None):
    return segmented.chunk_segmented(_core(backend, config, bwd_config), q, k, v, g, beta,
                                     initial_state, A_log, dt_bias, opts=opts, plan=plan)


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


_INPUTS_DOC = """
    Args:
      q: ``[B, T, H, K]`` queries. Every array argument is bf16, fp16 or fp32
        (float8, float64 and others raise TypeError). H, HV, K and V must be
        >= 1 (ValueError); B = 0 (no sequence) gives empty results without
        running a backend, and T = 0 empty sequences.
      k: ``[B, T, H, K]`` keys.
      v: ``[B, T, HV, V]`` values; HV % H == 0 (value head ``hv`` reads q/k head
        ``hv // (HV // H)``).
      g: ``[B, T, HV, K]`` per-channel log-decay (natural log, <= 0), or the raw
        gate with ``use_gate_in_kernel``.
      beta: ``[B, T, HV]`` delta-rule strength (a logit with
        ``use_beta_sigmoid_in_kernel``).
"""

_POOL_DOC = """      state_cache: the paged state pool, ``[slots, HV, K, V]`` (``[slots, HV,
        V, K]`` with ``state_v_first``), float32, bfloat16 or float16 (read
        into float32, computed in float32, each written row rounded once to
        the pool's dtype). Rows no sequence writes come back bit-identical.
        Donate it to the enclosing ``jax.jit`` (``donate_argnums``) and the
        update happens in place on a GPU.
      rows: a :class:`kda_jax.PoolRows`: the rows each sequence reads and
        writes (``ssm_state_indices`` [N], or [N, 1 + drafts] with
        ``num_accepted_tokens`` for a speculative verify; ``write_indices``
        for separate read and write rows; ``has_initial_state``). NumPy
        indices are checked on the host for the real sequences (all N with
        host bounds, the header's count with a NumPy VarlenBatch): an index
        >= slots, a row written twice, or a row one sequence writes and
        another reads raises ValueError naming the rows. Device indices, and
        NumPy ones with a batch already on the device, are not checked (that
        would need a device read): an index >= slots acts as padding, and
        the other two are undefined (the sequences run in no order).
        A verify's outputs and states are those of single-token decodes run
        one after another (bit for bit with a float32 pool on the XLA path,
        and on the Triton path when every sequence has the same length;
        otherwise up to float32 rounding); the states between its tokens stay
        float32.
"""

_STATE_DOC = """      initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
        ``state_v_first``), N = B, or the number of sequences in cu_seqlens;
        used in float32. Read only: the final state is a new array (for
        in-place updates keep the states in a pool: the ``*_pool`` forms).
      output_final_state: also return the state after each sequence.
"""

_OPTIONS_DOC = """      scale: query scale; default ``K ** -0.5``.
      use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6, float32).
      use_gate_in_kernel: g is raw; g_eff = -exp(A_log) * softplus(g + dt_bias),
        or with ``lower_bound`` lower_bound * sigmoid(exp(A_log) * (g + dt_bias)).
      A_log: ``[HV]`` float32; required with the gate unless ``lower_bound``.
      dt_bias: ``[HV * K]`` float32, optional.
      lower_bound: Python float in [-5, 0): the safe-gate form.
      use_beta_sigmoid_in_kernel: beta = sigmoid(beta).
      allow_neg_eigval: beta is 2 sigmoid(beta) (eigenvalues of the transition in
        [-1, 1]); needs ``use_beta_sigmoid_in_kernel=True``, as in fla.
      state_v_first: states are ``[N, HV, V, K]``.
      cu_seqlens: host bounds ``[N + 1]`` of sequences packed along T (B == 1):
        a NumPy array, a list/tuple or :class:`kda_jax.SeqBounds`. A jax.Array is
        refused (it would need a device read-back). Hashable bounds key the jit
        cache: equal bounds reuse a compiled program, new bounds retrace.
        Or a :class:`kda_jax.VarlenBatch`, the bucketed serving form: padded
        metadata as a runtime argument, one executable per bucket. Then q..beta
        are ``[1, bucket.max_tokens, ...]`` (rows past the real tokens get
        o = 0 and touch no state) and N = ``bucket.max_seqs`` (slots past the
        real sequences are empty; their pool rows are ignored).
      implementation: None (best available), ``"xla"`` or ``"triton"``.
        ``"triton"`` raises RuntimeError on a machine where Triton cannot run
        (no GPU, no jax-triton) and ValueError for K or V over 256.
"""

_CHUNK_SIZE_DOC = """      chunk_size: a Python int (or NumPy integer), 32 or 64; a float, bool or
        array raises TypeError.
"""

_RETURNS_STATE = """
    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32
      ``[N, HV, K, V]`` (or V-first), or None unless ``output_final_state``.
"""

_RETURNS_POOL = """
    Returns:
      ``(o, new_state_cache)``: o ``[B, T, HV, V]`` in q's dtype; the pool with
      the written rows, its shape and dtype.
"""

_TRANSFORMS_DOC = """
    Transformations: the XLA path supports ``jax.grad``, ``jax.vmap`` and
    ``jax.shard_map`` in every form (JAX's own rules). On the Triton path
    chunk_kda with host bounds is differentiable; chunk_kda and
    fused_recurrent_kda with host bounds batch under ``jax.vmap`` (the
    mapped axis folded into one launch, docs/sharding.md); the pool forms,
    a VarlenBatch and chunk_kda_checkpoints are forward only and
    unbatchable, and fused_recurrent_kda is forward only: grad, jvp and vmap
    of those raise ``kda_jax.NotDifferentiableError`` /
    ``kda_jax.NotBatchableError`` (``NotImplementedError`` subclasses)
    naming the form and the alternative. A ``cu_seqlens`` mapped by
    ``jax.vmap`` raises ValueError (bounds are host data). Inside
    ``jax.shard_map`` both paths run each device's shard, with q..beta split
    over B and/or over heads (H and HV together).
"""


def _chunk(q, k, v, g, beta, flags: dict, *, chunk_size, cu_seqlens, implementation,
           context_axis=None, pool_form=False, state_cache=None, rows=None,
           checkpoint_every=None):
    """The chunked forms' one dispatch: checks, then the backend's call.
    ``flags``: the arguments every form shares (scale, initial_state, ...)."""
    devices = context_parallel.axis_devices(context_axis, cu_seqlens)
    opts, bounds, pool = check_call(
        q, k, v, g, beta, **flags, chunk_size=check_chunk_size(chunk_size),
        cu_seqlens=cu_seqlens, implementation=implementation, pool_form=pool_form,
        state_cache=state_cache, rows=rows, context_devices=devices)
    if checkpoint_every is not None and state_pool.token_rows(pool) is not None:
        raise ValueError(
            f"checkpoint_every={checkpoint_every!r} with a speculative-verify "
            f"rows.ssm_state_indices of shape {tuple(pool.write_indices.shape)}: a verify "
            "already keeps the state after every token in its rows; drop checkpoint_every, "
            "or pass ssm_state_indices [N]")
    every, ckpt_rows = check_checkpoints(
        checkpoint_every, None if rows is None else rows.checkpoint_indices,
        chunk_size=opts.chunk_size, bounds=bounds, pool=pool)
    backend = _choose_backend(implementation, q, v)
    if bounds is None:
        out = _no_sequence(q, v, opts, pool)
        return out if every is None or pool is not None else out + (_no_checkpoints(q, v, opts),)
    args = (q, k, v, g, beta, flags["initial_state"], flags["A_log"], flags["dt_bias"], pool)
    if state_pool.token_rows(pool) is not None:
        # A verify writes the state after every token, which the chunked form
        # never holds: the token-by-token kernel is the one for it.
        return _recurrent(backend, args, opts, bounds)
    config = bwd_config = None
    if backend == "triton":
        config = configs.forward_config(chunk_size=opts.chunk_size)
        bwd_config = configs.backward_config(chunk_size=opts.chunk_size)
    if every is not None:
        # One pass, unsegmented: the checkpoints are states the pass carries.
        ckpt = dict(checkpoint_every=every, checkpoint_indices=ckpt_rows)
        if backend == "triton":
            return _chunk_triton(*args, opts=opts, bounds=bounds, config=config, **ckpt)
        return _chunk_xla(*args, opts=opts, bounds=bounds, **ckpt)
    if context_axis is not None:
        context_parallel.check_call(backend, q, v, TRITON_MAX_HEAD_DIM, context_axis)
        return context_parallel.chunk_kda_context(
            _core(backend, config, bwd_config), *args[:-1], opts=opts, bounds=bounds,
            rows=q.shape[0], axis=context_axis, devices=devices)
    plan = segmented.plan_call(backend, bounds, pool, opts, v.shape[-2])
    if plan is not None:
        return _chunk_segmented(*args[:-1], opts=opts, plan=plan, backend=backend,
                                config=config, bwd_config=bwd_config)
    if backend == "triton":
        return _chunk_triton(*args, opts=opts, bounds=bounds, config=config,
                             bwd_config=bwd_config, segments=configs.segment_config())
    return _chunk_xla(*args, opts=opts, bounds=bounds)


# The options every form shares. The pool forms have no initial_state and
# output_final_state (their states are the pool's rows).
_SHARED = dict(scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
               lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
               state_v_first=False)


def _flags(arguments: dict) -> dict:
    """The shared options from a public function's ``locals()`` (taken first
    thing), each absent one at its default."""
    return {name: arguments.get(name, default) for name, default in _SHARED.items()}


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, chunk_size=64, cu_seqlens=None, implementation=None,
    context_axis=None,
):
    flags = _flags(locals())
    return _chunk(q, k, v, g, beta, flags, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                  implementation=implementation, context_axis=context_axis)


def chunk_kda_checkpoints(
    q, k, v, g, beta, *, checkpoint_every, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
    A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False, state_v_first=False, chunk_size=64, cu_seqlens=None,
    implementation=None,
):
    flags = _flags(locals())
    if checkpoint_every is None:
        raise TypeError(
            "chunk_kda_checkpoints needs checkpoint_every, a positive Python int that is a "
            f"multiple of chunk_size={chunk_size!r}; without checkpoints call kda_jax.chunk_kda")
    return _chunk(q, k, v, g, beta, flags, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                  implementation=implementation, checkpoint_every=checkpoint_every)


def chunk_kda_pool(
    q, k, v, g, beta, state_cache, rows, *, scale=None, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
    chunk_size=64, cu_seqlens=None, implementation=None, checkpoint_every=None,
):
    flags = _flags(locals())
    return _chunk(q, k, v, g, beta, flags, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                  implementation=implementation, state_cache=state_cache,
                  pool_form=True, rows=rows, checkpoint_every=checkpoint_every)


chunk_kda.__doc__ = (
    """Kimi Delta Attention, chunked (prefill and training).

    Computes the gated delta rule with per-channel decay of docs/kda.md section 1
    in chunks of ``chunk_size`` (32 or 64) tokens. Call it inside ``jax.jit``;
    with ``cu_seqlens`` the varlen metadata is built on the host at trace time.
    fla's ``chunk_kda`` with the same names and meaning; the serving forms are
    :func:`chunk_kda_pool` and :func:`chunk_kda_checkpoints`.
"""
    + _INPUTS_DOC + _STATE_DOC + _OPTIONS_DOC + _CHUNK_SIZE_DOC
    + """      context_axis: None, or a mesh axis name: context parallel inside
        ``jax.shard_map``, each device of the axis holding a contiguous 1/n
        of every row's tokens (q..beta ``[B, T / n, ...]``; cu_seqlens the
        global host bounds of all ``T`` packed tokens; initial_state the same
        on every device). Sequences may cross devices; o is this device's
        rows, final_state all N sequences' on every device. Not with a
        VarlenBatch; on the Triton path V + K <= 256. docs/kda.md section 7.
"""
    + _RETURNS_STATE + _TRANSFORMS_DOC
    + """
    Long sequences with few heads run as parallel segments on the Triton
    path (docs/kda.md section 7; kda_jax.configs.SegmentConfig).
"""
)

_CHECKPOINTS_DOC = """      checkpoint_every: a positive Python int n, a multiple of chunk_size: the
        state before each n-token interval of every sequence is kept (prefix
        caching): the initial state (or zeros), the state after n tokens,
        after 2n, ... A sequence of length L has ceil(L / n) of them (none if
        empty: the state after the last token is the final state, not a
        checkpoint). Checkpoint j of a sequence equals the final state of a
        call on its first j * n tokens from the same initial state, on the
        same path: bit for bit on the Triton path (against an unsegmented
        call: the segmented chain rounds otherwise), to float32 rounding on
        the XLA path (its scan's products round with the number of lanes the
        sequences are packed in). Such calls run unsegmented.
"""

chunk_kda_checkpoints.__doc__ = (
    """:func:`chunk_kda` keeping prefill checkpoints: the states at every
    ``checkpoint_every`` tokens of each sequence, as one array.

    Host bounds only (the number of checkpoints is fixed at trace time); with
    a VarlenBatch write them into pool rows with :func:`chunk_kda_pool`. On
    the Triton path forward only; the XLA path differentiates through it.
"""
    + _INPUTS_DOC + _CHECKPOINTS_DOC + _STATE_DOC + _OPTIONS_DOC + _CHUNK_SIZE_DOC
    + """
    Returns:
      ``(o, final_state, checkpoints)``: o and final_state as
      :func:`chunk_kda`'s; ``checkpoints`` float32 ``[C, HV, K, V]``
      (``[C, HV, V, K]`` with ``state_v_first``), sequence by sequence in
      order, C = the sum over sequences of ceil(len / checkpoint_every).
"""
    + _TRANSFORMS_DOC
)

chunk_kda_pool.__doc__ = (
    """:func:`chunk_kda` on a paged state pool (serving prefill): each sequence
    starts from its pool row and writes its final state to a pool row.

    A speculative verify (``rows.ssm_state_indices`` [N, 1 + drafts]) runs
    the token-by-token kernel, as :func:`fused_recurrent_kda_pool` does: the
    chunked form holds no state between chunk boundaries.
"""
    + _INPUTS_DOC + _POOL_DOC
    + """      checkpoint_every: None, or as :func:`chunk_kda_checkpoints`'s: the
        checkpoints are written to the rows of ``rows.checkpoint_indices``
        ``[N, J]`` (J >= the most intervals any sequence has; extra columns
        are ignored, a negative entry skips one), each rounded once to the
        pool's dtype. NumPy indices are checked where the bounds are known
        (rows in [0, slots), each named once, none a row a final state is
        written to or another sequence reads); device ones are not: an index
        outside [0, slots) skips, a row written twice is undefined.
"""
    + _OPTIONS_DOC + _CHUNK_SIZE_DOC + _RETURNS_POOL + _TRANSFORMS_DOC
)


def _recurrent_call(q, k, v, g, beta, flags: dict, *, cu_seqlens, implementation,
                    pool_form=False, state_cache=None, rows=None):
    """The token-by-token forms' one dispatch: checks, then the backend's call."""
    opts, bounds, pool = check_call(
        q, k, v, g, beta, **flags, chunk_size=None, cu_seqlens=cu_seqlens,
        implementation=implementation, pool_form=pool_form, state_cache=state_cache,
        rows=rows)
    if pool is not None and rows.checkpoint_indices is not None:
        raise ValueError(
            "rows.checkpoint_indices with fused_recurrent_kda_pool: checkpoints are taken by "
            "kda_jax.chunk_kda_pool with checkpoint_every; drop checkpoint_indices")
    backend = _choose_backend(implementation, q, v)
    if bounds is None:
        return _no_sequence(q, v, opts, pool)
    return _recurrent(backend, (q, k, v, g, beta, flags["initial_state"], flags["A_log"],
                                flags["dt_bias"], pool), opts, bounds)


def fused_recurrent_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, cu_seqlens=None, implementation=None,
):
    flags = _flags(locals())
    return _recurrent_call(q, k, v, g, beta, flags, cu_seqlens=cu_seqlens,
                           implementation=implementation)


def fused_recurrent_kda_pool(
    q, k, v, g, beta, state_cache, rows, *, scale=None, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
    cu_seqlens=None, implementation=None,
):
    flags = _flags(locals())
    return _recurrent_call(q, k, v, g, beta, flags, cu_seqlens=cu_seqlens,
                           implementation=implementation, pool_form=True,
                           state_cache=state_cache, rows=rows)


def _recurrent(backend: str, args: tuple, opts: KdaOptions, bounds):
    if backend == "triton":
        return _recurrent_triton(*args, opts=opts, bounds=bounds,
                                 config=configs.recurrent_config())
    return _recurrent_xla(*args, opts=opts, bounds=bounds)


fused_recurrent_kda.__doc__ = (
    """Kimi Delta Attention, token by token (decode).

    The same function as :func:`chunk_kda`, computed one token at a time: the
    form for one-token decode steps and short sequences. fla's
    ``fused_recurrent_kda`` with the same names and meaning; the pool form is
    :func:`fused_recurrent_kda_pool`.
"""
    + _INPUTS_DOC + _STATE_DOC + _OPTIONS_DOC + _RETURNS_STATE + _TRANSFORMS_DOC
)

fused_recurrent_kda_pool.__doc__ = (
    """:func:`fused_recurrent_kda` on a paged state pool (serving decode and
    speculative verify): fla's ``fused_recurrent_kda_fwd`` with
    ``ssm_state_indices`` and ``num_accepted_tokens``, the pool updated as a
    new array (in place when donated).
"""
    + _INPUTS_DOC + _POOL_DOC + _OPTIONS_DOC + _RETURNS_POOL + _TRANSFORMS_DOC
)
