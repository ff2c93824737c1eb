"""Reading and writing one program's [BK, BV] float32 state tile, shared by the
chunked state kernel and the decode kernel.

States are [N, HV, K, V] (or V-first [N, HV, V, K]); with INDEXED_STATE they
are the rows of a pool, read at read_idx[n] and written at write_idx[n], and
an index outside [0, slots) reads zeros and writes nothing. The index is a
branch, not a mask: a row that is not read is never touched.
"""

import triton
import triton.language as tl


@triton.jit
def state_offsets(o_v, m_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  STATE_V_FIRST: tl.constexpr):
    """(o_k, m_k, o_s, m_kv): K offsets and mask, and the tile's element offsets
    and mask within one [K, V] (or [V, K]) state."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if STATE_V_FIRST:
        o_s = o_v[None, :] * K + o_k[:, None]
    else:
        o_s = o_k[:, None] * V + o_v[None, :]
    return o_k, m_k, o_s, m_k[:, None] & m_v[None, :]


@triton.jit
def next_k_block(o_k, m_k, m_kv, m_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 STATE_V_FIRST: tl.constexpr):
    """(o_k, m_k, shift, m_kv) of the K block BK rows on, for a state held as
    two K blocks: its offsets are state_offsets' o_s plus the element shift
    (a constant), so that no second offset tile is live. When K fills both
    blocks its masks are the first block's (the same values)."""
    o_k1 = o_k + BK
    if K >= 2 * BK:
        m_k1 = m_k
        m_kv1 = m_kv
    else:
        m_k1 = o_k1 < K
        m_kv1 = m_k1[:, None] & m_v[None, :]
    if STATE_V_FIRST:
        shift: tl.constexpr = BK
    else:
        shift: tl.constexpr = BK * V
    return o_k1, m_k1, shift, m_kv1


@triton.jit
def load_state(h0, read_idx, slots, i_n, i_hv, o_s, m_kv, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_INITIAL_STATE: tl.constexpr, INDEXED_STATE: tl.constexpr):
    """Sequence i_n's initial state tile (zeros without one)."""
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        if INDEXED_STATE:
            i_r = tl.load(read_idx + i_n)
            if (i_r >= 0) & (i_r < slots):
                p_h0 = h0 + (i_r.to(tl.int64) * HV + i_hv) * K * V
                b_h = tl.load(p_h0 + o_s, mask=m_kv, other=0.).to(tl.float32)
        else:
            p_h0 = h0 + (i_n.to(tl.int64) * HV + i_hv) * K * V
            b_h = tl.load(p_h0 + o_s, mask=m_kv, other=0.).to(tl.float32)
    return b_h


@triton.jit
def _rounded(b_h, DT: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """The float32 tile b_h in the state buffer's dtype DT, rounded to nearest
    even. For bfloat16 without NATIVE_CAST the rounding is written out on the
    bits (NaN kept NaN), since Triton's interpreter truncates in its float32 ->
    bfloat16 cast: the same bits on every backend as XLA's rounding of a
    float32 state. Compiled, Triton's conversion rounds the same way (on
    sm90 one instruction per pair)."""
    if DT == tl.bfloat16 and not NATIVE_CAST:
        b_u = b_h.to(tl.uint32, bitcast=True)
        b_u = b_u + ((b_u >> 16) & 1) + 0x7FFF
        b_r = (b_u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(b_h != b_h, b_h.to(tl.bfloat16), b_r)
    else:
        return b_h.to(DT)


@triton.jit
def store_state_row(ht, b_h, i_w, slots, i_hv, o_s, m_kv, HV: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                    INDEXED_STATE: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """The final state tile into row ``i_w``, already known: a pool row loaded
    at the program's start (written only inside [0, slots)), or the sequence.
    A 16-bit pool gets the float32 tile rounded once, to nearest even
    (_rounded; NATIVE_CAST: by the conversion instruction)."""
    if STORE_FINAL_STATE:
        b_s = _rounded(b_h, ht.dtype.element_ty, NATIVE_CAST)
        if INDEXED_STATE:
            if (i_w >= 0) & (i_w < slots):
                p_ht = ht + (i_w.to(tl.int64) * HV + i_hv) * K * V
                tl.store(p_ht + o_s, b_s, mask=m_kv)
        else:
            p_ht = ht + (i_w.to(tl.int64) * HV + i_hv) * K * V
            tl.store(p_ht + o_s, b_s, mask=m_kv)


@triton.jit
def store_state(ht, b_h, write_idx, slots, i_n, i_hv, o_s, m_kv, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                INDEXED_STATE: tl.constexpr):
    """Sequence i_n's final state tile (its pool row loaded here)."""
    if STORE_FINAL_STATE:
        i_w = i_n
        if INDEXED_STATE:
            i_w = tl.load(write_idx + i_n)
        store_state_row(ht, b_h, i_w, slots, i_hv, o_s, m_kv, HV, K, V, STORE_FINAL_STATE,
                        INDEXED_STATE, False)
