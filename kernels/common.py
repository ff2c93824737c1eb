"""Pieces shared by the chunked kernels (chunk_fwd, chunk_bwd) and the decode
kernel: the product-precision helper, tile loads, a chunk's rows, the
chunk-local decay G read back from its buffer, and the decay factors of the
dyadic intra-chunk products (docs/kda.md section 3). The log-decay numerics
(in-kernel gate, floor, non-finite checks) are kernels/gate.py.

Names follow the kernels': b_ register tiles, o_ offsets, m_ masks, p_
pointers or element offsets; BT the chunk, BK / BV the K / V blocks.
"""

import triton
import triton.language as tl

from .varlen import chunk_span


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
def gather_rows(b_x, rows):
    """b_x [BT, N] at row rows[i] for each row i (rows [BT], within [0, BT))."""
    return tl.gather(b_x, tl.broadcast_to(rows[:, None], b_x.shape), 0)


@triton.jit
def level_factor(b_p, o_t, h):
    """The decay factors of level h of the dyadic intra-chunk products
    (docs/kda.md section 3): (second [BT, 1] int1, E [BT, BK] fp32). Level h
    pairs row i of the second h rows of an aligned 2h-row block with row j of
    its first h rows, e^(G_i - G_j) = E[i] E[j]: E[i] = e^(g summed from the
    start of i's h-row segment to i) on the second halves (second[i]), E[j] =
    e^(g summed after j to the end of its segment) on the first halves. Both
    are <= 1 for any gates. b_p [BT, BK] float64 is the chunk's cumsum of the
    log-decays (rows past the sequence repeat the last): the exponents are
    differences there, exact before their one rounding to float32."""
    b_second = ((o_t // h) % 2 == 1)[:, None]
    s = (o_t // h) * h
    b_before = tl.where((s > 0)[:, None], gather_rows(b_p, tl.maximum(s - 1, 0)), 0.)
    b_exp = tl.where(b_second, b_p - b_before, gather_rows(b_p, s + h - 1) - b_p)
    return b_second, tl.exp(b_exp.to(tl.float32))


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
