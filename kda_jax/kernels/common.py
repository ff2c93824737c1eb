"""Pieces shared by the chunked kernels (chunk_fwd, chunk_bwd) and the decode
kernel: the product-precision helper, tile loads, a chunk's rows, the
chunk-local decay G read back from its buffer, and the decay factors and
masks of the two-level intra-chunk products (docs/kda.md section 3). The
log-decay numerics (in-kernel gate, floor, non-finite checks) are
kernels/gate.py.

Names follow the kernels': b_ register tiles, o_ offsets, m_ masks, p_
pointers or element offsets; BT the chunk, BK / BV the K / V blocks.
"""

import triton
import triton.language as tl

from .varlen import chunk_span


@triton.jit
def dot(a, b, DOT: tl.constexpr, acc=None):
    """acc + a @ b (acc None: zeros), float32 accumulate. DOT, one of
    kda_jax.configs.DOT_MODES: "ieee" (fp32), "tf32x3" (NVIDIA: three tf32
    products, about fp32 accuracy), "tf32", "bf16" (operands rounded to
    bf16), "bf16x3" (three bf16 products of a two-term split, about 1e-5
    relative), "bf16x6" (six products of a three-term split, about fp32
    accuracy)."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=DOT)


@triton.jit
def tile(x, rows, m_t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """Rows ``rows`` of head ``i_h`` of x [T, H, K], columns o_k, as float32
    (0 outside the masks)."""
    p = x + (rows.to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
    return tl.load(p, mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)


# The two-level products' clamp on log-decay sums (docs/kda.md section 3). An
# anchor's offset sums at most three clamped terms, so a factor's exponent
# has an offset of at most 3 * ANCHOR_CLAMP = 60 either way: no factor
# overflows, and one that underflows float32 (below e^-87) belongs to a pair
# whose decay passes e^-27 in truth. A pair whose decay the clamp shortens
# decays past e^-20 (2e-9) in truth and in the result alike. (At 26, factors
# of pairs decaying only e^-9 underflowed: errors of 1e-3 in dg.)
ANCHOR_CLAMP = tl.constexpr(20.0)
# Rows per block of the two-level products: pairs in different blocks are the
# first level, pairs within one block the second.
BR = tl.constexpr(8)
# Level 1's pairs lie in BR-row blocks on the diagonal: with the batched_l1
# configs its products run batched over BD-row diagonal blocks (BD >= 16, a
# matrix product's least size; each holds BD / BR level-1 blocks), on
# [BT / BD, BD, *] tiles: a quarter of a [BT, BT] product's work and
# registers at BT = 64.
BD = tl.constexpr(16)


@triton.jit
def chunk_exponents(b_g):
    """Every exponent the chunked kernels take from the log-decays b_g [BT, BK]
    fp32 of one chunk and K slice (0 on rows past the sequence): (G, S, R0,
    C0, R1, C1), all [BT, BK], with
      G_i = sum_{t <= i} g_t, the chunk-local cumsum;
      S_i = G_last - G_i = sum_{t > i} g_t;
      (R0, C0), (R1, C1): the exponents of the two-level intra-chunk
        products' factors (docs/kda.md section 3): e^(G_i - G_j) =
        e^(R_i + C_j), exactly but where the clamp below acts, for the pairs
        of level 0 (i and j in different BR-row blocks, i's block after j's)
        and of level 1 (i > j in one block).
    The compiler drops what a caller leaves unused.

    One scan runs within BR-row blocks; the block sums then go to every
    block at once (an exchange across the program), where masked sums over
    them give the sums of the blocks before and after each: no scan across
    the program. G and S are a block's partial sum plus whole block sums, so
    their rounding is relative to those sums and |g_i|, not to |G|.

    Level 0 anchors on the chunk's middle block boundary a: R_i = G_i - a,
    C_j = a - G_j, each a sum within its block (<= 0) plus the block sums
    between it and a; level 1 anchors each block on its row BR / 2 - 1.
    The sums on the far side of an anchor (block sums for level 0, single
    log-decays for level 1) are clamped at -ANCHOR_CLAMP before they enter
    an offset, so a factor is at most e^(3 ANCHOR_CLAMP): where a clamp
    acts, the pair's decay passes e^-ANCHOR_CLAMP both in truth and in the
    product (an error below 2e-9 |q_i| |k_j|, and below e^-20 times the
    pair's decay over the tokens no clamp touches: at level 1 row i's own
    log-decay, which every pair of row i spans, is never clamped). Factors
    a level never uses (block 0's rows and the last block's columns at
    level 0, each block's last row as a column at level 1) are e^0."""
    BT: tl.constexpr = b_g.shape[0]
    BK: tl.constexpr = b_g.shape[1]
    NB: tl.constexpr = BT // BR
    o_b = tl.arange(0, NB)[:, None]
    o_r = tl.arange(0, BR)[None, :, None]
    b_g3 = tl.reshape(b_g, [NB, BR, BK])
    b_l3 = tl.cumsum(b_g3, axis=1)  # within each block, inclusive
    b_t = tl.sum(b_g3, axis=1)  # block sums [NB, BK]
    # Every block's sums over the others, each block holding all NB of them
    # ([NB, NB, BK], block j's sum at column j): one exchange across the
    # program, then reductions within each block.
    o_j = tl.arange(0, NB)[None, :, None]
    o_i = tl.arange(0, NB)[:, None, None]
    b_tj = tl.broadcast_to(b_t[None, :, :], [NB, NB, BK])
    b_tcj = tl.maximum(b_tj, -ANCHOR_CLAMP)
    b_s = tl.sum(tl.where(o_j < o_i, b_tj, 0.), axis=1)  # the sums of the blocks before each
    b_p = tl.sum(tl.where(o_j > o_i, b_tj, 0.), axis=1)  # ... and after each
    b_G = tl.reshape(b_l3 + b_s[:, None, :], [BT, BK])
    b_S = tl.reshape((b_t[:, None, :] - b_l3) + b_p[:, None, :], [BT, BK])
    # Level 0: clamped block sums, anchored on the boundary after the first
    # NB / 2 blocks: b_d = (clamped G at block i's start) - (at the anchor),
    # the clamped sums of the blocks between them, with sign.
    b_tc = tl.maximum(b_t, -ANCHOR_CLAMP)
    m_a = o_j < NB // 2
    b_d = tl.sum(tl.where(o_j < o_i, tl.where(m_a, 0., b_tcj), tl.where(m_a, -b_tcj, 0.)),
                 axis=1)
    b_ro = tl.where(o_b == 0, 0., b_d)
    b_co = tl.where(o_b == NB - 1, 0., -b_d - b_tc)
    b_r0 = tl.reshape(b_l3 + b_ro[:, None, :], [BT, BK])
    b_c0 = tl.reshape(b_t[:, None, :] - b_l3 + b_co[:, None, :], [BT, BK])
    # Level 1: clamped log-decays within each block, anchored on its row
    # BR / 2 - 1; a row's own log-decay enters its factor unclamped.
    b_gc3 = tl.maximum(b_g3, -ANCHOR_CLAMP)
    b_lc3 = tl.cumsum(b_gc3, axis=1)
    b_h = tl.sum(tl.where(o_r < BR // 2, b_gc3, 0.), axis=1)[:, None, :]
    b_r1 = tl.reshape(b_lc3 - b_h + (b_g3 - b_gc3), [BT, BK])
    b_c1 = tl.reshape(tl.where(o_r == BR - 1, 0., b_h - b_lc3), [BT, BK])
    return b_G, b_S, b_r0, b_c0, b_r1, b_c1


@triton.jit
def anchored_mask(o_t, LEVEL: tl.constexpr):
    """[BT, BT]: the pairs of the two-level products' LEVEL (chunk_exponents):
    0, i's BR-row block after j's; 1, one block and i > j."""
    b_bi = (o_t // BR)[:, None]
    b_bj = (o_t // BR)[None, :]
    if LEVEL == 0:
        return b_bi > b_bj
    else:
        return (b_bi == b_bj) & (o_t[:, None] > o_t[None, :])


@triton.jit
def chunk_rows(meta, off_cu, off_ct, i_c, n_bounds, n_tokens, BT: tl.constexpr):
    """Rows of chunk-table entry i_c: (first row t0, rows in the chunk n_rows,
    o_t = 0..BT-1, rows = t0 + o_t, the mask o_t < n_rows, rows as int64)."""
    t0, eos = chunk_span(meta, off_cu, off_ct, i_c, n_bounds, n_tokens, BT)
    n_rows = tl.minimum(eos - t0, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    return t0, n_rows, o_t, rows, o_t < n_rows, rows.to(tl.int64)


@triton.jit
def decay_row(gl, i_c, i_hv, o_k, m_k, HV: tl.constexpr, K: tl.constexpr):
    """exp(G_last) of chunk row i_c over the K slice o_k (gl [NC, HV, K],
    fp32): the decay of the state across that chunk."""
    return tl.load(gl + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, mask=m_k, other=0.)


@triton.jit
def next_decay_row(gl, c0, i_t, n_chunks, i_hv, o_k, m_k, HV: tl.constexpr, K: tl.constexpr):
    """decay_row of chunk i_t of a state pass's sequence (row c0 + i_t),
    zeros when i_t is outside [0, n_chunks): for loading it a chunk ahead.
    Triton's software pipeliner stages the tiles that feed products but not
    this row: loaded where it is used, it cost every chunk a whole memory
    latency (on sm90 about a fifth of the forward state kernels' stall
    samples, Nsight Compute). The state passes carry it from the step before
    where registers allow (not on the float32 K-halves path, nor in the
    backward's reverse pass, which loads it first in the step instead)."""
    b_c = i_t + 0 * o_k  # the range test on a [BK] tile (a scalar one misbehaves in the interpreter)
    m_c = m_k & (b_c >= 0) & (b_c < n_chunks)
    return decay_row(gl, c0 + i_t, i_hv, o_k, m_c, HV, K)


@triton.jit
def g_last_row(gc, t0, n_rows, p_hk, o_k, m_k, HV: tl.constexpr, K: tl.constexpr):
    """G's last row over the K slice o_k, from gc [T, HV, K] fp32 (p_hk =
    head * K; zeros in a padded chunk, which has no rows)."""
    r_last = (t0 + tl.maximum(n_rows - 1, 0)).to(tl.int64)
    return tl.load(gc + r_last * (HV * K) + p_hk + o_k, mask=m_k & (o_k * 0 < n_rows), other=0.)


@triton.jit
def g_tile(gc, p_tk, m_t, m_k, b_last):
    """G [BT, BK] from gc; rows past the sequence repeat the last row (they
    add no decay)."""
    b_G = tl.load(gc + p_tk, mask=m_t[:, None] & m_k[None, :], other=0.)
    return tl.where(m_t[:, None], b_G, b_last[None, :])


@triton.jit
def store_zero_rows(o, start, n_tokens, i_hv, o_v, m_v, HV: tl.constexpr, V: tl.constexpr,
                    BR: tl.constexpr, BV: tl.constexpr):
    """o = 0 on the token rows [start, n_tokens) of value head i_hv, columns
    o_v (o [T, HV, V]), BR rows a step: the rows past a bucketed batch's
    real end, which belong to no sequence."""
    o_r = tl.arange(0, BR)
    b_zero = tl.zeros([BR, BV], dtype=o.dtype.element_ty)
    for r0 in range(start, n_tokens, BR):
        rows = r0 + o_r
        p_v = (rows.to(tl.int64) * HV + i_hv)[:, None] * V + o_v[None, :]
        tl.store(o + p_v, b_zero, mask=(rows < n_tokens)[:, None] & m_v[None, :])
