"""Causality of NaN/Inf (issue 17 item 3) in chunk_kda, both backends, and
one rule for it in every function and backend (issue 37 item 6, at the end).

A non-finite value in k, v, g or beta at token t makes the outputs of its
sequence and value head from t on and its final state NaN (docs/kda.md
section 6); outputs at tokens < t and every other sequence are bit-identical
to the run with zeros in place of the non-finite entries, forward and
gradients (with the cotangents of the NaN outputs zero). A non-finite q
poisons its own token only.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax.testing import assert_close, make_inputs
from kda_jax.triton import unavailable_reason

NO_TRITON = unavailable_reason() is not None


def _impls(triton=True):
    out = ["xla"]
    if triton:
        out.append(pytest.param("triton", marks=pytest.mark.skipif(
            NO_TRITON, reason=f"Triton path unavailable: {unavailable_reason()}")))
    return out


T, TOK, C = 40, 20, 32  # token 20: the middle of the first chunk of 32


def _inputs():
    return make_inputs(5, B=2, T=T, H=1, HV=2, K=16, V=16)


def _poison(x, field, value, b=0, t=TOK):
    """(poisoned copy, clean copy with zeros there) of the inputs."""
    bad, clean = _copy(x), _copy(x)
    arr, zero = getattr(bad, field), getattr(clean, field)
    if field in ("q", "k", "v", "g"):
        arr[b, t, 0, 3] = value
        zero[b, t, 0, 3] = 0.0
    else:  # beta
        arr[b, t, 1] = value
        zero[b, t, 1] = 0.0
    return bad, clean


def _copy(x):
    import copy
    return copy.deepcopy(x)


def _run(x, impl, **kw):
    o, s = kda_jax.chunk_kda(*x.args(), initial_state=x.initial_state, output_final_state=True,
                             implementation=impl, chunk_size=C, **kw)
    return np.asarray(o), np.asarray(s)


CASES = [(f, v) for f in ("k", "v", "g", "beta") for v in (np.nan, np.inf)] + [
    ("q", np.nan), ("q", -np.inf)]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("field,value", CASES)
def test_forward_is_causal(field, value, impl):
    x = _inputs()
    bad, clean = _poison(x, field, value)
    o, s = _run(bad, impl)
    oc, sc = _run(clean, impl)
    # Rows before the token, and the other sequence, bit-identical to the clean run.
    np.testing.assert_array_equal(o[0, :TOK], oc[0, :TOK])
    np.testing.assert_array_equal(o[1], oc[1])
    np.testing.assert_array_equal(s[1], sc[1])
    if field == "q":
        assert np.isnan(o[0, TOK, 0]).all()  # q's head 0 feeds value heads 0 and 1
        np.testing.assert_array_equal(o[0, TOK + 1:], oc[0, TOK + 1:])
        np.testing.assert_array_equal(s, sc)
    else:
        heads = [0, 1] if field in ("k",) else ([1] if field == "beta" else [0])
        assert np.isnan(o[0, TOK:, heads]).all()
        assert np.isnan(s[0, heads]).all()
        others = [h for h in (0, 1) if h not in heads]
        np.testing.assert_array_equal(o[0, :, others], oc[0, :, others])
    # And close to the reference with the clean inputs.
    ro, _ = kda_jax.naive_recurrent_kda(*clean.args(), initial_state=clean.initial_state)
    assert_close(o[0, :TOK], np.asarray(ro)[0, :TOK], "float32", "o before the token")


def test_minus_inf_gate_is_not_poison():
    x = _inputs()
    x.g[0, TOK] = -np.inf
    o, s = _run(x, "xla")
    assert np.isfinite(o).all() and np.isfinite(s).all()


_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _weighted_loss(p, w, impl):
    o, _ = kda_jax.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"],
                             initial_state=p["initial_state"], implementation=impl,
                             chunk_size=C)
    return jnp.sum(jnp.where(w != 0, o, 0.0) * w)


# One function for every case: the inputs and weights are arguments of one
# shape, so each implementation compiles once for the module.
_grad_of_loss = jax.jit(jax.grad(_weighted_loss), static_argnums=2)


def _grads(x, impl, keep_rows):
    """Gradients of sum(o * w) with w zero on rows >= keep_rows of sequence 0."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2, T, 2, 16)).astype(np.float32)
    w[0, keep_rows:] = 0.0
    g = _grad_of_loss({n: jnp.asarray(getattr(x, n)) for n in _NAMES}, jnp.asarray(w), impl)
    return {n: np.asarray(v) for n, v in g.items()}


