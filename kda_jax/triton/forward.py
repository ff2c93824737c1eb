"""chunk_kda forward through the Triton kernels (two launches)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax.bounds import SeqBounds, chunk_table, packed_metadata
from kda_jax.configs import DOT_MODES, ForwardConfig
from kda_jax.options import KdaOptions
from kda_jax.triton.launch import interpret_mode, kernels, launch

__all__ = ["KernelLaunch", "chunk_kda_triton", "forward_launches", "work_dtype"]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def work_dtype(input_dtype, *, interpret: bool = False):
    """The dtype of the intermediates (w, u, qg, kt, aqk): the inputs' 16-bit
    type, or float32 for float32 inputs. Triton's interpreter computes 16-bit
    tl.dot wrongly (seen with triton 3.9), so interpret mode keeps them in
    float32."""
    dtype = jnp.dtype(input_dtype)
    if interpret or dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dtype


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """What one kernel of the forward compiles with: its name in
    ``kda_jax.kernels.chunk_fwd``, its constexprs and its launch options."""

    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int


def forward_launches(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                     config: ForwardConfig, work, has_a_log: bool, has_dt_bias: bool,
                     has_initial_state: bool) -> tuple[KernelLaunch, KernelLaunch]:
    """The (prepare, state_output) launches for these shapes, options and
    config; ``work`` is the intermediates' dtype (:func:`work_dtype`).

    The one place the constexprs are derived: :func:`chunk_kda_triton` launches
    with them and :mod:`kda_jax.aot` compiles with them.
    """
    bt = opts.chunk_size
    prepare = KernelLaunch(
        kernel="kda_fwd_prepare_kernel",
        constexprs=dict(
            H=h, HV=hv, K=kd, V=vd, BT=bt,
            BK=min(_pow2(kd), config.prepare_block_k),
            BV=min(_pow2(vd), 64),
            SCALE=float(opts.scale),
            USE_L2NORM=opts.use_qk_l2norm_in_kernel, USE_GATE=opts.use_gate_in_kernel,
            HAS_A_LOG=has_a_log, HAS_DT_BIAS=has_dt_bias,
            HAS_LOWER_BOUND=opts.lower_bound is not None,
            LOWER_BOUND=float(opts.lower_bound if opts.lower_bound is not None else 0.0),
            BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
            BETA_SCALE=2.0 if opts.allow_neg_eigval else 1.0,
            DOT_A=DOT_MODES.index(config.prepare_dot),
            DOT_WU=DOT_MODES.index(config.prepare_wu_dot),
        ),
        num_warps=config.prepare_warps,
        num_stages=config.prepare_stages,
    )
    state = KernelLaunch(
        kernel="kda_fwd_state_output_kernel",
        constexprs=dict(
            HV=hv, K=kd, V=vd, BT=bt, BK=_pow2(max(kd, 16)),
            BV=min(_pow2(vd), config.state_block_v),
            USE_INITIAL_STATE=has_initial_state,
            STORE_FINAL_STATE=opts.output_final_state,
            STATE_V_FIRST=opts.state_v_first,
        ),
        num_warps=config.state_warps,
        # With K > 128 the pipelined [BT, K] tiles of w, qg and kt outgrow an
        # H200's 227 KiB of shared memory at two stages (measured: 232 KiB).
        num_stages=config.state_stages if _pow2(kd) <= 128 else 1,
    )
    return prepare, state


def chunk_kda_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                     opts: KdaOptions, bounds: SeqBounds, config: ForwardConfig):
    """Validated inputs in, ``(o, final_state | None)`` out; see kda_jax.chunk_kda."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    bt = opts.chunk_size
    n = bounds.num_seqs
    tokens = b * t
    flat = lambda x: x.reshape((tokens,) + x.shape[2:])
    q, k, v, g, beta = (flat(x) for x in (q, k, v, g, beta))
    work = work_dtype(q.dtype, interpret=interpret_mode())

    meta = packed_metadata(bounds, bt)
    meta_dev = jnp.asarray(meta.buffer)  # the one int32 constant of the program
    n_chunks = chunk_table(bounds, bt).shape[0]
    state_shape = (n, hv, vd, kd) if opts.state_v_first else (n, hv, kd, vd)

    if tokens == 0 or n_chunks == 0:
        o = jnp.zeros((b, t, hv, vd), q.dtype)
        if not opts.output_final_state:
            return o, None
        final = jnp.zeros(state_shape, jnp.float32) if initial_state is None else initial_state
        return o, final.astype(jnp.float32)

    mod = kernels("chunk_fwd")
    f32 = jnp.float32
    dummy = jnp.zeros((4,), f32)
    prep, state = forward_launches(
        h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config, work=work,
        has_a_log=A_log is not None, has_dt_bias=dt_bias is not None,
        has_initial_state=initial_state is not None,
    )
    w, u, qg, kt, aqk, gl = launch(
        getattr(mod, prep.kernel),
        q, k, v, g, beta,
        dummy if A_log is None else A_log.astype(f32),
        dummy if dt_bias is None else dt_bias.astype(f32),
        meta_dev, meta.offset("cu_seqlens"), meta.offset("chunk_table"),
        grid=(n_chunks, hv, 1),
        out_shape=[
            jax.ShapeDtypeStruct((tokens, hv, kd), work),
            jax.ShapeDtypeStruct((tokens, hv, vd), work),
            jax.ShapeDtypeStruct((tokens, hv, kd), work),
            jax.ShapeDtypeStruct((tokens, hv, kd), work),
            jax.ShapeDtypeStruct((tokens, hv, bt), work),
            jax.ShapeDtypeStruct((n_chunks, hv, kd), f32),
        ],
        name="kda_fwd_prepare",
        num_warps=prep.num_warps,
        num_stages=prep.num_stages,
        **prep.constexprs,
    )

    h0 = dummy if initial_state is None else initial_state.astype(f32)
    o, ht = launch(
        getattr(mod, state.kernel),
        w, u, qg, kt, aqk, gl, h0,
        meta_dev, meta.offset("cu_seqlens"), meta.offset("chunk_offsets"),
        grid=(n, hv, -(-vd // state.constexprs["BV"])),
        out_shape=[
            jax.ShapeDtypeStruct((tokens, hv, vd), q.dtype),
            jax.ShapeDtypeStruct(state_shape if opts.output_final_state else (4,), f32),
        ],
        name="kda_fwd_state_output",
        num_warps=state.num_warps,
        num_stages=state.num_stages,
        **state.constexprs,
    )
    o = o.reshape(b, t, hv, vd)
    return o, (ht if opts.output_final_state else None)
