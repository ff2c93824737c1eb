"""The segmented schedule: host plans and tables (kda_jax.segments), the rule,
and chunk_kda with segments forced on small shapes against the float32
reference and the unsegmented call, forward and gradients: the Triton path's
state chain (kda_jax.triton.state_chain, kda_jax/kernels/segments.py; interpreter on
the CPU) and the XLA path's composition (kda_jax.segmented)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import configs, segmented, segments
from kda_jax.bounds import SeqBounds
from kda_jax.testing import DENSE_SWEEP, make_inputs
from kda_jax.triton import state_chain, unavailable_reason

# Segments of one chunk each: every sequence longer than a chunk is cut.
FORCED = configs.SegmentConfig(segment_chunks=1, xla=True)
# Varlen: a long sequence cut into 3 segments (32, 32, 6 tokens at chunk 32),
# then an empty and a one-token sequence right after its last segment, then
# one more cut sequence: segments end on empty and one-token sequences.
CU = [0, 70, 70, 71, 140]


# --------------------------------------------------------------------------- #
# Host plans.
# --------------------------------------------------------------------------- #


def test_plan_cuts_whole_chunks_and_covers_every_token():
    bounds = SeqBounds(CU)
    plan = segments.segment_plan(bounds, 32, 1)
    assert plan.segments.cu_seqlens.tolist() == [0, 32, 64, 70, 71, 103, 135, 140]
    assert plan.seq.tolist() == [0, 0, 0, 2, 3, 3, 3]
    assert plan.first.tolist() == [True, False, False, True, True, False, False]
    # Lanes: sequences 0 and 3 (3 segments each); 1 is empty, 2 one segment.
    assert plan.fold.tolist() == [[0, 1, 2], [4, 5, 6]]
    assert plan.final_lane.tolist() == [0, -1, -1, 1]
    assert plan.final_segment.tolist() == [-1, -1, 3, -1]
    # The corrected segments' tokens, and each token's slot (first segments: none).
    c, rows = plan.corr_index.shape
    assert (c, rows) == (4, 32)
    slot = plan.corr_slot
    corrected = np.flatnonzero(slot < c * rows)
    assert corrected.tolist() == list(range(32, 70)) + list(range(103, 140))
    assert np.all(plan.corr_index.reshape(-1)[slot[corrected]] == corrected)
    assert plan.corr_start.tolist() == [0, 1, 3, 4]  # lane * steps + step - 1
    # Near-equal whole chunks, each at least 2 and under 4: 5 chunks -> 3, 2 (x 64
    # tokens, the last partial); 3 chunks stay whole.
    assert segments.segment_plan(SeqBounds([0, 300]), 64, 2).segments.lengths.tolist() == [
        192, 108]
    assert segments.segment_plan(SeqBounds([0, 190]), 64, 2).segments.lengths.tolist() == [190]


def test_tables_of_the_state_chain():
    """The Triton chain's tables: the segments' chunk offsets are the rows the
    unsegmented call numbers; chains = sequences with segments."""
    from kda_jax.bounds import chunk_offsets

    tables = segments.segment_tables(segments.segment_plan(SeqBounds(CU), 32, 1), 32)
    packed = tables.packed
    assert packed.view("cu_seqlens").tolist() == [0, 32, 64, 70, 71, 103, 135, 140]
    assert packed.view("chunk_offsets").tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert chunk_offsets(SeqBounds(CU), 32).tolist() == [0, 3, 3, 4, 7]
    assert packed.view("chains").tolist() == [[0, 3, 0], [3, 1, 2], [4, 3, 3]]
    assert tables.num_chains == 3
    assert tables.first_segment.tolist() == [0, -1, 3, 4]
    assert tables.last_segment.tolist() == [2, -1, 3, 6]


SWEEP_ROWS = ((1, 65536, 4), (1, 131072, 4), (1, 32768, 8), (1, 65536, 12))


def test_rule_segments_the_issue_rows_and_not_the_sweep():
    """sm90's rule (an H200 has 132 SMs) in the forward: the low-head long
    rows are cut so that the state-output pass over segments (V blocks of
    64: 2 per head) has at most 128 programs, one wave, in segments of at
    least 64 chunks; in the backward (8 V blocks of 16) only the 4-head rows,
    in 128-chunk segments; no other row of the forward sweep (K = V = 128).
    The AMD targets and unknown devices ship it off."""
    assert all(configs.SEGMENTS[a].forward.min_programs == 0 for a in
               ("gfx950", "gfx942", "gfx1250", "default"))
    cfg = configs.SEGMENTS["sm90"]

    def plan(b, t, h, backward=False):
        table = configs.BACKWARD if backward else configs.FORWARD
        tables = state_chain.chain_tables(
            SeqBounds.from_lengths([t] * b), cfg, chunk_size=64, hv=h, kd=128, vd=128,
            block_v=table["sm90"].state["16bit"].block_v, split_k=False, backward=backward,
            segment_block_v=None if backward else
            configs.FORWARD["sm90"].segment_state["16bit"].block_v)
        return None if tables is None else (tables.plan.segments.lengths // 64).tolist()

    for b, t, h in DENSE_SWEEP:
        if (b, t, h) not in SWEEP_ROWS:
            assert plan(b, t, h) is None and plan(b, t, h, True) is None, (b, t, h)
    # (segments, chunks each) per row: segments x heads x 2 programs <= 128.
    assert plan(1, 65536, 4) == [64] * 16
    assert plan(1, 131072, 4) == [128] * 16
    assert plan(1, 32768, 8) == [64] * 8
    assert plan(1, 65536, 12) == [205] * 4 + [204]  # 120 programs
    for b, t, h in SWEEP_ROWS:
        assert plan(b, t, h, backward=True) == ([128] * (t // 8192) if h == 4 else None)
    # Three segments' worth (192-255 chunks) at 4 heads: not cut (min_segments).
    assert plan(1, 200 * 64, 4) is None and plan(1, 256 * 64, 4) == [64] * 4
    # Forced, but every sequence fits in one segment: unsegmented.
    assert segments.segment_chunks(SeqBounds([0, 64]), 64, hv=1, programs_per_seq_head=1,
                                   min_programs=0, target_programs=0, min_segment_chunks=1,
                                   forced_segment_chunks=1) is None


def test_context_plan_pieces():
    # 4 devices of 24 tokens: sequence 3 starts at device 1's first token and
    # enters device 2; empty sequences at 24 and 72 (device boundaries).
    plans = segments.context_plan(SeqBounds([0, 10, 24, 24, 70, 72, 72, 96]), 1, 4)
    assert [p.bounds.lengths.tolist() for p in plans] == [[10, 14], [24], [22, 2], [24]]
    assert plans[1].entering.tolist() == [False] and plans[1].leaving.tolist() == [0]
    assert plans[2].entering.tolist() == [True, False] and plans[2].leaving.tolist() == [-1]
    owns = np.stack([p.owns for p in plans])
    assert owns.sum(axis=0).tolist() == [1] * 7  # each final state on one device
    assert np.argmax(owns, axis=0).tolist() == [0, 0, 1, 2, 2, 3, 3]
    assert plans[2].final_piece.tolist() == [-1, -1, -1, 0, 1, -1, -1]
    with pytest.raises(ValueError, match="split"):
        segments.context_plan(SeqBounds([0, 10]), 1, 4)
    with pytest.raises(ValueError, match="row"):
        segments.context_plan(SeqBounds([0, 6, 16]), 2, 2)


# --------------------------------------------------------------------------- #
# chunk_kda with segments forced, against the reference and the unsegmented call.
# --------------------------------------------------------------------------- #


def _inputs(seed, *, T, N, gates=False, **kw):
    x = make_inputs(seed, B=1, T=T, H=1, HV=2, K=16, V=16, N=N, **kw)
    if gates:  # strong gates: -1e4 and -inf, inside segments and on their last rows
        x.g[0, 5] = -1e4
        x.g[0, 31, 1] = -np.inf
        x.g[0, 69] = -1e4
        x.g[0, 100, 0, :3] = -np.inf
    return x


def _loss(fn, cu):
    def loss(q, k, v, g, beta, h0, w_o, w_f):
        o, f = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(f * w_f)
    return loss


@functools.lru_cache(maxsize=None)
def _compiled(impl, forced: bool, cu: tuple):
    """Jitted (forward, gradients) of chunk_kda with segments forced or off,
    shared by the tests (compiles are the cost); traced on first use, under
    the config."""
    fn = functools.partial(kda_jax.chunk_kda, implementation=impl, chunk_size=32)
    fwd = jax.jit(lambda q, k, v, g, b, h: fn(q, k, v, g, b, initial_state=h,
                                              output_final_state=True, cu_seqlens=list(cu)))
    grad = jax.jit(jax.grad(_loss(fn, list(cu)), argnums=tuple(range(6))))
    config = FORCED if forced else configs.SegmentConfig()

    def traced(f):
        def call(*args):
            with configs.override(config):
                return f(*args)
        return call

    return traced(fwd), traced(grad)


def _run(x, cu, impl, forced: bool, grads: bool = True):
    fwd, grad = _compiled(impl, forced, tuple(cu))
    args = (*x.args(), x.initial_state)
    o, f = fwd(*args)
    if not grads:
        return o, f, None
    rng = np.random.default_rng(7)
    w_o = rng.standard_normal(o.shape).astype(np.float32)
    w_f = rng.standard_normal(f.shape).astype(np.float32)
    return o, f, (grad(*args, w_o, w_f), w_o, w_f)


def _reference(x, cu, w_o, w_f):
    args = [np.asarray(a, np.float32) for a in (*x.args(), x.initial_state)]
    o, f = kda_jax.naive_recurrent_kda(*args[:5], initial_state=args[5],
                                       output_final_state=True, cu_seqlens=cu)
    g = jax.jit(jax.grad(_loss(kda_jax.naive_recurrent_kda, cu), argnums=tuple(range(6))))(
        *args, w_o, w_f)
    return o, f, g


NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("impl", ["xla", pytest.param("triton", marks=pytest.mark.skipif(
    unavailable_reason() is not None, reason="Triton path unavailable"))])
def test_segmented_equals_reference_and_unsegmented(impl, check_close, check_rel_rms):
    """Forward and gradients against the reference (the XLA path: its
    composition's fold within a device); on the Triton path (the state chain)
    also the unsegmented call."""
    x = _inputs(0, T=140, N=4, gates=True)
    o, f, grads = _run(x, CU, impl, forced=True)
    ro, rf, rg = _reference(x, CU, *grads[1:])
    check_close(o, ro, "float32", "o")
    check_close(f, rf, "float32", "final_state")
    for name, got, want in zip(NAMES, grads[0], rg):
        check_rel_rms(got, want, 1e-4, f"d{name}")
    if impl == "xla":
        return
    # The unsegmented call: the same function within float32 rounding.
    uo, uf, _ = _run(x, CU, impl, forced=False, grads=False)
    check_close(o, uo, "float32", "o vs unsegmented")
    check_close(f, uf, "float32", "final_state vs unsegmented")


@pytest.mark.skipif(unavailable_reason() is not None, reason="Triton path unavailable")
def test_triton_segmented_pass_with_its_own_v_block(check_close):
    """ForwardConfig.segment_state: the state-output pass over segments in
    16-wide V blocks where the one pass takes 32 (two programs per segment
    and head; the map too); the same outputs and final states as the
    reference."""
    x = make_inputs(4, B=1, T=150, H=1, HV=2, K=16, V=32, N=2, dtype=jnp.bfloat16)
    cu = [0, 90, 150]
    ro, rf = kda_jax.naive_recurrent_kda(*(np.asarray(a, np.float32) for a in x.args()),
                                        initial_state=np.asarray(x.initial_state, np.float32),
                                        output_final_state=True, cu_seqlens=cu)
    seen = []
    real = state_chain.segment_maps
    forward = configs.forward_config()
    for path, value in (("state.*.block_v", 32), ("segment_state.*.block_v", 16),
                        ("segment_state.*.warps", 2), ("map.*.block_v", 16)):
        forward = configs.replace(forward, path, value)
    with configs.override(forward, FORCED), pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_chain, "segment_maps", lambda *a, **kw: seen.append(a[0]) or real(*a, **kw))
        o, f = kda_jax.chunk_kda(*x.args(), chunk_size=32, implementation="triton",
                                 initial_state=x.initial_state, output_final_state=True,
                                 cu_seqlens=cu)
    assert seen and seen[0].map.constexprs["BV"] == 16
    check_close(o, ro, "bfloat16", "o")
    check_close(f, rf, "bfloat16", "final_state")


def test_segmented_pass_takes_its_own_launch_for_whole_blocks():
    """The segmented pass takes ForwardConfig.segment_state where V is a
    multiple of its V block (masked V columns keep the one pass's: they
    spilled at 64 on sm90), by the inputs' dtype (the interpreter's float32
    intermediates with 16-bit inputs take the 16-bit launch, at float32's
    product precision), the map its own config, and the backward's map its
    state pass's launch."""
    from kda_jax.options import KdaOptions
    from kda_jax.triton.forward import segmented_launches

    fwd = configs.FORWARD["sm90"]
    # tf32x3: a precision the interpreter keeps (bf16x3 runs as ieee there).
    for path, value in (("state.fp32.dot", "tf32x3"), ("map.fp32.dot", "tf32x3"),
                        ("segment_state.16bit.block_v", 64), ("segment_state.16bit.warps", 2),
                        ("segment_state.fp32.block_v", 32), ("segment_state.fp32.warps", 8),
                        ("map.16bit.block_v", 64), ("map.16bit.stages", 2),
                        ("map.fp32.block_v", 32), ("map.fp32.stages", 1)):
        fwd = configs.replace(fwd, path, value)

    def launch(given, work, vd):
        state, chain = segmented_launches(
            h=4, hv=4, kd=128 if work == jnp.bfloat16 else 64, vd=vd,
            opts=KdaOptions(scale=0.1), config=fwd, work=work, input_dtype=given,
            has_initial_state=False)
        return (state.constexprs["BV"], state.num_warps, chain.map.constexprs["BV"],
                chain.map.num_stages, chain.map.constexprs["DOT"], state.constexprs["DOT"])

    assert launch(jnp.bfloat16, jnp.bfloat16, 128) == (64, 2, 64, 2, "ieee", "ieee")
    assert launch(jnp.bfloat16, jnp.bfloat16, 96) == (
        fwd.state["16bit"].block_v, fwd.state["16bit"].warps, 64, 2, "ieee", "ieee")
    assert launch(jnp.float32, jnp.float32, 128) == (32, 8, 32, 1, "tf32x3", "ieee")
    # The interpreter: float32 work with 16-bit inputs takes the 16-bit launch at
    # float32's product precision (the segment state's "fp32" dot is ieee here).
    assert launch(jnp.bfloat16, jnp.float32, 128) == (64, 2, 64, 2, "tf32x3", "tf32x3")
    from kda_jax.triton.backward import segmented_backward_launches
    bwd = configs.BACKWARD["sm90"]
    L = segmented_backward_launches(h=4, hv=4, kd=128, vd=128, opts=KdaOptions(scale=0.1),
                                    config=bwd, work=jnp.bfloat16, has_initial_state=False,
                                    has_final_grad=False)
    bwd_map, bwd_state = L["chain"].map, L["state"]
    assert (bwd_map.constexprs["BV"], bwd_map.num_warps, bwd_map.num_stages) == (
        bwd_state.constexprs["BV"], bwd_state.num_warps, bwd_state.num_stages)
    assert bwd_map.constexprs["DOT"] == bwd_state.constexprs["DOT"]


