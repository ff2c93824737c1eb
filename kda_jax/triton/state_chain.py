"""The segmented state chain of the Triton path (docs/kda.md section 7).

Long sequences with few heads leave the state passes (one program per
sequence, value head and V block, walking every chunk in order) with too few
programs for the GPU. When the rule of :func:`kda_jax.segments.segment_chunks`
says so, sequences are cut into segments of whole chunks, and each state pass
runs per segment from the state the segment starts from:

1. the map kernel gives every segment's (E, M) at once (its end state from
   a zero start and its [K, K] transition),
2. the fold kernel walks each sequence's segments and writes the state each
   starts from (a float32 product per segment),
3. the state pass runs over the segments (the segments' bounds and chunk
   offsets in place of the sequences'), every segment's program in parallel.

The backward runs its forward state pass the same way, and its reverse pass
(the state's cotangent, carried from the end) with the transposed fold: a
first reverse pass from zero per segment gives each segment's own
contribution, the fold carries the cotangents across segments, and a second
reverse pass runs from them.

Host bounds only, K <= 128, and the state held whole in K (a call whose
state pass splits K in halves, float32 intermediates from K = 128 on, runs
unsegmented).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import configs
from kda_jax.bounds import SeqBounds, next_pow2
from kda_jax.segments import SegmentTables, segment_chunks, segment_plan, segment_tables
from kda_jax.triton.launch import KernelLaunch, dot_precision, launch_kernel, stand_in

__all__ = ["ChainLaunches", "chain_tables", "chain_launches", "segment_meta", "k_first",
           "segment_maps", "fold_states", "per_sequence"]

# The fold's states are [K, FOLD_BV] tiles (its M slices and warps: FoldConfig).
FOLD_BV = 32


def chain_tables(bounds, cfg: configs.SegmentConfig, *, chunk_size: int, hv: int, kd: int,
                 vd: int, block_v: int, split_k: bool, backward: bool = False,
                 segment_block_v: int | None = None) -> SegmentTables | None:
    """The segment tables of a call under the rule ``cfg`` (its backward
    rule for ``backward``), or None: it runs unsegmented. ``block_v``:
    the state pass's V block (its programs per sequence and head are
    cdiv(V, block_v)); ``segment_block_v``: the V block of that pass over
    segments, where it differs (None: ``block_v``); ``split_k``: the state
    pass holds the state as two K halves (then no segments). Host bounds
    only."""
    if not isinstance(bounds, SeqBounds) or split_k or next_pow2(max(kd, 16)) > 128:
        return None
    rule = cfg.backward if backward else cfg.forward
    per = segment_chunks(
        bounds, chunk_size, hv=hv, programs_per_seq_head=-(-vd // block_v),
        min_programs=rule.min_programs, target_programs=rule.target_programs,
        min_segment_chunks=rule.min_segment_chunks,
        min_segments=cfg.min_segments, forced_segment_chunks=cfg.segment_chunks,
        segment_programs_per_seq_head=None if segment_block_v is None else -(-vd // segment_block_v))
    if per is None:
        return None
    return segment_tables(segment_plan(bounds, chunk_size, per), chunk_size)


class ChainLaunches(NamedTuple):
    """The map and fold launches of one call (constexprs derived once, in
    :func:`chain_launches`, which the AOT compiles from too)."""

    map: KernelLaunch
    fold: KernelLaunch
    fold_reverse: KernelLaunch


def chain_launches(state: KernelLaunch, map_config: configs.StateConfig,
                   fold_config: configs.FoldConfig, *, use_h0: bool,
                   use_final_grad: bool = False) -> ChainLaunches:
    """Launches for a call whose state pass is ``state`` (the map kernel runs
    over its chunks at ``map_config``: the forward's map config, or the
    backward's state pass config, since that is what its map replaces) and
    the fold at ``fold_config``. ``use_h0``: the forward fold starts from
    initial states; ``use_final_grad``: the reverse fold from final-state
    cotangents."""
    c = state.constexprs
    hv, kd, vd, chunk_size = c["HV"], c["K"], c["V"], c["BT"]
    bk = next_pow2(max(kd, 16))
    map_ = KernelLaunch("kda_segment_map_kernel", dict(
        HV=hv, K=kd, V=vd, BT=chunk_size, BK=bk,
        BV=min(next_pow2(max(vd, 16)), map_config.block_v),
        DOT=dot_precision(map_config.dot)), map_config.warps, map_config.stages)
    fold = dict(HV=hv, K=kd, V=vd, BK=bk, BV=min(next_pow2(max(vd, 16)), FOLD_BV),
                BJ=min(bk, fold_config.block_j), DOT=dot_precision(fold_config.dot))
    return ChainLaunches(
        map_,
        KernelLaunch("kda_segment_fold_kernel", dict(fold, USE_H0=use_h0, REVERSE=False),
                     fold_config.warps, 1),
        KernelLaunch("kda_segment_fold_kernel", dict(fold, USE_H0=use_final_grad, REVERSE=True),
                     fold_config.warps, 1))


def segment_meta(tables: SegmentTables) -> dict:
    """The segments' metadata arguments of a per-sequence kernel: the buffer
    (the call's second int32 constant: make it once per call and pass it to
    every launch) and the offsets of the segments' bounds and chunk offsets."""
    packed = tables.packed
    return dict(meta=jnp.asarray(packed.buffer), off_cu=packed.offset("cu_seqlens"),
                off_co=packed.offset("chunk_offsets"))


def k_first(states, v_first: bool):
    """States float32 and K-first ``[..., K, V]`` from the caller's layout
    (``[..., V, K]`` when ``v_first``), or None; the same swap takes the
    chain's K-first states back."""
    if states is None:
        return None
    states = states.astype(jnp.float32)
    return jnp.swapaxes(states, -1, -2) if v_first else states


def segment_maps(launches: ChainLaunches, tables: SegmentTables, meta: dict, w, u, kt, gl, *,
                 n_tokens: int, n_chunk_rows: int):
    """(E [S, HV, K, V], M [S, HV, K, K]) float32 of every segment, from the
    prepare kernel's w, u, kt ([T, HV, *], the intermediates' dtype) and gl
    [chunks, HV, K]; ``meta``: :func:`segment_meta`'s."""
    c = launches.map.constexprs
    hv, kd, vd, bv = c["HV"], c["K"], c["V"], c["BV"]
    s = tables.plan.num_segments
    sds = jax.ShapeDtypeStruct
    out = launch_kernel(
        launches.map,
        inputs=dict(w=w, u=u, kt=kt, gl=gl, **meta, n_tokens=n_tokens,
                    n_chunk_rows=n_chunk_rows),
        outputs=dict(e=sds((s, hv, kd, vd), jnp.float32), m=sds((s, hv, kd, kd), jnp.float32)),
        grid=(s, hv, -(-vd // bv) + -(-kd // bv)), name="kda_segment_map")
    return out["e"], out["m"]


def fold_states(launch: KernelLaunch, tables: SegmentTables, meta: dict, e, m, start):
    """The state every segment starts from (forward launch) or the cotangent
    of its end state (reverse launch), float32 [S, HV, K, V] K-first, from the
    maps and ``start`` [N, HV, K, V] float32 (each sequence's initial state,
    or its final state's cotangent), or None (zeros). ``meta``:
    :func:`segment_meta`'s (its buffer holds the chains table too)."""
    c = launch.constexprs
    hv, kd, vd = c["HV"], c["K"], c["V"]
    s = tables.plan.num_segments
    packed = tables.packed
    out = launch_kernel(
        launch,
        inputs=dict(e=e, m=m, h0=stand_in() if start is None else start.astype(jnp.float32),
                    meta=meta["meta"], off_chains=packed.offset("chains")),
        outputs=dict(s=jax.ShapeDtypeStruct((s, hv, kd, vd), jnp.float32)),
        grid=(tables.num_chains, hv, -(-vd // c["BV"])), name="kda_segment_fold")
    return out["s"]


def per_sequence(states, index: np.ndarray, fallback):
    """Row ``index[n]`` of ``states`` [S, ...] for each sequence n, and
    ``fallback`` [N, ...] (or zeros when None) where the index is -1 (an empty
    sequence)."""
    index = np.asarray(index)
    picked = jnp.take(states, jnp.asarray(np.maximum(index, 0)), axis=0)
    empty = jnp.asarray(index < 0).reshape((-1,) + (1,) * (states.ndim - 1))
    other = jnp.zeros_like(picked) if fallback is None else fallback.astype(picked.dtype)
    return jnp.where(empty, other, picked)
