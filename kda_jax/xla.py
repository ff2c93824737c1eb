"""The portable backend: KDA in jax.numpy (docs/kda.md section 3), float32 inside.

Both forms take their varlen layout from a lane schedule: tokens are gathered
into ``[steps, lanes, chunk]`` slots, the chunk-parallel work is batched over
all slots, and one ``lax.scan`` over steps carries a state per lane. The traced
program's size depends on the slot grid, never on the number of sequences, and
it is differentiable by JAX autodiff.

With host bounds the schedule is the host-built :class:`LaneSchedule` (one
constant; steps = the longest sequence's chunk count). With a bucketed
:class:`kda_jax.VarlenBatch` the grid must not depend on the bounds, and the
only grid every bounds of a bucket fits is one lane of ``max_chunks`` steps
(``max_tokens`` for the token-by-token form): the tables are derived on the
device from the batch's metadata (no read-back), in chunk-table order. The
arithmetic is the static form's, but the state pass walks the batch's chunks
one after another instead of in parallel lanes: ``max_chunks`` sequential
steps instead of the longest sequence's chunk count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import pool as state_pool
from kda_jax import transforms, vma
from kda_jax.batch import VarlenBatch
from kda_jax.bounds import PackedTables, SeqBounds, checkpoint_slots, lane_schedule
from kda_jax.options import KdaOptions

__all__ = ["chunk_kda_xla", "fused_recurrent_kda_xla", "unit_lower_inverse"]

# Sub-block rows for the intra-chunk products: exponents factor through the
# row before each 16-row block, so that every exp() sees a value <= 0.
_SUB = 16
_HI = jax.lax.Precision.HIGHEST


class _Tables:
    """Static slices of a host-built int32 buffer (one constant): the lane
    schedule's tables, or the checkpoints'."""

    def __init__(self, packed: PackedTables):
        self._packed = packed
        self._buffer = jnp.asarray(packed.buffer)

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
    """``[S, L, C, ...]`` slots -> ``[T, ...]`` tokens (a gather by each token's
    slot); a token whose slot is out of range (a bucket's padding) gets 0."""
    flat = y.reshape((-1,) + y.shape[3:])
    return jnp.take(flat, slot_of_token, axis=0, mode="fill", fill_value=0)


def _batch_valid(batch: VarlenBatch) -> jax.Array:
    """bool scalar: whether the batch's metadata is what
    :func:`kda_jax.bounds.bucketed_metadata` builds from the bounds it holds
    (the host check of a NumPy buffer, made on the device for a device buffer:
    every table but the padding between them, which nothing reads)."""
    bucket = batch.bucket
    nb, cs = bucket.max_seqs, bucket.chunk_size
    n, t, nc, c = (batch.table("header")[i] for i in range(4))
    cu, co, ct = batch.table("cu_seqlens"), batch.table("chunk_offsets"), batch.table("chunk_table")
    slot = jnp.arange(nb + 2, dtype=jnp.int32)
    ok = ((n >= 1) & (n <= nb) & (t >= 0) & (t <= bucket.max_tokens) & (nc >= 0)
          & (nc <= bucket.max_chunks) & (c == cs) & (cu[0] == 0))
    ok &= jnp.all((cu[1:] >= cu[:-1]) | (slot[1:] > n))  # non-decreasing up to cu[n]
    ok &= jnp.all((cu == t) | (slot < n))  # cu[n] == T, and T repeated after it
    lens = jnp.where(slot[:-1] < n, cu[1:] - cu[:-1], 0)
    if bucket.max_len is not None:
        ok &= jnp.all(lens <= bucket.max_len)
    expected_co = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + cs - 1) // cs)])
    ok &= jnp.all(co == expected_co) & (expected_co[-1] == nc)
    row = jnp.arange(bucket.max_chunks, dtype=jnp.int32)
    seq = jnp.searchsorted(expected_co[1:], row, side="right").astype(jnp.int32)
    seq = jnp.clip(seq, 0, nb)
    real = row < nc
    ok &= jnp.all(ct[:, 0] == jnp.where(real, seq, nb))
    ok &= jnp.all(ct[:, 1] == jnp.where(real, row - expected_co[seq], 0))
    return ok


