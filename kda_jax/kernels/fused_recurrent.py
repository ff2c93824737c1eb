"""Token-by-token KDA (docs/kda.md section 1): the decode kernel.

``kda_fused_recurrent_kernel`` (grid (V-blocks, HV, sequences)) walks one
sequence's tokens in order for one value head and one V block, with the float32
state [BK, BV] (all of K) in registers, and writes o and the final state:

    S = exp(g_t)[:, None] * S
    S = S + beta_t * outer(k_t, v_t - k_t @ S)
    o_t = scale * (q_t @ S)

With UNIFORM the step is computed from both K reductions of the state before
it, taken in one pass (see the token loop): the same values up to float32
rounding.

Layouts (tokens of all sequences packed along T):
  q, k [T, H, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV]; o [T, HV, V];
  states [rows, HV, K, V] ([rows, HV, V, K] with STATE_V_FIRST), float32.
Varlen comes from one int32 metadata buffer with cu_seqlens at ``off_cu``
(bounds clamped to [0, n_tokens] by kernels.varlen, whatever the buffer holds);
with UNIFORM (host bounds whose sequences all have SEQ_LEN tokens, e.g. a decode
step of one token each) sequence n spans [n * SEQ_LEN, (n + 1) * SEQ_LEN) and no
bound is loaded: the loads of a program's tokens then wait on nothing.
LOOP_STAGES is the token loop's software-pipelining depth (tl.range).
NATIVE_CAST: a bfloat16 pool row gets the float32 state through Triton's
conversion, else through the rounding written out on the bits (state_io;
the same values, round to nearest even).
Programs i_n < n_seqs are sequences; a program i_n == n_seqs (launched for a
bucketed batch only) writes o = 0 on the token rows [cu_seqlens[n_seqs],
n_tokens), which belong to no sequence.

State rows: without INDEXED_STATE sequence n reads h0[n] and writes ht[n].
With INDEXED_STATE (a paged state pool) it reads h0[read_idx[n]] and writes
ht[write_idx[n]]; an index outside [0, slots) reads zeros / writes nothing.
With WRITE_COLUMNS = W > 0 (a speculative verify) write_idx is [N, W] and the
state after token t (t < W) is written to ht[write_idx[n, t]] instead of a
final state: every draft's state lands in a row, and the next step starts
from the row of the last accepted token.
The pool is passed as h0 and aliased to ht, so rows no sequence names keep
their contents.

Every exponent is <= 0: the decay exp(g) (g <= 0, -inf included), and the
in-kernel gate and sigmoid of kernels/gate.py, which never overflow.

Non-finite inputs (docs/kda.md section 6): the entries that
kda_jax.transforms.sanitize flags (a NaN or +-inf in k, v or beta, a NaN or
+inf in g; with USE_GATE a NaN in the raw gate, with BETA_SIGMOID a NaN in
beta) are found on each token's raw values. Such an entry at token t puts NaN
into token t's k (into its beta for a bad beta), so that the delta v - k @ S
is NaN in every column and the state NaN in every entry from t on: the state
is the program's poison flag. o from t on and the final state (a pool row
included) are then NaN, since NaN * 0 is NaN and no decay or zero q clears
it. Every V block of a head must see the same poison, so each program checks
the whole v row, not only its block, read in K-wide pieces laid out as k is:
the check folds into k and so into the reduction over K already taken. (An
explicit flag reduced over K and V took the serving form on gfx950 from 126
to 132 VGPRs, and its float32 form from 128 to 143.) A non-finite q puts NaN
into its token's q: that o only. Poisoning g and beta entries are replaced
by 0 first, so that exp() (the decay, the gate, the sigmoid) still sees only
values <= 0.
"""

import triton
import triton.language as tl

from .common import store_zero_rows
from .gate import bad_log_decay, gate, nonfinite, sigmoid
from .state_io import load_state, state_offsets, store_state_row
from .varlen import seq_span


@triton.jit
def _in_kernel_gate(b_g, b_dt, b_alog, m, HAS_A_LOG: tl.constexpr,
                    HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """The log-decay from raw gate values (kernels/gate.py); 0 where ``m`` is False."""
    return tl.where(m, gate(b_g + b_dt, b_alog, HAS_A_LOG, HAS_LOWER_BOUND, LOWER_BOUND), 0.)


@triton.jit
def _add_pair(a0, b0, a1, b1):
    """The combine of two sums reduced together (tl.reduce over a pair)."""
    return a0 + a1, b0 + b1


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
    STATE_V_FIRST: tl.constexpr, INDEXED_STATE: tl.constexpr, WRITE_COLUMNS: tl.constexpr,
    UNIFORM: tl.constexpr, SEQ_LEN: tl.constexpr, LOOP_STAGES: tl.constexpr,
    NATIVE_CAST: tl.constexpr,
):
    # V blocks first: the programs that share a state's rows run together.
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if UNIFORM:
        bos = i_n * SEQ_LEN
        eos = bos + SEQ_LEN
    else:
        bos, eos = seq_span(meta, off_cu, i_n, n_tokens)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if i_n < n_seqs:
        _recurrent_sequence(
            q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, slots,
            o, ht, i_n, i_hv, bos, eos, o_v, m_v, H, HV, K, V, BK, BV, SCALE, USE_L2NORM,
            USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND, LOWER_BOUND, BETA_SIGMOID,
            BETA_SCALE, USE_INITIAL_STATE, STORE_FINAL_STATE, STATE_V_FIRST, INDEXED_STATE,
            WRITE_COLUMNS, UNIFORM, SEQ_LEN, LOOP_STAGES, NATIVE_CAST)
    else:
        # The tail program of a bucketed batch: o = 0 on rows [bos, n_tokens).
        store_zero_rows(o, bos, n_tokens, i_hv, o_v, m_v, HV, V, TAIL_ROWS, BV)


