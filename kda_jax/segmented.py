"""The segment maps composed around any backend (docs/kda.md section 7): the
XLA path's segmented schedule and the algebra of context parallelism. (The
Triton path segments its state passes itself: kda_jax.triton.state_chain.)

KDA is linear in (v, the initial state) jointly for fixed q, k, g and beta.
A stretch of a sequence run with values ``[v | 0_K]`` from the state
``[h | I_K]`` (``V + K`` columns) gives outputs ``[o0 | P]`` and the final
state ``[E | M]``, where for any start state ``S``

    o(S) = o0 + P @ S       (P ``[T, K]`` per head: the outputs' dependence on S)
    S_end(S) = E + M @ S    (E ``[K, V]``, M ``[K, K]``: the stretch's affine map)

and ``o0``, ``E`` are those from ``h``. So one call of any backend over all
stretches at once (each stretch a sequence of finer bounds) gives every
stretch's map in parallel; a float32 fold of the maps gives each stretch's true
start state, and one batched product corrects its outputs. Gradients are
autodiff of this composition (the Triton call is differentiable).

Non-finite inputs: a stretch whose outputs or map hold a NaN or an infinity
(the backends poison a sequence from a bad token on) is carried as flags, and
its values as zeros, through the fold and the correction; the flags put NaN
on exactly the outputs and states the unsegmented call makes NaN, as selects,
so no cotangent meets a NaN (the contract of docs/kda.md section 6). Flags are
per value column: a bad token poisons every column of its head (M and P are
bad), a non-finite initial state only its own columns (E and o0 are).

This module: the augmented call, the map algebra, and the within-device
schedule (:func:`chunk_segmented`, on a :class:`kda_jax.segments.SegmentPlan`).
:mod:`kda_jax.context_parallel` folds the same maps across devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import configs
from kda_jax.bounds import SeqBounds
from kda_jax.options import KdaOptions
from kda_jax.segments import SegmentPlan, segment_chunks, segment_plan

__all__ = ["augmented_run", "apply_map", "compose", "chunk_segmented", "plan_call"]

_HI = jax.lax.Precision.HIGHEST


def augmented_run(core, q, k, v, g, beta, h_aug, A_log, dt_bias, *, opts: KdaOptions, bounds):
    """One backend call over ``bounds`` with values ``[v | 0_K]`` from the
    states ``h_aug`` float32 ``[N, HV, K, V + K]`` (K-first).

    ``core(q, k, v, g, beta, initial_state, A_log, dt_bias, *, opts, bounds)``
    is a backend's chunk_kda. Returns ``(o0, o0_bad, P, E, M, map_bad)``:
    o0 ``[B, T, HV, V]`` float32, P ``[B, T, HV, K]`` float32, o0_bad bool
    ``[B, T, HV, V]``; E ``[N, HV, K, V]``, M ``[N, HV, K, K]`` float32,
    map_bad bool ``[N, HV, V]``: per value column, set on every column of a
    row of P or a map M that is not finite; the values are zeros where bad.
    """
    kd, vd = q.shape[-1], v.shape[-1]
    v_aug = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (kd,), v.dtype)], axis=-1)
    run_opts = dataclasses.replace(opts, output_final_state=True, state_v_first=False)
    o, final = core(q, k, v_aug, g, beta, h_aug, A_log, dt_bias, opts=run_opts, bounds=bounds)
    o = o.astype(jnp.float32)
    o0, P, E, M = o[..., :vd], o[..., vd:], final[..., :vd], final[..., vd:]
    p_bad = jnp.any(~jnp.isfinite(P), axis=-1)  # [B, T, HV]
    m_bad = jnp.any(~jnp.isfinite(M), axis=(-2, -1))  # [N, HV]
    o_bad = ~jnp.isfinite(o0) | p_bad[..., None]
    map_bad = jnp.any(~jnp.isfinite(E), axis=-2) | m_bad[..., None]
    zero = jnp.zeros((), jnp.float32)
    return (jnp.where(o_bad, zero, o0), o_bad, jnp.where(p_bad[..., None], zero, P),
            jnp.where(map_bad[..., None, :], zero, E), jnp.where(m_bad[..., None, None], zero, M),
            map_bad)


def augmented_states(h_left, identity, kd: int):
    """``[h_left | identity * I_K]`` float32 ``[N, HV, K, V + K]``: h_left
    ``[N, HV, K, V]`` (or zeros), identity bool ``[N]`` (NumPy or jax)."""
    eye = jnp.eye(kd, dtype=jnp.float32)
    right = jnp.where(jnp.asarray(identity)[:, None, None, None], eye, 0.0)
    right = jnp.broadcast_to(right, h_left.shape[:2] + (kd, kd))
    return jnp.concatenate([h_left.astype(jnp.float32), right], axis=-1)


def apply_map(E, M, bad, S, S_bad):
    """``E + M @ S`` with per-column flags (``[..., V]``: M mixes the rows of
    S, never its columns): values zero where flagged, flag = either's."""
    out = E + jnp.matmul(M, S, precision=_HI)
    flag = bad | S_bad
    return jnp.where(flag[..., None, :], 0.0, out), flag


def compose(earlier, later):
    """The map ``later ∘ earlier`` of two (M, E, bad) maps (broadcasting over
    leading axes): ``S -> E2 + M2 (E1 + M1 S)``. Associative."""
    M1, E1, b1 = earlier
    M2, E2, b2 = later
    return (jnp.matmul(M2, M1, precision=_HI), E2 + jnp.matmul(M2, E1, precision=_HI),
            b1 | b2)