@pytest.mark.skipif(unavailable_reason() is not None, reason="Triton path unavailable")
@pytest.mark.parametrize("kd,block_j", [(32, 16), (24, None), (24, 16)])
def test_triton_fold_whole_or_sliced(kd, block_j, check_close, check_rel_rms):
    """The fold kernel reads each map whole (FoldConfig.block_j >= K) or in 16-column
    slices, forward and reverse (the gradient), at K = 32 and at a masked
    K = 24: outputs, final states and gradients against the reference."""
    x = make_inputs(5, B=1, T=140, H=1, HV=2, K=kd, V=16, N=2)
    cu = [0, 100, 140]
    fn = functools.partial(kda_jax.chunk_kda, implementation="triton", chunk_size=32)
    fwd = jax.jit(lambda q, k, v, g, b, h: fn(q, k, v, g, b, initial_state=h,
                                              output_final_state=True, cu_seqlens=cu))
    args = (*x.args(), x.initial_state)
    rng = np.random.default_rng(8)
    launches = []
    real = state_chain.fold_states
    fold = configs.FoldConfig(block_j=block_j or 128, warps=4, dot="ieee")
    with configs.override(FORCED, dataclasses.replace(configs.forward_config(), fold=fold),
                          dataclasses.replace(configs.backward_config(), fold=fold)), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_chain, "fold_states",
                   lambda launch, *a, **kw: launches.append(launch) or real(launch, *a, **kw))
        o, f = fwd(*args)
        w_o = rng.standard_normal(o.shape).astype(np.float32)
        w_f = rng.standard_normal(f.shape).astype(np.float32)
        grads = jax.jit(jax.grad(_loss(fn, cu), argnums=tuple(range(6))))(*args, w_o, w_f)
    assert {(l.constexprs["BJ"], l.constexprs["REVERSE"]) for l in launches} == {
        (32 if block_j is None else 16, False), (32 if block_j is None else 16, True)}
    ro, rf, rg = _reference(x, cu, w_o, w_f)
    check_close(o, ro, "float32", "o")
    check_close(f, rf, "float32", "final_state")
    for name, got, want in zip(NAMES, grads, rg):
        check_rel_rms(got, want, 1e-4, f"d{name}")


