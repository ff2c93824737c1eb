"""chunk_kda forward through the Triton kernels (two launches; with segments,
the chain's map and fold between them, :mod:`kda_jax.triton.state_chain`).

Varlen metadata comes from either form (:mod:`kda_jax.batch`): host bounds
(one constant) or a bucketed batch (a runtime buffer; grids from the bucket).
With a paged state pool (:class:`kda_jax.pool.StatePool`) the state kernel
reads and writes the pool's rows itself, through the indices: the pool goes in
as an input aliased to the kernel's state output, so no gather or scatter runs
around the kernels, and with the pool donated to the caller's jit XLA updates
it in place.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import pool as state_pool
from kda_jax.bounds import checkpoint_offsets, next_pow2
from kda_jax.batch import kernel_metadata
from kda_jax.configs import (ForwardConfig, PrepareConfig, SegmentConfig, StateConfig,
                             variant_key)
from kda_jax.options import KdaOptions
from kda_jax.triton.forward_only import forward_only
from kda_jax.triton.launch import (KernelLaunch, dot_precision, interpret_mode, launch_kernel,
                                   stand_in, transform_constexprs)
from kda_jax.triton.partitioning import CALL, partitioned
from kda_jax.triton import state_chain
from kda_jax.triton.state_args import kernel_states

__all__ = ["chunk_kda_triton", "chunk_kda_triton_serving", "flags_in_prepare",
           "forward_launches", "prepare_launch", "segmented_launches", "split_state_k",
           "state_launch", "work_dtype"]


def work_dtype(input_dtype, *, interpret: bool = False):
    """The dtype of the intermediates (w, u, qg, kt, aqk): the inputs' 16-bit
    type, or float32 for float32 inputs. Triton's interpreter computes 16-bit
    tl.dot wrongly (seen with triton 3.9), so interpret mode keeps them in
    float32."""
    dtype = jnp.dtype(input_dtype)
    if interpret or dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dtype


def split_state_k(work, kd: int) -> bool:
    """Whether the state kernels (the forward's and the backward's two passes)
    hold the state as two K halves: with float32 intermediates from K = 128
    (padded) on. Their fp32-grade products split each [BT, K] operand into
    tf32 parts in registers (tf32x3 on sm90): with [64, 128] float32 tiles
    they spilled 264-1188 bytes on sm90 at every V block (16, 32), warp count
    (4, 8) and stage count (1, 2) tried; in K halves they compile without
    spills (bench.aot). 16-bit intermediates keep one tile (unchanged code)."""
    return jnp.dtype(work).itemsize != 2 and next_pow2(max(kd, 16)) >= 128


def forward_launches(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                     config: ForwardConfig, work, has_a_log: bool, has_dt_bias: bool,
                     has_initial_state: bool, indexed_state: bool = False,
                     checkpoint_chunks: int = 0,
                     store_flags: bool = False) -> tuple[KernelLaunch, KernelLaunch]:
    """The (prepare, state_output) launches for these shapes, options and
    config; ``work`` is the intermediates' dtype (:func:`work_dtype`);
    ``indexed_state``: states are read from and written to a pool's rows;
    ``checkpoint_chunks``: the state pass stores the state at the start of
    every this-many-th chunk (prefill checkpoints; 0: none); ``store_flags``:
    the prepare kernel also writes the per-token non-finite flags (the
    forward of a differentiated call, BackwardConfig.nonfinite_flags="prepare").

    The one place the constexprs are derived: :func:`chunk_kda_triton` launches
    with them and :mod:`bench.aot` compiles with them.
    """
    work = jnp.dtype(work).name
    prepare = prepare_launch(config.prepare[variant_key(config.prepare, work, kd)], h=h, hv=hv,
                             kd=kd, vd=vd, opts=opts, has_a_log=has_a_log,
                             has_dt_bias=has_dt_bias, store_flags=store_flags)
    state = state_launch(config.state[variant_key(config.state, work, kd)], hv=hv, kd=kd, vd=vd,
                         opts=opts, work=work, has_initial_state=has_initial_state,
                         indexed_state=indexed_state, checkpoint_chunks=checkpoint_chunks)
    return prepare, state


def flags_in_prepare(config: ForwardConfig, input_dtype, kd: int) -> bool:
    """Whether the prepare kernel of a differentiated call stores the per-token
    non-finite flags (STORE_FLAGS) for inputs of ``input_dtype`` at K = ``kd``:
    16-bit inputs with K a multiple of the prepare's K slice. Elsewhere XLA
    computes them from the inputs (kda_jax.transforms.nonfinite_flags, the
    same flags): storing them holds registers, and on sm90 the float32
    variant spilled 12-28 bytes and the masked K = 100 form 8 (bench.aot,
    Triton 3.9; docs/tuning.md). The rule follows the inputs' dtype, not the
    intermediates', so that the interpreter's float32 intermediates take a
    GPU's form."""
    if jnp.dtype(input_dtype).itemsize != 2:
        return False
    pc = config.prepare[variant_key(config.prepare, jnp.dtype(input_dtype).name, kd)]
    return kd % min(next_pow2(max(kd, 16)), pc.block_k) == 0