@triton.jit
def _recurrent_sequence(
    q, k, v, g, beta, A_log, dt_bias, h0, read_idx, write_idx, slots,
    o, ht, i_n, i_hv, bos, eos, o_v, m_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, INDEXED_STATE: tl.constexpr, WRITE_COLUMNS: tl.constexpr,
    UNIFORM: tl.constexpr, SEQ_LEN: tl.constexpr, LOOP_STAGES: tl.constexpr,
    NATIVE_CAST: tl.constexpr,
):
    """Sequence i_n's tokens in order (kda_fused_recurrent_kernel's body)."""
    i_h = i_hv // (HV // H)
    o_k, m_k, o_s, m_kv = state_offsets(o_v, m_v, K, V, BK, STATE_V_FIRST)
    # A pool's write row is loaded now, beside the read row, not after the
    # tokens: the final store then does not wait on a load of its own.
    i_w = i_n
    if INDEXED_STATE and STORE_FINAL_STATE:
        i_w = tl.load(write_idx + i_n)
    b_h = load_state(h0, read_idx, slots, i_n, i_hv, o_s, m_kv, HV, K, V, BK, BV,
                     USE_INITIAL_STATE, INDEXED_STATE)

    # Per-head gate parameters, loaded once.
    b_alog = 0.
    b_dt = tl.zeros([BK], dtype=tl.float32)
    if USE_GATE:
        if HAS_A_LOG or not HAS_LOWER_BOUND:
            b_alog = tl.load(A_log + i_hv).to(tl.float32)
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
    # The v row's base: the poison check reads the row in K-wide pieces.
    p_vr = v + (t0 * HV + i_hv) * V

    # A software-pipelined loop: the next token's loads are issued before this
    # token's update, which hides the latency of loads that wait on bounds
    # read from metadata (docs/tuning.md, decode).
    for i_t in tl.range(0, eos - bos, num_stages=LOOP_STAGES):
        b_q = tl.load(p_q, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(p_g, mask=m_k, other=0.).to(tl.float32)
        b_beta = tl.load(p_b).to(tl.float32)

        # Poisoning entries, on the raw values (see the module docstring):
        # any in k, g or the whole v row marks k, one in beta marks beta.
        b_gbad = bad_log_decay(b_g, USE_GATE)
        if BETA_SIGMOID:
            b_bbad = b_beta != b_beta
        else:
            b_bbad = nonfinite(b_beta)
        b_kbad = nonfinite(b_k) | b_gbad
        for j in tl.static_range(0, V, BK):
            b_vr = tl.load(p_vr + (o_k + j), mask=o_k + j < V, other=0.).to(tl.float32)
            b_kbad = b_kbad | nonfinite(b_vr)
        b_qbad = nonfinite(b_q)
        b_g = tl.where(b_gbad, 0., b_g)
        b_beta = tl.where(b_bbad, 0., b_beta)

        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        if USE_GATE:
            b_g = _in_kernel_gate(b_g, b_dt, b_alog, m_k, HAS_A_LOG, HAS_LOWER_BOUND,
                                  LOWER_BOUND)
        if BETA_SIGMOID:
            b_beta = sigmoid(b_beta)
        b_beta = b_beta * BETA_SCALE
        b_k = tl.where(b_kbad, float("nan"), b_k)
        b_beta = tl.where(b_bbad, float("nan"), b_beta)
        b_q = tl.where(b_qbad, float("nan"), b_q)

        if UNIFORM:
            # Both reductions over K read the loaded state and share one pass
            # (one round of cross-warp partial sums): with S' = d * S (d =
            # exp(g)), k @ S' = (d k) @ S and q @ (S' + k u) = (d q) @ S +
            # (q . k) u, so the update waits on one reduction, not two in a
            # row. With bounds loaded from metadata this form loses the
            # pipelined loop's gain, so that form keeps the reductions in
            # sequence (docs/tuning.md, decode).
            b_d = tl.exp(b_g)
            b_kh, b_qh = tl.reduce((b_h * (b_k * b_d)[:, None], b_h * (b_q * b_d)[:, None]), 0,
                                   _add_pair)
            b_v = b_beta * (b_v - b_kh)
            b_o = (b_qh + tl.sum(b_q * b_k, axis=0) * b_v) * SCALE
            b_h = b_h * b_d[:, None] + b_k[:, None] * b_v[None, :]
        else:
            b_h = b_h * tl.exp(b_g)[:, None]
            b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
            b_h += b_k[:, None] * b_v[None, :]
            b_o = tl.sum(b_h * b_q[:, None], axis=0) * SCALE
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        if WRITE_COLUMNS > 0:
            # A verify: the state after token i_t goes to its own pool row.
            if i_t < WRITE_COLUMNS:
                i_wt = tl.load(write_idx + i_n * WRITE_COLUMNS + i_t)
                store_state_row(ht, b_h, i_wt, slots, i_hv, o_s, m_kv, HV, K, V, True,
                                INDEXED_STATE, NATIVE_CAST)

        p_q += H * K
        p_k += H * K
        p_g += HV * K
        p_b += HV
        p_v += HV * V
        p_o += HV * V
        p_vr += HV * V

    store_state_row(ht, b_h, i_w, slots, i_hv, o_s, m_kv, HV, K, V, STORE_FINAL_STATE,
                    INDEXED_STATE, NATIVE_CAST)