def test_segmented_dense_bf16_every_transform_state_v_first(check_close):
    """Dense rows (no cu_seqlens), bf16 inputs, V-first states and every
    in-kernel transform (gate with A_log and dt_bias, L2 norm, beta sigmoid,
    negative eigenvalues; they act per token). P and o0 come back in bf16
    from the backend; the corrected outputs stay within bf16's tolerance."""
    x = make_inputs(3, B=2, T=100, H=1, HV=2, K=16, V=16, dtype=jnp.bfloat16,
                    state_v_first=True, raw_gate=True, normalized_k=False, beta_logits=True)
    kw = dict(use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias,
              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              allow_neg_eigval=True, initial_state=x.initial_state, output_final_state=True,
              state_v_first=True)
    ro, rf = kda_jax.naive_recurrent_kda(*(np.asarray(a, np.float32) for a in x.args()), **kw)
    with configs.override(FORCED):
        o, f = kda_jax.chunk_kda(*x.args(), chunk_size=32, implementation="xla", **kw)
    assert o.dtype == jnp.bfloat16
    check_close(o, ro, "bfloat16", "o")
    check_close(f, rf, "bfloat16", "final_state")


@pytest.mark.skipif(unavailable_reason() is not None, reason="Triton path unavailable")
def test_triton_chain_runs_maps_and_folds(monkeypatch):
    """With segments forced, the Triton forward launches the map kernel and
    the forward fold over the plan's segments, and its gradient also the
    reverse fold; with the rule off, neither."""
    seen = []
    for name in ("segment_maps", "fold_states"):
        real = getattr(state_chain, name)
        monkeypatch.setattr(state_chain, name, lambda *a, _real=real, _name=name, **kw: (
            seen.append((_name, getattr(a[0], "constexprs", {}).get("REVERSE"),
                         a[1].plan.num_segments))
            or _real(*a, **kw)))
    x = make_inputs(2, B=1, T=70, H=1, HV=1, K=16, V=16)
    loss = lambda *a: jnp.sum(kda_jax.chunk_kda(*a, chunk_size=32, implementation="triton")[0])
    with configs.override(FORCED):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*x.args())
    maps, folds = ([r for r in seen if r[0] == n] for n in ("segment_maps", "fold_states"))
    # Traced in the forward (as many times as JAX traces it) and the backward,
    # over 3 segments (32, 32, 6 tokens); one reverse fold.
    assert len(maps) >= 2 and {m[2] for m in maps} == {3}
    assert len(folds) == len(maps) + 1 and [f[1] for f in folds].count(True) == 1
    seen.clear()
    with configs.override(configs.SegmentConfig()):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*x.args())
    assert seen == []


