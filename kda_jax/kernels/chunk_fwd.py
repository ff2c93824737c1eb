"""Chunked KDA forward in two kernels (docs/kda.md section 3).

``kda_fwd_prepare_kernel`` (chunk-parallel, grid (chunks, HV)) applies the input
transforms, the chunk-local gate cumsum, the intra-chunk products and the
inverse (I + L)^-1, and writes per chunk: w, u, q * exp(G) * scale,
k * exp(G_last - G), Aqk and exp(G_last).

``kda_fwd_state_output_kernel`` (grid (sequences, HV, V-blocks)) walks each
sequence's chunks in order, carrying the float32 state, and writes o and the
final state: the state pass and the output fused, so h is never stored (but
for prefill checkpoints: the state at the start of every CHECKPOINT_CHUNKS-th
chunk).

Layouts (tokens of all sequences packed along T):
  q, k [T, H, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV];
  w, qg, kt [T, HV, K]; u [T, HV, V]; aqk [T, HV, BT]; gl [NC, HV, K] fp32;
  x [T, HV, BT] fp32 (the inverse, transposed: row i of a chunk holds
    column i of X; for the backward's recompute only);
  gc [T, HV, K] fp32 (G, for the backward's recompute; with SPLIT_PASSES
    and the in-kernel gate also the log-decays between the two passes);
  states [N, HV, K, V] ([N, HV, V, K] with STATE_V_FIRST) fp32.
Varlen comes from one int32 metadata buffer: cu_seqlens at ``off_cu``,
chunk_offsets at ``off_co`` and the (sequence, chunk) table at ``off_ct``,
read through kernels.varlen, which clamps every index taken from it to the
arrays: n_bounds (cu_seqlens' length - 1), n_tokens (T) and n_chunk_rows (NC).

The prepare kernel works on whole-chunk tiles [BT, BK]. Its intra-chunk
products run in two levels whose cost does not depend on the gate values
(_anchored_accumulate): every decay factor is at most e^60 for any g in
[-inf, 0] (floored at GATE_FLOOR, kernels/gate.py), accurate relative to its
pair's decay, which a clamp changes only where it passes e^-20 anyway.
"""

import triton
import triton.language as tl

from .common import (BD, anchored_mask, chunk_exponents, chunk_rows, decay_row, dot,
                     next_decay_row, store_zero_rows, tile)
from .gate import GATE_FLOOR, bad_log_decay, gate, nonfinite, sigmoid
from .state_io import load_state, next_k_block, state_offsets, store_state, store_state_row
from .varlen import seq_chunks, seq_span


@triton.jit
def _inv_norm(x, rows, m_t, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
              BT: tl.constexpr):
    """1 / sqrt(sum(x^2) + 1e-6) per row, over all of K (non-finite entries
    count as 0, as everywhere in the prepare kernel)."""
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for ks in range(0, K, BK):
        o_k = ks + tl.arange(0, BK)
        b_x, _ = _tile_checked(x, rows, m_t, i_h, o_k, o_k < K, H, K)
        b_ss += tl.sum(b_x * b_x, axis=1)
    return 1. / tl.sqrt(b_ss + 1e-6)