def _poison(x, tables):
    """``x``, or NaN throughout when the tables come from a batch whose
    metadata fails :func:`_batch_valid` (a device buffer cannot be checked on
    the host: a result from a corrupt buffer must not pass for a result)."""
    if isinstance(tables, dict):
        return jnp.where(tables["valid"], x, jnp.nan).astype(x.dtype)
    return x


def _bucketed_tables(batch: VarlenBatch, chunk_size: int) -> dict[str, jax.Array]:
    """The :class:`LaneSchedule` tables of a one-lane schedule, from the batch's
    metadata on the device: slot s holds chunk-table row s (token s when
    ``chunk_size`` is 1). Padded rows point at the empty sentinel sequence
    (so hold only padding); token rows past the real end map to no slot.

    Every value read from the metadata is clipped into its range first (a
    no-op for a valid batch), so that each gather and scatter index below is
    in range by construction, whatever the buffer holds; "valid" is
    :func:`_batch_valid`, which turns the results into NaN when False."""
    nb, tb = batch.bucket.max_seqs, batch.bucket.max_tokens
    cu = jnp.clip(batch.table("cu_seqlens"), 0, tb)  # [nb + 2]
    t_real = jnp.clip(batch.table("header")[1], 0, tb)
    i32 = jnp.int32
    tok = jnp.arange(tb, dtype=i32)
    live = tok < t_real
    # The sequence of each token: the last slot starting at or before it
    # (an empty sequence starts where the next one does, so never wins).
    seq_of_tok = jnp.searchsorted(cu[: nb + 1], tok, side="right").astype(i32) - 1
    seq_of_tok = jnp.clip(seq_of_tok, 0, nb)
    rel = tok - cu[seq_of_tok]
    nonempty = cu[1 : nb + 1] > cu[:nb]
    if chunk_size == 1:
        slots = tb
        first = live & (rel == 0)
        ending = live & (tok == cu[seq_of_tok + 1] - 1)
        token_index = jnp.where(live, tok, tb).reshape(slots, 1, 1)
        seq_at = seq_of_tok
        slot_of_token = jnp.where(live, tok, slots)
        last_slot = jnp.where(nonempty, cu[1 : nb + 1] - 1, slots)
    else:
        slots = batch.bucket.max_chunks
        co = jnp.clip(batch.table("chunk_offsets"), 0, slots)
        ct = batch.table("chunk_table")
        seq_at = jnp.clip(ct[:, 0], 0, nb)
        j = jnp.clip(ct[:, 1], 0, -(-tb // chunk_size))
        start = cu[seq_at] + j * chunk_size
        rows = start[:, None] + jnp.arange(chunk_size, dtype=i32)[None, :]
        has = cu[seq_at + 1] > cu[seq_at]
        first = has & (j == 0)
        ending = has & (j == co[seq_at + 1] - co[seq_at] - 1)
        token_index = jnp.where(rows < cu[seq_at + 1][:, None], rows, tb)
        token_index = token_index.reshape(slots, 1, chunk_size)
        flat = (co[seq_of_tok] + rel // chunk_size) * chunk_size + rel % chunk_size
        slot_of_token = jnp.where(live, flat, slots * chunk_size)
        last_slot = jnp.where(nonempty, co[1 : nb + 1] - 1, slots)
    column = lambda x: x.reshape(slots, 1)
    return {
        "token_index": token_index,
        "slot_of_token": slot_of_token,
        "first": column(first.astype(i32)),
        "seq_of_slot": column(jnp.where(first, seq_at, nb)),
        "last_slot": last_slot,
        "seq_ending": column(jnp.where(ending, seq_at, nb)),
        "valid": _batch_valid(batch),
    }


def _schedule(bounds, chunk_size: int):
    """(tables, number of sequence slots) of either varlen form."""
    if isinstance(bounds, VarlenBatch):
        return _bucketed_tables(bounds, chunk_size), bounds.bucket.max_seqs
    return _Tables(lane_schedule(bounds, chunk_size).tables), bounds.num_seqs


def _prepare(q, k, v, g, beta, initial_state, A_log, dt_bias, opts: KdaOptions):
    """Sanitizing, transforms, the log-decay floor, GVA expansion and flattening
    to ``[B*T, HV, ...]`` float32. Also returns the flattened ``poison`` and
    ``q_bad`` flags ``[B*T, HV]`` of :func:`kda_jax.transforms.sanitize`."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    q, k, v, g, beta, poison, q_bad = transforms.sanitize(
        q, k, v, g, beta, use_gate_in_kernel=opts.use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel)
    q, k, g, beta = transforms.prepare_inputs(q, k, g, beta, **opts.transform_flags(A_log, dt_bias))
    g = transforms.log_decay(g)
    q = jnp.repeat(q, hv // h, axis=2)
    k = jnp.repeat(k, hv // h, axis=2)
    flat = lambda x: x.reshape((b * t,) + x.shape[2:])
    h0 = None
    if initial_state is not None:
        h0 = initial_state.astype(jnp.float32)
        if opts.state_v_first:
            h0 = jnp.swapaxes(h0, -1, -2)
    return (flat(q), flat(k), flat(v.astype(jnp.float32)), flat(g), flat(beta), h0,
            flat(poison), flat(q_bad))


def _initial_rows(h0, n, hv, kd, vd):
    """``[N + 1, HV, K, V]``: the initial states plus a zero row for slots with none."""
    zero = jnp.zeros((1, hv, kd, vd), jnp.float32)
    if h0 is None:
        return jnp.zeros((n + 1, hv, kd, vd), jnp.float32)
    return jnp.concatenate([h0, zero], axis=0)


def _finish_state(final, state_v_first):
    return jnp.swapaxes(final, -1, -2) if state_v_first else final


def _suffix_sums(g):
    """``sum_{r > i} g_r`` along the rows (axis -2) of ``g [..., C, K]``: a
    reverse cumsum shifted by one row, so each entry is a sum of the g it
    spans (error relative to that sum, not to the chunk's total)."""
    rev = jnp.flip(jnp.cumsum(jnp.flip(g, axis=-2), axis=-2), axis=-2)
    return jnp.concatenate([rev[..., 1:, :], jnp.zeros_like(rev[..., :1, :])], axis=-2)


def _decay_products(x, y, g, *, inclusive):
    """``M[i, j] = sum_d x_id y_jd exp(G_id - G_jd)`` for j < i (j <= i if
    inclusive), G the cumsum of g along C.

    x, y, g: ``[..., C, K]`` float32, g <= 0 (floored: finite). Every exponent
    is a partial sum of g over the rows it spans, never a difference of two
    prefix sums: its error is relative to itself, however large G gets. Blocks
    of 16 rows below the diagonal factor through the row before the block:
    row i takes e^(sum of g from the block's first row to i), column j of an
    earlier block e^(sum of g from j + 1 to the row before the block) (the
    rest of j's block plus the whole blocks in between). Diagonal blocks take
    the pairwise partial sums. Every exponent is <= 0.
    """
    c, kd = g.shape[-2:]
    nb = c // _SUB
    lead = g.shape[:-2]
    blk = lambda a: a.reshape(lead + (nb, _SUB, kd))
    gb, xb, yb = blk(g), blk(x), blk(y)
    within = jnp.cumsum(gb, axis=-2)  # [..., nb, 16, K]: from the block's first row
    after = _suffix_sums(gb)  # [..., nb, 16, K]: to the block's last row
    total = within[..., -1, :]  # [..., nb, K]

    # Off-diagonal blocks: column j (block c) before row block b; the whole
    # blocks strictly between c and b, summed with a select (at most nb - 2 terms).
    bi = np.arange(nb)
    between = (bi[None, None, :] > bi[None, :, None]) & (bi[None, None, :] < bi[:, None, None])
    span = jnp.sum(jnp.where(between[..., None], total[..., None, None, :, :], 0.0), axis=-2)
    col_exp = after.reshape(lead + (1, c, kd)) + jnp.repeat(span, _SUB, axis=-2)  # [..., nb, C, K]
    rows = np.arange(c)
    before = rows[None, :] < (bi * _SUB)[:, None]  # [nb, C]
    x_row = xb * jnp.exp(within)
    col_exp = jnp.where(before[:, :, None], col_exp, 0.0)
    y_col = y[..., None, :, :] * jnp.where(before[:, :, None], jnp.exp(col_exp), 0.0)
    off = jnp.einsum("...bik,...bjk->...bij", x_row, y_col, precision=_HI)
    off = off.reshape(lead + (c, c))

    # Diagonal blocks: D[i, j] = sum of g over rows j + 1 .. i.
    sub = np.arange(_SUB)
    spans = jnp.where((sub[:, None] > sub[None, :])[:, :, None], gb[..., :, None, :], 0.0)
    pair = jnp.cumsum(spans, axis=-3)  # [..., nb, 16 (i), 16 (j), K]
    keep = (sub[None, :] <= sub[:, None]) if inclusive else (sub[None, :] < sub[:, None])
    keep = keep[:, :, None]
    decay = jnp.where(keep, jnp.exp(jnp.where(keep, pair, 0.0)), 0.0)
    diag = jnp.einsum("...bid,...bjd,...bijd->...bij", xb, yb, decay, precision=_HI)
    diag = jnp.einsum("...bij,bc->...bicj", diag, np.eye(nb, dtype=np.float32))
    return off + diag.reshape(lead + (c, c))


def unit_lower_inverse(n):
    """``(I + N)^-1`` of a strictly lower triangular ``N [..., C, C]`` float32,
    batched over the leading axes; returns ``[..., C, C]`` float32.

    Matrix products only (the Triton kernels, too, merge their blocked
    inverse with products): N is nilpotent (N^C = 0), so
    ``(I + N)^-1 = prod_{i : 2^i < C} (I + (-N)^(2^i))``, for C >= 2 in
    2 (ceil(log2 C) - 1) float32 matmuls at HIGHEST precision. Not LAPACK's
    batched triangular solve: that custom call deadlocks XLA's CPU runtime in
    multi-device programs (shard_map over forced host devices; docs/kda.md
    section 7), and matmuls suit every backend. Entries of ``n`` on and above
    the diagonal must be 0 (they are not masked); any C >= 1 works, not only
    powers of two.
    """
    c = n.shape[-1]
    if n.ndim < 2 or n.shape[-2] != c:
        raise ValueError(f"unit_lower_inverse: n must be [..., C, C], got shape {n.shape}; "
                         "pass a batch of square strictly lower triangular matrices")
    power = -n  # (-N)^(2^i)
    inv = jnp.eye(c, dtype=n.dtype) + power  # sum_{j < span} (-N)^j
    span = 2
    while span < c:
        power = jnp.matmul(power, power, precision=_HI)
        inv = inv + jnp.matmul(inv, power, precision=_HI)
        span *= 2
    return inv


def chunk_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                  opts: KdaOptions, bounds: SeqBounds | VarlenBatch,
                  checkpoint_every: int | None = None, checkpoint_indices=None):
    """Chunked KDA in jax.numpy. Arguments are already validated by the API.

    ``bounds`` covers the flattened ``B * T`` tokens (B equal sequences when the
    call has no cu_seqlens), as host bounds or a bucketed batch. Returns
    ``(o [B, T, HV, V] in q.dtype, final | None)``.

    With ``checkpoint_every`` (a multiple of the chunk size) a third output
    holds the scan's state before every interval of that many tokens
    (:func:`_checkpoints`): ``[C, HV, ., .]`` float32 in the state layout
    (host bounds), or with ``checkpoint_indices`` int32 ``[N, J]`` the pair
    ``(rows, states)`` to write into a pool (-1: none).
    """
    b, t, _, kd = q.shape
    hv, vd = v.shape[-2:]
    out_dtype = q.dtype
    q, k, v, g, beta, h0, poison, q_bad = _prepare(q, k, v, g, beta, initial_state, A_log,
                                                    dt_bias, opts)
    scale = opts.scale
    tables, n = _schedule(bounds, opts.chunk_size)
    idx = tables["token_index"]
    steps, lanes, c = idx.shape

    # Slots, heads before rows: [S, L, HV, C, K|V] and beta [S, L, HV, C].
    to_heads = lambda x: jnp.moveaxis(_gather_slots(x, idx), 2, 3)
    q, k, v, g = (to_heads(x) for x in (q, k, v, g))
    rows_of = lambda x: jnp.swapaxes(_gather_slots(x, idx), 2, 3)
    beta, poison, q_bad = rows_of(beta), rows_of(poison), rows_of(q_bad)
    # A non-finite input poisons its row and every later row of the chunk,
    # and the state after it; earlier rows see zeros in its place.
    poisoned = jnp.cumsum(poison.astype(jnp.int32), axis=-1) > 0  # [S, L, HV, C]
    chunk_poisoned = poisoned[..., -1]  # [S, L, HV]

    G = jnp.cumsum(g, axis=-2)
    Akk = _decay_products(k, k, g, inclusive=False) * beta[..., :, None]
    Aqk = _decay_products(q, k, g, inclusive=True) * scale
    A = unit_lower_inverse(Akk)
    w = jnp.matmul(A, beta[..., None] * k * jnp.exp(G), precision=_HI)
    u = jnp.matmul(A, beta[..., None] * v, precision=_HI)
    k_tail = k * jnp.exp(_suffix_sums(g))  # e^(G_last - G) from partial sums
    decay_last = jnp.exp(G[..., -1:, :])[..., 0, :, None]  # [S, L, HV, K, 1]

    h_init = _initial_rows(h0, n, hv, kd, vd)
    first = tables["first"].astype(bool)
    seq_of_slot = tables["seq_of_slot"]

    # The carried state stays finite (the sanitized computation); a flag per
    # lane and head says whether its sequence was poisoned before the chunk,
    # and the NaNs go on the outputs only, as selects: no cotangent meets a NaN.
    def step(carry, xs):
        state, flag = carry
        w_s, u_s, kt_s, dl_s, first_s, seq_s, bad_s = xs
        state = jnp.where(first_s[:, None, None, None], h_init[seq_s], state)
        flag = jnp.where(first_s[:, None], False, flag)
        v_new = u_s - jnp.matmul(w_s, state, precision=_HI)
        nxt = dl_s * state + jnp.matmul(jnp.swapaxes(kt_s, -1, -2), v_new, precision=_HI)
        return (nxt, flag | bad_s), (state, v_new, flag)

    state0 = jnp.zeros((lanes, hv, kd, vd), jnp.float32)
    flag0 = jnp.zeros((lanes, hv), bool)
    xs = (w, u, k_tail, decay_last, first, seq_of_slot, chunk_poisoned)
    # Inside shard_map the carry varies over the mesh axes its inputs vary over.
    init = vma.like((state0, flag0), xs, h_init)
    _, (h, v_new, before) = jax.lax.scan(step, init, xs)
    chunk_poisoned = chunk_poisoned | before  # the state after the chunk is NaN

    o = jnp.matmul(q * jnp.exp(G), h, precision=_HI) * scale
    o = o + jnp.matmul(Aqk, v_new, precision=_HI)
    o = jnp.where((poisoned | q_bad | before[..., None])[..., None], jnp.nan, o)
    o = _scatter_tokens(jnp.moveaxis(o, 3, 2), tables["slot_of_token"])
    o = _poison(o.reshape(b, t, hv, vd), tables).astype(out_dtype)
    final = None
    if opts.output_final_state:
        # The state after each sequence's last chunk, recomputed from that
        # chunk's h and v_new; empty sequences keep their initial state.
        last = tables["last_slot"]
        pick = lambda x: jnp.take(x.reshape((-1,) + x.shape[2:]), last, axis=0, mode="fill",
                                  fill_value=0)
        after = pick(decay_last) * pick(h) + jnp.matmul(
            jnp.swapaxes(pick(k_tail), -1, -2), pick(v_new), precision=_HI
        )
        after = jnp.where(pick(chunk_poisoned)[..., None, None], jnp.nan, after)
        empty = last == steps * lanes  # from the packed table: no second metadata constant
        final = _poison(jnp.where(empty[:, None, None, None], h_init[:-1], after), tables)
        final = _finish_state(final, opts.state_v_first)
    if checkpoint_every is None:
        return o, final
    # Each slot's start state, NaN where the sequence was poisoned before it
    # (as the final state of a prefix ending there is).
    starts = _poison(jnp.where(before[..., None, None], jnp.nan, h), tables)
    starts = _finish_state(starts.reshape((steps * lanes,) + h.shape[2:]), opts.state_v_first)
    return o, final, _checkpoints(starts, bounds, opts.chunk_size, checkpoint_every,
                                  checkpoint_indices)


def _checkpoints(starts, bounds, chunk_size: int, every: int, indices):
    """The checkpoints among the slots' start states ``starts`` ``[S * L, ...]``:
    ``[C, ...]`` in the order of :func:`kda_jax.bounds.checkpoint_offsets`
    (host bounds, ``indices`` None), else ``(rows [S * L], starts)`` with each
    slot's pool row from ``indices`` int32 ``[N, J]`` (-1: no checkpoint)."""
    if isinstance(bounds, VarlenBatch):
        seq, col = _bucketed_checkpoint_slots(bounds, chunk_size, every)
    else:
        tables = _Tables(checkpoint_slots(bounds, chunk_size, every))
        if indices is None:
            return jnp.take(starts, tables["slot"], axis=0)
        seq, col = tables["seq"], tables["col"]
    cols = indices.shape[1]
    at = (seq >= 0) & (col < cols)  # a device batch's columns past J are skipped
    rows = indices[jnp.maximum(seq, 0), jnp.clip(col, 0, cols - 1)]
    return jnp.where(at, rows, -1), starts


def _bucketed_checkpoint_slots(batch: VarlenBatch, chunk_size: int, every: int):
    """(seq, col) int32 ``[max_chunks]`` of :func:`_bucketed_tables`' one-lane
    slots (slot s = chunk-table row s): the sequence and checkpoint whose
    state is the slot's start state, -1 where none; from the batch's
    metadata on the device, clipped into range as there."""
    bucket = batch.bucket
    ct = batch.table("chunk_table")
    seq = jnp.clip(ct[:, 0], 0, bucket.max_seqs)
    j = jnp.clip(ct[:, 1], 0, -(-bucket.max_tokens // chunk_size))
    row = jnp.arange(bucket.max_chunks, dtype=jnp.int32)
    every_chunks = every // chunk_size
    at = (row < batch.table("header")[2]) & (seq < bucket.max_seqs) & (j % every_chunks == 0)
    return jnp.where(at, seq, -1), jnp.where(at, j // every_chunks, -1)


def fused_recurrent_kda_xla(q, k, v, g, beta, initial_state, A_log, dt_bias, *,
                            opts: KdaOptions, bounds: SeqBounds | VarlenBatch,
                            token_writes=None):
    """Token-by-token KDA in jax.numpy: one scan step per token of the longest
    sequence, all sequences in parallel lanes. Same contract as chunk_kda_xla.

    ``token_writes``: None, or ``(cache, rows)`` for a speculative verify
    (kda_jax.pool.token_rows): the state after token t of sequence n is
    written into ``cache`` (the pool's layout and dtype) at row ``rows[n, t]``
    for t < W (none where the row is outside [0, slots)) as the scan goes,
    and the call returns ``(o, new_cache)``."""
    b, t, _, kd = q.shape
    hv, vd = v.shape[-2:]
    out_dtype = q.dtype
    q, k, v, g, beta, h0, poison, q_bad = _prepare(q, k, v, g, beta, initial_state, A_log,
                                                    dt_bias, opts)
    scale = opts.scale
    tables, n = _schedule(bounds, 1)
    idx = tables["token_index"]
    steps, lanes, _ = idx.shape
    slots = lambda x: _gather_slots(x, idx)[:, :, 0]
    q, k, v, g, beta, poison, q_bad = (slots(x) for x in (q, k, v, g, beta, poison, q_bad))

    h_init = _initial_rows(h0, n, hv, kd, vd)
    first = tables["first"].astype(bool)

    live = idx[:, :, 0] < b * t  # [steps, lanes]: the slot holds a token
    if token_writes is not None:
        cache, rows = token_writes
        # Row n (the empty sentinel) writes nothing.
        rows = jnp.concatenate([rows, jnp.full((1, rows.shape[1]), -1, rows.dtype)])

    def write_token_states(cache, lane, filed, first_s, seq_s, live_s):
        """The verify's pool writes of one step: each lane's sequence and its
        token's position in it are carried along the lane."""
        seq, pos = lane
        seq = jnp.where(first_s, seq_s, seq)
        pos = jnp.where(first_s, 0, pos + 1)
        w = rows.shape[1]
        row = jnp.where(live_s & (pos < w), rows[seq, jnp.minimum(pos, w - 1)], -1)
        cache = state_pool.write_rows(cache, row, _finish_state(filed, opts.state_v_first))
        return cache, (seq, pos)

    def step(carry, xs):
        state, flag, finals, writes = carry
        q_s, k_s, v_s, g_s, b_s, bad_s, qbad_s, first_s, seq_s, end_s, live_s = xs
        state = jnp.where(first_s[:, None, None, None], h_init[seq_s], state)
        state = jnp.exp(g_s)[..., None] * state
        kv = jnp.einsum("lhk,lhkv->lhv", k_s, state, precision=_HI)
        state = state + (b_s[..., None] * k_s)[..., None] * (v_s - kv)[..., None, :]
        o_s = scale * jnp.einsum("lhk,lhkv->lhv", q_s, state, precision=_HI)
        # A non-finite input poisons the state from its token on: the carried
        # state stays the sanitized one and the flag puts NaN on the outputs,
        # as selects (no cotangent meets a NaN).
        flag = jnp.where(first_s[:, None], False, flag) | bad_s
        o_s = jnp.where((qbad_s | flag)[..., None], jnp.nan, o_s)
        filed = jnp.where(flag[..., None, None], jnp.nan, state)
        # Lanes whose sequence ends here file its state; others write row N.
        finals = finals.at[end_s].set(filed) if opts.output_final_state else finals
        if token_writes is not None:
            writes = write_token_states(*writes, _poison(filed, tables), first_s, seq_s,
                                        live_s)
        return (state, flag, finals, writes), o_s

    state0 = jnp.zeros((lanes, hv, kd, vd), jnp.float32)
    flag0 = jnp.zeros((lanes, hv), bool)
    finals0 = h_init if opts.output_final_state else jnp.zeros((0,), jnp.float32)
    writes0 = ()
    if token_writes is not None:
        writes0 = (cache, (jnp.full((lanes,), n, jnp.int32), jnp.zeros((lanes,), jnp.int32)))
    xs = (q, k, v, g, beta, poison, q_bad, first, tables["seq_of_slot"], tables["seq_ending"],
          live)
    # Inside shard_map the carry varies over the mesh axes its inputs vary over.
    init = vma.like((state0, flag0, finals0, writes0), xs, h_init)
    (_, _, finals, writes), o = jax.lax.scan(step, init, xs)
    o = _scatter_tokens(o[:, :, None], tables["slot_of_token"])
    o = _poison(o.reshape(b, t, hv, vd), tables).astype(out_dtype)
    if token_writes is not None:
        return o, writes[0]
    if not opts.output_final_state:
        return o, None
    return o, _finish_state(_poison(finals[:n], tables), opts.state_v_first)