def prepare_launch(pc: PrepareConfig, *, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                   has_a_log: bool, has_dt_bias: bool, store_x: bool = False,
                   store_flags: bool = False) -> KernelLaunch:
    """The prepare kernel's launch at the config ``pc`` (the forward's, or the
    backward's recompute with ``store_x``; ``store_flags``: the non-finite
    flags too)."""
    return KernelLaunch(
        kernel="kda_fwd_prepare_kernel",
        constexprs=dict(
            H=h, HV=hv, K=kd, V=vd, BT=opts.chunk_size,
            # Tiles at least 16 wide: a matrix product needs K >= 16 on a GPU.
            BK=min(next_pow2(max(kd, 16)), pc.block_k),
            BV=min(next_pow2(max(vd, 16)), 64),
            **transform_constexprs(opts, has_a_log=has_a_log, has_dt_bias=has_dt_bias),
            DOT_A=dot_precision(pc.dot), DOT_WU=dot_precision(pc.wu_dot),
            DOT_INV=dot_precision(pc.inverse_dot),
            STORE_X=store_x,
            SPLIT_PASSES=pc.split,
            BATCHED_L1=pc.batched_l1,
            STORE_FLAGS=store_flags,
        ),
        num_warps=pc.warps,
        num_stages=pc.stages,
    )


def state_launch(sc: StateConfig, *, hv: int, kd: int, vd: int, opts: KdaOptions, work,
                 has_initial_state: bool, indexed_state: bool = False,
                 checkpoint_chunks: int = 0) -> KernelLaunch:
    """The state-output kernel's launch at the config ``sc`` (the one pass's
    or the pass over segments')."""
    # The state as two K halves where the intermediates call for it.
    split = split_state_k(work, kd) and sc.split_k
    stages = sc.stages
    if split and checkpoint_chunks:
        # The checkpoint stores in the chunk loop: at two stages the float32
        # state kernel in K halves spilled on sm90 at chunk 32 (bench.aot).
        stages = 1
    return KernelLaunch(
        kernel="kda_fwd_state_output_kernel",
        constexprs=dict(
            HV=hv, K=kd, V=vd, BT=opts.chunk_size,
            BK=next_pow2(max(kd, 16)) // (2 if split else 1),
            BV=min(next_pow2(max(vd, 16)), sc.block_v),
            USE_INITIAL_STATE=has_initial_state or indexed_state,
            STORE_FINAL_STATE=opts.output_final_state or indexed_state,
            STATE_V_FIRST=opts.state_v_first,
            INDEXED_STATE=indexed_state,
            DOT=dot_precision(sc.dot),
            SPLIT_K=split,  # the state as two [BK, BV] tiles
            CHECKPOINT_CHUNKS=checkpoint_chunks,
        ),
        num_warps=sc.warps,
        num_stages=stages,
    )


