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

__all__ = ["chunk_kda", "fused_recurrent_kda", "IMPLEMENTATIONS"]

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


_ARGS_DOC = """
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
      scale: query scale; default ``K ** -0.5``.
      initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
        ``state_v_first``), N = B, or the number of sequences in cu_seqlens;
        used in float32.
        Read only: the final state is a new array. Donating initial_state to
        the enclosing jit does not make a step in place (XLA copies the new
        state into the donated buffer, about twice the time of an in-place
        step): for in-place updates keep the states in a ``state_cache``.
      output_final_state: also return the state after each sequence.
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
        real sequences are empty; their pool indices are ignored).
      state_cache: a paged state pool (serving), ``[slots, HV, K, V]``
        (``[slots, HV, V, K]`` with ``state_v_first``), float32, bfloat16 or
        float16 (read into float32, computed in float32, each written row
        rounded once to the pool's dtype). Sequence n starts from
        row ``state_indices[n]`` and its final state is written back to that
        row; the call returns ``(o, new_state_cache)``, with every row no
        sequence names bit-identical. Not together with ``initial_state`` or
        ``output_final_state``. Donate the pool to the enclosing ``jax.jit``
        (``donate_argnums``) and the update happens in place on a GPU.
      state_indices: int32 ``[N]`` (NumPy or jax, traced allowed; other integer
        types are narrowed to int32 with every index outside [0, slots) made
        -1 first, so int64 under jax_enable_x64 never wraps onto a row): each
        sequence's pool row. A negative index is a padding slot: nothing is
        read (o is computed from a zero state) or written.
        Required with ``state_cache``, unless ``read_indices`` and
        ``write_indices`` replace it. NumPy indices are checked on the host
        for the real sequences: all N with host bounds, the first
        (real count) with a NumPy VarlenBatch, whose padded slots' indices
        are ignored unchecked. There an index >= slots, or a row named twice,
        raises ValueError. Device indices, and NumPy indices with a batch
        already on the device (its real count is device data), are not
        checked (that would need a device read): an index >= slots acts as
        padding, and a row named twice is undefined (either sequence's final
        state may land there).
        Or int32 ``[N, W]``, W = 1 + S drafts (speculative verify, each
        sequence at most W tokens): sequence n starts from row
        ``state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
        ``num_accepted_tokens``) and writes the state after its token t to
        row ``state_indices[n, t]``, -1 for none; no other final state is
        written. The outputs and states are those of single-token decodes run
        one after another (bit for bit with a float32 pool on the XLA path,
        and on the Triton path when every sequence has the same length;
        otherwise up to float32 rounding). A 16-bit pool rounds each written
        state once, and the states between a verify's tokens stay float32.
        Written rows must be distinct over the whole matrix (checked for
        NumPy indices). chunk_kda runs a verify with the token-by-token
        kernel, as fused_recurrent_kda does: the chunked form holds no state
        between chunk boundaries.
      num_accepted_tokens: int32 ``[N]`` (NumPy or jax, traced allowed), only
        with a ``[N, W]`` state_indices: the tokens of each sequence's last
        verify that were accepted, in [1, W] (NumPy counts are checked on the
        host; a device count outside [1, W] reads no row: zeros).
      read_indices, write_indices: int32 ``[N]`` each, together in place of
        ``state_indices`` (read / write slots, e.g. for prefix caching): sequence
        n starts from row ``read_indices[n]`` and writes its final state to row
        ``write_indices[n]``; -1 reads (zeros) or writes nothing. A row that is
        read and not written comes back bit-identical, and several sequences
        may read one row; written rows must be distinct (checked as
        ``state_indices`` is), and no sequence may read a row another one
        writes (or checkpoints into) in the same call: the sequences run in no
        order (NumPy indices that do are refused; device ones are undefined).
      has_initial_state: bool ``[N]`` or None (all True). False: the sequence
        starts from zeros and never reads its row (which may hold garbage);
        the row still receives its final state.
      implementation: None (best available), ``"xla"`` or ``"triton"``.
        ``"triton"`` raises RuntimeError on a machine where Triton cannot run
        (no GPU, no jax-triton) and ValueError for K or V over 256.

    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32
      ``[N, HV, K, V]`` (or V-first), or None unless ``output_final_state``.
      With ``state_cache``: ``(o, new_state_cache)``, the pool's shape and dtype.

    Transformations: the XLA path supports ``jax.grad``, ``jax.vmap`` and
    ``jax.shard_map`` in every form (JAX's own rules). On the Triton path
    chunk_kda with host bounds and no ``state_cache`` is differentiable;
    with host bounds and no ``state_cache`` both functions batch under
    ``jax.vmap`` (the mapped axis folded into one launch, docs/sharding.md);
    the serving forms (a ``state_cache`` or a VarlenBatch) are forward only
    and unbatchable, and fused_recurrent_kda is forward only: grad, jvp and
    vmap of those raise ``kda_jax.NotDifferentiableError`` /
    ``kda_jax.NotBatchableError`` (``NotImplementedError`` subclasses) naming
    the form and the alternative.
    A ``cu_seqlens`` mapped by ``jax.vmap`` raises ValueError (bounds are host
    data). Inside ``jax.shard_map`` both paths run each device's shard, with
    q..beta split over B and/or over heads (H and HV together).
"""


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, chunk_size=64, cu_seqlens=None, state_cache=None, state_indices=None,
    has_initial_state=None, implementation=None, context_axis=None, read_indices=None,
    write_indices=None, num_accepted_tokens=None, checkpoint_every=None,
    checkpoint_indices=None,
):
    devices = context_parallel.axis_devices(context_axis, cu_seqlens)
    opts, bounds, pool = check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        chunk_size=check_chunk_size(chunk_size), cu_seqlens=cu_seqlens,
        implementation=implementation,
        state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state, context_devices=devices,
        read_indices=read_indices, write_indices=write_indices,
        num_accepted_tokens=num_accepted_tokens,
    )
    if checkpoint_every is not None and state_pool.token_rows(pool) is not None:
        raise ValueError(
            f"checkpoint_every={checkpoint_every!r} with a speculative-verify state_indices of "
            f"shape {tuple(pool.write_indices.shape)}: a verify already keeps the state after "
            "every token in its rows; drop checkpoint_every, or pass state_indices [N]")
    every, ckpt_rows = check_checkpoints(checkpoint_every, checkpoint_indices,
                                         chunk_size=opts.chunk_size, bounds=bounds, pool=pool,
                                         context_axis=context_axis)
    backend = _choose_backend(implementation, q, v)
    if bounds is None:
        out = _no_sequence(q, v, opts, pool)
        return out if every is None or pool is not None else out + (_no_checkpoints(q, v, opts),)
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, pool)
    if state_pool.token_rows(pool) is not None:
        # A verify writes the state after every token, which the chunked form
        # never holds: the token-by-token kernel is the one for it.
        if context_axis is not None:
            context_parallel.check_call(pool, backend, q, v, TRITON_MAX_HEAD_DIM, context_axis)
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
        context_parallel.check_call(pool, backend, q, v, TRITON_MAX_HEAD_DIM, context_axis)
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


