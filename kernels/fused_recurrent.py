"""Token-by-token KDA (KDA_SPEC section 1): the decode kernel.

``kda_fused_recurrent_kernel`` (grid (V-blocks, HV, sequences)) walks one
sequence's tokens in order for one value head and one V block, with the float32
state [BK, BV] (all of K) in registers, and writes o and the final state:

    S = exp(g_t)[:, None] * S
    S = S + beta_t * outer(k_t, v_t - k_t @ S)
    o_t = scale * (q_t @ S)

Layouts (tokens of all sequences packed along T):
  q, k [T, H, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV]; o [T, HV, V];
  states [rows, HV, K, V] ([rows, HV, V, K] with STATE_V_FIRST), float32.
Varlen comes from one int32 metadata buffer with cu_seqlens at ``off_cu``;
with UNIFORM (host bounds whose sequences all have SEQ_LEN tokens, e.g. a decode
step of one token each) sequence n spans [n * SEQ_LEN, (n + 1) * SEQ_LEN) and no
bound is loaded: the loads of a program's tokens then wait on nothing.
Programs i_n < n_seqs are sequences; a program i_n == n_seqs (launched for a
bucketed batch only) writes o = 0 on the token rows [cu_seqlens[n_seqs],
n_tokens), which belong to no sequence.

State rows: without INDEXED_STATE sequence n reads h0[n] and writes ht[n].
With INDEXED_STATE (a paged state pool) it reads h0[read_idx[n]] and writes
ht[write_idx[n]]; an index outside [0, slots) reads zeros / writes nothing.
The pool is passed as h0 and aliased to ht, so rows no sequence names keep
their contents.

With STREAM (every sequence has at most one token: a decode step) the state
is not held whole: two passes stream it through [BKS, BV] tiles. The
first decays each tile and accumulates k @ S and q @ S; then
v_new = beta (v - k @ S) and o = scale (q @ S + (q . k) v_new), since
q @ (S + outer(k, v_new)) = q @ S + (q . k) v_new; the second pass reads each
tile again (from L2, mostly) and writes S + outer(k, v_new). Small tiles leave
registers for more programs per multiprocessor, so more of the state's reads
and writes are in flight at once.

Every exponent is <= 0: the decay exp(g) (g <= 0), and the sigmoid and
softplus of the in-kernel transforms, which are written on -|x|.
"""

import triton
import triton.language as tl

from .state_io import load_state, state_offsets, store_state_row