@pytest.mark.skipif(unavailable_reason() is not None, reason="Triton path unavailable")
def test_triton_chain_gva_transforms_state_v_first(check_close, check_rel_rms):
    """The Triton state chain on dense rows (B = 2), GVA (HV = 2 H), V-first
    states and every in-kernel transform, from an initial state, with a
    final state's cotangent: outputs and gradients against the reference."""
    x = make_inputs(3, B=2, T=100, H=1, HV=2, K=16, V=16, state_v_first=True, raw_gate=True,
                    normalized_k=False, beta_logits=True)
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, output_final_state=True,
              state_v_first=True)
    w_o = np.random.default_rng(5).standard_normal((2, 100, 2, 16)).astype(np.float32)
    w_f = np.random.default_rng(6).standard_normal((2, 2, 16, 16)).astype(np.float32)

    def loss(fn, q, k, v, g, beta, A_log, dt_bias, h0):
        o, f = fn(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, **kw)
        return jnp.sum(o * w_o) + jnp.sum(f * w_f), (o, f)

    args = [np.asarray(a, np.float32)
            for a in (*x.args(), x.A_log, x.dt_bias, x.initial_state)]
    chunked = functools.partial(kda_jax.chunk_kda, chunk_size=32, implementation="triton")
    grad = jax.grad(loss, argnums=tuple(range(1, 9)), has_aux=True)
    with configs.override(FORCED):
        g, (o, f) = jax.jit(functools.partial(grad, chunked))(*args)
    rg, (ro, rf) = jax.jit(functools.partial(grad, kda_jax.naive_recurrent_kda))(*args)
    check_close(o, ro, "float32", "o")
    check_close(f, rf, "float32", "final_state")
    for name, got, want in zip(NAMES[:5] + ("A_log", "dt_bias", "initial_state"), g, rg):
        check_rel_rms(got, want, 1e-4, f"d{name}")


