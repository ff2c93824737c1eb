"""The portable backend: KDA in jax.numpy (KDA_SPEC section 3), float32 inside.

Both forms take their varlen layout from a host-built :class:`LaneSchedule`:
tokens are gathered into ``[steps, lanes, chunk]`` slots, the chunk-parallel
work is batched over all slots, and one ``lax.scan`` over steps carries a state
per lane. The traced program's size depends on the slot grid, never on the
number of sequences, and it is differentiable by JAX autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import transforms
from kda_jax.bounds import LaneSchedule, SeqBounds, lane_schedule
from kda_jax.options import KdaOptions

__all__ = ["chunk_kda_xla", "fused_recurrent_kda_xla"]

# Sub-block rows for the intra-chunk products: exponents are anchored on the
# first row of each 16-row block so that every exp() sees a value <= 0.
_SUB = 16
_HI = jax.lax.Precision.HIGHEST


class _Tables:
    """Static slices of the schedule's single int32 constant."""

    def __init__(self, schedule: LaneSchedule):
        self._packed = schedule.tables
        self._buffer = jnp.asarray(schedule.tables.buffer)

    def __getitem__(self, name: str) -> jax.Array:
        off, shape = self._packed.offset(name), self._packed.shape(name)
        size = int(np.prod(shape, dtype=np.int64))
        return jax.lax.slice(self._buffer, (off,), (off + size,)).reshape(shape)


def _gather_slots(x, token_index):
    """``[T, ...]`` tokens -> ``[S, L, C, ...]`` slots; padding rows read zeros."""
    s, l, c = token_index.shape
    if x.shape[0] == 0:  # no tokens at all (every sequence empty): all padding
        return jnp.zeros((s, l, c) + x.shape[1:], x.dtype)
    y = jnp.take(x, token_index.reshape(-1), axis=0, mode="fill", fill_value=0)
    return y.reshape((s, l, c) + x.shape[1:])


def _scatter_tokens(y, slot_of_token):
    """``[S, L, C, ...]`` slots -> ``[T, ...]`` tokens (a gather by each token's slot)."""
    flat = y.reshape((-1,) + y.shape[3:])
    return jnp.take(flat, slot_of_token, axis=0, mode="clip")


