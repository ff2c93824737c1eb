"""Gradients of chunk_kda's Triton path: a jax.custom_vjp around the forward.

The forward is :func:`kda_jax.triton.forward.chunk_kda_triton` (the input
transforms in-kernel); its residuals are the raw inputs only (q, k, v, g,
beta, initial_state, A_log, dt_bias): every intermediate is recomputed. The
backward

1. recomputes the transformed inputs in JAX under ``jax.vjp`` (non-finite
   entries zeroed, L2 norm, gate, log-decay floor, beta sigmoid / negative
   eigenvalues: elementwise and cheap) and zeroes the cotangents of what the
   forward made NaN (rows from a non-finite input on, and those sequences'
   final states): the kernels then see the clean computation only,
2. runs, on them (transforms off), the forward's prepare kernel storing
   X = (I + L)^-1 too, then the kernels of ``kda_jax.kernels.chunk_bwd``:
   state pass and reverse state pass (a launch each, or one launch for both
   where the config says so; over segments when the call is segmented,
   :mod:`kda_jax.triton.state_chain`), then per chunk the state terms, the
   terms through X and the intra-chunk products (three kernels, or one
   where the config fuses them),
3. sums dq and dk over each GVA group (the kernels work per value head) and
   chains everything through the transforms' vjp.

The varlen metadata is the forward's host-built int32 constant; nothing is
read back from the device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import configs, transforms
from kda_jax.bounds import SeqBounds, chunk_table, next_pow2, packed_metadata
from kda_jax.configs import BackwardConfig, ForwardConfig, StateConfig, variant_key
from kda_jax.options import KdaOptions
from kda_jax.triton.forward import (chunk_kda_triton, flags_in_prepare, prepare_launch,
                                    split_state_k, work_dtype)
from kda_jax.triton.batching import BOUNDS, HEAD_PARAM, PACKED, ROWS, STATE, foldable
from kda_jax.triton.launch import (KernelLaunch, dot_precision, interpret_mode, launch_kernel,
                                   stand_in)
from kda_jax.triton import state_chain
from kda_jax.triton.partitioning import (CALL, GRAD_CALL, GRADS, PARAMS, partitioned,
                                         unpartitioned_under_vmap)

__all__ = ["chunk_kda_triton_grad", "backward_launches", "backward_work_dtype", "kernel_qk_dtype",
           "core_backward",
           "recompute_launch", "segmented_backward_launches"]


def recompute_launch(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                     config: BackwardConfig, work) -> KernelLaunch:
    """The backward's recompute: the forward's prepare kernel on the
    transformed inputs (every in-kernel transform off), storing X too, at the
    backward config's prepare_* values."""
    plain = dataclasses.replace(
        opts, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, lower_bound=None,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)
    prepare = config.recompute[variant_key(config.recompute, jnp.dtype(work).name, kd)]
    return prepare_launch(prepare, h=h, hv=hv, kd=kd, vd=vd, opts=plain, has_a_log=False,
                          has_dt_bias=False, store_x=True)


def kernel_qk_dtype(input_dtype, opts: KdaOptions, config: BackwardConfig):
    """The dtype of the q, k the backward's kernels take for inputs of
    ``input_dtype`` (:func:`_kernel_qk`): the in-kernel L2 norm's float32
    output, rounded back to a 16-bit input's dtype where
    ``config.normalized_qk`` is "input"; without the norm, the inputs' own.
    :func:`backward_work_dtype` of this is the backward's work dtype."""
    dtype = jnp.dtype(input_dtype)
    if not opts.use_qk_l2norm_in_kernel:
        return dtype
    if config.normalized_qk == "input" and dtype.itemsize == 2:
        return dtype
    return jnp.dtype(jnp.float32)


def backward_work_dtype(input_dtype, opts: KdaOptions, config: BackwardConfig, kd: int, *,
                        interpret: bool = False):
    """The dtype of the backward's intermediates (the recompute's w, u, qg, kt,
    Aqk; v_new and dv_new) for kernel inputs q, k of ``input_dtype`` (from a
    call's inputs: :func:`kernel_qk_dtype`): :func:`kda_jax.triton.forward.work_dtype`,
    or float32 with the in-kernel gate for K up to ``config.gate_fp32_max_k``
    (16-bit ones put the gate parameters' gradients above 1e-3:
    configs.BackwardConfig)."""
    if opts.use_gate_in_kernel and kd <= config.gate_fp32_max_k:
        return jnp.dtype(jnp.float32)
    return work_dtype(input_dtype, interpret=interpret)