@pytest.mark.skipif(unavailable_reason() is not None, reason="Triton path unavailable")
def test_segmented_nonfinite_matches_unsegmented():
    """A NaN in a middle segment: outputs and final state NaN from that token
    of that sequence and head on, as unsegmented; the gradients of everything
    else finite and equal to the unsegmented call's (Triton path: its
    compiles are the test above's)."""
    x = _inputs(1, T=140, N=4)
    x.v[0, 40, 1, 3] = np.nan  # sequence 0, head 1, second segment
    o, f, (g, w_o, w_f) = _run(x, CU, "triton", forced=True)
    uo, uf, (ug, _, _) = _run(x, CU, "triton", forced=False)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(uo))
    np.testing.assert_array_equal(np.isnan(f), np.isnan(uf))
    assert np.isnan(o[0, 40:70, 1]).all() and not np.isnan(o[0, :40]).any()
    for name, got, want in zip(NAMES, g, ug):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=name)


def test_nonfinite_initial_state_poisons_its_columns():
    """A NaN in one entry (head 1, key 2, value column 3) of sequence 0's
    initial state: that column of the sequence's outputs and final state is
    NaN, the other columns are not, as unsegmented and in the recurrence (the
    XLA composition's flags are per value column)."""
    x = _inputs(4, T=140, N=4)
    x.initial_state[0, 1, 2, 3] = np.nan
    o, f, _ = (np.asarray(y) if y is not None else y for y in _run(x, CU, "xla", True, False))
    uo, uf, _ = (np.asarray(y) if y is not None else y for y in _run(x, CU, "xla", False, False))
    np.testing.assert_array_equal(np.isnan(o), np.isnan(uo))
    np.testing.assert_array_equal(np.isnan(f), np.isnan(uf))
    assert np.isnan(o[0, :70, 1, 3]).all() and np.isnan(f[0, 1, :, 3]).all()
    assert np.isnan(o).sum() == 70 and np.isnan(f).sum() == 16
    ok = ~np.isnan(uo)
    np.testing.assert_allclose(o[ok], uo[ok], rtol=1e-4, atol=1e-5)