@triton.jit
def _sigmoid(x):
    """1 / (1 + e^-x), through e^-|x| for either sign of x."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1. / (1. + e), e / (1. + e))


@triton.jit
def _softplus(x):
    """log(1 + e^x) as max(x, 0) + log(1 + e^-|x|); x itself above 20."""
    return tl.where(x > 20., x, tl.maximum(x, 0.) + tl.log(1. + tl.exp(-tl.abs(x))))


@triton.jit
def _in_kernel_gate(b_g, b_dt, b_a, m, HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """The log-decay from raw gate values: lower_bound * sigmoid(a (g + dt_bias))
    or -a softplus(g + dt_bias) (a = exp(A_log)); 0 where ``m`` is False."""
    b_x = b_g + b_dt
    if HAS_LOWER_BOUND:
        b_g = LOWER_BOUND * _sigmoid(b_a * b_x)
    else:
        b_g = -b_a * _softplus(b_x)
    return tl.where(m, b_g, 0.)


# Rows zeroed per step by the tail program.
TAIL_ROWS = tl.constexpr(32)


@triton.jit
def kda_fused_recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, meta, off_cu, n_seqs, n_tokens,
    slots,
    o, ht,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, INDEXED_STATE: tl.constexpr,
    UNIFORM: tl.constexpr, SEQ_LEN: tl.constexpr, STREAM: tl.constexpr, BKS: tl.constexpr,
):
    # V blocks first: the programs that share a state's rows run together.
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if UNIFORM:
        bos = i_n * SEQ_LEN
    else:
        bos = tl.load(meta + off_cu + i_n)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if i_n < n_seqs:
        # STREAM is a constexpr: one of the two forms is compiled, not both.
        if STREAM:  # at most one token per sequence
            if UNIFORM:
                has_tok = tl.full([], 1, tl.int1)  # a tensor, as the loaded case
            else:
                has_tok = tl.load(meta + off_cu + i_n + 1) > bos
            _one_token_streamed(
                q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, slots, o, ht, i_n,
                i_hv, bos, has_tok, o_v, m_v, H, HV, K, V, BK, BV, BKS, SCALE, USE_L2NORM,
                USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND, LOWER_BOUND, BETA_SIGMOID,
                BETA_SCALE, USE_INITIAL_STATE, STORE_FINAL_STATE, STATE_V_FIRST, INDEXED_STATE)
        else:
            _recurrent_sequence(
                q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, meta, off_cu, slots,
                o, ht, i_n, i_hv, bos, o_v, m_v, H, HV, K, V, BK, BV, SCALE, USE_L2NORM,
                USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND, LOWER_BOUND, BETA_SIGMOID,
                BETA_SCALE, USE_INITIAL_STATE, STORE_FINAL_STATE, STATE_V_FIRST, INDEXED_STATE,
                UNIFORM, SEQ_LEN)
    else:
        # The tail program of a bucketed batch: o = 0 on rows [bos, n_tokens).
        o_z = tl.arange(0, TAIL_ROWS)
        b_zero = tl.zeros([TAIL_ROWS, BV], dtype=o.dtype.element_ty)
        for t0 in range(bos, n_tokens, TAIL_ROWS):
            rows = t0 + o_z
            p_z = (rows.to(tl.int64) * HV + i_hv)[:, None] * V + o_v[None, :]
            tl.store(o + p_z, b_zero, mask=(rows < n_tokens)[:, None] & m_v[None, :])


@triton.jit
def _recurrent_sequence(
    q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, meta, off_cu, slots,
    o, ht, i_n, i_hv, bos, o_v, m_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, INDEXED_STATE: tl.constexpr,
    UNIFORM: tl.constexpr, SEQ_LEN: tl.constexpr,
):
    """Sequence i_n's tokens in order (kda_fused_recurrent_kernel's body)."""
    i_h = i_hv // (HV // H)
    if UNIFORM:
        eos = bos + SEQ_LEN
    else:
        eos = tl.load(meta + off_cu + i_n + 1)

    o_k, m_k, o_s, m_kv = state_offsets(o_v, m_v, K, V, BK, STATE_V_FIRST)
    # A pool's write row is loaded now, beside the read row, not after the
    # tokens: the final store then does not wait on a load of its own.
    i_w = i_n
    if INDEXED_STATE and STORE_FINAL_STATE:
        i_w = tl.load(write_idx + i_n)
    b_h = load_state(h0, read_idx, slots, i_n, i_hv, o_s, m_kv, HV, K, V, BK, BV,
                     USE_INITIAL_STATE, INDEXED_STATE)

    # Per-head gate parameters, loaded once.
    b_a = 1.
    b_dt = tl.zeros([BK], dtype=tl.float32)
    if USE_GATE:
        if HAS_A_LOG:
            b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_dt = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)

    # Row pointers of the first token; int64 because T * HV * K can pass 2^31.
    t0 = bos.to(tl.int64)
    p_q = q + (t0 * H + i_h) * K + o_k
    p_k = k + (t0 * H + i_h) * K + o_k
    p_g = g + (t0 * HV + i_hv) * K + o_k
    p_b = beta + t0 * HV + i_hv
    p_v = v + (t0 * HV + i_hv) * V + o_v
    p_o = o + (t0 * HV + i_hv) * V + o_v

    for _ in range(0, eos - bos):
        b_q = tl.load(p_q, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(p_g, mask=m_k, other=0.).to(tl.float32)
        b_beta = tl.load(p_b).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        if USE_GATE:
            b_g = _in_kernel_gate(b_g, b_dt, b_a, m_k, HAS_LOWER_BOUND, LOWER_BOUND)
        if BETA_SIGMOID:
            b_beta = _sigmoid(b_beta)
        b_beta = b_beta * BETA_SCALE

        b_h = b_h * tl.exp(b_g)[:, None]
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * SCALE
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        p_q += H * K
        p_k += H * K
        p_g += HV * K
        p_b += HV
        p_v += HV * V
        p_o += HV * V

    store_state_row(ht, b_h, i_w, slots, i_hv, o_s, m_kv, HV, K, V, STORE_FINAL_STATE,
                    INDEXED_STATE)


@triton.jit
def _one_token_streamed(
    q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, slots, o, ht, i_n, i_hv, bos,
    has_tok, o_v, m_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BKS: tl.constexpr, SCALE: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, INDEXED_STATE: tl.constexpr,
):
    """Sequence i_n's one token (none where ``has_tok`` is False: an empty
    sequence, whose state passes through) with the state streamed in two passes
    over K tiles (see the module docstring); the same reads and writes of the
    state rows as _recurrent_sequence."""
    i_h = i_hv // (HV // H)
    # An empty sequence reads row 0 (always there) and zeroes what it read:
    # k = 0, beta = 0 and no decay leave its state as it was; its o is not written.
    t0 = tl.where(has_tok, bos, 0).to(tl.int64)
    p_qk = (t0 * H + i_h) * K      # q and k rows of the token (int64: T * H * K can pass 2^31)
    p_gk = (t0 * HV + i_hv) * K    # g row
    p_vo = (t0 * HV + i_hv) * V    # v and o rows

    # Whole-K reductions first: the L2 norms and q . k (vectors of K floats).
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_q = tl.load(q + p_qk + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.where(has_tok, tl.load(k + p_qk + o_k, mask=m_k, other=0.).to(tl.float32), 0.)
    r_q = 1.
    r_k = 1.
    if USE_L2NORM:
        r_q = 1. / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        r_k = 1. / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    b_qk = tl.sum(b_q * b_k, axis=0) * r_q * r_k

    b_a = 1.
    if USE_GATE:
        if HAS_A_LOG:
            b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_beta = tl.load(beta + t0 * HV + i_hv).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = _sigmoid(b_beta)
    b_beta = tl.where(has_tok, b_beta * BETA_SCALE, 0.)
    b_v = tl.load(v + p_vo + o_v, mask=m_v, other=0.).to(tl.float32)

    # The state rows: read from (zeros without one), written to (or not); an
    # index outside [0, slots) is a branch not taken, as in load_state.
    i_src = i_n.to(tl.int64)
    i_dst = i_n.to(tl.int64)
    has_src = True  # scalar tensors with INDEXED_STATE
    has_dst = True
    if INDEXED_STATE:
        i_r = tl.load(read_idx + i_n)
        i_w = tl.load(write_idx + i_n)
        has_src = (i_r >= 0) & (i_r < slots)
        has_dst = (i_w >= 0) & (i_w < slots)
        i_src = i_r.to(tl.int64)
        i_dst = i_w.to(tl.int64)
    p_src = h0 + (i_src * HV + i_hv) * K * V
    p_dst = ht + (i_dst * HV + i_hv) * K * V

    # Pass 1: decay each tile; accumulate k @ S and q @ S.
    b_ks = tl.zeros([BV], dtype=tl.float32)
    b_qs = tl.zeros([BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BKS)):
        b_h, b_kb, o_kb, m_kb, o_s, m_kv = _decayed_tile(
            p_src, has_src, has_tok, k, g, dt_bias, p_qk, p_gk, i_hv, i_k, o_v, m_v, r_k, b_a, K,
            V, BKS, BV, USE_GATE, HAS_DT_BIAS, HAS_LOWER_BOUND, LOWER_BOUND, USE_INITIAL_STATE,
            STATE_V_FIRST)
        b_qb = tl.load(q + p_qk + o_kb, mask=m_kb, other=0.).to(tl.float32) * r_q
        b_ks += tl.sum(b_h * b_kb[:, None], axis=0)
        b_qs += tl.sum(b_h * b_qb[:, None], axis=0)

    b_vn = b_beta * (b_v - b_ks)
    b_o = (b_qs + b_qk * b_vn) * SCALE
    if has_tok:
        tl.store(o + p_vo + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    # Pass 2: the decayed tiles again, plus outer(k, v_new).
    if STORE_FINAL_STATE and has_dst:
        for i_k in range(0, tl.cdiv(K, BKS)):
            b_h, b_kb, o_kb, m_kb, o_s, m_kv = _decayed_tile(
                p_src, has_src, has_tok, k, g, dt_bias, p_qk, p_gk, i_hv, i_k, o_v, m_v, r_k, b_a,
                K, V, BKS, BV, USE_GATE, HAS_DT_BIAS, HAS_LOWER_BOUND, LOWER_BOUND, USE_INITIAL_STATE,
                STATE_V_FIRST)
            tl.store(p_dst + o_s, b_h + b_kb[:, None] * b_vn[None, :], mask=m_kv)


@triton.jit
def _decayed_tile(p_src, has_src, has_tok, k, g, dt_bias, p_qk, p_gk, i_hv, i_k, o_v, m_v, r_k,
                  b_a, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
                  USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                  HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr,
                  USE_INITIAL_STATE: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """K tile i_k of the streamed state: (exp(g) S tile, k tile, its offsets
    o_kb and mask m_kb, the tile's element offsets o_s and mask m_kv)."""
    o_kb = i_k * BKS + tl.arange(0, BKS)
    m_kb = o_kb < K
    if STATE_V_FIRST:
        o_s = o_v[None, :] * K + o_kb[:, None]
    else:
        o_s = o_kb[:, None] * V + o_v[None, :]
    m_kv = m_kb[:, None] & m_v[None, :]
    b_h = tl.zeros([BKS, BV], dtype=tl.float32)
    if USE_INITIAL_STATE and has_src:
        b_h = tl.load(p_src + o_s, mask=m_kv, other=0.)
    b_gk = tl.load(g + p_gk + o_kb, mask=m_kb, other=0.).to(tl.float32)
    if USE_GATE:
        b_dt = tl.zeros([BKS], dtype=tl.float32)
        if HAS_DT_BIAS:
            b_dt = tl.load(dt_bias + i_hv * K + o_kb, mask=m_kb, other=0.).to(tl.float32)
        b_gk = _in_kernel_gate(b_gk, b_dt, b_a, m_kb, HAS_LOWER_BOUND, LOWER_BOUND)
    b_gk = tl.where(has_tok, b_gk, 0.)  # no token: no decay and k = 0
    b_kb = tl.where(has_tok, tl.load(k + p_qk + o_kb, mask=m_kb, other=0.).to(tl.float32) * r_k,
                    0.)
    return b_h * tl.exp(b_gk)[:, None], b_kb, o_kb, m_kb, o_s, m_kv
