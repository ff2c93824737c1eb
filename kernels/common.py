"""Pieces shared by the chunked kernels (chunk_fwd, chunk_bwd) and the decode
kernel: the product-precision helper, tile loads, a chunk's rows, the
chunk-local decay G read back from its scratch, and the test that decides
which path a chunk's intra-chunk products take: anchored, blocked or
pairwise (docs/kda.md sections 3 and 6). The log-decay numerics (in-kernel gate, floor,
non-finite checks) are kernels/gate.py.

Names follow the kernels': b_ register tiles, o_ offsets, m_ masks, p_
pointers or element offsets; BT the chunk, BK / BV the K / V blocks.
"""

import triton
import triton.language as tl

from .varlen import chunk_span

# A chunk takes the anchored (matrix-product) path while every channel's
# decay factor relative to the chunk's anchor row stays within e^(+-60):
# products of such factors with O(1) keys stay far inside float32.
ANCHOR_SPAN = tl.constexpr(60.0)

# A chunk past ANCHOR_SPAN takes the blocked path (products anchored per
# BS-row block, chunk_fwd._blocked_product) while its depth max(-G_last) is
# within BLOCKED_DEPTH: each G carries a rounding error of about |G| * 6e-8,
# so a product's factor e^(G_i - G_j) is off by up to about depth * 1.2e-7
# relative (2.5e-4 here, half of fp16's unit roundoff), and the outputs'
# relative RMS error comes to about depth * 1e-8 (2e-5, against float32's
# 1e-4 tolerance). Deeper chunks take the exact pairwise path.
BS = tl.constexpr(16)
BLOCKED_DEPTH = tl.constexpr(2048.0)


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """a @ b, float32 accumulate. DOT indexes kda_jax.configs.DOT_MODES:
    0 = fp32 "ieee", 1 = "tf32x3" (NVIDIA: three tf32 products, about fp32
    accuracy), 2 = "tf32", 3 = operands rounded to bf16, 4 = "bf16x3" (three
    bf16 products of a two-term split, about 1e-5 relative), 5 = "bf16x6"
    (six products of a three-term split, about fp32 accuracy)."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="tf32x3")
    elif DOT == 2:
        return tl.dot(a, b, input_precision="tf32")
    elif DOT == 3:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == 4:
        return tl.dot(a, b, input_precision="bf16x3")
    elif DOT == 5:
        return tl.dot(a, b, input_precision="bf16x6")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def tile(x, rows, m_t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """Rows ``rows`` of head ``i_h`` of x [T, H, K], columns o_k, as float32
    (0 outside the masks)."""
    p = x + (rows.to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
    return tl.load(p, mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)


@triton.jit
def row_of(b_x, o_t, j):
    """Row j of a [BT, N] tile as an [N] vector."""
    return tl.sum(tl.where(o_t[:, None] == j, b_x, 0.), axis=0)


@triton.jit
def col_of(b_x, o_t, j):
    """Column j of a [N, BT] tile as an [N] vector."""
    return tl.sum(tl.where(o_t[None, :] == j, b_x, 0.), axis=1)


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
def anchor_rows(t0, n_rows, BT: tl.constexpr):
    """(anchor row, last row) of a chunk, int64: the anchor is the middle row,
    or the last one of a shorter chunk; rows past the sequence repeat the
    last (they add no decay)."""
    r_anchor = (t0 + tl.maximum(tl.minimum(BT // 2, n_rows) - 1, 0)).to(tl.int64)
    return r_anchor, (t0 + tl.maximum(n_rows - 1, 0)).to(tl.int64)


@triton.jit
def g_rows(gc, r_anchor, r_last, p_hk, o_k, m_k, n_rows, HV: tl.constexpr, K: tl.constexpr):
    """G's anchor row and last row over the K slice o_k, from the scratch gc
    [T, HV, K] fp32 (p_hk = head * K; zeros in a padded chunk, which has no
    rows)."""
    m_kr = m_k & (o_k * 0 < n_rows)
    b_A = tl.load(gc + r_anchor * (HV * K) + p_hk + o_k, mask=m_kr, other=0.)
    b_last = tl.load(gc + r_last * (HV * K) + p_hk + o_k, mask=m_kr, other=0.)
    return b_A, b_last


@triton.jit
def g_tile(gc, p_tk, m_t, m_k, b_last):
    """G [BT, BK] from the scratch gc; rows past the sequence repeat the last
    row (they add no decay, and keep every anchored factor bounded)."""
    b_G = tl.load(gc + p_tk, mask=m_t[:, None] & m_k[None, :], other=0.)
    return tl.where(m_t[:, None], b_G, b_last[None, :])


@triton.jit
def product_path(gc, r_anchor, r_last, p_hk, n_rows, HV: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr):
    """Which path the chunk's intra-chunk products take: 0 anchored, when
    for every channel the row factor e^(G_i - A) and the column factor
    e^(A - G_j) stay within e^(+-ANCHOR_SPAN), i.e. max(-A, A - G_last) <=
    ANCHOR_SPAN (G is a cumsum of log-decays <= 0: G_0 >= G_i >= G_last);
    1 blocked, when the chunk's depth max(-G_last) is within BLOCKED_DEPTH;
    2 exact pairwise. One decision for the whole chunk (two reductions
    across the program, once per chunk); the K slices are unrolled so that
    the row loads go out together."""
    b_span = tl.zeros([BK], dtype=tl.float32)
    b_depth = tl.zeros([BK], dtype=tl.float32)
    for ks in tl.static_range(0, K, BK):
        o_k = ks + tl.arange(0, BK)
        b_A, b_last = g_rows(gc, r_anchor, r_last, p_hk, o_k, o_k < K, n_rows, HV, K)
        b_span = tl.maximum(b_span, tl.maximum(-b_A, b_A - b_last))
        b_depth = tl.maximum(b_depth, -b_last)
    path = tl.where(tl.max(b_depth, axis=0) <= BLOCKED_DEPTH, 1, 2)
    return tl.where(tl.max(b_span, axis=0) <= ANCHOR_SPAN, 0, path)


@triton.jit
def suffix_exponent(b_g):
    """G_last - G_i = sum of the log-decays after row i, from the [BT, BK]
    log-decays: (reverse cumsum) - g, with error relative to |g_i| + the sum
    (g_i >= GATE_FLOOR), not to |G|."""
    return tl.cumsum(b_g, axis=0, reverse=True) - b_g


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