GRAD_CASES = {"xla": CASES, "triton": [("v", np.nan), ("k", np.inf), ("g", np.nan),
                                       ("beta", np.inf), ("q", np.nan)]}


@pytest.mark.parametrize("impl,field,value",
                         [(i, f, v) for i in ("xla", "triton") for f, v in GRAD_CASES[i]])
def test_gradients_are_causal(impl, field, value):
    if impl == "triton" and NO_TRITON:
        pytest.skip(f"Triton path unavailable: {unavailable_reason()}")
    x = _inputs()
    bad, clean = _poison(x, field, value)
    gb = _grads(bad, impl, TOK)
    gc = _grads(clean, impl, TOK)
    for n in gb:
        assert np.isfinite(gb[n]).all(), f"d{n} is not finite"
        if n == "initial_state":
            np.testing.assert_array_equal(gb[n], gc[n], err_msg=n)
            continue
        np.testing.assert_array_equal(gb[n][0, :TOK], gc[n][0, :TOK], err_msg=n)
        np.testing.assert_array_equal(gb[n][1], gc[n][1], err_msg=n)


@pytest.mark.parametrize("impl", _impls())
def test_right_padded_batch_with_garbage(impl):
    """v[0, 30:] = nan (a right-padded dense batch): o[0, :30] equals the
    zero-padded run and the reference of the first 30 tokens."""
    x = _inputs()
    bad, clean = _copy(x), _copy(x)
    bad.v[0, 30:] = np.nan
    clean.v[0, 30:] = 0.0
    o, _ = _run(bad, impl)
    oc, _ = _run(clean, impl)
    np.testing.assert_array_equal(o[0, :30], oc[0, :30])
    np.testing.assert_array_equal(o[1], oc[1])
    assert np.isnan(o[0, 30:]).all()
    head = lambda a: a[:1, :30]
    ro, _ = kda_jax.naive_recurrent_kda(head(x.q), head(x.k), head(x.v), head(x.g),
                                        head(x.beta), initial_state=x.initial_state[:1])
    assert_close(o[:1, :30], ro, "float32", "o of the real tokens")


@pytest.mark.parametrize("impl", _impls())
def test_varlen_poisoned_sequence_leaves_others_identical(impl):
    cu = np.asarray([0, 20, 45, 45, 70])
    x = make_inputs(6, B=1, T=70, H=1, K=16, V=16, N=4)
    bad, clean = _copy(x), _copy(x)
    bad.k[0, 30, 0, :] = np.nan  # sequence 1, its 11th token (second chunk of 32? no: first)
    clean.k[0, 30, 0, :] = 0.0
    o, s = _run(bad, impl, cu_seqlens=cu)
    oc, sc = _run(clean, impl, cu_seqlens=cu)
    np.testing.assert_array_equal(o[0, :30], oc[0, :30])
    np.testing.assert_array_equal(o[0, 45:], oc[0, 45:])
    assert np.isnan(o[0, 30:45]).all()
    np.testing.assert_array_equal(s[[0, 2, 3]], sc[[0, 2, 3]])
    assert np.isnan(s[1]).all()


# --------------------------------------------------------------------------- #
# One rule for every function and backend (issue 37 item 6): chunk_kda and
# fused_recurrent_kda on both paths, and naive_recurrent_kda, in one varlen
# batch whose sequences each hold one non-finite entry.
# --------------------------------------------------------------------------- #

# field: q, k (its q/k head), v, g, beta (a value head), initial_state (index
# = (row, column)); tok: the token within the sequence; poisons: whether the
# rule calls the entry poison (False: -inf in g, +-inf in a raw gate or in beta
# before its sigmoid, which the recurrence takes as finite).
Bad = collections.namedtuple("Bad", "field seq tok head index value poisons",
                             defaults=(True,))