chunk_kda.__doc__ = (
    """Kimi Delta Attention, chunked (prefill and training).

    Computes the gated delta rule with per-channel decay of docs/kda.md section 1
    in chunks of ``chunk_size`` (32 or 64) tokens. Call it inside ``jax.jit``;
    with ``cu_seqlens`` the varlen metadata is built on the host at trace time.
"""
    + _ARGS_DOC
    + """      chunk_size: a Python int (or NumPy integer), 32 or 64; a float, bool or
        array raises TypeError.
      context_axis: None, or a mesh axis name: context parallel inside
        ``jax.shard_map``, each device of the axis holding a contiguous 1/n
        of every row's tokens (q..beta ``[B, T / n, ...]``; cu_seqlens the
        global host bounds of all ``T`` packed tokens; initial_state the same
        on every device). Sequences may cross devices; o is this device's
        rows, final_state all N sequences' on every device. Not with
        state_cache or a VarlenBatch; on the Triton path V + K <= 256.
        docs/kda.md section 7.
      checkpoint_every: None, or a positive Python int n, a multiple of
        chunk_size: prefill checkpoints (prefix caching). The call then
        returns ``(o, final_state, checkpoints)`` (final_state None unless
        ``output_final_state``): ``checkpoints`` float32 ``[C, HV, K, V]``
        (``[C, HV, V, K]`` with ``state_v_first``) holds, sequence by
        sequence in order, the state before each n-token interval: the
        initial state (or zeros), the state after n tokens, after 2n, ...;
        C = sum over sequences of ceil(len / n), an empty sequence has none
        (the state after the last token is the final state, not a
        checkpoint). Checkpoint j of a sequence equals the final state of a
        call on its first j * n tokens from the same initial state, on the
        same path: bit for bit on the Triton path (against an unsegmented
        call: the segmented chain rounds otherwise), to float32 rounding on the
        XLA path (its scan's products round with the number of lanes the
        sequences are packed in). Host bounds only (C is fixed at trace
        time); with a VarlenBatch use the pool form. Such calls run
        unsegmented (no segmented state chain, no ``context_axis``).
        On the Triton path they are forward only (``jax.grad`` and
        ``jax.vmap`` raise ``kda_jax.NotDifferentiableError`` /
        ``NotBatchableError``); the XLA path differentiates through them.
      checkpoint_indices: with ``state_cache`` (required there), int32
        ``[N, J]``, J >= the most intervals any sequence has (extra columns
        are ignored): checkpoint j of sequence n is written to pool row
        ``checkpoint_indices[n, j]`` (a negative index skips it), rounded
        once to the pool's dtype, and the call returns ``(o,
        new_state_cache)``. Device data (traced; no read-back, no recompile
        when values change) or NumPy, which is checked on the host where the
        bounds are known: rows in [0, slots), each named once and none a row
        a final state is written to. Device indices are not checked: an index
        outside [0, slots) skips and a row written twice is undefined;
        columns past J skip on both paths. A checkpoint row that
        another sequence of the same call reads is undefined on the Triton
        path (its programs run in any order).

    Long sequences with few heads run as parallel segments on the Triton
    path (docs/kda.md section 7; kda_jax.configs.SegmentConfig).
"""
)


def fused_recurrent_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    state_v_first=False, cu_seqlens=None, state_cache=None, state_indices=None,
    has_initial_state=None, implementation=None, read_indices=None, write_indices=None,
    num_accepted_tokens=None,
):
    opts, bounds, pool = check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        chunk_size=None, cu_seqlens=cu_seqlens, implementation=implementation,
        state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state, read_indices=read_indices,
        write_indices=write_indices, num_accepted_tokens=num_accepted_tokens,
    )
    backend = _choose_backend(implementation, q, v)
    if bounds is None:
        return _no_sequence(q, v, opts, pool)
    return _recurrent(backend, (q, k, v, g, beta, initial_state, A_log, dt_bias, pool), opts,
                      bounds)


def _recurrent(backend: str, args: tuple, opts: KdaOptions, bounds):
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