def plan_call(backend: str, bounds, pool, opts: KdaOptions, hv: int) -> SegmentPlan | None:
    """The segment plan of an XLA-path chunk_kda call (the rule of
    :func:`kda_jax.segments.segment_chunks` with the current
    :class:`kda_jax.configs.SegmentConfig`, when its ``xla`` is set), or None:
    the call runs as one pass. Host bounds only (the serving forms, a pool or
    a VarlenBatch, stay one pass). The Triton path segments its state passes
    itself (:mod:`kda_jax.triton.state_chain`)."""
    if backend != "xla" or pool is not None or not isinstance(bounds, SeqBounds):
        return None
    cfg = configs.segment_config()
    if not cfg.xla:
        return None
    per = segment_chunks(
        bounds, opts.chunk_size, hv=hv, programs_per_seq_head=1,
        min_programs=cfg.forward.min_programs, target_programs=cfg.forward.target_programs,
        min_segment_chunks=cfg.forward.min_segment_chunks, min_segments=cfg.min_segments,
        forced_segment_chunks=cfg.segment_chunks)
    return None if per is None else segment_plan(bounds, opts.chunk_size, per)


def _take(x, index, fill=0):
    """x[index] along axis 0 with host indices; -1 (none) and past-the-end
    entries read ``fill``."""
    index = np.where(np.asarray(index) < 0, x.shape[0], index)
    return jnp.take(x, jnp.asarray(index), axis=0, mode="fill", fill_value=fill)


def chunk_segmented(core, q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                    opts: KdaOptions, plan: SegmentPlan):
    """chunk_kda on ``plan.bounds`` (over the flattened ``B * T`` tokens) run
    as ``plan``'s segments: one augmented call of ``core`` over all segments
    (a segment that starts its sequence runs from its initial state, the
    others from the identity), a float32 fold of the maps per sequence (an
    associative scan over its segments), the outputs corrected by
    ``P @ S_start``. Same arguments and result as the backends' chunk_kda.
    """
    b, t, _, kd = q.shape
    hv, vd = v.shape[-2:]
    f32 = jnp.float32
    flat = lambda x: x.reshape((1, b * t) + x.shape[2:])
    n = plan.bounds.num_seqs

    h_seq = jnp.zeros((n, hv, kd, vd), f32)  # [N, HV, K, V]: each sequence's initial state
    if initial_state is not None:
        h_seq = initial_state.astype(f32)
        if opts.state_v_first:
            h_seq = jnp.swapaxes(h_seq, -1, -2)
    first = jnp.asarray(plan.first)
    h_left = jnp.where(first[:, None, None, None], _take(h_seq, plan.seq), 0.0)
    h_aug = augmented_states(h_left, ~plan.first, kd)

    o0, o_bad, P, E, M, bad = augmented_run(
        core, flat(q), flat(k), flat(v), flat(g), flat(beta), h_aug, A_log, dt_bias,
        opts=opts, bounds=plan.segments)
    o0, o_bad, P = o0[0], o_bad[0], P[0]  # [T, HV, ...]

    # The fold: per lane (a sequence of >= 2 segments), the inclusive scan of
    # its maps; padding steps are the identity. A first segment's map has
    # M = 0, so the scan's E is each segment's end state.
    eye = jnp.broadcast_to(jnp.eye(kd, dtype=f32), (1, hv, kd, kd))
    M_ext = jnp.concatenate([M, eye], axis=0)
    E_ext = jnp.concatenate([E, jnp.zeros((1, hv, kd, vd), f32)], axis=0)
    bad_ext = jnp.concatenate([bad, jnp.zeros((1, hv, vd), bool)], axis=0)
    lanes, steps = plan.fold.shape
    fold = jnp.asarray(plan.fold)
    maps = (M_ext[fold], E_ext[fold], bad_ext[fold])  # [L, steps, HV, ...]
    _, S_end, S_bad = jax.lax.associative_scan(compose, maps, axis=1)
    S_end = S_end.reshape((lanes * steps, hv, kd, vd))
    S_bad = S_bad.reshape((lanes * steps, hv, vd))

    # Outputs of the segments that start from a folded state: o0 + P @ S_start.
    c, rows = plan.corr_index.shape
    o = o0
    row_bad = o_bad
    if c:
        S_in = _take(S_end, plan.corr_start)  # [C, HV, K, V]
        in_bad = _take(S_bad, plan.corr_start, False)  # [C, HV, V]
        P_slots = _take(P, plan.corr_index.reshape(-1)).reshape((c, rows, hv, kd))
        corr = jnp.einsum("crhk,chkv->crhv", P_slots, S_in, precision=_HI)
        o = o + _take(corr.reshape((c * rows, hv, vd)), plan.corr_slot)
        in_bad = jnp.broadcast_to(in_bad[:, None], (c, rows, hv, vd)).reshape((c * rows, hv, vd))
        row_bad = row_bad | _take(in_bad, plan.corr_slot, False)
    o = jnp.where(row_bad, jnp.nan, o).astype(q.dtype).reshape((b, t, hv, vd))
    if not opts.output_final_state:
        return o, None

    lane_last = S_end.reshape((lanes, steps, hv, kd, vd))[:, -1]
    lane_bad = S_bad.reshape((lanes, steps, hv, vd))[:, -1]
    from_lane = jnp.asarray(plan.final_lane >= 0)[:, None, None]
    from_seg = jnp.asarray(plan.final_segment >= 0)[:, None, None]
    final = jnp.where(from_lane[..., None], _take(lane_last, plan.final_lane),
                      jnp.where(from_seg[..., None], _take(E, plan.final_segment), h_seq))
    final_bad = jnp.where(from_lane, _take(lane_bad, plan.final_lane, False),
                          from_seg & _take(bad, plan.final_segment, False))
    final = jnp.where(final_bad[..., None, :], jnp.nan, final)
    if opts.state_v_first:
        final = jnp.swapaxes(final, -1, -2)
    return o, final
