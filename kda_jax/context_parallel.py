"""Context parallelism: chunk_kda over tokens split across the devices of a mesh axis.

Inside ``jax.shard_map`` each device of the axis holds a contiguous ``1/n`` of
every row's tokens (``[B, T / n, ...]``; with ``cu_seqlens`` the global host
bounds of the packed ``[1, T, ...]`` tokens). Sequences may cross device
boundaries. Per device (docs/kda.md section 7):

1. its pieces of the sequences (:func:`kda_jax.segments.context_plan`, host
   data per device; ``lax.switch`` on the axis index picks the device's static
   plan) run as one augmented call (:func:`kda_jax.segmented.augmented_run`):
   a piece that starts its sequence from the sequence's initial state, the
   piece entering from the previous device from the identity, so its outputs
   and end state are affine in the state handed over;
2. the maps ``(E, M)`` of the pieces leaving to the next device are gathered
   over the axis (``all_gather``, one ``[K, V + K]`` map per row and head per
   device) and every device folds the earlier devices' maps in float32
   (``n - 1`` steps), which gives the state entering it;
3. it corrects its entering piece's outputs by ``P @ S_in``; final states
   are completed on the device holding each sequence's last token and summed
   over the axis (``psum``), so every device returns all of them.

Gradients are autodiff through the collectives and the backend's call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import vma
from kda_jax.batch import VarlenBatch
from kda_jax.options import KdaOptions
from kda_jax.segmented import apply_map, augmented_run, augmented_states
from kda_jax.segments import context_plan

__all__ = ["axis_devices", "check_call", "chunk_kda_context"]


def axis_devices(axis, cu_seqlens=None) -> int:
    """The number of devices on mesh axis ``axis`` (1 for None); raises when
    the call is not inside a ``jax.shard_map`` binding that axis, or with a
    VarlenBatch (checked first: the bounds' checks assume global host bounds)."""
    if axis is None:
        return 1
    if not isinstance(axis, str):
        raise TypeError(f"context_axis must be a mesh axis name (a str) or None, got {axis!r}")
    if isinstance(cu_seqlens, VarlenBatch):
        raise ValueError(
            "context_axis with a VarlenBatch as cu_seqlens is not supported; pass the "
            "global host bounds (a SeqBounds, NumPy array or list)")
    try:
        return int(jax.lax.axis_size(axis))
    except NameError:
        raise ValueError(
            f"context_axis={axis!r} is not a mesh axis bound here: call chunk_kda inside "
            f"jax.shard_map over a mesh with an axis {axis!r}, with T split over it (e.g. "
            f"in_specs=P(None, {axis!r}) for q, k, v, g, beta and P() for initial_state)"
        ) from None


def check_call(backend: str, q, v, max_head_dim: int, axis: str):
    """What context parallelism does not serve (beyond :func:`axis_devices`'
    checks), as errors naming the fix. Under shard_map's vma checks q must vary
    over ``axis``: otherwise its in_spec does not split T (k, v, g, beta split
    while q is not would have failed the shape checks)."""
    if vma.checked() and axis not in vma.axes_of(q):
        raise ValueError(
            f"context_axis={axis!r}: q is the same on every device of the axis (its in_spec "
            f"does not split it over {axis!r}); split T: in_specs=P(None, {axis!r}) for q, "
            "k, v, g, beta")
    kd, vd = q.shape[-1], v.shape[-1]
    if backend == "triton" and kd + vd > max_head_dim:
        raise ValueError(
            f"context_axis on the Triton path runs V + K columns, at most {max_head_dim}, "
            f"got K={kd}, V={vd}; use implementation='xla'")


def _take(x, index, fill=0):
    index = np.where(np.asarray(index) < 0, x.shape[0], index)
    return jnp.take(x, jnp.asarray(index), axis=0, mode="fill", fill_value=fill)


def chunk_kda_context(core, q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                      opts: KdaOptions, bounds, rows: int, axis: str, devices: int):
    """The context-parallel chunk_kda of one device (inside shard_map).

    q, k ``[B, L, H, K]``, v ``[B, L, HV, V]``, g, beta: this device's
    tokens; ``bounds`` the global host bounds over ``B * L * devices`` tokens
    (B rows of ``L * devices``); initial_state ``[N, HV, K, V]`` (or V-first)
    the same on every device. Returns ``(o [B, L, HV, V], final | None)``,
    the final states of all N sequences on every device.
    """
    b, t, _, kd = q.shape
    hv, vd = v.shape[-2:]
    f32 = jnp.float32
    n = bounds.num_seqs
    h_seq = jnp.zeros((n, hv, kd, vd), f32)
    if initial_state is not None:
        h_seq = initial_state.astype(f32)
        if opts.state_v_first:
            h_seq = jnp.swapaxes(h_seq, -1, -2)
    finish = lambda s: jnp.swapaxes(s, -1, -2) if opts.state_v_first else s
    if t == 0:  # no token anywhere: every sequence is empty
        o = jnp.zeros((b, t, hv, vd), q.dtype)
        return o, (finish(h_seq) if opts.output_final_state else None)

    plans = context_plan(bounds, rows, devices)
    flat = lambda x: x.reshape((1, b * t) + x.shape[2:])

    def branch(plan):
        def run(q, k, v, g, beta, h_seq, A_log, dt_bias):
            h_left = jnp.where(jnp.asarray(plan.starts)[:, None, None, None],
                               _take(h_seq, plan.seq), 0.0)
            h_aug = augmented_states(h_left, plan.entering, kd)
            o0, o_bad, P, E, M, bad = augmented_run(
                core, flat(q), flat(k), flat(v), flat(g), flat(beta), h_aug, A_log, dt_bias,
                opts=opts, bounds=plan.bounds)
            shape = lambda x: x.reshape((b, t) + x.shape[2:])
            lane = (_take(E, plan.leaving), _take(M, plan.leaving),
                    _take(bad, plan.leaving, False))
            fin = (_take(E, plan.final_piece), _take(M, plan.final_piece),
                   _take(bad, plan.final_piece, False))
            return (shape(o0), shape(o_bad), shape(P)) + lane + fin
        return run

    index = jax.lax.axis_index(axis)
    # Every operand varies over the axis before the switch: an operand the
    # same on every device (initial_state, A_log, dt_bias) would be cast to
    # varying inside the branches, and that cast's transpose, a psum, would
    # then run inside the branch each device picks for itself (kda_jax.vma).
    operands = vma.like((q, k, v, g, beta, h_seq, A_log, dt_bias), index)
    o0, o_bad, P, lane_E, lane_M, lane_bad, fin_E, fin_M, fin_bad = jax.lax.switch(
        index, [branch(p) for p in plans], *operands)

    # Host tables of all devices, indexed by the axis index.
    # uses[d, r]: device d's leaving piece of row r entered it (its map reads
    # the state handed over); entering_len[d, r]: tokens of row r's entering piece.
    uses = np.zeros((devices, b), bool)
    entering_len = np.zeros((devices, b), np.int64)
    for d, p in enumerate(plans):
        lengths, row_of = p.bounds.lengths, p.lane[p.seq]
        for i in np.flatnonzero(p.entering).tolist():
            entering_len[d, row_of[i]] = lengths[i]
        ok = p.leaving >= 0
        uses[d, ok] = p.entering[p.leaving[ok]]

    # The state entering each device, per row: a float32 fold of the earlier
    # devices' maps (every device computes all n - 1 steps; n is small).
    maps = [jax.lax.all_gather(x, axis) for x in (lane_E, lane_M, lane_bad)]
    S = jnp.zeros((b, hv, kd, vd), f32)
    S_bad = jnp.zeros((b, hv, vd), bool)
    entering_state = [(S, S_bad)]
    for d in range(devices - 1):
        E_d, M_d, bad_d = (m[d] for m in maps)
        S_next, bad_next = apply_map(E_d, M_d, bad_d, S, S_bad)
        use = jnp.asarray(uses[d])
        S = jnp.where(use[:, None, None, None], S_next, E_d)
        S_bad = jnp.where(use[:, None, None], bad_next, bad_d)
        entering_state.append((S, S_bad))
    S_in = jnp.stack([s for s, _ in entering_state])[index]  # [B, HV, K, V]
    S_in_bad = jnp.stack([f for _, f in entering_state])[index]  # [B, HV, V]

    o = o0 + jnp.einsum("blhk,bhkv->blhv", P, S_in, precision=jax.lax.Precision.HIGHEST)
    entering = jnp.arange(t)[None, :] < jnp.asarray(entering_len)[index][:, None]  # [B, L]
    o_bad = o_bad | (entering[..., None, None] & S_in_bad[:, None])
    o = jnp.where(o_bad, jnp.nan, o).astype(q.dtype)
    if not opts.output_final_state:
        return o, None

    owns = np.stack([p.owns for p in plans])  # [devices, N]
    # reads[d, n]: sequence n ends in device d's entering piece (its final
    # state reads the state handed over).
    reads = np.stack([(p.final_piece >= 0) & p.entering[np.maximum(p.final_piece, 0)]
                      for p in plans])  # [devices, N]
    has_piece = np.stack([p.final_piece >= 0 for p in plans])
    lane_of = plans[0].lane
    S_seq, S_seq_bad = S_in[lane_of], S_in_bad[lane_of]  # [N, ...]
    value, value_bad = apply_map(fin_E, fin_M, fin_bad, S_seq, S_seq_bad)
    read = jnp.asarray(reads)[index][:, None, None]
    value = jnp.where(read[..., None], value, fin_E)
    value_bad = jnp.where(read, value_bad, fin_bad)
    piece = jnp.asarray(has_piece)[index][:, None, None, None]
    value = jnp.where(piece, value, h_seq)  # an empty sequence keeps its initial state
    value = jnp.where((value_bad & piece[..., 0])[..., None, :], jnp.nan, value)
    mine = jnp.asarray(owns)[index][:, None, None, None]
    final = jax.lax.psum(jnp.where(mine, value, 0.0), axis)
    return o, finish(final)