def chunk_state_dtype(config: BackwardConfig, work):
    """The dtype of the per-chunk states h and dS the state passes store for
    the inter kernel (``config.chunk_states``)."""
    return jnp.dtype(work) if config.chunk_states == "work" else jnp.dtype(jnp.float32)


def state_block_v(sc: StateConfig, work, kd: int, vd: int) -> int:
    """The state passes' V block cap: ``sc.block_v``, but with float32
    intermediates no wider than 16 where K or V is not a power of two (the
    masked columns' registers: on sm90 float32 passes over 32-wide blocks
    spill 76-84 bytes at K = 100, V = 60, none at 16)."""
    if jnp.dtype(work).itemsize != 2 and (kd != next_pow2(kd) or vd != next_pow2(vd)):
        return min(sc.block_v, 16)
    return sc.block_v


def _block(n: int, cap: int) -> int:
    """A block over a dimension of n: its power of two (at least 16), at most cap."""
    return min(next_pow2(max(n, 16)), cap)


def backward_launches(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                      config: BackwardConfig, has_initial_state: bool,
                      has_final_grad: bool, work) -> dict[str, KernelLaunch]:
    """The backward kernels' launches for these shapes, options and config,
    by kernel name (in launch order): the two state passes, then the three
    per-chunk kernels, or the fused gradient kernel in their place where
    ``config.grads_for`` gives its config. The one place their constexprs are derived:
    :func:`core_backward` launches with them, :mod:`bench.aot` compiles
    with them."""
    bt = opts.chunk_size
    name = jnp.dtype(work).name
    sc, dc, ic, wc, ac = (c[variant_key(c, name, kd)] for c in (
        config.state, config.dstate, config.inter, config.wy, config.intra))
    grc = config.grads_for(name, kd)
    if grc is not None and (kd % _block(kd, grc.block_k) or vd % _block(vd, grc.block_v)):
        # A masked K or V block holds more registers: at K = 100, V = 60 the
        # fused kernel spills 80 bytes on sm90 under Triton 3.9.
        grc = None
    bk_state = next_pow2(max(kd, 16))
    # The state as two K halves where the intermediates call for it (as the
    # forward's), in each pass whose config allows it.
    split = split_state_k(work, kd)
    common = dict(HV=hv, K=kd, V=vd, BT=bt)
    launches = [
        KernelLaunch("kda_bwd_state_kernel", dict(
            **common, BK=bk_state // (2 if split and sc.split_k else 1),
            BV=min(next_pow2(max(vd, 16)), state_block_v(sc, work, kd, vd)),
            USE_INITIAL_STATE=has_initial_state, STATE_V_FIRST=opts.state_v_first,
            DOT=dot_precision(sc.dot), SPLIT_K=split and sc.split_k), sc.warps, sc.stages),
        KernelLaunch("kda_bwd_dstate_kernel", dict(
            **common, BK=bk_state // (2 if split and dc.split_k else 1),
            BV=min(next_pow2(max(vd, 16)), state_block_v(dc, work, kd, vd)),
            USE_FINAL_GRAD=has_final_grad, STORE_INITIAL_GRAD=has_initial_state,
            STATE_V_FIRST=opts.state_v_first, DOT=dot_precision(dc.dot),
            SPLIT_K=split and dc.split_k, STORE_CHUNKS=True),
            dc.warps, dc.stages),
    ]
    if grc is not None:
        launches.append(KernelLaunch("kda_bwd_grads_kernel", dict(
            H=h, **common, BK=_block(kd, grc.block_k), BV=_block(vd, grc.block_v),
            SCALE=float(opts.scale), DOT=dot_precision(grc.dot),
            DOT_X=dot_precision(grc.x_dot), DOT_A=dot_precision(grc.product_dot),
            BATCHED_L1=grc.batched_l1), grc.warps, grc.stages))
    else:
        launches += [
            KernelLaunch("kda_bwd_inter_kernel", dict(
                H=h, **common, BK=_block(kd, ic.block_k), BV=_block(vd, ic.block_v),
                SCALE=float(opts.scale), DOT=dot_precision(ic.dot)),
                ic.warps, 1),
            KernelLaunch("kda_bwd_wy_kernel", dict(
                H=h, **common, BK=_block(kd, wc.block_k), BV=_block(vd, wc.block_v),
                SCALE=float(opts.scale), DOT_X=dot_precision(wc.dot)),
                wc.warps, 1),
            KernelLaunch("kda_bwd_intra_kernel", dict(
                H=h, HV=hv, K=kd, BT=bt, BK=_block(kd, ac.block_k), DOT_A=dot_precision(ac.dot),
                BATCHED_L1=ac.batched_l1),
                ac.warps, 1)]
    return {launch_.kernel: launch_ for launch_ in launches}