def test_rule_picks_segments_automatically():
    """The Triton chain's tables (kda_jax.triton.state_chain.chain_tables)
    and the XLA path's plan (kda_jax.segmented.plan_call) follow the config's
    rule; the chain only where the state pass holds the state whole."""
    from kda_jax.options import KdaOptions

    bounds = SeqBounds([0, 300])
    tables = lambda cfg, backward=False, split_k=False, kd=16, seg_bv=None: (
        state_chain.chain_tables(bounds, cfg, chunk_size=32, hv=1, kd=kd, vd=16, block_v=16,
                                 split_k=split_k, backward=backward, segment_block_v=seg_bv))
    rule = configs.SegmentConfig(
        forward=configs.SegmentRule(min_programs=1000, target_programs=4, min_segment_chunks=2),
        backward=configs.SegmentRule(min_programs=1, target_programs=4, min_segment_chunks=2))
    # 10 chunks, target 4 segments: at least 3 chunks each -> 4, 3, 3.
    assert tables(rule).plan.segments.lengths.tolist() == [128, 96, 76]
    assert tables(dataclasses.replace(rule, min_segments=4)) is None  # 3 segments < 4
    # The segmented pass in 8-wide V blocks: 2 programs per segment, so 2 segments.
    assert tables(rule, seg_bv=8).plan.segments.lengths.tolist() == [160, 140]
    assert tables(rule, backward=True) is None  # 1 program is not under 1
    assert tables(rule, split_k=True) is None and tables(rule, kd=256) is None
    assert tables(configs.replace(rule, "forward.min_programs", 1)) is None
    assert state_chain.chain_tables(kda_jax.VarlenBatch.from_lengths(
        [300], kda_jax.Bucket(1, 512)), rule, chunk_size=32, hv=1, kd=16, vd=16, block_v=16,
        split_k=False) is None  # a bucketed batch: device bounds, one pass

    opts = KdaOptions(scale=0.25, chunk_size=32)
    plan = lambda: segmented.plan_call("xla", bounds, None, opts, 1)
    with configs.override(dataclasses.replace(rule, xla=True)):
        assert plan().segments.lengths.tolist() == [128, 96, 76]
        assert segmented.plan_call("triton", bounds, None, opts, 1) is None
    with configs.override(rule):
        assert plan() is None
    assert plan() is None  # the CPU's default config: no segments