R_LENS = [9, 0, 37, 6, 40, 1, 14, 12, 5]  # an empty sequence; 37 and 40 cross a chunk
R_H, R_HV, R_K, R_V = 1, 2, 16, 24  # GVA: a bad k or q reaches both value heads
NAN, INF = np.nan, np.inf
_GATED = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              use_qk_l2norm_in_kernel=True)

RULE_CASES = {
    "nan": ({}, [
        Bad("q", 2, 20, 0, 3, NAN), Bad("k", 3, 2, 0, 7, NAN), Bad("v", 4, 35, 1, 23, NAN),
        Bad("beta", 5, 0, 0, None, NAN), Bad("g", 6, 5, 1, 15, NAN),
        Bad("v", 7, 3, 0, 0, NAN), Bad("initial_state", 8, 0, 1, (2, 5), NAN),
        Bad("g", 0, 4, 0, 2, -INF, poisons=False)]),
    "inf": ({}, [
        Bad("q", 2, 20, 0, 3, -INF), Bad("k", 3, 2, 0, 7, INF), Bad("v", 4, 35, 1, 23, -INF),
        Bad("beta", 5, 0, 0, None, INF), Bad("g", 6, 5, 1, 15, INF),
        Bad("v", 7, 3, 0, 0, INF), Bad("initial_state", 8, 0, 1, (2, 5), INF),
        Bad("g", 0, 4, 0, 2, -INF, poisons=False)]),
    "gated-nan": (_GATED, [
        Bad("q", 2, 20, 0, 3, NAN), Bad("k", 3, 2, 0, 7, NAN), Bad("v", 4, 35, 1, 23, NAN),
        Bad("beta", 5, 0, 0, None, NAN), Bad("g", 6, 5, 1, 15, NAN),
        Bad("k", 7, 3, 0, 0, -INF), Bad("initial_state", 8, 0, 0, (15, 0), -INF)]),
    "gated-inf": (_GATED, [
        Bad("q", 2, 20, 0, 3, INF), Bad("k", 3, 2, 0, 7, -INF), Bad("v", 4, 35, 1, 23, INF),
        Bad("beta", 5, 0, 0, None, INF, poisons=False),
        Bad("beta", 0, 6, 1, None, -INF, poisons=False),
        Bad("g", 6, 5, 1, 15, INF, poisons=False), Bad("g", 7, 3, 0, 0, -INF, poisons=False),
        Bad("initial_state", 8, 0, 1, (2, 5), INF)]),
}

BACKENDS = {
    "reference": lambda *a, **kw: kda_jax.naive_recurrent_kda(*a, **kw),
    "xla-chunk": lambda *a, **kw: kda_jax.chunk_kda(*a, chunk_size=C, implementation="xla",
                                                    **kw),
    "xla-recurrent": lambda *a, **kw: kda_jax.fused_recurrent_kda(*a, implementation="xla",
                                                                  **kw),
    "triton-chunk": lambda *a, **kw: kda_jax.chunk_kda(*a, chunk_size=C,
                                                       implementation="triton", **kw),
    "triton-recurrent": lambda *a, **kw: kda_jax.fused_recurrent_kda(
        *a, implementation="triton", **kw),
}


def _rule_inputs(case):
    """(bad inputs, the same with zeros in place of the poisoning entries,
    call kwargs, cu_seqlens, bad placements) of RULE_CASES[case]."""
    flags, bads = RULE_CASES[case]
    cu = np.cumsum([0] + R_LENS)
    gated = bool(flags)
    x = make_inputs(11, B=1, T=int(cu[-1]), H=R_H, HV=R_HV, K=R_K, V=R_V, N=len(R_LENS),
                    raw_gate=gated, beta_logits=gated, normalized_k=not gated)
    bad, clean = _copy(x), _copy(x)
    for p in bads:
        t = cu[p.seq] + p.tok
        for y, value in ((bad, p.value), (clean, 0.0 if p.poisons else p.value)):
            if p.field == "initial_state":
                y.initial_state[(p.seq, p.head) + p.index] = value
            elif p.field == "beta":
                y.beta[0, t, p.head] = value
            else:
                getattr(y, p.field)[0, t, p.head, p.index] = value
    kw = dict(flags, cu_seqlens=cu, output_final_state=True)
    if gated:
        kw.update(A_log=x.A_log, dt_bias=x.dt_bias)
    return bad, clean, kw, cu, bads


