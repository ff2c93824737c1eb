"""fused_recurrent_kda through the Triton decode kernel (one launch).

Without a pool the kernel reads ``initial_state[n]`` and writes
``final_state[n]``. With a pool (:class:`kda_jax.pool.StatePool`) it reads and
writes the pool's rows itself, through the indices: the pool goes in as an
input aliased to the kernel's state output, so no gather or scatter runs
around the kernel, and with the pool donated to the caller's jit XLA updates
it in place. Varlen metadata comes from either form (:mod:`kda_jax.batch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kda_jax import pool as state_pool
from kda_jax.batch import kernel_metadata
from kda_jax.bounds import SeqBounds, next_pow2
from kda_jax.configs import DecodeConfig, RecurrentConfig
from kda_jax.options import KdaOptions
from kda_jax.triton.batching import BOUNDS, HEAD_PARAM, ROWS, STATE, foldable
from kda_jax.triton.forward_only import forward_only, not_differentiable
from kda_jax.triton.launch import (KernelLaunch, interpret_mode, launch_kernel, stand_in,
                                   transform_constexprs)
from kda_jax.triton.partitioning import CALL, partitioned
from kda_jax.triton.state_args import kernel_states

__all__ = ["KERNEL", "decode_config", "recurrent_constexprs", "recurrent_launch",
           "fused_recurrent_kda_triton"]

KERNEL = "kda_fused_recurrent_kernel"
# The metadata buffer is the one chunk_kda builds (same cache entry); this
# kernel reads only its cu_seqlens block.
_META_CHUNK = 64


def recurrent_constexprs(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                         config: RecurrentConfig, has_a_log: bool, has_dt_bias: bool,
                         has_initial_state: bool, indexed_state: bool,
                         uniform_len: int | None = None, write_columns: int = 0) -> dict:
    """The kernel's constexprs for these shapes, options and config (the one
    place they are derived). ``uniform_len``: every sequence has this many
    tokens (host bounds; the kernel then loads no bound), None: varlen; the
    config's variant: :func:`decode_config`. ``write_columns``: W of a
    verify's ``[N, W]`` write rows (the state after each token), 0
    otherwise."""
    dc = decode_config(config, kd, uniform_len)
    return dict(
        H=h, HV=hv, K=kd, V=vd,
        BK=next_pow2(max(kd, 16)),
        BV=min(next_pow2(max(vd, 8)), dc.block_v),
        **transform_constexprs(opts, has_a_log=has_a_log, has_dt_bias=has_dt_bias),
        USE_INITIAL_STATE=has_initial_state or indexed_state,
        STORE_FINAL_STATE=(opts.output_final_state or indexed_state) and not write_columns,
        STATE_V_FIRST=opts.state_v_first,
        INDEXED_STATE=indexed_state,
        WRITE_COLUMNS=write_columns,
        UNIFORM=uniform_len is not None,
        SEQ_LEN=uniform_len or 0,
        LOOP_STAGES=dc.stages,
        # The interpreter's float32 -> bfloat16 conversion truncates (DecodeConfig).
        NATIVE_CAST=dc.state_cast == "native" and not interpret_mode(),
    )


def decode_config(config: RecurrentConfig, kd: int, uniform_len: int | None) -> DecodeConfig:
    """The variant of ``config`` a call takes: "wide" past K = 128, else
    "varlen" when the kernel loads the bounds (``uniform_len`` None), else
    "dense"."""
    if kd > 128:
        return config.decode["wide"]
    return config.decode["varlen" if uniform_len is None else "dense"]


def recurrent_launch(*, config: RecurrentConfig, **kwargs) -> KernelLaunch:
    """The kernel's launch: :func:`recurrent_constexprs` (same arguments) and
    its variant's warps and stages."""
    dc = decode_config(config, kwargs["kd"], kwargs.get("uniform_len"))
    return KernelLaunch(KERNEL, recurrent_constexprs(config=config, **kwargs), dc.warps,
                        dc.stages)


# The decode grid is (V blocks, heads, sequences): sequences take the third
# grid dimension, 65535 at most on CUDA and HIP.
_MAX_GRID_Z = 65535