@triton.jit
def _tile_checked(x, rows, m_t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """As common.tile, with non-finite entries replaced by 0; also returns where
    they were ([BT, BK] int1; _bad_rows turns that into rows)."""
    b_x = tile(x, rows, m_t, i_h, o_k, m_k, H, K)
    b_bad = nonfinite(b_x)
    return tl.where(b_bad, 0., b_x), b_bad


@triton.jit
def _bad_rows(b_bad):
    """[BT] int1: the rows of a [BT, BK] int1 tile that hold a True."""
    return tl.max(b_bad.to(tl.int32), axis=1) > 0


@triton.jit
def _log_decay_tile(g, b_alog, dt_bias, rows, m_t, i_hv, o_k, m_k,
                    HV: tl.constexpr, K: tl.constexpr, USE_GATE: tl.constexpr,
                    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                    HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """The per-token log-decay [BT, BK] (the gate applied, floored at
    GATE_FLOOR; 0 on rows past the sequence and where the raw g poisons the
    recurrence), and where such a g was ([BT, BK] int1). b_alog: the head's
    A_log (float32 scalar, loaded once by the caller; unused without it)."""
    p = g + (rows.to(tl.int64) * HV + i_hv)[:, None] * K + o_k[None, :]
    m = m_t[:, None] & m_k[None, :]
    b_g = tl.load(p, mask=m, other=0.).to(tl.float32)
    b_bad = bad_log_decay(b_g, USE_GATE)
    b_g = tl.where(b_bad, 0., b_g)
    if USE_GATE:
        if HAS_DT_BIAS:
            b_dt = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)
            b_g = b_g + b_dt[None, :]
        b_g = gate(b_g, b_alog, HAS_A_LOG, HAS_LOWER_BOUND, LOWER_BOUND)
    b_g = tl.where(m, tl.maximum(b_g, GATE_FLOOR), 0.)
    return b_g, b_bad


@triton.jit
def _anchored_accumulate(b_x0, b_x1, b_a, b_e0, b_y0, b_e1, b_y1, o_t, DOT: tl.constexpr,
                         MASKED: tl.constexpr, BATCHED: tl.constexpr):
    """The two levels' products of one K slice (docs/kda.md section 3): b_a
    [BT, BK] the row operand (q for Aqk, k for Akk), b_e0 = R0 and b_e1 =
    R1 its factors, b_y0 = (k C0)^T [BK, BT] level 0's column operand and
    b_y1 level 1's (_level1_operand; both shared by Aqk and Akk). Every
    factor is finite on every pair (at most e^60, common.chunk_exponents),
    so by default each level accumulates unmasked, b_x0 + (a R0) (k C0)^T
    ([BT, BT]) and b_x1 + (a R1) (k C1)^T, and its mask applies once, after
    the last slice (_anchored_combine).

    BATCHED: level 1 only over its BD-row diagonal blocks (b_x1 and b_y1 by
    block: [BT / BD, BD, BD] and [BT / BD, BK, BD]); otherwise b_x1 is
    [BT, BT] and b_y1 = (k C1)^T [BK, BT]. MASKED (never with BATCHED):
    both levels go masked into b_x0 at every slice (one [BT, BT]
    accumulator instead of two: fewer registers, more instructions; b_x1
    unused)."""
    BT: tl.constexpr = b_a.shape[0]
    BK: tl.constexpr = b_a.shape[1]
    if MASKED:
        b_x0 += tl.where(anchored_mask(o_t, 0), dot(b_a * b_e0, b_y0, DOT), 0.)
        b_x0 += tl.where(anchored_mask(o_t, 1), dot(b_a * b_e1, b_y1, DOT), 0.)
    else:
        b_x0 = dot(b_a * b_e0, b_y0, DOT, b_x0)
        if BATCHED:
            b_x1 = dot(tl.reshape(b_a * b_e1, [BT // BD, BD, BK]), b_y1, DOT, b_x1)
        else:
            b_x1 = dot(b_a * b_e1, b_y1, DOT, b_x1)
    return b_x0, b_x1


@triton.jit
def _level1_operand(b_k, b_c1, BATCHED: tl.constexpr):
    """Level 1's column operand: (k C1)^T [BK, BT], or with BATCHED k C1 by
    BD-row diagonal block, [BT / BD, BK, BD] (_anchored_accumulate)."""
    BT: tl.constexpr = b_k.shape[0]
    BK: tl.constexpr = b_k.shape[1]
    if BATCHED:
        return tl.permute(tl.reshape(b_k * tl.exp(b_c1), [BT // BD, BD, BK]), (0, 2, 1))
    else:
        return tl.trans(b_k * tl.exp(b_c1))


@triton.jit
def _level1_zeros(BT: tl.constexpr, BATCHED: tl.constexpr):
    """Level 1's accumulator (_anchored_accumulate), zeros."""
    if BATCHED:
        return tl.zeros([BT // BD, BD, BD], dtype=tl.float32)
    else:
        return tl.zeros([BT, BT], dtype=tl.float32)


@triton.jit
def _anchored_combine(b_x0, b_x1, o_t, MASKED: tl.constexpr, BATCHED: tl.constexpr):
    """a_i . k_j e^(G_i - G_j) for every j < i ([BT, BT], 0 elsewhere) from
    _anchored_accumulate's accumulators, each level on its own pairs: level
    0 where i's BR-row block follows j's, level 1 within one BR-row block
    (common.anchored_mask; with BATCHED its diagonal blocks placed on the
    diagonal; with MASKED, b_x0 already is the sum)."""
    BT: tl.constexpr = b_x0.shape[0]
    if BATCHED:
        b_x1 = tl.where(anchored_mask(tl.arange(0, BD), 1)[None, :, :], b_x1, 0.)
        o_b = tl.arange(0, BT // BD)
        m_own = o_b[:, None, None, None] == o_b[None, None, :, None]
        b_x1 = tl.reshape(tl.where(m_own, b_x1[:, :, None, :], 0.), [BT, BT])
        return tl.where(anchored_mask(o_t, 0), b_x0, 0.) + b_x1
    elif MASKED:
        return b_x0
    else:
        return (tl.where(anchored_mask(o_t, 0), b_x0, 0.)
                + tl.where(anchored_mask(o_t, 1), b_x1, 0.))


# Diagonal block of the blocked inverse: a sweep of BB - 1 steps inverts all of
# them at once, and BT / BB blocks merge in BT / BB - 1 products.
BB = tl.constexpr(16)


@triton.jit
def _diag_block_inverse(b_l, BT: tl.constexpr):
    """The inverses of the BT / BB diagonal [BB, BB] blocks of I + L, as a
    block-diagonal [BT, BT] tile. The sweep works on the blocks alone, a
    [BT / BB, BB, BB] tile: a quarter of the [BT, BT] tile's elements, and
    each reduction runs within a block (its rows, or its columns)."""
    o_b = tl.arange(0, BT // BB)
    o_i = tl.arange(0, BB)
    m_own = o_b[:, None, None, None] == o_b[None, None, :, None]
    b_ld = tl.sum(tl.where(m_own, tl.reshape(b_l, [BT // BB, BB, BT // BB, BB]), 0.), axis=2)
    b_x = tl.zeros([BT // BB, BB, BB], dtype=tl.float32)
    b_x += tl.where(o_i[:, None] == o_i[None, :], 1., 0.)[None, :, :]
    for j in range(0, BB - 1):
        # L[b, i, j] per row i of block b; X[b, j, c] per column c.
        b_lc = tl.sum(tl.where(o_i[None, None, :] == j, b_ld, 0.), axis=2)
        b_xr = tl.sum(tl.where(o_i[None, :, None] == j, b_x, 0.), axis=1)
        b_x -= b_lc[:, :, None] * b_xr[:, None, :]
    return tl.reshape(tl.where(m_own, b_x[:, :, None, :], 0.), [BT, BT])


@triton.jit
def _unit_lower_inverse(b_l, o_t, BT: tl.constexpr, DOT_INV: tl.constexpr):
    """(I + L)^-1 of a strictly lower [BT, BT] L, blocked by BB rows.

    The diagonal blocks B = I + L_d first, all of them together, by a column
    sweep in float32 (_diag_block_inverse): once columns < j of a block are
    applied, its row j of X is final, and its column j of L removes
    L[:, j] X[j, :] from the rows below (BB - 1 dependent steps, each a row and
    a column reduction within the blocks). Then with D = B^-1 and E the
    part of L below the diagonal blocks, I + L = B (I + M) with M = D E
    strictly block-lower, so M^(BT/BB) = 0 and
        (I + L)^-1 = (I - M + M^2 - ...) D = D - M (D - M (D - ...)),
    BT/BB - 1 products after M's (precision DOT_INV)."""
    b_blk_r = (o_t // BB) * BB
    m_blk = b_blk_r[:, None] == b_blk_r[None, :]
    b_x = _diag_block_inverse(b_l, BT)
    if BT > BB:
        b_m = dot(b_x, tl.where(m_blk, 0., b_l), DOT_INV)
        b_y = b_x - dot(b_m, b_x, DOT_INV)
        for _ in tl.static_range(BT // BB - 2):
            b_y = b_x - dot(b_m, b_y, DOT_INV)
        b_x = b_y
    return b_x


@triton.jit
def kda_fwd_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, meta, off_cu, off_ct, n_bounds, n_tokens,
    w, u, qg, kt, aqk, gl, x, gc, flags,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
    DOT_A: tl.constexpr, DOT_WU: tl.constexpr, DOT_INV: tl.constexpr, STORE_X: tl.constexpr,
    SPLIT_PASSES: tl.constexpr, BATCHED_L1: tl.constexpr, STORE_FLAGS: tl.constexpr,
):
    """One program per (chunk, value head). With STORE_X (the backward's
    recompute) it also writes X^T, X = (I + L)^-1 (fp32, [T, HV, BT]), and G,
    the chunk-local cumsum of the log-decay (fp32, gc [T, HV, K]), which the
    backward's kernels read; x is unused otherwise. SPLIT_PASSES: Aqk and Akk
    take a pass over K each (one [BT, BT] accumulator live at a time; fewer
    registers, the k and log-decay tiles read twice); gc then also carries
    the in-kernel gate's log-decays from the first pass to the second.
    BATCHED_L1: level 1's products batched over diagonal blocks
    (_anchored_accumulate; each matrix a [BT, BT] and a [BT / 16, 16, 16]
    accumulator, both unmasked until the end), Aqk's diagonal and the
    non-finite rows reduced per slice (fewer registers); otherwise the split
    passes mask every slice into one [BT, BT] accumulator per matrix.

    Non-finite inputs: every load replaces the entries that would poison the
    recurrence by 0 (kernels/gate.py), and records the rows that held one.
    At the end, if any row of the chunk did, Aqk is NaN from the first such
    row of k, v, g or beta on (and on rows whose q held one), and so is gl:
    the state kernel's outputs from that row on and its state after the chunk
    are NaN, while earlier rows equal those of the inputs with zeros there.
    STORE_FLAGS (the forward of a differentiated call): each row's flags go
    to flags [T, HV] int8, bit 0 where its k, v, g or beta poisons the
    recurrence, bit 1 where its q holds a non-finite entry
    (kda_jax.transforms.nonfinite_flags, packed as kda_jax.triton.backward
    packs them); flags is unused otherwise."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n_rows, o_t, rows, m_t, r64 = chunk_rows(meta, off_cu, off_ct, i_c, n_bounds, n_tokens,
                                                 BT)

    # beta, transformed; rows past the sequence get 0 (no update).
    b_b = tl.load(beta + r64 * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_poison = b_b != b_b
        b_b = sigmoid(tl.where(b_poison, 0., b_b))
    else:
        b_poison = nonfinite(b_b)
        b_b = tl.where(b_poison, 0., b_b)
    b_b = tl.where(m_t, b_b * BETA_SCALE, 0.)

    # Row scales of the in-kernel L2 norm (over all of K, before any slice).
    b_sq = tl.full([BT], 1., tl.float32)
    b_sk = tl.full([BT], 1., tl.float32)
    if USE_L2NORM:
        b_sq = _inv_norm(q, rows, m_t, i_h, H, K, BK, BT)
        b_sk = _inv_norm(k, rows, m_t, i_h, H, K, BK, BT)

    b_alog = 0.
    if USE_GATE and (HAS_A_LOG or not HAS_LOWER_BOUND):
        b_alog = tl.load(A_log + i_hv).to(tl.float32)

    # Pass 1 over K slices: the log-decays, exp(G_last), Aqk and Akk (with
    # SPLIT_PASSES, Aqk alone), and the rows q*exp(G)*scale, k*exp(G_last - G)
    # and beta*k*exp(G) (into w's rows: pass 3 reads them back). Every
    # exponent is a sum of log-decays within a block plus (clamped, for the
    # products) block sums (common.chunk_exponents), not a difference of G:
    # its rounding is relative to itself, however deep the chunk's decay.
    # In one pass, each level's products accumulate unmasked over the slices
    # and its mask applies once at the end; the split passes mask every
    # slice into one accumulator per matrix (fewer registers;
    # _anchored_accumulate).
    # Non-finite entries of k are zeroed like the others (_tile_checked): the
    # rows from the first poisoning row on are NaN'ed at the end.
    p_hk = i_hv * K
    p_gl = gl + (i_c.to(tl.int64) * HV + i_hv) * K
    b_aqk0 = tl.zeros([BT, BT], dtype=tl.float32)
    b_aqk1 = _level1_zeros(BT, BATCHED_L1)
    b_akk0 = tl.zeros([BT, BT], dtype=tl.float32)
    b_akk1 = _level1_zeros(BT, BATCHED_L1)
    MASKED: tl.constexpr = SPLIT_PASSES and not BATCHED_L1
    # Aqk's diagonal and the non-finite entries: elementwise over the slices
    # and reduced once after the loop, or (BATCHED_L1) reduced per slice,
    # which holds fewer registers.
    if BATCHED_L1:
        b_qk = tl.zeros([BT], dtype=tl.float32)
        b_bad_tk = tl.zeros([BT], dtype=tl.int1)
    else:
        b_qk = tl.zeros([BT, BK], dtype=tl.float32)
        b_bad_tk = tl.zeros([BT, BK], dtype=tl.int1)
    for ks in range(0, K, BK):
        o_k = ks + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = r64[:, None] * (HV * K) + p_hk + o_k[None, :]
        b_g, b_bad = _log_decay_tile(g, b_alog, dt_bias, rows, m_t, i_hv, o_k, m_k, HV, K,
                                     USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND,
                                     LOWER_BOUND)
        if BATCHED_L1:
            b_bad_g = b_bad
        else:
            b_bad_tk = b_bad_tk | b_bad
        # Rows past the sequence have g = 0: G repeats the last row there.
        b_G, b_S, b_r0, b_c0, b_r1, b_c1 = chunk_exponents(b_g)
        if STORE_X and not SPLIT_PASSES:
            tl.store(gc + p_tk, b_G, mask=m_tk)
        if SPLIT_PASSES and USE_GATE:
            tl.store(gc + p_tk, b_g, mask=m_tk)  # for pass 2
        b_q = tile(q, rows, m_t, i_h, o_k, m_k, H, K) * b_sq[:, None]
        b_k, b_bad = _tile_checked(k, rows, m_t, i_h, o_k, m_k, H, K)
        if BATCHED_L1:
            b_bad_tk = b_bad_tk | _bad_rows(b_bad_g | b_bad)
        else:
            b_bad_tk = b_bad_tk | b_bad
        b_k = b_k * b_sk[:, None]
        if BATCHED_L1:
            # k e^(G_last - G) first: S then dies before the products (at 4
            # warps on sm90 the masked K = 100 form spilled 20 bytes otherwise).
            tl.store(kt + p_tk, (b_k * tl.exp(b_S)).to(kt.dtype.element_ty), mask=m_tk)
        b_e0 = tl.exp(b_r0)
        b_e1 = tl.exp(b_r1)
        b_y0 = tl.trans(b_k * tl.exp(b_c0))
        b_y1 = _level1_operand(b_k, b_c1, BATCHED_L1)
        b_aqk0, b_aqk1 = _anchored_accumulate(b_aqk0, b_aqk1, b_q, b_e0, b_y0, b_e1, b_y1, o_t,
                                              DOT_A, MASKED, BATCHED_L1)
        if not SPLIT_PASSES:
            b_akk0, b_akk1 = _anchored_accumulate(b_akk0, b_akk1, b_k, b_e0, b_y0, b_e1, b_y1,
                                                  o_t, DOT_A, MASKED, BATCHED_L1)
        if BATCHED_L1:
            b_qk += tl.sum(b_q * b_k, axis=1)
        else:
            b_qk += b_q * b_k
        b_eG = tl.exp(b_G)
        # exp(G_last): G's last row (rows past the sequence repeat it).
        tl.store(p_gl + o_k[None, :] + 0 * o_t[:, None], b_eG,
                 mask=(o_t == BT - 1)[:, None] & m_k[None, :])
        tl.store(qg + p_tk, (b_q * b_eG * SCALE).to(qg.dtype.element_ty), mask=m_tk)
        if not BATCHED_L1:
            tl.store(kt + p_tk, (b_k * tl.exp(b_S)).to(kt.dtype.element_ty), mask=m_tk)
        tl.store(w + p_tk, (b_k * b_b[:, None] * b_eG).to(w.dtype.element_ty), mask=m_tk)
    # Aqk, scaled, its diagonal exact (q_i . k_i), zero above it.
    b_aqk = _anchored_combine(b_aqk0, b_aqk1, o_t, MASKED, BATCHED_L1)
    if BATCHED_L1:
        b_poison = b_poison | b_bad_tk
        b_diag = b_qk
    else:
        b_poison = b_poison | _bad_rows(b_bad_tk)
        b_diag = tl.sum(b_qk, axis=1)
    b_aqk += tl.where(o_t[:, None] == o_t[None, :], b_diag[:, None], 0.)
    b_aqk = b_aqk * SCALE
    tl.store(aqk + (r64 * HV + i_hv)[:, None] * BT + o_t[None, :],
             b_aqk.to(aqk.dtype.element_ty), mask=m_t[:, None])

    if SPLIT_PASSES:
        # Pass 2: Akk, over the K slices again, so that one [BT, BT]
        # accumulator is live at a time; the log-decays come from gc (the
        # in-kernel gate's, stored by pass 1; the barrier makes every
        # thread's stores visible to the whole program) or from g again.
        # With STORE_X, G then goes to gc.
        tl.debug_barrier()
        for ks in range(0, K, BK):
            o_k = ks + tl.arange(0, BK)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            p_tk = r64[:, None] * (HV * K) + p_hk + o_k[None, :]
            if USE_GATE:
                b_g = tl.load(gc + p_tk, mask=m_tk, other=0.)
            else:
                b_g, _ = _log_decay_tile(g, b_alog, dt_bias, rows, m_t, i_hv, o_k, m_k, HV, K,
                                         USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND,
                                         LOWER_BOUND)
            b_k, _ = _tile_checked(k, rows, m_t, i_h, o_k, m_k, H, K)
            b_k = b_k * b_sk[:, None]
            b_G, _, b_r0, b_c0, b_r1, b_c1 = chunk_exponents(b_g)
            b_akk0, b_akk1 = _anchored_accumulate(
                b_akk0, b_akk1, b_k, tl.exp(b_r0), tl.trans(b_k * tl.exp(b_c0)),
                tl.exp(b_r1), _level1_operand(b_k, b_c1, BATCHED_L1), o_t, DOT_A, MASKED,
                BATCHED_L1)
            if STORE_X:
                if USE_GATE:
                    tl.debug_barrier()  # every read of the slice before any write over it
                tl.store(gc + p_tk, b_G, mask=m_tk)

    # X = (I + L)^-1 with L = diag(beta) strict_lower(Akk).
    b_l = _anchored_combine(b_akk0, b_akk1, o_t, MASKED, BATCHED_L1) * b_b[:, None]
    b_x = _unit_lower_inverse(b_l, o_t, BT, DOT_INV)
    if STORE_X:
        tl.store(x + (r64 * HV + i_hv)[:, None] * BT + o_t[None, :], tl.trans(b_x),
                 mask=m_t[:, None])
    if DOT_WU == "bf16":
        b_x = b_x.to(tl.bfloat16).to(tl.float32)  # rounded once, not per product

    # Pass 3: w = X (beta * k * exp(G)), from the rows pass 1 stored (the
    # barrier makes every thread's stores visible to the whole program).
    # Its K slices are as wide as pass 4's V blocks: no [BT, BT] accumulator
    # is live here, and wide slices take fewer steps.
    tl.debug_barrier()
    for ks in range(0, K, BV):
        o_k = ks + tl.arange(0, BV)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = r64[:, None] * (HV * K) + p_hk + o_k[None, :]
        b_kb = tl.load(w + p_tk, mask=m_tk, other=0.).to(tl.float32)
        tl.debug_barrier()  # every read of the slice before any write over it
        tl.store(w + p_tk, dot(b_x, b_kb, DOT_WU).to(w.dtype.element_ty), mask=m_tk)

    # Pass 4: u = X (beta * v).
    for vs in range(0, V, BV):
        o_v = vs + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
        b_vb = tl.load(v + p_tv, mask=m_tv, other=0.).to(tl.float32)
        b_bad = nonfinite(b_vb)
        b_poison = b_poison | _bad_rows(b_bad)
        b_vb = tl.where(b_bad, 0., b_vb) * b_b[:, None]
        tl.store(u + p_tv, dot(b_x, b_vb, DOT_WU).to(u.dtype.element_ty), mask=m_tv)

    if STORE_FLAGS:
        # q's non-finite rows from a pass of their own, here where few tiles
        # are live: tracked in pass 1 they cost registers, and sm90 spilled
        # (20-28 bytes at fp32w/c64/default and masked/c64/all, bench.aot).
        b_q_bad = tl.zeros([BT], dtype=tl.int1)
        for ks in range(0, K, BK):
            o_k = ks + tl.arange(0, BK)
            b_q_bad = b_q_bad | _bad_rows(nonfinite(tile(q, rows, m_t, i_h, o_k, o_k < K, H, K)))
        tl.store(flags + r64 * HV + i_hv, b_poison.to(tl.int8) | (b_q_bad.to(tl.int8) * 2),
                 mask=m_t)

    # Poison (rare: one test per chunk): NaN over Aqk's rows from the first
    # poisoning row on, and rows whose q was non-finite (o = qg h + Aqk v_new
    # row by row); NaN over gl (the state after the chunk).
    b_first = tl.min(tl.where(b_poison & m_t, o_t, BT), axis=0)
    b_nan_rows = (o_t >= b_first) & m_t
    if tl.max(b_nan_rows.to(tl.int32), axis=0) > 0:
        tl.debug_barrier()  # after every store of pass 1
        tl.store(aqk + (r64 * HV + i_hv)[:, None] * BT + o_t[None, :],
                 tl.full([BT, BT], float("nan"), tl.float32).to(aqk.dtype.element_ty),
                 mask=b_nan_rows[:, None])
        if b_first < BT:
            o_k = tl.arange(0, BK)
            for ks in range(0, K, BK):
                tl.store(gl + (i_c.to(tl.int64) * HV + i_hv) * K + ks + o_k,
                         tl.full([BK], float("nan"), tl.float32), mask=ks + o_k < K)


@triton.jit
def kda_fwd_state_output_kernel(
    w, u, qg, kt, aqk, gl, h0, read_idx, write_idx, ckpt_idx, meta, off_cu, off_co, n_seqs,
    n_tokens, n_chunk_rows, slots, ckpt_cols,
    o, ht, hc,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    INDEXED_STATE: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr,
    CHECKPOINT_CHUNKS: tl.constexpr,
):
    """One program per (sequence, value head, V block): the state [BK, BV] stays
    in registers (float32) while the sequence's chunks go by in order. With
    SPLIT_K it is two [BK, BV] tiles (K rows 0..BK-1 and BK..2 BK-1), and each
    [BT, K] tile is loaded and multiplied in two halves.

    Programs i_n < n_seqs are sequences. State rows: without INDEXED_STATE
    sequence n reads h0[n] and writes ht[n]. With INDEXED_STATE (a paged state
    pool) it reads h0[read_idx[n]] and writes ht[write_idx[n]]; an index
    outside [0, slots) reads zeros / writes nothing. The pool is passed as h0
    and aliased to ht, so rows no sequence names keep their contents.

    Checkpoints (CHECKPOINT_CHUNKS > 0): the state at the start of chunks 0,
    CHECKPOINT_CHUNKS, 2 CHECKPOINT_CHUNKS, ... of each sequence, i.e. before
    each interval of CHECKPOINT_CHUNKS * BT tokens (store_checkpoint). Without
    INDEXED_STATE checkpoint j of sequence n is row ckpt_idx[n] + j of hc
    (ckpt_idx: the host-built offsets); with INDEXED_STATE it is pool row
    ckpt_idx[n, j] of ht (ckpt_idx [n_seqs, ckpt_cols]; a column past
    ckpt_cols or a row outside [0, slots) is skipped), rounded like a final
    state. CHECKPOINT_CHUNKS = 0: hc, ckpt_idx and ckpt_cols are unused.

    A program i_n == n_seqs (launched for a bucketed batch only) writes o = 0
    on the token rows [cu_seqlens[n_seqs], n_tokens): rows past the batch's
    real end, which belong to no sequence.
    """
    i_n, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = seq_span(meta, off_cu, i_n, n_tokens)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_v = o_v < V
    if i_n < n_seqs:
        _state_output_sequence(
            w, u, qg, kt, aqk, gl, h0, read_idx, write_idx, ckpt_idx, meta, off_co,
            n_chunk_rows, slots, ckpt_cols, o, ht, hc, i_n, i_hv, bos, eos, o_v, o_t, m_v, HV,
            K, V, BT, BK, BV, USE_INITIAL_STATE, STORE_FINAL_STATE, STATE_V_FIRST,
            INDEXED_STATE, DOT, SPLIT_K, CHECKPOINT_CHUNKS)
    else:
        store_zero_rows(o, bos, n_tokens, i_hv, o_v, m_v, HV, V, BT, BV)


@triton.jit
def store_checkpoint(p_hc, b_h, ckpt_idx, ckpt_cols, slots, i_n, i_hv, i_c, n_chunks, o_s, m_kv,
                     HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     CHECKPOINT_CHUNKS: tl.constexpr, INDEXED_STATE: tl.constexpr):
    """Stores the state tile b_h of sequence i_n after i_c of its n_chunks
    chunks when it is a checkpoint: i_c a multiple of CHECKPOINT_CHUNKS below
    n_chunks (the state before an interval; the state after the last chunk
    is the final state, not a checkpoint). Checkpoint j = i_c /
    CHECKPOINT_CHUNKS goes to pool row ckpt_idx[i_n, j] of p_hc (-1, none,
    for a column past ckpt_cols; rounded to the pool's dtype), or with the
    [C, ...] output to its row ckpt_idx[i_n] + j."""
    if CHECKPOINT_CHUNKS > 0:
        if (i_c % CHECKPOINT_CHUNKS == 0) & (i_c < n_chunks):
            i_j = i_c // CHECKPOINT_CHUNKS
            if INDEXED_STATE:
                i_r = tl.load(ckpt_idx + i_n.to(tl.int64) * ckpt_cols + i_j,
                              mask=i_j < ckpt_cols, other=-1)
            else:
                i_r = tl.load(ckpt_idx + i_n) + i_j
            store_state_row(p_hc, b_h, i_r, slots, i_hv, o_s, m_kv, HV, K, V, True,
                            INDEXED_STATE, False)


@triton.jit
def _state_output_sequence(
    w, u, qg, kt, aqk, gl, h0, read_idx, write_idx, ckpt_idx, meta, off_co, n_chunk_rows,
    slots, ckpt_cols, o, ht, hc, i_n, i_hv, bos, eos, o_v, o_t, m_v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    INDEXED_STATE: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr,
    CHECKPOINT_CHUNKS: tl.constexpr,
):
    """The state pass and output of sequence i_n (kda_fwd_state_output_kernel's body)."""
    # A pool takes its checkpoints in its own rows (ht is the pool's buffer).
    if INDEXED_STATE:
        p_hc = ht
    else:
        p_hc = hc
    c0, n_chunks = seq_chunks(meta, off_co, i_n, bos, eos, n_chunk_rows, BT)

    o_k, m_k, o_s, m_kv = state_offsets(o_v, m_v, K, V, BK, STATE_V_FIRST)
    b_h = load_state(h0, read_idx, slots, i_n, i_hv, o_s, m_kv, HV, K, V, BK, BV,
                     USE_INITIAL_STATE, INDEXED_STATE)
    if SPLIT_K:
        o_k1, m_k1, shift, m_kv1 = next_k_block(o_k, m_k, m_kv, m_v, K, V, BK,
                                                  STATE_V_FIRST)
        b_h1 = load_state(h0 + shift, read_idx, slots, i_n, i_hv, o_s, m_kv1, HV, K, V, BK,
                          BV, USE_INITIAL_STATE, INDEXED_STATE)
    else:
        b_gl_next = next_decay_row(gl, c0, 0, n_chunks, i_hv, o_k, m_k, HV, K)

    # Checkpoint 0, the initial state (store_checkpoint: none for an empty sequence).
    store_checkpoint(p_hc, b_h, ckpt_idx, ckpt_cols, slots, i_n, i_hv, 0, n_chunks, o_s, m_kv,
                     HV, K, V, CHECKPOINT_CHUNKS, INDEXED_STATE)
    if SPLIT_K:
        store_checkpoint(p_hc + shift, b_h1, ckpt_idx, ckpt_cols, slots, i_n, i_hv, 0, n_chunks,
                         o_s, m_kv1, HV, K, V, CHECKPOINT_CHUNKS, INDEXED_STATE)
    for i_t in range(0, n_chunks):
        if not SPLIT_K:
            b_gl = b_gl_next  # loaded a chunk ahead (common.next_decay_row)
            b_gl_next = next_decay_row(gl, c0, i_t + 1, n_chunks, i_hv, o_k, m_k, HV, K)
        rows = bos + i_t * BT + o_t
        m_t = rows < eos
        r64 = rows.to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_k = (r64 * HV + i_hv)[:, None] * K + o_k[None, :]
        p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
        if SPLIT_K:
            # Both products with one K half of the state, then both with the
            # other, and u loaded last: in the order of the whole-tile path
            # the float32 kernel spills on sm90 (bench.aot).
            m_tk1 = m_t[:, None] & m_k1[None, :]
            b_w = tl.load(w + p_k, mask=m_tk, other=0.)
            b_hd = b_h.to(b_w.dtype)
            b_wh = dot(b_w, b_hd, DOT)
            b_qg = tl.load(qg + p_k, mask=m_tk, other=0.)
            b_o = dot(b_qg, b_hd, DOT)
            b_hd = b_h1.to(b_w.dtype)
            b_w = tl.load(w + BK + p_k, mask=m_tk1, other=0.)
            b_wh += dot(b_w, b_hd, DOT)
            b_qg = tl.load(qg + BK + p_k, mask=m_tk1, other=0.)
            b_o += dot(b_qg, b_hd, DOT)
            b_u = tl.load(u + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_vnd = (b_u - b_wh).to(b_w.dtype)
        else:
            # Each tile is loaded just before its product, so that at most one
            # [BT, K] tile is live at a time (K = 256 is tight in registers).
            b_u = tl.load(u + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_w = tl.load(w + p_k, mask=m_tk, other=0.)
            b_hd = b_h.to(b_w.dtype)
            b_vnd = (b_u - dot(b_w, b_hd, DOT)).to(b_w.dtype)
            b_qg = tl.load(qg + p_k, mask=m_tk, other=0.)
            b_o = dot(b_qg, b_hd, DOT)
        b_a = tl.load(aqk + (r64 * HV + i_hv)[:, None] * BT + o_t[None, :],
                      mask=m_t[:, None], other=0.)
        b_o += dot(b_a.to(b_w.dtype), b_vnd, DOT)
        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
        b_kt = tl.load(kt + p_k, mask=m_tk, other=0.)
        if SPLIT_K:
            b_gl = decay_row(gl, c0 + i_t, i_hv, o_k, m_k, HV, K)
        b_h = b_h * b_gl[:, None] + dot(tl.trans(b_kt), b_vnd, DOT)
        # The state after i_t + 1 chunks, stored here (the end of the step,
        # each K half after its own update), where the fewest tiles are live:
        # at the step's start the loaded operands are live too, and sm90
        # spills (bench.aot).
        store_checkpoint(p_hc, b_h, ckpt_idx, ckpt_cols, slots, i_n, i_hv, i_t + 1, n_chunks,
                         o_s, m_kv, HV, K, V, CHECKPOINT_CHUNKS, INDEXED_STATE)
        if SPLIT_K:
            b_kt = tl.load(kt + BK + p_k, mask=m_tk1, other=0.)
            b_gl = decay_row(gl, c0 + i_t, i_hv, o_k1, m_k1, HV, K)
            b_h1 = b_h1 * b_gl[:, None] + dot(tl.trans(b_kt), b_vnd, DOT)
            store_checkpoint(p_hc + shift, b_h1, ckpt_idx, ckpt_cols, slots, i_n, i_hv, i_t + 1,
                             n_chunks, o_s, m_kv1, HV, K, V, CHECKPOINT_CHUNKS, INDEXED_STATE)

    store_state(ht, b_h, write_idx, slots, i_n, i_hv, o_s, m_kv, HV, K, V, STORE_FINAL_STATE,
                INDEXED_STATE)
    if SPLIT_K:
        store_state(ht + shift, b_h1, write_idx, slots, i_n, i_hv, o_s, m_kv1, HV, K, V,
                    STORE_FINAL_STATE, INDEXED_STATE)