def test_map_and_fold_launches_take_their_configs():
    """The map kernel runs over the state pass's chunks at its own config; the
    fold reads whole maps (BJ = BK) where block_j reaches K, in slices
    otherwise, at its warps, both directions."""
    from kda_jax.triton.launch import KernelLaunch

    state = KernelLaunch("kda_fwd_state_output_kernel",
                         dict(HV=4, K=128, V=128, BT=64, BV=32, DOT="ieee"), 4, 3)
    map_config = configs.StateConfig(block_v=64, warps=8, stages=2, dot="tf32x3")
    whole = configs.FoldConfig(block_j=128, warps=2, dot="ieee")
    chain = state_chain.chain_launches(state, map_config, whole, use_h0=False)
    assert (chain.map.constexprs["BV"], chain.map.num_warps, chain.map.num_stages,
            chain.map.constexprs["DOT"]) == (64, 8, 2, "tf32x3")
    for fold in (chain.fold, chain.fold_reverse):
        assert (fold.constexprs["BJ"], fold.constexprs["BK"], fold.num_warps) == (128, 128, 2)
    sliced = state_chain.chain_launches(
        state, map_config, configs.FoldConfig(block_j=16, warps=4, dot="ieee"), use_h0=False)
    assert (sliced.fold.constexprs["BJ"], sliced.fold.num_warps) == (16, 4)


