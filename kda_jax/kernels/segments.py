"""The state chain over segments (docs/kda.md section 7): each segment's map,
then a fold of the maps along each sequence.

A segment (whole chunks of one sequence) maps its start state S to its end
state E + M S: E [K, V] is the end state from a zero start, M [K, K] the
product of its chunks' transitions diag(gl) - kt^T w. The map kernel runs
every segment's chunks at once (one program per segment, value head and block
of columns of [E | M]); the fold kernel walks each sequence's segments in
order (or in reverse, with M^T, for the state's cotangent) and writes the
state each segment starts from (ends at). The state passes then run per
segment from those states, all in parallel.

Both kernels hold the state whole in K: the glue segments only calls whose
state pass does (K <= 128, and not split in K halves as float32
intermediates are from K = 128 on, kda_jax.triton.forward.split_state_k).
Their metadata is host-built (kda_jax.segments.segment_tables), never a
runtime buffer: the fold's chain table is read unclamped.
"""

import triton
import triton.language as tl

from .common import dot, next_decay_row
from .varlen import seq_chunks, seq_span


@triton.jit
def kda_segment_map_kernel(
    w, u, kt, gl, meta, off_cu, off_co, n_tokens, n_chunk_rows,
    e, m,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
):
    """One program per (segment, value head, column block): blocks below
    cdiv(V, BV) are E's columns (a zero start, values u), the others M's (an
    identity start, no values). Each is the forward's state recurrence
    h <- diag(gl) h + kt^T (u - w h) over the segment's chunks, with the
    state pass's product precision (DOT; 16-bit operands for 16-bit
    intermediates), so the maps carry the rounding the unsegmented pass has.
    Writes e [S, HV, K, V] and m [S, HV, K, K], float32."""
    i_s, i_hv, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV: tl.constexpr = (V + BV - 1) // BV
    bos, eos = seq_span(meta, off_cu, i_s, n_tokens)
    c0, n_chunks = seq_chunks(meta, off_co, i_s, bos, eos, n_chunk_rows, BT)
    is_m = i_c >= NV
    col = i_c * BV + tl.arange(0, BV)  # E's columns, then M's
    o_c = tl.where(col >= NV * BV, col - NV * BV, col)
    m_c = tl.where(col >= NV * BV, o_c < K, o_c < V)
    m_u = m_c & (col < NV * BV)  # M's columns have no values
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t = tl.arange(0, BT)
    b_h = tl.where((o_k[:, None] == o_c[None, :]) & (col >= NV * BV)[None, :], 1.0, 0.0)
    b_h = b_h.to(tl.float32)
    b_gl_next = next_decay_row(gl, c0, 0, n_chunks, i_hv, o_k, m_k, HV, K)

    for i_t in range(0, n_chunks):
        b_gl = b_gl_next  # loaded a chunk ahead (common.next_decay_row)
        b_gl_next = next_decay_row(gl, c0, i_t + 1, n_chunks, i_hv, o_k, m_k, HV, K)
        rows = bos + i_t * BT + o_t
        m_t = rows < eos
        r64 = (rows.to(tl.int64) * HV + i_hv)
        p_k = r64[:, None] * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_u = tl.load(u + r64[:, None] * V + o_c[None, :], mask=m_t[:, None] & m_u[None, :],
                      other=0.).to(tl.float32)
        b_w = tl.load(w + p_k, mask=m_tk, other=0.)
        b_vnd = (b_u - dot(b_w, b_h.to(b_w.dtype), DOT)).to(b_w.dtype)
        b_kt = tl.load(kt + p_k, mask=m_tk, other=0.)
        b_h = b_h * b_gl[:, None] + dot(tl.trans(b_kt), b_vnd, DOT)

    base = i_s.to(tl.int64) * HV + i_hv
    m_kc = m_k[:, None] & m_c[None, :]
    if is_m:
        tl.store(m + base * K * K + o_k[:, None] * K + o_c[None, :], b_h, mask=m_kc)
    else:
        tl.store(e + base * K * V + o_k[:, None] * V + o_c[None, :], b_h, mask=m_kc)


@triton.jit
def kda_segment_fold_kernel(
    e, m, h0, meta, off_chains,
    s,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BJ: tl.constexpr, USE_H0: tl.constexpr, REVERSE: tl.constexpr,
    DOT: tl.constexpr,
):
    """One program per (chain, value head, V block); a chain is a sequence
    with segments, its row (first segment, count, sequence) of the chains
    table.

    Forward: from the sequence's state h0[n] (zeros without USE_H0), writes
    s[j] = the state segment j starts from, then carries e[j] + m[j] s[j].
    REVERSE: from the cotangent of the sequence's final state h0[n], walks
    the segments last to first, writes s[j] = the cotangent of segment j's
    end state and carries e[j] + m[j]^T s[j] (e then holds each segment's
    start cotangent from a zero end one).

    All [K, V] states float32, K-first. With BJ == BK the product takes
    m[j] whole, one [BK, BK] tile, and the state in registers. With BJ < BK
    no [K, K] tile is held: the product reads m[j] in BJ-column slices and
    the state just written back in BJ-row slices (global memory); each
    program reads back only the columns it wrote, after a barrier of its own
    threads (tl.debug_barrier, a workgroup barrier that orders global memory
    too on NVIDIA and AMD)."""
    i_c, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s0 = tl.load(meta + off_chains + 3 * i_c)
    count = tl.load(meta + off_chains + 3 * i_c + 1)
    i_n = tl.load(meta + off_chains + 3 * i_c + 2)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_s = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    o_j = tl.arange(0, BJ)
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s = tl.load(h0 + (i_n.to(tl.int64) * HV + i_hv) * K * V + o_s, mask=m_kv, other=0.)

    for i in range(0, count):
        i_s = s0 + i
        if REVERSE:
            i_s = s0 + count - 1 - i
        base = i_s.to(tl.int64) * HV + i_hv
        p_s = s + base * K * V
        tl.store(p_s + o_s, b_s, mask=m_kv)
        if i < count - 1:
            if BJ == BK:  # the map whole
                if REVERSE:
                    p_m = m + base * K * K + o_k[None, :] * K + o_k[:, None]
                else:
                    p_m = m + base * K * K + o_k[:, None] * K + o_k[None, :]
                b_m = tl.load(p_m, mask=m_k[:, None] & m_k[None, :], other=0.)
                b_s = tl.load(e + base * K * V + o_s, mask=m_kv, other=0.) + dot(b_m, b_s, DOT)
            else:
                tl.debug_barrier()  # the slices below are read by other threads
                b_s = tl.load(e + base * K * V + o_s, mask=m_kv, other=0.)
                for j in tl.static_range(0, BK, BJ):
                    o_c = j + o_j
                    m_c = o_c < K
                    if REVERSE:
                        p_m = m + base * K * K + o_c[None, :] * K + o_k[:, None]
                    else:
                        p_m = m + base * K * K + o_k[:, None] * K + o_c[None, :]
                    b_m = tl.load(p_m, mask=m_k[:, None] & m_c[None, :], other=0.)
                    b_p = tl.load(p_s + o_c[:, None] * V + o_v[None, :],
                                  mask=m_c[:, None] & m_v[None, :], other=0.,
                                  cache_modifier=".cg")
                    b_s += dot(b_m, b_p, DOT)