def core_backward(q, k, v, g, beta, initial_state, do, dht, *, opts: KdaOptions,
                  bounds: SeqBounds, config: BackwardConfig,
                  segments: configs.SegmentConfig | None = None):
    """The gradients of the core recurrence (no input transforms).

    Args (tokens packed along T, any float dtype unless said):
      q, k ``[T, H, K]``; v ``[T, HV, V]``; g ``[T, HV, K]`` log-decay;
      beta ``[T, HV]``; initial_state float32 in the state layout, or None;
      do ``[T, HV, V]`` the output's cotangent; dht the final state's
      cotangent (state layout, float32) or None.

    Returns float32 ``(dq, dk, dv, dg, dbeta, dh0)``: dq, dk ``[T, HV, K]``
    per value head (not yet summed over a GVA group), dv ``[T, HV, V]``,
    dg ``[T, HV, K]``, dbeta ``[T, HV]``, dh0 like initial_state or None.
    """
    tokens, h, kd = q.shape
    hv, vd = v.shape[-2:]
    bt = opts.chunk_size
    n = bounds.num_seqs
    f32 = jnp.float32
    work = backward_work_dtype(q.dtype, opts, config, q.shape[-1], interpret=interpret_mode())
    if work == jnp.dtype(f32):
        # Float32 intermediates take float32 inputs, as a float32 caller's do: the
        # kernels built are those the AOT report checks for spills.
        q, k, v, g, beta, do = (x.astype(f32) for x in (q, k, v, g, beta, do))
    meta = packed_metadata(bounds, bt)
    n_chunks = chunk_table(bounds, bt).shape[0]
    state_shape = (n, hv, vd, kd) if opts.state_v_first else (n, hv, kd, vd)
    if tokens == 0 or n_chunks == 0:
        zeros = lambda *s: jnp.zeros(s, f32)
        dh0 = None
        if initial_state is not None:
            dh0 = zeros(*state_shape) if dht is None else dht.astype(f32)
        return (zeros(tokens, hv, kd), zeros(tokens, hv, kd), zeros(tokens, hv, vd),
                zeros(tokens, hv, kd), zeros(tokens, hv), dh0)

    meta_dev = jnp.asarray(meta.buffer)
    off_cu, off_co, off_ct = (meta.offset(x) for x in ("cu_seqlens", "chunk_offsets",
                                                       "chunk_table"))
    dummy = stand_in()
    L = backward_launches(h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config,
                          has_initial_state=initial_state is not None,
                          has_final_grad=dht is not None, work=work)
    sds = jax.ShapeDtypeStruct
    by_chunk = dict(meta=meta_dev, off_cu=off_cu, off_ct=off_ct, n_bounds=n, n_tokens=tokens)
    by_seq = dict(meta=meta_dev, off_cu=off_cu, off_co=off_co, n_tokens=tokens,
                  n_chunk_rows=n_chunks)
    tk, tv, tt = sds((tokens, hv, kd), f32), sds((tokens, hv, vd), f32), sds((tokens, hv, bt), f32)

    def run(name, grid, inputs, outputs):
        return launch_kernel(L[name], inputs=inputs, outputs=outputs, grid=grid, name=name)

    # The forward's prepare kernel on the transformed inputs, also storing X.
    prep = recompute_launch(h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config, work=work)
    r = launch_kernel(
        prep,
        inputs=dict(q=q, k=k, v=v, g=g, beta=beta, A_log=dummy, dt_bias=dummy, **by_chunk),
        outputs=dict(w=sds(tk.shape, work), u=sds(tv.shape, work), qg=sds(tk.shape, work),
                     kt=sds(tk.shape, work), aqk=sds(tt.shape, work),
                     gl=sds((n_chunks, hv, kd), f32), x=tt,
                     gc=tk,  # G, read by the kernels below
                     flags=sds((4,), jnp.int8)),  # the forward's (unused here)
        grid=(n_chunks, hv, 1), name="kda_bwd_recompute")

    # The state passes' tiling.
    first = L["kda_bwd_state_kernel"]
    n_v = -(-vd // first.constexprs["BV"])
    tables = None
    if segments is not None:
        tables = state_chain.chain_tables(
            bounds, segments, chunk_size=bt, hv=hv, kd=kd, vd=vd,
            block_v=first.constexprs["BV"], split_k=first.constexprs["SPLIT_K"],
            backward=True)
    if tables is not None:
        state, dstate = _segmented_state_passes(
            r, tables, initial_state, dht, do, h=h, hv=hv, kd=kd, vd=vd,
            n_chunks=n_chunks, tokens=tokens, opts=opts, config=config, work=work)
    else:
        chunk_states = sds((n_chunks, hv, kd, vd), chunk_state_dtype(config, work))
        state = run(
            "kda_bwd_state_kernel", (n, hv, n_v),
            dict(w=r["w"], u=r["u"], kt=r["kt"], gl=r["gl"],
                 h0=dummy if initial_state is None else initial_state.astype(f32), **by_seq),
            dict(h=chunk_states, vn=sds(tv.shape, work)))
        dstate = run(
            "kda_bwd_dstate_kernel", (n, hv, n_v),
            dict(qg=r["qg"], kt=r["kt"], w=r["w"], aqk=r["aqk"], gl=r["gl"], do=do,
                 dht=dummy if dht is None else dht.astype(f32), **by_seq),
            dict(dh=chunk_states, dvn=sds(tv.shape, work),
                 dh0=sds(state_shape if initial_state is not None else (4,), f32)))

    if "kda_bwd_grads_kernel" in L:
        grads = run(
            "kda_bwd_grads_kernel", (n_chunks, hv, 1),
            dict(q=q, k=k, v=v, g=g, gc=r["gc"], beta=beta, x=r["x"], h=state["h"],
                 dh=dstate["dh"], vn=state["vn"], dvn=dstate["dvn"], do=do, **by_chunk),
            dict(dq=tk, dk=tk, dv=tv, dg=tk, dbeta=sds((tokens, hv), f32), dl=tt, daqk=tt))
        return (grads["dq"], grads["dk"], grads["dv"], grads["dg"], grads["dbeta"],
                dstate["dh0"] if initial_state is not None else None)

    n_k = -(-kd // L["kda_bwd_inter_kernel"].constexprs["BK"])
    inter = run(
        "kda_bwd_inter_kernel", (n_chunks, hv, n_k),
        dict(q=q, k=k, gc=r["gc"], g=g, h=state["h"], dh=dstate["dh"], vn=state["vn"],
             dvn=dstate["dvn"], do=do, **by_chunk),
        dict(dq=tk, dk=tk, dg=tk, dw=tk))
    wy = run(
        "kda_bwd_wy_kernel", (n_chunks, hv, 1),
        dict(k=k, v=v, gc=r["gc"], beta=beta, x=r["x"], w=r["w"], u=r["u"], vn=state["vn"],
             dvn=dstate["dvn"], do=do, dk_p=inter["dk"], dg_p=inter["dg"], dw=inter["dw"],
             **by_chunk),
        dict(dv=tv, dk_w=tk, dg_w=tk, dl=tt, daqk=tt, dbeta=sds((tokens, hv), f32)))

    n_k = -(-kd // L["kda_bwd_intra_kernel"].constexprs["BK"])
    intra = run(
        "kda_bwd_intra_kernel", (n_chunks * n_k, hv, 1),
        dict(q=q, k=k, g=g, beta=beta, dl=wy["dl"], daqk=wy["daqk"], dq_p=inter["dq"],
             dk_w=wy["dk_w"], dg_w=wy["dg_w"], **by_chunk),
        dict(dq=tk, dk=tk, dg=tk, dbeta_k=sds((tokens, hv, n_k), f32)))
    dq, dk, dg, dv, dh0 = intra["dq"], intra["dk"], intra["dg"], wy["dv"], dstate["dh0"]
    dbeta = wy["dbeta"] + jnp.sum(intra["dbeta_k"], axis=-1)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None)


def segmented_backward_launches(*, h: int, hv: int, kd: int, vd: int, opts: KdaOptions,
                                config: BackwardConfig, work, has_initial_state: bool,
                                has_final_grad: bool) -> dict:
    """The backward's launches over segments, by role: ``state`` (the state
    pass from each segment's start state), ``own`` (the reverse pass from
    zero storing only each segment's start cotangent), ``dstate`` (the
    reverse pass from each segment's end cotangent), ``chain`` (map and
    folds, :mod:`kda_jax.triton.state_chain`). States K-first. The glue
    launches with them and :mod:`bench.aot` compiles them."""
    seg_opts = dataclasses.replace(opts, state_v_first=False)  # states K-first inside
    L = backward_launches(h=h, hv=hv, kd=kd, vd=vd, opts=seg_opts, config=config,
                          has_initial_state=True, has_final_grad=True, work=work)
    state, dstate = L["kda_bwd_state_kernel"], L["kda_bwd_dstate_kernel"]
    own = dataclasses.replace(dstate, constexprs=dict(
        dstate.constexprs, USE_FINAL_GRAD=False, STORE_CHUNKS=False))
    # The map replaces the state pass over each segment: it runs at that pass's launch.
    map_config = StateConfig(block_v=state.constexprs["BV"], warps=state.num_warps,
                             stages=state.num_stages, dot=state.constexprs["DOT"])
    chain = state_chain.chain_launches(state, map_config, config.fold,
                                       use_h0=has_initial_state, use_final_grad=has_final_grad)
    return dict(state=state, own=own, dstate=dstate, chain=chain)


def _segmented_state_passes(r, tables, initial_state, dht, do, *, h, hv, kd, vd, n_chunks,
                            tokens, opts, config, work):
    """The backward's two state passes over segments (kda_jax.triton.state_chain):
    the forward chain's maps and fold give each segment's start state for the
    state pass; a reverse pass from zero per segment, the transposed fold and
    a second reverse pass give the cotangents. ``r``: the recompute's outputs.
    Returns the outputs of the two passes as :func:`core_backward` uses them
    (``dh0`` per sequence, in the state layout, or a stand-in)."""
    f32 = jnp.float32
    sds = jax.ShapeDtypeStruct
    h0 = state_chain.k_first(initial_state, opts.state_v_first)
    ht_bar = state_chain.k_first(dht, opts.state_v_first)
    L = segmented_backward_launches(h=h, hv=hv, kd=kd, vd=vd, opts=opts, config=config,
                                    work=work, has_initial_state=h0 is not None,
                                    has_final_grad=ht_bar is not None)
    state_l, own_l, dstate_l, chain = L["state"], L["own"], L["dstate"], L["chain"]
    meta = state_chain.segment_meta(tables)
    e, m = state_chain.segment_maps(chain, tables, meta, r["w"], r["u"], r["kt"], r["gl"],
                                    n_tokens=tokens, n_chunk_rows=n_chunks)
    starts = state_chain.fold_states(chain.fold, tables, meta, e, m, h0)
    n_seg = tables.plan.num_segments
    by_seg = dict(**meta, n_tokens=tokens, n_chunk_rows=n_chunks)
    grid = (n_seg, hv, -(-vd // state_l.constexprs["BV"]))
    tv = sds((tokens, hv, vd), work)
    chunk_states = sds((n_chunks, hv, kd, vd), chunk_state_dtype(config, work))
    seg_states = sds((n_seg, hv, kd, vd), f32)
    state = launch_kernel(
        state_l, inputs=dict(w=r["w"], u=r["u"], kt=r["kt"], gl=r["gl"], h0=starts, **by_seg),
        outputs=dict(h=chunk_states, vn=tv), grid=grid, name="kda_bwd_state_seg")
    rev = dict(qg=r["qg"], kt=r["kt"], w=r["w"], aqk=r["aqk"], gl=r["gl"], do=do, **by_seg)
    stand = sds((4,), f32)
    own = launch_kernel(own_l, inputs=dict(rev, dht=stand_in()),
                        outputs=dict(dh=stand, dvn=sds((4,), work), dh0=seg_states), grid=grid,
                        name="kda_bwd_dstate_own")
    ends = state_chain.fold_states(chain.fold_reverse, tables, meta, own["dh0"], m, ht_bar)
    dstate = launch_kernel(dstate_l, inputs=dict(rev, dht=ends),
                           outputs=dict(dh=chunk_states, dvn=tv, dh0=seg_states), grid=grid,
                           name="kda_bwd_dstate_seg")
    if initial_state is None:
        return state, dict(dstate, dh0=stand_in())
    dh0 = state_chain.per_sequence(dstate["dh0"], tables.first_segment, ht_bar)
    return state, dict(dstate, dh0=state_chain.k_first(dh0, opts.state_v_first))


def _transform(opts: KdaOptions):
    """The input handling of the forward kernels as one function of the raw
    (q, k, v, g, beta, A_log, dt_bias): non-finite entries zeroed
    (:func:`kda_jax.transforms.sanitize`), the enabled transforms, and the
    log-decay floor. Returns (q, k, v, g, beta, poison, q_bad); inputs without
    a transform keep their dtype."""

    def fn(q, k, v, g, beta, A_log, dt_bias):
        q, k, v, g, beta, poison, q_bad = transforms.sanitize(
            q, k, v, g, beta, use_gate_in_kernel=opts.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel)
        if opts.use_qk_l2norm_in_kernel:
            q, k = transforms.l2norm(q), transforms.l2norm(k)
        if opts.use_gate_in_kernel:
            g = transforms.log_decay(transforms.gate(g, A_log, dt_bias, opts.lower_bound))
        else:
            g = transforms.log_decay(g).astype(g.dtype)
        if opts.use_beta_sigmoid_in_kernel or opts.allow_neg_eigval:
            beta = transforms.beta_transform(beta, opts.use_beta_sigmoid_in_kernel,
                                             opts.allow_neg_eigval)
        return q, k, v, g, beta, poison, q_bad

    return fn


def _poisoned(poison, q_bad, bounds: SeqBounds):
    """What the forward made NaN, from the per-token flags ``[T, HV]``: the
    rows (``[T, HV]``: from a poisoning token to its sequence's end, and
    rows whose q was non-finite) and the final states (``[N, HV]``)."""
    cu = np.asarray(bounds.cu_seqlens, dtype=np.int64)
    start = np.repeat(cu[:-1], np.diff(cu))  # each token's sequence start
    seen = jnp.concatenate([jnp.zeros((1, poison.shape[1]), jnp.int32),
                            jnp.cumsum(poison.astype(jnp.int32), axis=0)])
    rows = (seen[1:] - seen[start] > 0) | q_bad
    return rows, seen[cu[1:]] - seen[cu[:-1]] > 0


# The layouts of the kernel-level functions (kda_jax.triton.batching): the
# forward's (q, k, v, g, beta, initial_state, A_log, dt_bias, bounds) -> (o,
# final), and core_backward's packed tokens (q, k, v, g, beta, initial_state,
# do, dht, bounds) -> (dq, dk, dv, dg, dbeta, dh0).
FORWARD_INPUTS = (ROWS,) * 5 + (STATE, HEAD_PARAM, HEAD_PARAM, BOUNDS)
FORWARD_OUTPUTS = (ROWS, STATE)
BACKWARD_INPUTS = (PACKED,) * 5 + (STATE, PACKED, STATE, BOUNDS)
BACKWARD_OUTPUTS = (PACKED,) * 5 + (STATE,)


def _forward(q, k, v, g, beta, initial_state, A_log, dt_bias, opts, bounds, config, segments,
             store_flags: bool = False):
    """The forward's launches: partitioned under a sharded jit
    (:mod:`kda_jax.triton.partitioning`), one launch for the mapped batch
    under jax.vmap (:mod:`kda_jax.triton.batching`). Returns (o, final), and
    with ``store_flags`` the non-finite flags int8 ``[B, T, HV]`` third."""
    def run(q, k, v, g, beta, initial_state, A_log, dt_bias, bounds):
        return chunk_kda_triton(q, k, v, g, beta, initial_state, A_log, dt_bias, opts=opts,
                                bounds=bounds, config=config, segments=segments,
                                store_flags=store_flags)

    outs, roles = ("o", "state"), FORWARD_OUTPUTS
    if store_flags:
        outs, roles = outs + ("flags",), roles + (ROWS,)
    run = foldable(partitioned(run, CALL[:9], outs), FORWARD_INPUTS, roles)
    return run(q, k, v, g, beta, initial_state, A_log, dt_bias, bounds)


def _backward_kernels(q, k, v, g, beta, initial_state, do, dht, opts, bounds, config, segments):
    """:func:`core_backward`; under jax.vmap one launch per kernel for the mapped batch."""
    def run(q, k, v, g, beta, initial_state, do, dht, bounds):
        return core_backward(q, k, v, g, beta, initial_state, do, dht, opts=opts,
                             bounds=bounds, config=config, segments=segments)

    run = foldable(run, BACKWARD_INPUTS, BACKWARD_OUTPUTS)
    return run(q, k, v, g, beta, initial_state, do, dht, bounds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _chunk_kda(q, k, v, g, beta, initial_state, A_log, dt_bias, opts, bounds, config,
               bwd_config, segments):
    return _forward(q, k, v, g, beta, initial_state, A_log, dt_bias, opts, bounds, config,
                    segments)


def _fwd(q, k, v, g, beta, initial_state, A_log, dt_bias, opts, bounds, config, bwd_config,
         segments):
    # nonfinite_flags="forward": XLA computes the flags from the inputs;
    # "prepare": the prepare kernel writes them as it reads the inputs (no
    # pass of its own over them), where it can (flags_in_prepare).
    keep = bwd_config.nonfinite_flags in ("forward", "prepare")
    store_flags = (bwd_config.nonfinite_flags == "prepare"
                   and flags_in_prepare(config, q.dtype, q.shape[-1]))
    out = _forward(q, k, v, g, beta, initial_state, A_log, dt_bias, opts, bounds, config,
                   segments, store_flags=store_flags)
    flags = None
    if store_flags:
        *out, flags = out
        out = tuple(out)
    elif keep:
        poison, q_bad = transforms.nonfinite_flags(
            q, k, v, g, beta, use_gate_in_kernel=opts.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel)
        flags = (poison.astype(jnp.int8) * _POISON) | (q_bad.astype(jnp.int8) * _Q_BAD)
    return out, (q, k, v, g, beta, initial_state, A_log, dt_bias, flags)


# The non-finite flags kept by the forward (BackwardConfig.nonfinite_flags "forward", "prepare"):
# one int8 per token and value head, as the prepare kernel packs them
# (kernels/chunk_fwd.py, STORE_FLAGS).
_POISON, _Q_BAD = 1, 2


def _bwd(opts, bounds, config, bwd_config, segments, residuals, cotangents):
    # Partitioned under a sharded jit; under jax.vmap (which has no rule for
    # a custom_partitioning) the plain gradients, whose kernel part folds the
    # mapped axis into one launch.
    run = lambda *args: _grads(*args[:8], *args[9:], opts=opts, bounds=args[8],
                               bwd_config=bwd_config, segments=segments)
    step = unpartitioned_under_vmap(partitioned(run, GRAD_CALL, GRADS, summed=PARAMS), run)
    *inputs, flags = residuals
    return step(*inputs, bounds, *cotangents, flags)


def _grads(q, k, v, g, beta, initial_state, A_log, dt_bias, do, dht, flags=None, *,
           opts: KdaOptions, bounds: SeqBounds, bwd_config: BackwardConfig,
           segments: configs.SegmentConfig | None = None):
    """The gradients of q, k, v, g, beta, initial_state, A_log, dt_bias (None
    for an absent one) from the raw inputs and the cotangents ``do`` and
    ``dht`` (None without a final state). ``flags``: the forward's packed
    non-finite flags ``[B, T, HV]`` int8, or None (computed here, with the
    transforms)."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    tokens = b * t
    flat = lambda x: x.reshape((tokens,) + x.shape[2:])

    (tq, tk, tv, tg, tb, poison, q_bad), transform_vjp = _vjp_with_flags(
        opts, flat(q), flat(k), flat(v), flat(g), flat(beta), A_log, dt_bias,
        recompute=bwd_config.transform_residuals == "recompute" and _transforms_on(opts))
    if flags is not None:  # the transforms' own flags then go unused (and unbuilt)
        flags = flat(flags)
        poison, q_bad = (flags & _POISON) != 0, (flags & _Q_BAD) != 0
    # The forward's NaN outputs and states are constants: no cotangent
    # reaches the clean computation through them.
    rows, finals = _poisoned(poison, q_bad, bounds)
    do = jnp.where(rows[..., None], jnp.zeros((), do.dtype), flat(do))
    if dht is not None:
        state_axes = (slice(None), slice(None), None, None)
        dht = jnp.where(finals[state_axes], jnp.zeros((), dht.dtype), dht)
    kq, kk = _kernel_qk(tq, tk, q.dtype, k.dtype, opts, bwd_config)
    dq, dk, dv, dg, dbeta, dh0 = _backward_kernels(kq, kk, tv, tg, tb, initial_state, do, dht,
                                                   opts, bounds, bwd_config, segments)
    # A value head's q/k gradient belongs to its group's q/k head.
    group = lambda x: x.reshape(tokens, h, hv // h, kd).sum(axis=2)
    dq, dk = group(dq), group(dk)
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias = transform_vjp(
        (dq.astype(tq.dtype), dk.astype(tk.dtype), dv.astype(tv.dtype), dg.astype(tg.dtype),
         dbeta.astype(tb.dtype)))
    unflat = lambda x, like: x.reshape(like.shape).astype(like.dtype)
    grads = (unflat(dq, q), unflat(dk, k), unflat(dv, v), unflat(dg, g), unflat(dbeta, beta),
             None if initial_state is None else dh0.astype(initial_state.dtype),
             None if A_log is None else dA_log.astype(A_log.dtype),
             None if dt_bias is None else ddt_bias.astype(dt_bias.dtype))
    return grads


_chunk_kda.defvjp(_fwd, _bwd)


def _kernel_qk(q, k, q_dtype, k_dtype, opts: KdaOptions, config: BackwardConfig):
    """The (transformed) q, k the backward's kernels take, in
    :func:`kernel_qk_dtype` of the caller's dtypes: the in-kernel
    L2-normalized ones are float32, each rounded to its caller's 16-bit dtype
    where ``config.normalized_qk`` is "input" (then the intermediates are
    16-bit)."""
    return (q.astype(kernel_qk_dtype(q_dtype, opts, config)),
            k.astype(kernel_qk_dtype(k_dtype, opts, config)))


def _transforms_on(opts: KdaOptions) -> bool:
    """Whether an input transform beyond the non-finite zeroing runs in the kernels."""
    return (opts.use_qk_l2norm_in_kernel or opts.use_gate_in_kernel
            or opts.use_beta_sigmoid_in_kernel or opts.allow_neg_eigval)


def _vjp_with_flags(opts, q, k, v, g, beta, A_log, dt_bias, *, recompute: bool = False):
    """jax.vjp of :func:`_transform`, the boolean flags as auxiliary outputs.
    ``recompute``: the vjp keeps the raw inputs only and recomputes the
    transforms in its pass (BackwardConfig.transform_residuals): XLA keeps a
    transcendental with several consumers as an array, so autodiff's own
    residuals cross the backward's kernels through memory."""
    fn = _transform(opts)

    def split(*args):
        *values, poison, q_bad = fn(*args)
        return tuple(values), (poison, q_bad)

    if recompute:
        split = jax.checkpoint(split)

    values, vjp, (poison, q_bad) = jax.vjp(split, q, k, v, g, beta, A_log, dt_bias,
                                           has_aux=True)
    return (*values, poison, q_bad), vjp


def chunk_kda_triton_grad(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                          opts: KdaOptions, bounds: SeqBounds, config: ForwardConfig,
                          bwd_config: BackwardConfig | None = None,
                          segments: configs.SegmentConfig | None = None):
    """:func:`kda_jax.triton.forward.chunk_kda_triton` made differentiable
    (same arguments and result), with gradients for q, k, v, g, beta,
    initial_state, A_log and dt_bias. ``bwd_config`` defaults to the current
    arch's :func:`kda_jax.configs.backward_config` (read at trace time);
    ``segments``: the rule that may run the state passes over segments
    (:mod:`kda_jax.triton.state_chain`), None: never."""
    if bwd_config is None:
        bwd_config = configs.backward_config()
    return _chunk_kda(q, k, v, g, beta, initial_state, A_log, dt_bias, opts, bounds, config,
                      bwd_config, segments)