def _rule_masks(cu, bads):
    """What the rule makes NaN: o rows [T, HV] and final states [N, HV]; and
    what a non-finite initial-state entry makes non-finite: o [T, HV, V] and
    final-state columns [N, HV, V]."""
    t, n, groups = int(cu[-1]), len(cu) - 1, R_HV // R_H
    o_nan, s_nan = np.zeros((t, R_HV), bool), np.zeros((n, R_HV), bool)
    o_col, s_col = np.zeros((t, R_HV, R_V), bool), np.zeros((n, R_HV, R_V), bool)
    for p in bads:
        if not p.poisons:
            continue
        lo, hi = cu[p.seq], cu[p.seq + 1]
        heads = (list(range(p.head * groups, (p.head + 1) * groups)) if p.field in ("q", "k")
                 else [p.head])
        if p.field == "initial_state":
            o_col[lo:hi, p.head, p.index[1]] = True
            s_col[p.seq, p.head, p.index[1]] = True
        elif p.field == "q":
            o_nan[lo + p.tok, heads] = True
        else:
            o_nan[lo + p.tok:hi, heads] = True
            s_nan[p.seq, heads] = True
    return o_nan, s_nan, o_col, s_col


def _call(backend, x, kw):
    o, s = BACKENDS[backend](*x.args(), initial_state=x.initial_state, **kw)
    return np.asarray(o)[0], np.asarray(s)


@functools.lru_cache(maxsize=None)
def _reference_clean(case):
    _, clean, kw, _, _ = _rule_inputs(case)
    return _call("reference", clean, kw)


@pytest.mark.parametrize("backend", [
    b if not b.startswith("triton") else pytest.param(b, marks=pytest.mark.skipif(
        NO_TRITON, reason=f"Triton path unavailable: {unavailable_reason()}"))
    for b in BACKENDS])
@pytest.mark.parametrize("case", list(RULE_CASES))
def test_one_rule_across_backends(case, backend):
    bad, clean, kw, cu, bads = _rule_inputs(case)
    o_nan, s_nan, o_col, s_col = _rule_masks(cu, bads)
    o, s = _call(backend, bad, kw)
    ro, rs = _reference_clean(case)
    o_nan_e = np.broadcast_to(o_nan[..., None], o.shape)
    s_nan_e = np.broadcast_to(s_nan[..., None, None], s.shape)
    s_col_e = np.broadcast_to(s_col[:, :, None, :], s.shape)  # [N, HV, K, V]: column V
    # NaN exactly where the rule says; non-finite exactly there and in the
    # value columns of a non-finite initial-state entry.
    np.testing.assert_array_equal(np.isnan(o) & ~o_col, o_nan_e & ~o_col, err_msg="NaN in o")
    np.testing.assert_array_equal(~np.isfinite(o), o_nan_e | o_col, err_msg="non-finite o")
    np.testing.assert_array_equal(np.isnan(s) & ~s_col_e, s_nan_e & ~s_col_e,
                                  err_msg="NaN in the final state")
    np.testing.assert_array_equal(~np.isfinite(s), s_nan_e | s_col_e,
                                  err_msg="non-finite final state")
    # Elsewhere: close to the reference with zeros in place of the poisoning
    # entries, and bit for bit the backend's own run with them. The Triton
    # chunk form skips the second run (a minute in the interpreter): its bit
    # identity is test_forward_is_causal's.
    keep_o, keep_s = ~(o_nan_e | o_col), ~(s_nan_e | s_col_e)
    assert_close(o[keep_o], ro[keep_o], "float32", f"{backend} o off the poisoned rows")
    assert_close(s[keep_s], rs[keep_s], "float32", f"{backend} final states off them")
    if backend != "triton-chunk":
        oc, sc = _call(backend, clean, kw)
        np.testing.assert_array_equal(o[keep_o], oc[keep_o], err_msg="o, zeros in place")
        np.testing.assert_array_equal(s[keep_s], sc[keep_s], err_msg="states, zeros in place")
