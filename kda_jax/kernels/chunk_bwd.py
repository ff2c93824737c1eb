"""Chunked KDA backward: the kernels after a recompute (docs/kda.md sections 3 and 4).

The kernels see the *transformed* inputs (L2 norm, gate and beta transforms
are applied and differentiated in JAX by the caller, kda_jax.triton.backward):
q, k [T, H, K]; v [T, HV, V]; g [T, HV, K] the log-decay; beta [T, HV].
Per chunk, with G the chunk-local cumsum of g, L = diag(beta) strict_lower(Akk),
X = (I + L)^-1, B = beta k e^G, w = X B, u = X (beta v):

  v_new = u - w h,  o = qg h + Aqk v_new,  h' = gl h + kt^T v_new
  (qg = scale q e^G, kt = k e^(G_last - G), gl = e^(G_last)).

With dS the cotangent of a chunk's end state (dS of the last chunk = the
final state's cotangent), the backward is

  dv_new = Aqk^T do + kt dS,     dh = gl dS + qg^T do - w^T dv_new
  dqg = do h^T,  dw = -dv_new h^T,  dkt = v_new dS^T,  dgl = sum_V(dS h)
  dAqk = do v_new^T (lower),  M = dw w^T + dv_new u^T,  dL = -X^T M (strictly lower)
  dB = X^T dw,  d(beta v) = X^T dv_new,  dAkk = beta dL,
  then the products Akk, Aqk back to q, k, G, and dg = reverse cumsum of dG.

Kernels, in launch order (all recompute from the inputs; nothing is kept from
the forward). First the forward's kda_fwd_prepare_kernel (chunk_fwd) with
STORE_X, grid (chunks, HV): w, u, qg, kt, Aqk, gl, G and X^T. Then:
  kda_bwd_state_kernel    grid (sequences, HV, V blocks): h per chunk, v_new.
  kda_bwd_dstate_kernel   grid (sequences, HV, V blocks): walks chunks in
                          reverse: dS per chunk, dv_new, the initial state's
                          gradient (only that without STORE_CHUNKS).
  (Segmented, kda_jax.triton.state_chain: both state passes per segment, the
  reverse one twice, and the segments' bounds as the sequences.)
  Then per chunk either the three kernels below or kda_bwd_grads_kernel:
  kda_bwd_inter_kernel    grid (chunks, HV, K blocks): the state terms dqg,
                          dw, dkt, dgl, turned into partial dq, dk, dG.
  kda_bwd_wy_kernel       grid (chunks, HV): everything that needs X: dv,
                          dbeta's WY terms, B's terms of dk and dG, and
                          dL = -X^T M (the inverse's backward).
  kda_bwd_intra_kernel    grid (chunks x K blocks, HV): the intra-chunk
                          products back to dq, dk, dG; dg = reverse cumsum.
  kda_bwd_grads_kernel    grid (chunks, HV): the three kernels' work in one
                          program per chunk, in their place where the
                          config says (BackwardConfig.grads_for) and K, V
                          are multiples of its blocks: M = dv_new v_new^T,
                          dw in registers, the partials in the outputs.

Layouts: h, dS [NC, HV, K, V] fp32 (K first, whatever the state layout);
v_new, dv_new [T, HV, V] and w, qg, kt, aqk as the forward's (work dtype);
X, dL and scale * dAqk [T, HV, BT] fp32; between the three kernels partial
dq, dk, dG and dw [T, HV, K] fp32. dq and dk are per value head (the caller
sums a GVA group); with the three kernels dbeta comes in two parts (the wy
kernel's [T, HV] and the intra kernel's [T, HV, NK]) that the caller adds,
the fused kernel writes it whole. Varlen metadata as chunk_fwd, clamped by
kernels.varlen (n_bounds, n_tokens, n_chunk_rows as there).

Exponents stay bounded as in the forward: e^G, e^(G_last - G) and e^(G_last)
have exponents <= 0, and the products' backward takes the forward's
two-level factors (common.chunk_exponents, from the log-decays g, which the
caller floors at GATE_FLOOR): one path for every gate. The inter
kernel takes e^(G_last - G) as partial sums of g, with error relative to
themselves, not to |G|.
"""

import triton
import triton.language as tl

from .common import (BD, anchored_mask, chunk_exponents, chunk_rows, decay_row, dot,
                     g_last_row, g_tile, next_decay_row, tile)
from .state_io import load_state, next_k_block, state_offsets, store_state
from .varlen import seq_chunks, seq_span


@triton.jit
def _decay(gc, t0, n_rows, rows, m_t, i_hv, o_k, m_k, BT: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr):
    """(G [BT, BK], its last row) over the K slice o_k, from the recompute's
    G gc [T, HV, K] (no cumsum here); rows past the sequence repeat the last
    row, as a cumsum over them would."""
    b_last = g_last_row(gc, t0, n_rows, i_hv * K, o_k, m_k, HV, K)
    p_tk = rows.to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    return g_tile(gc, p_tk, m_t, m_k, b_last), b_last


