"""chunk_kda forward through the Triton kernels (two launches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax.bounds import SeqBounds, chunk_table, packed_metadata
from kda_jax.configs import ForwardConfig
from kda_jax.options import KdaOptions
from kda_jax.triton.launch import interpret_mode, kernels, launch

__all__ = ["chunk_kda_triton"]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


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
    # Intermediates in the inputs' 16-bit type, or float32 for float32 inputs.
    # Triton's interpreter computes 16-bit tl.dot wrongly (seen with triton
    # 3.9), so interpret mode keeps them in float32.
    work = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    if interpret_mode():
        work = jnp.float32
    precision = "ieee" if work == jnp.float32 else "tf32"

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
    bk = min(_pow2(kd), config.prepare_block_k)
    bv = min(_pow2(vd), 64)
    w, u, qg, kt, aqk, gl = launch(
        mod.kda_fwd_prepare_kernel,
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
        num_warps=config.prepare_warps,
        num_stages=config.prepare_stages,
        H=h, HV=hv, K=kd, V=vd, BT=bt, BK=bk, BV=bv, SCALE=float(opts.scale),
        USE_L2NORM=opts.use_qk_l2norm_in_kernel, USE_GATE=opts.use_gate_in_kernel,
        HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_LOWER_BOUND=opts.lower_bound is not None,
        LOWER_BOUND=float(opts.lower_bound if opts.lower_bound is not None else 0.0),
        BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
        BETA_SCALE=2.0 if opts.allow_neg_eigval else 1.0,
        FOUR_BLOCKS=bt == 64,
    )

    bv_state = min(_pow2(vd), config.state_block_v)
    h0 = dummy if initial_state is None else initial_state.astype(f32)
    o, ht = launch(
        mod.kda_fwd_state_output_kernel,
        w, u, qg, kt, aqk, gl, h0,
        meta_dev, meta.offset("cu_seqlens"), meta.offset("chunk_offsets"),
        grid=(n, hv, -(-vd // bv_state)),
        out_shape=[
            jax.ShapeDtypeStruct((tokens, hv, vd), q.dtype),
            jax.ShapeDtypeStruct(state_shape if opts.output_final_state else (4,), f32),
        ],
        name="kda_fwd_state_output",
        num_warps=config.state_warps,
        num_stages=config.state_stages,
        HV=hv, K=kd, V=vd, BT=bt, BK=_pow2(max(kd, 16)), BV=bv_state,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=opts.output_final_state,
        STATE_V_FIRST=opts.state_v_first,
        DOT_PRECISION=precision,
    )
    o = o.reshape(b, t, hv, vd)
    return o, (ht if opts.output_final_state else None)