def chunk_kda_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                     opts: KdaOptions, bounds, config: ForwardConfig,
                     pool: state_pool.StatePool | None = None,
                     segments: SegmentConfig | None = None,
                     checkpoint_every: int | None = None, checkpoint_indices=None,
                     store_flags: bool = False):
    """Validated inputs in; ``(o, final_state | None)`` out, or ``(o, new_cache)``
    with a pool (then ``initial_state`` is None). ``bounds``: SeqBounds or
    VarlenBatch (a batch's padded sequence slots already masked in ``pool``).
    ``segments``: the rule that may run the state pass over segments
    (:mod:`kda_jax.triton.state_chain`; host bounds only), None: never.

    ``checkpoint_every`` (a multiple of the chunk size): the state pass also
    stores each sequence's state before every interval of that many tokens.
    With a pool into the rows ``checkpoint_indices`` int32 ``[N, J]`` names
    (the result stays ``(o, new_cache)``); without, host bounds only, as a
    third output ``[C, HV, ., .]`` float32 (C from
    :func:`kda_jax.bounds.checkpoint_offsets`). Checkpoints run the state pass
    unsegmented. See kda_jax.chunk_kda.

    ``store_flags`` (host bounds, no pool or checkpoints: the forward of a
    differentiated call): a third output, the per-token non-finite flags int8
    ``[B, T, HV]`` as the prepare kernel finds them (bit 0 poison, bit 1 a
    non-finite q; kda_jax.transforms.nonfinite_flags)."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    bt = opts.chunk_size
    tokens = b * t
    f32 = jnp.float32
    dummy = stand_in()
    meta = kernel_metadata(bounds, bt)
    n = meta.num_seqs
    indexed = pool is not None
    state_shape = (n, hv, vd, kd) if opts.state_v_first else (n, hv, kd, vd)

    # Host bounds with no chunk at all (every sequence empty, so no token).
    # A bucketed batch always launches: its grids come from the bucket.
    empty = meta.chunk_programs == 0
    ckpt = _checkpoint_args(bounds, pool, checkpoint_every, checkpoint_indices, bt,
                            state_shape[1:])
    if store_flags and (indexed or ckpt is not None):
        raise ValueError("store_flags is for the forward of a differentiated call: no pool, "
                         "no checkpoints")
    if empty and not indexed:
        o = jnp.zeros((b, t, hv, vd), q.dtype)
        final = None
        if opts.output_final_state:
            final = jnp.zeros(state_shape, f32) if initial_state is None else initial_state
            final = final.astype(f32)
        if store_flags:
            return o, final, jnp.zeros((b, t, hv), jnp.int8)  # no token
        if ckpt is None:
            return o, final
        return o, final, jnp.zeros(ckpt.shape.shape, f32)  # no token: no checkpoint

    work = work_dtype(q.dtype, interpret=interpret_mode())
    prep, state = forward_launches(
        h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config, work=work,
        has_a_log=A_log is not None, has_dt_bias=dt_bias is not None,
        has_initial_state=initial_state is not None, indexed_state=indexed,
        checkpoint_chunks=0 if ckpt is None else ckpt.chunks, store_flags=store_flags,
    )
    sds = jax.ShapeDtypeStruct
    if empty:
        # Only the state pass runs (it writes the pool's rows); it reads no
        # token, so stand-ins keep jax-triton away from empty buffers.
        p = dict(w=dummy, u=dummy, qg=dummy, kt=dummy, aqk=dummy, gl=dummy)
    else:
        flat = lambda x: x.reshape((tokens,) + x.shape[2:])
        p = launch_kernel(
            prep,
            inputs=dict(q=flat(q), k=flat(k), v=flat(v), g=flat(g), beta=flat(beta),
                        A_log=dummy if A_log is None else A_log.astype(f32),
                        dt_bias=dummy if dt_bias is None else dt_bias.astype(f32),
                        meta=meta.buffer, off_cu=meta.off_cu, off_ct=meta.off_ct,
                        n_bounds=meta.num_bounds, n_tokens=tokens),
            outputs=dict(
                w=sds((tokens, hv, kd), work), u=sds((tokens, hv, vd), work),
                qg=sds((tokens, hv, kd), work), kt=sds((tokens, hv, kd), work),
                aqk=sds((tokens, hv, bt), work), gl=sds((meta.chunk_programs, hv, kd), f32),
                x=sds((4,), f32),  # X: not stored in the forward
                gc=sds((tokens, hv, kd), f32),  # the kernel's scratch
                flags=sds((tokens, hv) if store_flags else (4,), jnp.int8)),
            grid=(meta.chunk_programs, hv, 1), name="kda_fwd_prepare")
    flags = p["flags"].reshape(b, t, hv) if store_flags and not empty else None

    tables = None
    if segments is not None and not indexed and not empty and ckpt is None:
        seg_launches = segmented_launches(h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config,
                                          work=work, input_dtype=q.dtype,
                                          has_initial_state=initial_state is not None)
        tables = state_chain.chain_tables(
            bounds, segments, chunk_size=bt, hv=hv, kd=kd, vd=vd, block_v=state.constexprs["BV"],
            split_k=state.constexprs["SPLIT_K"],
            segment_block_v=seg_launches[0].constexprs["BV"])
    if tables is not None:
        out = _segmented_state_output(p, tables, seg_launches, initial_state, q.dtype, hv=hv,
                                      kd=kd, vd=vd, b=b, t=t, opts=opts,
                                      n_chunk_rows=meta.chunk_programs)
        return out if flags is None else (*out, flags)

    st = kernel_states(pool, initial_state, state_shape, opts.output_final_state)
    if ckpt is None:
        ckpt = _NO_CHECKPOINTS
    out = launch_kernel(
        state,
        inputs=dict(w=p["w"], u=p["u"], qg=p["qg"], kt=p["kt"], aqk=p["aqk"], gl=p["gl"],
                    h0=st.h0, read_idx=st.read_idx, write_idx=st.write_idx,
                    ckpt_idx=ckpt.index(), meta=meta.buffer, off_cu=meta.off_cu,
                    off_co=meta.off_co, n_seqs=n, n_tokens=tokens,
                    n_chunk_rows=meta.chunk_programs, slots=st.slots, ckpt_cols=ckpt.cols),
        outputs=dict(o=sds((tokens, hv, vd) if tokens else (4,), q.dtype),
                     ht=sds(st.ht_shape, st.ht_dtype), hc=ckpt.shape),
        grid=(meta.seq_programs, hv, -(-vd // state.constexprs["BV"])),
        name="kda_fwd_state_output",
        aliases={"h0": "ht"} if st.aliased else None)  # the pool's buffer
    o, ht = out["o"], out["ht"]
    o = o.reshape(b, t, hv, vd) if tokens else jnp.zeros((b, t, hv, vd), q.dtype)
    if indexed:
        return o, ht
    final = ht if opts.output_final_state else None
    if flags is not None:
        return o, final, flags
    return (o, final) if ckpt.chunks == 0 else (o, final, out["hc"])


class _Checkpoints(NamedTuple):
    """The state-output kernel's checkpoint arguments: CHECKPOINT_CHUNKS, the
    ckpt_idx table (a host array: the [C, ...] output's offsets; or a pool's
    indices [N, J], device data; None: none), ckpt_cols (J, or 0) and the hc
    output (the [C, ...] checkpoints, or a stand-in when there are none or
    they go into a pool's rows)."""

    chunks: int
    table: object
    cols: int
    shape: jax.ShapeDtypeStruct

    def index(self):
        # A host table becomes a small constant of the program.
        return stand_in(np.int32) if self.table is None else jnp.asarray(self.table)


_STAND_IN_OUT = jax.ShapeDtypeStruct((4,), jnp.float32)
_NO_CHECKPOINTS = _Checkpoints(0, None, 0, _STAND_IN_OUT)


def _checkpoint_args(bounds, pool, every, indices, chunk_size: int,
                     state_row: tuple) -> _Checkpoints | None:
    """The checkpoint arguments of a call with ``checkpoint_every=every``, or
    None without. ``state_row``: one state's shape (HV, ., .)."""
    if every is None:
        return None
    chunks = every // chunk_size
    if pool is not None:
        return _Checkpoints(chunks, indices, int(indices.shape[1]), _STAND_IN_OUT)
    offsets = checkpoint_offsets(bounds, every)
    return _Checkpoints(chunks, offsets, 0,
                        jax.ShapeDtypeStruct((int(offsets[-1]),) + tuple(state_row), jnp.float32))


def segmented_launches(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                       config: ForwardConfig, work, input_dtype, has_initial_state: bool
                       ) -> tuple[KernelLaunch, state_chain.ChainLaunches]:
    """The forward's launches over segments: the state-output kernel (states
    K-first, every segment from a start state) at ``config.segment_state``
    where V is a multiple of its V block (else the one pass's: float32 state
    tiles at V block 64 spilled on sm90 at K = 64, and 16-bit ones with
    masked V columns at K = 100, bench.aot), and the chain's map and fold
    (:mod:`kda_jax.triton.state_chain`). The segment kernels' variants follow
    the inputs' dtype (``input_dtype``), so that the interpreter's float32
    intermediates with 16-bit inputs take a GPU's 16-bit launch and
    segments; the products' precision follows ``work``. The glue launches
    with them and :mod:`bench.aot` compiles them."""
    seg_opts = dataclasses.replace(opts, state_v_first=False)  # states K-first inside
    work, given = jnp.dtype(work).name, jnp.dtype(input_dtype).name
    sc = config.segment_state[variant_key(config.segment_state, given, kd)]
    mc = config.map[variant_key(config.map, given, kd)]
    if work != given:  # the interpreter: float32 work, 16-bit inputs
        own = config.state[variant_key(config.state, work, kd)]
        sc = dataclasses.replace(sc, dot=own.dot)
        mc = dataclasses.replace(mc, dot=own.dot)
    if vd % sc.block_v:
        sc = config.state[variant_key(config.state, work, kd)]
    state = state_launch(sc, hv=hv, kd=kd, vd=vd, opts=seg_opts, work=work,
                         has_initial_state=True)
    return state, state_chain.chain_launches(state, mc, config.fold, use_h0=has_initial_state)


def _segmented_state_output(p, tables, launches, initial_state, out_dtype, *, hv, kd, vd, b, t,
                            opts, n_chunk_rows):
    """The state pass over segments (:mod:`kda_jax.triton.state_chain`): maps,
    fold, then the state-output kernel per segment from its start state.
    ``p``: the prepare kernel's outputs; ``launches``: segmented_launches'.
    Same result as the one pass."""
    tokens = b * t
    f32 = jnp.float32
    state, chain = launches
    meta = state_chain.segment_meta(tables)
    e, m = state_chain.segment_maps(chain, tables, meta, p["w"], p["u"], p["kt"], p["gl"],
                                    n_tokens=tokens, n_chunk_rows=n_chunk_rows)
    h0 = state_chain.k_first(initial_state, opts.state_v_first)
    starts = state_chain.fold_states(chain.fold, tables, meta, e, m, h0)
    n_seg = tables.plan.num_segments
    no_index = stand_in(np.int32)
    sds = jax.ShapeDtypeStruct
    out = launch_kernel(
        state,
        inputs=dict(w=p["w"], u=p["u"], qg=p["qg"], kt=p["kt"], aqk=p["aqk"], gl=p["gl"],
                    h0=starts, read_idx=no_index, write_idx=no_index, ckpt_idx=no_index,
                    **meta, n_seqs=n_seg, n_tokens=tokens,
                    n_chunk_rows=n_chunk_rows, slots=0, ckpt_cols=0),
        outputs=dict(o=sds((tokens, hv, vd), out_dtype),
                     ht=sds((n_seg, hv, kd, vd) if opts.output_final_state else (4,), f32),
                     hc=_STAND_IN_OUT),
        grid=(n_seg, hv, -(-vd // state.constexprs["BV"])), name="kda_fwd_state_output_seg")
    o = out["o"].reshape(b, t, hv, vd)
    if not opts.output_final_state:
        return o, None
    final = state_chain.per_sequence(out["ht"], tables.last_segment, h0)
    return o, state_chain.k_first(final, opts.state_v_first)


def chunk_kda_triton_serving(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                             opts: KdaOptions, bounds, config: ForwardConfig,
                             pool: state_pool.StatePool | None = None,
                             checkpoint_every: int | None = None, checkpoint_indices=None):
    """:func:`chunk_kda_triton` for the serving forms (a pool, a VarlenBatch
    as ``bounds``, or prefill checkpoints), which are forward only: jax.grad
    and jax.vmap of it raise (:mod:`kda_jax.triton.forward_only`) instead of
    failing inside JAX."""
    name = ("chunk_kda_pool" if pool is not None else
            "chunk_kda" if checkpoint_every is None else "chunk_kda_checkpoints")
    form = f"{name} on the Triton path (implementation='triton', the default on a GPU)"
    if pool is None and checkpoint_every is None:
        form += " with a VarlenBatch as cu_seqlens"

    def run(q, k, v, g, beta, initial_state, A_log, dt_bias, bounds, pool, checkpoint_indices):
        return chunk_kda_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, opts=opts,
                                bounds=bounds, config=config, pool=pool,
                                checkpoint_every=checkpoint_every,
                                checkpoint_indices=checkpoint_indices)

    outs = ("o", "state" if pool is None else "cache")
    if checkpoint_every is not None and pool is None:
        outs += ("checkpoints",)
    return forward_only(partitioned(run, CALL + ("checkpoint_indices",), outs), form)(
        q, k, v, g, beta, initial_state, A_log, dt_bias, bounds, pool, checkpoint_indices)