@triton.jit
def _seq_program(i_n, meta, off_cu, off_co, n_tokens, n_chunk_rows, V: tl.constexpr,
                 BT: tl.constexpr, BV: tl.constexpr):
    """A state pass's program for sequence i_n (grid axes 1 and 2: value
    head, V block): (i_hv, bos, eos, its first chunk row c0, n_chunks, o_v,
    o_t, m_v)."""
    i_hv, i_v = tl.program_id(1), tl.program_id(2)
    bos, eos = seq_span(meta, off_cu, i_n, n_tokens)
    c0, n_chunks = seq_chunks(meta, off_co, i_n, bos, eos, n_chunk_rows, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    return i_hv, bos, eos, c0, n_chunks, o_v, tl.arange(0, BT), o_v < V


@triton.jit
def _seq_chunk(bos, eos, c0, i_t, o_t, i_hv, o_k, m_k, o_v, m_v, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Offsets and masks of chunk i_t of a state pass's sequence: (m_t, rows
    as int64, [BT, K] and [BT, V] offsets, their masks, the chunk row i_c,
    and the offsets of its [K, V] state in h / dS)."""
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    r64 = rows.to(tl.int64)
    p_k = (r64 * HV + i_hv)[:, None] * K + o_k[None, :]
    p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
    i_c = (c0 + i_t).to(tl.int64)
    p_h = ((i_c * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
    return (m_t, r64, p_k, p_v, m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :], i_c,
            p_h)


@triton.jit
def kda_bwd_state_kernel(
    w, u, kt, gl, h0, meta, off_cu, off_co, n_tokens, n_chunk_rows,
    h, vn,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """The forward state pass again, storing the state at each chunk's start
    (h: float32, or the intermediates' dtype, BackwardConfig.chunk_states) and
    v_new; one program per (sequence, value head, V block). SPLIT_K: the state
    is two [BK, BV] tiles, as the forward's."""
    _state_pass(w, u, kt, gl, h0, meta, off_cu, off_co, n_tokens, n_chunk_rows, h, vn,
                tl.program_id(0), HV, K, V, BT, BK, BV, USE_INITIAL_STATE, STATE_V_FIRST, DOT,
                SPLIT_K)


@triton.jit
def _state_pass(
    w, u, kt, gl, h0, meta, off_cu, off_co, n_tokens, n_chunk_rows, h, vn, i_n,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """kda_bwd_state_kernel's body for sequence i_n."""
    i_hv, bos, eos, c0, n_chunks, o_v, o_t, m_v = _seq_program(
        i_n, meta, off_cu, off_co, n_tokens, n_chunk_rows, V, BT, BV)
    o_k, m_k, o_s, m_kv = state_offsets(o_v, m_v, K, V, BK, STATE_V_FIRST)
    b_h = load_state(h0, h0, 0, i_n, i_hv, o_s, m_kv, HV, K, V, BK, BV, USE_INITIAL_STATE,
                     False)
    if SPLIT_K:
        o_k1, m_k1, shift, m_kv1 = next_k_block(o_k, m_k, m_kv, m_v, K, V, BK,
                                                  STATE_V_FIRST)
        b_h1 = load_state(h0 + shift, h0, 0, i_n, i_hv, o_s, m_kv1, HV, K, V, BK, BV,
                          USE_INITIAL_STATE, False)
    else:
        b_gl_next = next_decay_row(gl, c0, 0, n_chunks, i_hv, o_k, m_k, HV, K)

    for i_t in range(0, n_chunks):
        if not SPLIT_K:
            b_gl = b_gl_next  # loaded a chunk ahead (common.next_decay_row)
            b_gl_next = next_decay_row(gl, c0, i_t + 1, n_chunks, i_hv, o_k, m_k, HV, K)
        m_t, r64, p_k, p_v, m_tk, m_tv, i_c, p_h = _seq_chunk(
            bos, eos, c0, i_t, o_t, i_hv, o_k, m_k, o_v, m_v, HV, K, V, BT)
        tl.store(h + p_h, b_h.to(h.dtype.element_ty), mask=m_kv)
        if SPLIT_K:
            m_tk1 = m_t[:, None] & m_k1[None, :]
            tl.store(h + BK * V + p_h, b_h1.to(h.dtype.element_ty), mask=m_kv1)
        b_w = tl.load(w + p_k, mask=m_tk, other=0.)
        b_kt = tl.load(kt + p_k, mask=m_tk, other=0.)
        b_u = tl.load(u + p_v, mask=m_tv, other=0.).to(tl.float32)
        if SPLIT_K:
            b_gl = decay_row(gl, i_c, i_hv, o_k, m_k, HV, K)
        b_vn = b_u - dot(b_w, b_h.to(b_w.dtype), DOT)
        if SPLIT_K:
            b_w = tl.load(w + BK + p_k, mask=m_tk1, other=0.)
            b_vn -= dot(b_w, b_h1.to(b_w.dtype), DOT)
        b_vnd = b_vn.to(b_w.dtype)
        tl.store(vn + p_v, b_vnd.to(vn.dtype.element_ty), mask=m_tv)
        b_h = b_h * b_gl[:, None] + dot(tl.trans(b_kt), b_vnd, DOT)
        if SPLIT_K:
            b_kt = tl.load(kt + BK + p_k, mask=m_tk1, other=0.)
            b_gl = decay_row(gl, i_c, i_hv, o_k1, m_k1, HV, K)
            b_h1 = b_h1 * b_gl[:, None] + dot(tl.trans(b_kt), b_vnd, DOT)


@triton.jit
def kda_bwd_dstate_kernel(
    qg, kt, w, aqk, gl, do, dht, meta, off_cu, off_co, n_tokens, n_chunk_rows,
    dh, dvn, dh0,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_FINAL_GRAD: tl.constexpr,
    STORE_INITIAL_GRAD: tl.constexpr, STATE_V_FIRST: tl.constexpr, DOT: tl.constexpr,
    SPLIT_K: tl.constexpr, STORE_CHUNKS: tl.constexpr,
):
    """The state's cotangent, carried from the final state back over the
    chunks in reverse: stores dS (the cotangent of each chunk's end state,
    float32 or the intermediates' dtype, as h), dv_new, and the initial state's gradient. SPLIT_K: dS is two
    [BK, BV] tiles, as the forward's state. Without STORE_CHUNKS only the
    initial state's gradient is stored (a segment's own contribution,
    kda_jax.triton.state_chain)."""
    _dstate_pass(qg, kt, w, aqk, gl, do, dht, meta, off_cu, off_co, n_tokens, n_chunk_rows,
                 dh, dvn, dh0, tl.program_id(0), HV, K, V, BT, BK, BV, USE_FINAL_GRAD,
                 STORE_INITIAL_GRAD, STATE_V_FIRST, DOT, SPLIT_K, STORE_CHUNKS)


@triton.jit
def _dstate_pass(
    qg, kt, w, aqk, gl, do, dht, meta, off_cu, off_co, n_tokens, n_chunk_rows,
    dh, dvn, dh0, i_n,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_FINAL_GRAD: tl.constexpr,
    STORE_INITIAL_GRAD: tl.constexpr, STATE_V_FIRST: tl.constexpr, DOT: tl.constexpr,
    SPLIT_K: tl.constexpr, STORE_CHUNKS: tl.constexpr,
):
    """kda_bwd_dstate_kernel's body for sequence i_n."""
    i_hv, bos, eos, c0, n_chunks, o_v, o_t, m_v = _seq_program(
        i_n, meta, off_cu, off_co, n_tokens, n_chunk_rows, V, BT, BV)
    o_k, m_k, o_s, m_kv = state_offsets(o_v, m_v, K, V, BK, STATE_V_FIRST)
    # The final state's cotangent, laid out as the states are.
    b_dh = load_state(dht, dht, 0, i_n, i_hv, o_s, m_kv, HV, K, V, BK, BV, USE_FINAL_GRAD,
                      False)
    if SPLIT_K:
        o_k1, m_k1, shift, m_kv1 = next_k_block(o_k, m_k, m_kv, m_v, K, V, BK,
                                                  STATE_V_FIRST)
        b_dh1 = load_state(dht + shift, dht, 0, i_n, i_hv, o_s, m_kv1, HV, K, V, BK, BV,
                           USE_FINAL_GRAD, False)

    for s in range(0, n_chunks):
        i_t = n_chunks - 1 - s
        m_t, r64, p_k, p_v, m_tk, m_tv, i_c, p_h = _seq_chunk(
            bos, eos, c0, i_t, o_t, i_hv, o_k, m_k, o_v, m_v, HV, K, V, BT)
        if STORE_CHUNKS:
            tl.store(dh + p_h, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        if SPLIT_K:
            # The products with dS first, one K half at a time; the tiles used
            # transposed are loaded [BK, BT] (K contiguous) instead: transposing
            # loaded [BT, BK] float32 tiles spilled 200-500 bytes on sm90
            # (bench.aot).
            p_kt = (r64 * HV + i_hv)[None, :] * K + o_k[:, None]
            m_kt = m_k[:, None] & m_t[None, :]
            m_kt1 = m_k1[:, None] & m_t[None, :]
            m_tk1 = m_t[:, None] & m_k1[None, :]
            if STORE_CHUNKS:
                tl.store(dh + BK * V + p_h, b_dh1.to(dh.dtype.element_ty), mask=m_kv1)
            b_kt = tl.load(kt + p_k, mask=m_tk, other=0.)
            b_dvn = dot(b_kt, b_dh.to(b_kt.dtype), DOT)
            b_kt = tl.load(kt + BK + p_k, mask=m_tk1, other=0.)
            b_dvn += dot(b_kt, b_dh1.to(b_kt.dtype), DOT)
            b_at = tl.load(aqk + (r64 * HV + i_hv)[None, :] * BT + o_t[:, None],
                           mask=m_t[None, :], other=0.)
            b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(b_at.dtype)
            b_dvn += dot(b_at, b_do, DOT)
            b_dvnd = b_dvn.to(b_kt.dtype)
            if STORE_CHUNKS:
                tl.store(dvn + p_v, b_dvnd.to(dvn.dtype.element_ty), mask=m_tv)
            b_gl = decay_row(gl, i_c, i_hv, o_k, m_k, HV, K)
            b_qgt = tl.load(qg + p_kt, mask=m_kt, other=0.)
            b_dh = b_dh * b_gl[:, None] + dot(b_qgt, b_do, DOT)
            b_wt = tl.load(w + p_kt, mask=m_kt, other=0.)
            b_dh -= dot(b_wt, b_dvnd, DOT)
            b_gl = decay_row(gl, i_c, i_hv, o_k1, m_k1, HV, K)
            b_qgt = tl.load(qg + BK + p_kt, mask=m_kt1, other=0.)
            b_dh1 = b_dh1 * b_gl[:, None] + dot(b_qgt, b_do, DOT)
            b_wt = tl.load(w + BK + p_kt, mask=m_kt1, other=0.)
            b_dh1 -= dot(b_wt, b_dvnd, DOT)
        else:
            # Each [BT, K] tile is loaded just before its product, so that one
            # at a time is live (K = 256 and float32 tiles are tight in registers);
            # the decay row first, so that its latency passes under the products
            # (carried from the step before, as the forward's is, it spilled at
            # K = 100 on sm90).
            b_gl = decay_row(gl, i_c, i_hv, o_k, m_k, HV, K)
            b_a = tl.load(aqk + (r64 * HV + i_hv)[:, None] * BT + o_t[None, :],
                          mask=m_t[:, None], other=0.)
            b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(b_a.dtype)
            b_dvn = dot(tl.trans(b_a), b_do, DOT)
            b_kt = tl.load(kt + p_k, mask=m_tk, other=0.)
            b_dvn += dot(b_kt, b_dh.to(b_kt.dtype), DOT)
            b_dvnd = b_dvn.to(b_kt.dtype)
            if STORE_CHUNKS:
                tl.store(dvn + p_v, b_dvnd.to(dvn.dtype.element_ty), mask=m_tv)
            b_qg = tl.load(qg + p_k, mask=m_tk, other=0.)
            b_dh = b_dh * b_gl[:, None] + dot(tl.trans(b_qg), b_do, DOT)
            b_w = tl.load(w + p_k, mask=m_tk, other=0.)
            b_dh -= dot(tl.trans(b_w), b_dvnd, DOT)

    store_state(dh0, b_dh, dh0, 0, i_n, i_hv, o_s, m_kv, HV, K, V, STORE_INITIAL_GRAD, False)
    if SPLIT_K:
        store_state(dh0 + shift, b_dh1, dh0, 0, i_n, i_hv, o_s, m_kv1, HV, K, V,
                    STORE_INITIAL_GRAD, False)


@triton.jit
def kda_bwd_inter_kernel(
    q, k, gc, g, h, dh, vn, dvn, do, meta, off_cu, off_ct, n_bounds, n_tokens,
    dq, dk, dg, dw,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    DOT: tl.constexpr,
):
    """The terms that go through the state (_state_terms), for one chunk and
    K block, written as partial dq, dk, dG (fp32) and dw."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    t0, n_rows, o_t, rows, m_t, r64 = chunk_rows(meta, off_cu, off_ct, i_c, n_bounds,
                                                  n_tokens, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_dq, b_dk, b_dG, b_dw, _, _, _, _ = _state_terms(
        q, k, gc, g, h, dh, vn, dvn, do, i_c, i_h, i_hv, t0, n_rows, o_t, rows, m_t, r64, o_k,
        m_k, H, HV, K, V, BT, BV, SCALE, DOT)
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = r64[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    tl.store(dq + p_tk, b_dq, mask=m_tk)
    tl.store(dk + p_tk, b_dk, mask=m_tk)
    tl.store(dg + p_tk, b_dG, mask=m_tk)
    tl.store(dw + p_tk, b_dw, mask=m_tk)


@triton.jit
def _state_terms(q, k, gc, g, h, dh, vn, dvn, do, i_c, i_h, i_hv, t0, n_rows, o_t, rows, m_t,
                 r64, o_k, m_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
                 DOT: tl.constexpr):
    """The terms that go through the state, for one chunk and the K block
    o_k: dqg = do h^T, dw = -dv_new h^T, dkt = v_new dS^T and
    dgl = sum_V(dS h), turned into (dq, dk, dG, dw) [BT, BK] fp32 (dq, dk,
    dG partial), and the tiles it loaded after the products: q, k, the
    log-decays g and e^G (the fused kernel's other terms take them; the
    inter kernel drops them). dG's row n_rows - 1 also carries the gradient
    of G_last, which the reverse cumsum hands to every row of the chunk."""
    BK: tl.constexpr = o_k.shape[0]
    i_c64 = i_c.to(tl.int64)
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkt = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)
    for vs in range(0, V, BV):
        o_v = vs + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
        p_h = ((i_c64 * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
        b_vn = tl.load(vn + p_v, mask=m_tv, other=0.)
        b_dvn = tl.load(dvn + p_v, mask=m_tv, other=0.)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(b_vn.dtype)
        b_h = tl.load(h + p_h, mask=m_kv, other=0.)
        b_dh = tl.load(dh + p_h, mask=m_kv, other=0.)
        b_hd = b_h.to(b_vn.dtype)
        b_dqg += dot(b_do, tl.trans(b_hd), DOT)
        b_dw -= dot(b_dvn, tl.trans(b_hd), DOT)
        b_dkt += dot(b_vn, tl.trans(b_dh.to(b_vn.dtype)), DOT)
        b_dgl += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), axis=1)

    b_G, b_last = _decay(gc, t0, n_rows, rows, m_t, i_hv, o_k, m_k, BT, HV, K)
    b_q = tile(q, rows, m_t, i_h, o_k, m_k, H, K)
    b_k = tile(k, rows, m_t, i_h, o_k, m_k, H, K)
    b_eg = tl.exp(b_G)
    b_g = tile(g, rows, m_t, i_hv, o_k, m_k, HV, K)
    _, b_sfx, _, _, _, _ = chunk_exponents(b_g)
    b_et = tl.exp(b_sfx)
    b_kt = b_k * b_et
    b_dq = b_dqg * b_eg * SCALE
    b_dk = b_dkt * b_et
    # kt's exponent G_last - G_i is identically 0 on the last row: that row's
    # term goes to neither dG_last nor -dG_i. Adding it to both would leave
    # float32 residue of its O(1) size where the true dG is below 1e-16
    # (fully decayed channels), which the reverse cumsum spreads over the chunk.
    b_dkte = tl.where(o_t[:, None] == n_rows - 1, 0., b_dkt * b_kt)
    b_dG = b_dqg * b_q * b_eg * SCALE - b_dkte
    b_dlast = tl.sum(b_dkte, axis=0) + b_dgl * tl.exp(b_last)
    b_dG += tl.where(o_t[:, None] == n_rows - 1, b_dlast[None, :], 0.)
    return b_dq, b_dk, b_dG, b_dw, b_q, b_k, b_g, b_eg


@triton.jit
def _anchored_products_bwd(b_q, b_k, b_g, b_b, b_dl, b_daqs, b_dl1, b_daqs1, o_t,
                           DOT: tl.constexpr, BATCHED: tl.constexpr):
    """Backward of the forward's two-level intra-chunk products
    (chunk_fwd._anchored_accumulate; docs/kda.md section 3) over one K slice:
    per level, the row factors R and column factors C with e_ij = R_i C_j on
    its pairs (common.chunk_exponents), and four masked products. b_g: the
    log-decays [BT, BK]; b_dl = dL and b_daqs = dAqk without its diagonal
    ([BT, BT]); with BATCHED, b_dl1 and b_daqs1 their BD-row diagonal
    blocks on level 1's pairs alone ([BT / BD, BD, BD], _level1_blocks),
    and level 1's products run batched over those blocks as the forward's
    do (unused otherwise); b_b = beta.
    The diagonal (e^0, dAqk's only: dL is strictly lower) is the caller's.

    Returns (Qd, Dk, P) for this K slice: Qd_i = sum_j dAqk_ij k_j e_ij,
    Dk_j = sum_i (beta_i dL_ij k_i + dAqk_ij q_i) e_ij and
    P_i = sum_j dL_ij k_j e_ij, e_ij = e^(G_i - G_j), i > j."""
    b_dlb = b_dl * b_b[:, None]
    _, _, b_r0, b_c0, b_r1, b_c1 = chunk_exponents(b_g)
    b_qd, b_dk, b_pk = _anchored_level_bwd(b_q, b_k, tl.exp(b_r0), tl.exp(b_c0),
                                           anchored_mask(o_t, 0), b_dl, b_dlb, b_daqs, DOT)
    if BATCHED:
        e_qd, e_dk, e_pk = _level1_batched_bwd(b_q, b_k, tl.exp(b_r1), tl.exp(b_c1), b_b, b_dl1,
                                               b_daqs1, DOT)
    else:
        e_qd, e_dk, e_pk = _anchored_level_bwd(b_q, b_k, tl.exp(b_r1), tl.exp(b_c1),
                                               anchored_mask(o_t, 1), b_dl, b_dlb, b_daqs, DOT)
    return b_qd + e_qd, b_dk + e_dk, b_pk + e_pk


@triton.jit
def _anchored_level_bwd(b_q, b_k, b_r, b_c, m_l, b_dl, b_dlb, b_daqs, DOT: tl.constexpr):
    """One level of _anchored_products_bwd: (Qd, Dk, P) over the pairs m_l."""
    b_dam = tl.where(m_l, b_daqs, 0.)
    b_dkc = dot(tl.trans(tl.where(m_l, b_dlb, 0.)), b_k * b_r, DOT)
    b_dkc = dot(tl.trans(b_dam), b_q * b_r, DOT, b_dkc)
    b_kc = b_k * b_c
    b_qd = b_r * dot(b_dam, b_kc, DOT)
    b_pk = b_r * dot(tl.where(m_l, b_dl, 0.), b_kc, DOT)
    return b_qd, b_c * b_dkc, b_pk


@triton.jit
def _level1_batched_bwd(b_q, b_k, b_r, b_c, b_b, b_dl1, b_daqs1, DOT: tl.constexpr):
    """Level 1 of _anchored_products_bwd batched over its BD-row diagonal
    blocks (b_dl1, b_daqs1: [BT / BD, BD, BD], its pairs alone): (Qd, Dk,
    P) as _anchored_level_bwd's, [BT, BK]."""
    BT: tl.constexpr = b_q.shape[0]
    BK: tl.constexpr = b_q.shape[1]
    NB: tl.constexpr = BT // BD
    b_dlb1 = b_dl1 * tl.reshape(b_b, [NB, BD, 1])
    b_dkc = dot(tl.permute(b_dlb1, (0, 2, 1)), tl.reshape(b_k * b_r, [NB, BD, BK]), DOT)
    b_dkc = dot(tl.permute(b_daqs1, (0, 2, 1)), tl.reshape(b_q * b_r, [NB, BD, BK]), DOT,
                b_dkc)
    b_kc = tl.reshape(b_k * b_c, [NB, BD, BK])
    b_qd = b_r * tl.reshape(dot(b_daqs1, b_kc, DOT), [BT, BK])
    b_pk = b_r * tl.reshape(dot(b_dl1, b_kc, DOT), [BT, BK])
    return b_qd, b_c * tl.reshape(b_dkc, [BT, BK]), b_pk


@triton.jit
def _level1_blocks(x, t0, n_rows, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """The BD-row diagonal blocks of the chunk's [BT, BT] tile of x [T, HV, BT]
    on level 1's pairs (i > j in one BR-row block; 0 elsewhere and on rows
    past the chunk), [BT / BD, BD, BD] fp32, loaded as such."""
    o_b = tl.arange(0, BT // BD)[:, None, None] * BD
    o_d = tl.arange(0, BD)
    o_r = o_d[None, :, None]
    m_1 = anchored_mask(o_d, 1)[None, :, :] & (o_b + o_r < n_rows)
    p_1 = ((t0 + o_b + o_r).to(tl.int64) * HV + i_hv) * BT + o_b + o_d[None, None, :]
    return tl.load(x + p_1, mask=m_1, other=0.).to(tl.float32)


@triton.jit
def _dot_16(a, b, DOT: tl.constexpr):
    """a @ b, float32 accumulate, for operands that may be 16-bit: a native
    16-bit product when a and b are 16-bit of one type (their products are
    exact in float32); under "bf16x3" with float32 a and bfloat16 b (exact in
    bf16, its low half zero), a's two-term split times b: the sum bf16x3
    forms, less its zero term and without b's float32 copy and split held in
    registers; else in float32 at precision DOT (as common.dot)."""
    if a.dtype == b.dtype and a.dtype.primitive_bitwidth == 16:
        return tl.dot(a, b)
    elif DOT == "bf16x3" and b.dtype == tl.bfloat16:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a_hi, b, tl.dot(a_lo, b))
    else:
        return dot(a.to(tl.float32), b.to(tl.float32), DOT)


@triton.jit
def _x_transposed(x, p_tt, m_t):
    """X^T of the chunk (the recompute stores it transposed). Loaded at each
    use rather than held: a [BT, BT] fp32 tile live across the loops, split
    for fp32-grade products, spills on sm90 (X^T stays in L1/L2)."""
    return tl.load(x + p_tt, mask=m_t[:, None], other=0.)


@triton.jit
def _xt_dot(x, b, t0, n_rows, r64, m_t, i_hv, o_c, m_c, HV: tl.constexpr, N: tl.constexpr,
            BT: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr):
    """X^T B for B the chunk's rows of b [T, HV, N] at columns o_c (BC of
    them, mask m_c): [BT, BC] fp32. Under "bf16x3" the token (contraction)
    dimension runs in two halves, an X^T column half times a B row half,
    each loaded where it is multiplied: a split product holds its operands
    twice, and halves of them fit gfx1250's waves at occupancy 6
    (docs/tuning.md, "AMD product precisions"); other precisions take one
    product (halves spill sm90's float32 form)."""
    HALF: tl.constexpr = BT // 2 if DOT == "bf16x3" else BT
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for h in tl.static_range(0, BT, HALF):
        o_h = h + tl.arange(0, HALF)
        r_h = (t0 + o_h).to(tl.int64)
        b_bh = tl.load(b + (r_h * HV + i_hv)[:, None] * N + o_c[None, :],
                       mask=(o_h < n_rows)[:, None] & m_c[None, :], other=0.)
        b_xh = tl.load(x + (r64 * HV + i_hv)[:, None] * BT + o_h[None, :],
                       mask=m_t[:, None], other=0.)
        acc += _dot_16(b_xh, b_bh, DOT)
    return acc


@triton.jit
def _v_terms(x, dvn, v, dv, b_b, t0, n_rows, r64, m_t, i_hv, o_v, HV: tl.constexpr,
             V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, DOT_X: tl.constexpr):
    """d(beta v) = X^T dv_new over the V block o_v: stores dv = beta X^T dv_new
    and returns dbeta's v term, sum over the block of X^T dv_new * v [BT]."""
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
    b_dvb = _xt_dot(x, dvn, t0, n_rows, r64, m_t, i_hv, o_v, o_v < V, HV, V, BT, BV, DOT_X)
    tl.store(dv + p_v, (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
    b_v = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
    return tl.sum(b_dvb * b_v, axis=1)


@triton.jit
def _store_dl(dl, x, b_m, p_tt, o_t, m_t, DOT_X: tl.constexpr):
    """dL = -X^T M, strictly lower, into the chunk's rows of dl [T, HV, BT]."""
    b_dl = dot(_x_transposed(x, p_tt, m_t), b_m, DOT_X)
    tl.store(dl + p_tt, tl.where(o_t[:, None] > o_t[None, :], -b_dl, 0.), mask=m_t[:, None])


@triton.jit
def _b_terms(b_dB, b_k, b_eg, b_b):
    """B = beta k e^G back to k, G and beta from dB = X^T dw ([BT, BK]; b_eg =
    e^G, b_b = beta [BT]): (dk, dG, dbeta) terms, the last summed over the
    K block ([BT])."""
    b_keg = b_k * b_eg
    return b_dB * b_b[:, None] * b_eg, b_dB * b_keg * b_b[:, None], tl.sum(b_dB * b_keg, axis=1)


@triton.jit
def kda_bwd_wy_kernel(
    k, v, gc, beta, x, w, u, vn, dvn, do, dk_p, dg_p, dw, meta, off_cu, off_ct, n_bounds,
    n_tokens,
    dv, dk_w, dg_w, dl, daqk, dbeta,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    DOT_X: tl.constexpr,
):
    """Per chunk, everything that goes through X: dv and dbeta's v term
    (d(beta v) = X^T dv_new); B's terms of dk, dG and dbeta (dB = X^T dw,
    added to the inter kernel's partials: dk_w, dg_w); dL = -X^T M with
    M = dv_new u^T + dw w^T (strictly lower) and scale * dAqk, both stored
    [T, HV, BT] fp32 for the products kernel. Only X^T is needed (loaded
    transposed); w and u are the recompute's. DOT_X: the precision of the
    dots with X^T and of dw w^T, as common.dot (fp32-grade: "ieee" or
    "tf32x3"); do v_new^T and dv_new u^T multiply 16-bit intermediates
    natively (exact products) and take DOT_X only for float32 ones."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    t0, n_rows, o_t, rows, m_t, r64 = chunk_rows(meta, off_cu, off_ct, i_c, n_bounds,
                                                  n_tokens, BT)
    i_h = i_hv // (HV // H)
    b_b = tl.load(beta + r64 * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    p_tt = (r64 * HV + i_hv)[:, None] * BT + o_t[None, :]

    # V blocks, twice, so that at most one [BT, BT] fp32 accumulator is live
    # beside X^T: first dAqk = do v_new^T, then dv, dbeta's v term and
    # M = dv_new u^T.
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    for vs in range(0, V, BV):
        o_v = vs + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
        b_vn = tl.load(vn + p_v, mask=m_tv, other=0.)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.)
        b_daqk += _dot_16(b_do, tl.trans(b_vn), DOT_X)
    tl.store(daqk + p_tt, tl.where(o_t[:, None] >= o_t[None, :], b_daqk * SCALE, 0.),
             mask=m_t[:, None])

    b_m = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for vs in range(0, V, BV):
        o_v = vs + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
        b_u = tl.load(u + p_v, mask=m_tv, other=0.)
        b_dvn = tl.load(dvn + p_v, mask=m_tv, other=0.)
        b_m += _dot_16(b_dvn, tl.trans(b_u), DOT_X)
        b_db += _v_terms(x, dvn, v, dv, b_b, t0, n_rows, r64, m_t, i_hv, o_v, HV, V, BT, BV,
                         DOT_X)

    # K blocks: M += dw w^T, and dB = X^T dw into dk, dG, dbeta.
    for ks in range(0, K, BK):
        o_k = ks + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = r64[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.)
        b_dw = tl.load(dw + p_tk, mask=m_tk, other=0.)
        b_m += _dot_16(b_dw, tl.trans(b_w), DOT_X)
        b_dB = _xt_dot(x, dw, t0, n_rows, r64, m_t, i_hv, o_k, m_k, HV, K, BT, BK, DOT_X)
        b_G, _ = _decay(gc, t0, n_rows, rows, m_t, i_hv, o_k, m_k, BT, HV, K)
        e_dk, e_dG, e_db = _b_terms(b_dB, tile(k, rows, m_t, i_h, o_k, m_k, H, K),
                                    tl.exp(b_G), b_b)
        b_db += e_db
        tl.store(dk_w + p_tk, tl.load(dk_p + p_tk, mask=m_tk, other=0.) + e_dk, mask=m_tk)
        tl.store(dg_w + p_tk, tl.load(dg_p + p_tk, mask=m_tk, other=0.) + e_dG, mask=m_tk)

    _store_dl(dl, x, b_m, p_tt, o_t, m_t, DOT_X)
    tl.store(dbeta + r64 * HV + i_hv, b_db, mask=m_t)


@triton.jit
def _product_terms(b_q, b_k, b_g, b_b, dl, daqk, t0, n_rows, o_t, r64, m_t, i_hv,
                   HV: tl.constexpr, BT: tl.constexpr, DOT_A: tl.constexpr,
                   BATCHED: tl.constexpr):
    """The intra-chunk products back to q, k and G over one K slice: (dq,
    dk, dG) terms [BT, BK] and dbeta's term summed over the slice [BT].
    b_q, b_k, b_g (log-decays) [BT, BK], b_b = beta; dL and scale * dAqk
    are the chunk's rows of dl and daqk [T, HV, BT] fp32, loaded here (with
    BATCHED, level 1's diagonal blocks as such: _level1_blocks).

    dAqk's diagonal (factor e^(G_i - G_i) = 1) goes to dq and dk only: its
    exponent does not depend on G, and adding its O(1) term to dG_i from the
    row side and subtracting it from the column side would leave float32
    residue where the true dG is below 1e-16 (fully decayed channels)."""
    p_tt = (r64 * HV + i_hv)[:, None] * BT + o_t[None, :]
    b_dd = tl.load(daqk + (r64 * HV + i_hv) * BT + o_t, mask=m_t, other=0.)
    b_dl = tl.load(dl + p_tt, mask=m_t[:, None], other=0.)
    b_daqs = tl.load(daqk + p_tt, mask=m_t[:, None] & (o_t[:, None] != o_t[None, :]), other=0.)
    b_dl1 = b_dl
    b_daqs1 = b_daqs
    if BATCHED:
        b_dl1 = _level1_blocks(dl, t0, n_rows, i_hv, HV, BT)
        b_daqs1 = _level1_blocks(daqk, t0, n_rows, i_hv, HV, BT)
    e_dq, e_dk, e_p = _anchored_products_bwd(b_q, b_k, b_g, b_b, b_dl, b_daqs, b_dl1, b_daqs1,
                                             o_t, DOT_A, BATCHED)
    b_dG = e_p * b_b[:, None] * b_k + e_dq * b_q - e_dk * b_k
    return (e_dq + b_dd[:, None] * b_k, e_dk + e_p * b_b[:, None] + b_dd[:, None] * b_q, b_dG,
            tl.sum(e_p * b_k, axis=1))


@triton.jit
def _finish_k_block(q, k, g, dl, daqk, dq_p, dk_p, dg_p, dq, dk, dg, b_b, i_h, i_hv, t0, n_rows,
                    o_t, rows, m_t, r64, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, BT: tl.constexpr, DOT_A: tl.constexpr,
                    BATCHED: tl.constexpr, IN_PLACE: tl.constexpr):
    """The K block o_k of a chunk finished: the products' terms
    (_product_terms) added to the partial dq, dk, dG (dq_p, dk_p, dg_p
    [T, HV, K] fp32, loaded after the products: fewer tiles live), dg the
    reverse cumsum of dG; stores dq, dk, dg and returns dbeta's term [BT].
    IN_PLACE: the partials are the outputs' own buffers (a barrier between
    every thread's loads and any store over them)."""
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = r64[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_q = tile(q, rows, m_t, i_h, o_k, m_k, H, K)
    b_k = tile(k, rows, m_t, i_h, o_k, m_k, H, K)
    # The forward's factors come from the (floored) log-decays
    # (common.chunk_exponents).
    b_g = tile(g, rows, m_t, i_hv, o_k, m_k, HV, K)
    e_dq, e_dk, e_dG, b_db = _product_terms(b_q, b_k, b_g, b_b, dl, daqk, t0, n_rows, o_t, r64,
                                            m_t, i_hv, HV, BT, DOT_A, BATCHED)
    b_dk = tl.load(dk_p + p_tk, mask=m_tk, other=0.) + e_dk
    b_dq = tl.load(dq_p + p_tk, mask=m_tk, other=0.) + e_dq
    b_dG = tl.load(dg_p + p_tk, mask=m_tk, other=0.) + e_dG
    b_dg = tl.cumsum(tl.where(m_tk, b_dG, 0.), axis=0, reverse=True)
    if IN_PLACE:
        tl.debug_barrier()
    tl.store(dq + p_tk, b_dq, mask=m_tk)
    tl.store(dk + p_tk, b_dk, mask=m_tk)
    tl.store(dg + p_tk, b_dg, mask=m_tk)
    return b_db


@triton.jit
def kda_bwd_intra_kernel(
    q, k, g, beta, dl, daqk, dq_p, dk_w, dg_w, meta, off_cu, off_ct, n_bounds,
    n_tokens,
    dq, dk, dg, dbeta_k,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, DOT_A: tl.constexpr, BATCHED_L1: tl.constexpr,
):
    """Per chunk, value head and K block: the intra-chunk products
    Akk = k k^T e^(G_i - G_j) and Aqk = q k^T e^(G_i - G_j) back to q, k and G
    (dAkk = beta dL, and scale * dAqk from the wy kernel), then dg = the
    reverse cumsum of dG. Writes the final dq, dk, dg and dbeta's share
    sum over K of k_i * sum_j dL_ij k_j e^(G_i - G_j): dbeta_k [T, HV, NK],
    one column per program along K. BATCHED_L1: level 1's products batched
    over diagonal blocks (_anchored_products_bwd)."""
    # A chunk's K blocks are neighbours in the grid: they read the same dL and
    # dAqk tiles, which then come from L2.
    NK: tl.constexpr = (K + BK - 1) // BK
    i_c, i_k, i_hv = tl.program_id(0) // NK, tl.program_id(0) % NK, tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n_rows, o_t, rows, m_t, r64 = chunk_rows(meta, off_cu, off_ct, i_c, n_bounds,
                                                  n_tokens, BT)
    b_b = tl.load(beta + r64 * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_db = _finish_k_block(q, k, g, dl, daqk, dq_p, dk_w, dg_w, dq, dk, dg, b_b, i_h, i_hv, t0,
                           n_rows, o_t, rows, m_t, r64, o_k, m_k, H, HV, K, BT, DOT_A,
                           BATCHED_L1, False)
    tl.store(dbeta_k + (r64 * HV + i_hv) * NK + i_k, b_db, mask=m_t)


@triton.jit
def _loop_variant_zero(ks, n_tokens):
    """0, as a function of the loop index ks and a runtime scalar (n_tokens is
    never negative). Row and address tiles offset by it are loop-variant to
    every compiler pass: each trip of kda_bwd_grads_kernel's last K loop
    rebuilds them where they are used. Loop-invariant, they are hoisted out of
    the loop and held across it, and the kernel spills on sm90 at 4 warps
    (docs/tuning.md, "The per-chunk gradients in one launch")."""
    return ks * (n_tokens < 0).to(tl.int32)


@triton.jit
def kda_bwd_grads_kernel(
    q, k, v, g, gc, beta, x, h, dh, vn, dvn, do, meta, off_cu, off_ct, n_bounds, n_tokens,
    dq, dk, dv, dg, dbeta, dl, daqk,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    DOT: tl.constexpr, DOT_X: tl.constexpr, DOT_A: tl.constexpr, BATCHED_L1: tl.constexpr,
):
    """The inter, wy and intra kernels' work in one program per (chunk, value
    head): every gradient of the chunk's rows (dq, dk, dg, dv, dbeta); dw
    never in memory, the partial dq, dk, dG in the outputs.

    First over V blocks: dAqk = do v_new^T, dv and dbeta's v term
    (d(beta v) = X^T dv_new), and M = dv_new v_new^T. M is the wy kernel's
    dv_new u^T + dw w^T with dw = -dv_new h^T, summed: u - w h = v_new, so
    dL = -X^T M needs no pass over K. dL and scale * dAqk go to dl and daqk
    ([T, HV, BT] fp32, this program's rows; scratch the last pass reads back
    from L1 or L2). Then over K blocks: the state terms (_state_terms) and
    B's terms through dB = X^T dw (_b_terms), stored as partial dq, dk, dG
    in the outputs. Then over K blocks again: the products' terms added in
    place and dg the reverse cumsum of dG (_finish_k_block). The two K passes
    hold their tiles apart (the second's are the intra kernel's).
    Precisions: DOT the state terms' products (the inter kernel's; exact
    "ieee" for 16-bit intermediates), DOT_X those with X^T and of the cotangents with
    v_new (the wy kernel's), DOT_A the intra-chunk products' (the intra
    kernel's). dq and dk are per value head (the caller sums a GVA group)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n_rows, o_t, rows, m_t, r64 = chunk_rows(meta, off_cu, off_ct, i_c, n_bounds,
                                                  n_tokens, BT)
    b_b = tl.load(beta + r64 * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    p_tt = (r64 * HV + i_hv)[:, None] * BT + o_t[None, :]

    # V blocks: dAqk, M, dv and dbeta's v term.
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_m = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for vs in range(0, V, BV):
        o_v = vs + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (r64 * HV + i_hv)[:, None] * V + o_v[None, :]
        b_vn = tl.load(vn + p_v, mask=m_tv, other=0.)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.)
        b_dvn = tl.load(dvn + p_v, mask=m_tv, other=0.)
        b_daqk += _dot_16(b_do, tl.trans(b_vn), DOT_X)
        b_m += _dot_16(b_dvn, tl.trans(b_vn), DOT_X)
        b_db += _v_terms(x, dvn, v, dv, b_b, t0, n_rows, r64, m_t, i_hv, o_v, HV, V, BT, BV,
                         DOT_X)
    tl.store(daqk + p_tt, tl.where(o_t[:, None] >= o_t[None, :], b_daqk * SCALE, 0.),
             mask=m_t[:, None])
    _store_dl(dl, x, b_m, p_tt, o_t, m_t, DOT_X)

    # K blocks: the state terms and B's terms, as partial dq, dk, dG.
    for ks in range(0, K, BK):
        o_k = ks + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = r64[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        b_dq, b_dk, b_dG, b_dw, _, b_k, _, b_eg = _state_terms(
            q, k, gc, g, h, dh, vn, dvn, do, i_c, i_h, i_hv, t0, n_rows, o_t, rows, m_t, r64,
            o_k, m_k, H, HV, K, V, BT, BV, SCALE, DOT)
        e_dk, e_dG, e_db = _b_terms(_dot_16(_x_transposed(x, p_tt, m_t), b_dw, DOT_X), b_k,
                                    b_eg, b_b)
        b_db += e_db
        tl.store(dq + p_tk, b_dq, mask=m_tk)
        tl.store(dk + p_tk, b_dk + e_dk, mask=m_tk)
        tl.store(dg + p_tk, b_dG + e_dG, mask=m_tk)
    tl.debug_barrier()  # dl, daqk and every partial stored before any is read

    # K blocks again: the products' terms, in place. Triton's hoisting is off
    # and the row tiles are offset by a loop-variant zero (_loop_variant_zero).
    for ks in tl.range(0, K, BK, disable_licm=True):
        z = _loop_variant_zero(ks, n_tokens)
        b_bk = tl.load(beta + (r64 + z) * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
        b_db += _finish_k_block(q, k, g, dl, daqk, dq, dk, dg, dq, dk, dg, b_bk, i_h, i_hv,
                                t0 + z, n_rows, o_t, rows + z, m_t & (o_t + z >= 0), r64 + z,
                                ks + tl.arange(0, BK), ks + tl.arange(0, BK) < K, H, HV, K,
                                BT, DOT_A, BATCHED_L1, True)
    tl.store(dbeta + r64 * HV + i_hv, b_db, mask=m_t)