def _prepare(q, k, v, g, beta, initial_state, A_log, dt_bias, opts: KdaOptions):
    """Transforms, GVA expansion and flattening to ``[B*T, HV, ...]`` float32."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    q, k, g, beta = transforms.prepare_inputs(q, k, g, beta, **opts.transform_flags(A_log, dt_bias))
    q = jnp.repeat(q, hv // h, axis=2)
    k = jnp.repeat(k, hv // h, axis=2)
    flat = lambda x: x.reshape((b * t,) + x.shape[2:])
    h0 = None
    if initial_state is not None:
        h0 = initial_state.astype(jnp.float32)
        if opts.state_v_first:
            h0 = jnp.swapaxes(h0, -1, -2)
    return flat(q), flat(k), flat(v.astype(jnp.float32)), flat(g), flat(beta), h0


def _initial_rows(h0, n, hv, kd, vd):
    """``[N + 1, HV, K, V]``: the initial states plus a zero row for slots with none."""
    zero = jnp.zeros((1, hv, kd, vd), jnp.float32)
    if h0 is None:
        return jnp.zeros((n + 1, hv, kd, vd), jnp.float32)
    return jnp.concatenate([h0, zero], axis=0)


def _finish_state(final, state_v_first):
    return jnp.swapaxes(final, -1, -2) if state_v_first else final


def _decay_products(x, y, G, *, inclusive):
    """``M[i, j] = sum_d x_id y_jd exp(G_id - G_jd)`` for j < i (j <= i if inclusive).

    x, y, G: ``[..., C, K]`` float32 with G non-increasing along C. Blocks of
    16 rows below the diagonal use the block's first row as anchor; diagonal
    blocks take the pairwise differences. Every exponent is <= 0.
    """
    c, kd = G.shape[-2:]
    nb = c // _SUB
    lead = G.shape[:-2]
    blk = lambda a: a.reshape(lead + (nb, _SUB, kd))
    Gb, xb, yb = blk(G), blk(x), blk(y)
    anchor = Gb[..., :, :1, :]  # [..., nb, 1, K]

    # Off-diagonal blocks: column j belongs to a block before row block I.
    rows = np.arange(c)
    before = rows[None, :] < (np.arange(nb) * _SUB)[:, None]  # [nb, C]
    x_row = xb * jnp.exp(Gb - anchor)
    col_exp = jnp.where(before[:, :, None], anchor - G[..., None, :, :], 0.0)
    y_col = y[..., None, :, :] * jnp.where(before[:, :, None], jnp.exp(col_exp), 0.0)
    off = jnp.einsum("...bik,...bjk->...bij", x_row, y_col, precision=_HI)
    off = off.reshape(lead + (c, c))

    # Diagonal blocks, pairwise.
    sub = np.arange(_SUB)
    keep = (sub[None, :] <= sub[:, None]) if inclusive else (sub[None, :] < sub[:, None])
    keep = keep[:, :, None]
    diff = jnp.where(keep, Gb[..., :, None, :] - Gb[..., None, :, :], 0.0)
    decay = jnp.where(keep, jnp.exp(diff), 0.0)
    diag = jnp.einsum("...bid,...bjd,...bijd->...bij", xb, yb, decay, precision=_HI)
    diag = jnp.einsum("...bij,bc->...bicj", diag, np.eye(nb, dtype=np.float32))
    return off + diag.reshape(lead + (c, c))


def chunk_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                  opts: KdaOptions, bounds: SeqBounds):
    """Chunked KDA in jax.numpy. Arguments are already validated by the API.

    ``bounds`` covers the flattened ``B * T`` tokens (B equal sequences when the
    call has no cu_seqlens). Returns ``(o [B, T, HV, V] in q.dtype, final | None)``.
    """
    b, t, _, kd = q.shape
    hv, vd = v.shape[-2:]
    out_dtype = q.dtype
    q, k, v, g, beta, h0 = _prepare(q, k, v, g, beta, initial_state, A_log, dt_bias, opts)
    scale = opts.scale
    sched = lane_schedule(bounds, opts.chunk_size)
    tables = _Tables(sched)
    idx = tables["token_index"]
    steps, lanes, c = idx.shape

    # Slots, heads before rows: [S, L, HV, C, K|V] and beta [S, L, HV, C].
    to_heads = lambda x: jnp.moveaxis(_gather_slots(x, idx), 2, 3)
    q, k, v, g = (to_heads(x) for x in (q, k, v, g))
    beta = jnp.swapaxes(_gather_slots(beta, idx), 2, 3)

    G = jnp.cumsum(g, axis=-2)
    G_last = G[..., -1:, :]
    Akk = _decay_products(k, k, G, inclusive=False) * beta[..., :, None]
    Aqk = _decay_products(q, k, G, inclusive=True) * scale
    eye = jnp.eye(c, dtype=jnp.float32)
    A = jax.scipy.linalg.solve_triangular(
        eye + Akk, jnp.broadcast_to(eye, Akk.shape), lower=True, unit_diagonal=True
    )
    w = jnp.matmul(A, beta[..., None] * k * jnp.exp(G), precision=_HI)
    u = jnp.matmul(A, beta[..., None] * v, precision=_HI)
    k_tail = k * jnp.exp(G_last - G)
    decay_last = jnp.exp(G_last)[..., 0, :, None]  # [S, L, HV, K, 1]

    h_init = _initial_rows(h0, bounds.num_seqs, hv, kd, vd)
    first = tables["first"].astype(bool)
    seq_of_slot = tables["seq_of_slot"]

    def step(state, xs):
        w_s, u_s, kt_s, dl_s, first_s, seq_s = xs
        state = jnp.where(first_s[:, None, None, None], h_init[seq_s], state)
        v_new = u_s - jnp.matmul(w_s, state, precision=_HI)
        nxt = dl_s * state + jnp.matmul(jnp.swapaxes(kt_s, -1, -2), v_new, precision=_HI)
        return nxt, (state, v_new)

    state0 = jnp.zeros((lanes, hv, kd, vd), jnp.float32)
    _, (h, v_new) = jax.lax.scan(step, state0, (w, u, k_tail, decay_last, first, seq_of_slot))

    o = jnp.matmul(q * jnp.exp(G), h, precision=_HI) * scale
    o = o + jnp.matmul(Aqk, v_new, precision=_HI)
    o = _scatter_tokens(jnp.moveaxis(o, 3, 2), tables["slot_of_token"])
    o = o.reshape(b, t, hv, vd).astype(out_dtype)
    if not opts.output_final_state:
        return o, None

    # The state after each sequence's last chunk, recomputed from that chunk's
    # h and v_new; empty sequences keep their initial state.
    last = tables["last_slot"]
    pick = lambda x: jnp.take(x.reshape((-1,) + x.shape[2:]), last, axis=0, mode="fill", fill_value=0)
    after = pick(decay_last) * pick(h) + jnp.matmul(
        jnp.swapaxes(pick(k_tail), -1, -2), pick(v_new), precision=_HI
    )
    empty = last == steps * lanes  # from the packed table: no second metadata constant
    final = jnp.where(empty[:, None, None, None], h_init[:-1], after)
    return o, _finish_state(final, opts.state_v_first)


def fused_recurrent_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                            opts: KdaOptions, bounds: SeqBounds):
    """Token-by-token KDA in jax.numpy: one scan step per token of the longest
    sequence, all sequences in parallel lanes. Same contract as chunk_kda_xla."""
    b, t, _, kd = q.shape
    hv, vd = v.shape[-2:]
    out_dtype = q.dtype
    n = bounds.num_seqs
    q, k, v, g, beta, h0 = _prepare(q, k, v, g, beta, initial_state, A_log, dt_bias, opts)
    scale = opts.scale
    tables = _Tables(lane_schedule(bounds, 1))
    idx = tables["token_index"]
    steps, lanes, _ = idx.shape
    slots = lambda x: _gather_slots(x, idx)[:, :, 0]
    q, k, v, g, beta = (slots(x) for x in (q, k, v, g, beta))

    h_init = _initial_rows(h0, n, hv, kd, vd)
    first = tables["first"].astype(bool)

    def step(carry, xs):
        state, finals = carry
        q_s, k_s, v_s, g_s, b_s, first_s, seq_s, end_s = xs
        state = jnp.where(first_s[:, None, None, None], h_init[seq_s], state)
        state = jnp.exp(g_s)[..., None] * state
        kv = jnp.einsum("lhk,lhkv->lhv", k_s, state, precision=_HI)
        state = state + (b_s[..., None] * k_s)[..., None] * (v_s - kv)[..., None, :]
        o_s = scale * jnp.einsum("lhk,lhkv->lhv", q_s, state, precision=_HI)
        # Lanes whose sequence ends here file its state; others write row N.
        finals = finals.at[end_s].set(state) if opts.output_final_state else finals
        return (state, finals), o_s

    state0 = jnp.zeros((lanes, hv, kd, vd), jnp.float32)
    finals0 = h_init if opts.output_final_state else jnp.zeros((0,), jnp.float32)
    xs = (q, k, v, g, beta, first, tables["seq_of_slot"], tables["seq_ending"])
    (_, finals), o = jax.lax.scan(step, (state0, finals0), xs)
    o = _scatter_tokens(o[:, :, None], tables["slot_of_token"])
    o = o.reshape(b, t, hv, vd).astype(out_dtype)
    if not opts.output_final_state:
        return o, None
    return o, _finish_state(finals[:n], opts.state_v_first)