def fused_recurrent_kda_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                               opts: KdaOptions, bounds, config: RecurrentConfig,
                               pool: state_pool.StatePool | None = None):
    """Validated inputs in; ``(o, final_state | None)`` out, or ``(o, new_cache)``
    with a pool (then ``initial_state`` is None). ``bounds``: SeqBounds or
    VarlenBatch (a batch's padded sequence slots already masked in ``pool``).
    See kda_jax.fused_recurrent_kda.

    Forward only in every form: jax.grad of it raises
    (:mod:`kda_jax.triton.forward_only`). jax.vmap folds the mapped axis into
    the one launch (:mod:`kda_jax.triton.batching`) with host bounds and no
    pool; the serving forms (a pool, a VarlenBatch) raise under it."""
    if pool is None and isinstance(bounds, SeqBounds):
        def run(q, k, v, g, beta, initial_state, A_log, dt_bias, bounds):
            return _launch(q, k, v, g, beta, initial_state, A_log, dt_bias, opts=opts,
                           bounds=bounds, config=config, pool=None)

        run = foldable(partitioned(run, CALL[:9], ("o", "state")), LAUNCH_INPUTS,
                       LAUNCH_OUTPUTS)
        return not_differentiable(run, _FORM)(q, k, v, g, beta, initial_state, A_log, dt_bias,
                                              bounds)

    def serve(q, k, v, g, beta, initial_state, A_log, dt_bias, bounds, pool):
        return _launch(q, k, v, g, beta, initial_state, A_log, dt_bias, opts=opts,
                       bounds=bounds, config=config, pool=pool)

    form = (f"fused_recurrent_kda_pool{_ON_TRITON}" if pool is not None else
            f"fused_recurrent_kda{_ON_TRITON} with a VarlenBatch as cu_seqlens")
    outs = ("o", "state" if pool is None else "cache")
    return forward_only(partitioned(serve, CALL, outs), form)(
        q, k, v, g, beta, initial_state, A_log, dt_bias, bounds, pool)


_ON_TRITON = " on the Triton path (implementation='triton', the default on a GPU)"
_FORM = "fused_recurrent_kda" + _ON_TRITON
# The launch's layout without a pool (kda_jax.triton.batching): (q, k, v, g,
# beta, initial_state, A_log, dt_bias, bounds) -> (o, final_state).
LAUNCH_INPUTS = (ROWS,) * 5 + (STATE, HEAD_PARAM, HEAD_PARAM, BOUNDS)
LAUNCH_OUTPUTS = (ROWS, STATE)


def _launch(q, k, v, g, beta, initial_state, A_log, dt_bias, *, opts: KdaOptions, bounds,
            config: RecurrentConfig, pool: state_pool.StatePool | None):
    """The launch of :func:`fused_recurrent_kda_triton` (same arguments)."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    tokens = b * t
    out_dtype = q.dtype
    f32 = jnp.float32
    dummy = stand_in()

    meta = kernel_metadata(bounds, _META_CHUNK)
    n = meta.num_seqs
    if meta.seq_programs > _MAX_GRID_Z:
        raise ValueError(
            f"fused_recurrent_kda(implementation='triton') launches one program row per "
            f"sequence (plus one for a bucketed batch), at most {_MAX_GRID_Z} (a grid's third "
            f"dimension); got {meta.seq_programs} for {n} sequences: split the batch")

    if tokens == 0:
        # Every sequence is empty: no token row is touched, but states still
        # pass through the kernel (a pool row with has_initial_state False
        # becomes zeros). Stand-ins keep jax-triton away from empty buffers.
        q = k = v = g = dummy.reshape(1, 1, 1, 4)
        beta = dummy.reshape(1, 1, 4)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])
    q, k, v, g, beta = (flat(x) for x in (q, k, v, g, beta))

    indexed = pool is not None
    state_shape = (n, hv, vd, kd) if opts.state_v_first else (n, hv, kd, vd)
    st = kernel_states(pool, initial_state, state_shape, opts.output_final_state)
    spec = recurrent_launch(
        h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config,
        has_a_log=A_log is not None, has_dt_bias=dt_bias is not None,
        has_initial_state=initial_state is not None, indexed_state=indexed,
        uniform_len=meta.uniform_len, write_columns=st.write_columns,
    )
    out = launch_kernel(
        spec,
        inputs=dict(q=q, k=k, v=v, g=g, beta=beta,
                    A_log=dummy if A_log is None else A_log.astype(f32),
                    dt_bias=dummy if dt_bias is None else dt_bias.astype(f32),
                    h0=st.h0, read_idx=st.read_idx, write_idx=st.write_idx, meta=meta.buffer,
                    off_cu=meta.off_cu, n_seqs=n, n_tokens=tokens, slots=st.slots),
        outputs=dict(o=jax.ShapeDtypeStruct((tokens, hv, vd) if tokens else (4,), out_dtype),
                     ht=jax.ShapeDtypeStruct(st.ht_shape, st.ht_dtype)),
        grid=(-(-vd // spec.constexprs["BV"]), hv, meta.seq_programs),
        name="kda_fused_recurrent",
        aliases={"h0": "ht"} if st.aliased else None)  # the pool's buffer
    o, ht = out["o"], out["ht"]
    o = o.reshape(b, t, hv, vd) if tokens else jnp.zeros((b, t, hv, vd), out_dtype)
    if indexed:
        return o, ht
    return o, (ht if opts.output_final_state else None)