def test_each_direction_takes_its_own_rule():
    """SegmentConfig.forward applies to the forward's state pass,
    SegmentConfig.backward to the backward's."""
    bounds = SeqBounds([0, 64 * 64])  # 64 chunks of 64
    lengths = lambda cfg, backward: (state_chain.chain_tables(
        bounds, cfg, chunk_size=64, hv=1, kd=16, vd=16, block_v=16, split_k=False,
        backward=backward).plan.segments.lengths // 64).tolist()
    same = configs.SegmentRule(min_programs=8, target_programs=8, min_segment_chunks=4)
    rule = configs.SegmentConfig(forward=same, backward=same)
    assert lengths(rule, False) == [8] * 8 and lengths(rule, True) == [8] * 8
    own = dataclasses.replace(rule, backward=configs.SegmentRule(
        min_programs=8, target_programs=4, min_segment_chunks=16))
    assert lengths(own, False) == [8] * 8
    assert lengths(own, True) == [16] * 4


@pytest.mark.skipif(unavailable_reason() is not None, reason="Triton path unavailable")
def test_bench_forward_times_segmented_against_unsegmented(tmp_path, monkeypatch):
    """bench.forward's triton-noseg (today's single pass) and triton-seq rows
    (one call each here: the interpreter is slow)."""
    from bench import forward, sweep

    traced = []
    real = state_chain.chain_tables

    def spy(*a, **kw):
        tables = real(*a, **kw)
        traced.append(tables)
        return tables

    monkeypatch.setattr(state_chain, "chain_tables", spy)
    monkeypatch.setattr(forward, "time_jax", lambda fn, *a: float(
        np.asarray(jax.block_until_ready(fn(*a))).size > 0))
    out = tmp_path / "f.json"
    forward.main(["--impls", "triton-noseg,triton-seq", "--shapes", "1,130,1", "--head-dim",
                  "16", "--segment-chunks", "1", "--json", str(out)])
    import json
    rows = json.loads(out.read_text())
    assert [r["implementation"] for r in rows] == ["kda_jax-triton-noseg", "kda_jax-triton-seq"]
    assert all(r["ms"] for r in rows), rows
    # One pass (no tables), then 130 tokens at chunk 64 as segments of 64, 64, 2.
    assert [None if t is None else t.plan.num_segments for t in traced] == [None, 3]
    assert sweep.implementation("xla")[0] == "xla"
