"""The XLA paths (chunk_kda, fused_recurrent_kda) against the float32 reference.

The cases are kda_jax.testing.CASES (awkward shapes, every flag, fp32/bf16/fp16
inputs), run by the suite every backend runs (tests/reference_suite.py). The
reference itself is checked against a float64 NumPy transcription of
docs/kda.md sections 1-2 that shares no code with the library (the reference
and the XLA path share kda_jax.transforms).
"""

from __future__ import annotations

import numpy as np
import pytest

import kda_jax
from kda_jax.testing import CASES, assert_close, make_inputs
from reference_suite import ReferenceSuite, reference


class TestXla(ReferenceSuite):
    """The XLA path on every case but the GPU sizes (tests/reference_suite.py)."""

    implementation = "xla"


@pytest.mark.parametrize("case", [c for c in CASES if c.off is not None], ids=str)
def test_feature_changes_the_reference(case):
    """Each flag case exercises its flag: switching it off changes the answer."""
    x, ref_o, _ = reference(case)
    o_off, _ = kda_jax.naive_recurrent_kda(*x.args(), **case.kwargs(x, case.off))
    assert not np.allclose(np.asarray(o_off), ref_o, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_state_v_first_is_the_transpose(impl):
    """state_v_first only changes the state layout: same o, transposed states.

    Checked against the reference in the K-first layout, so a layout mix-up in
    the reference's own state_v_first handling cannot hide one in the XLA path.
    """
    x = make_inputs(5, B=2, T=40, H=1, HV=2, K=32, V=48)
    ref_o, ref_final = kda_jax.naive_recurrent_kda(
        *x.args(), initial_state=x.initial_state, output_final_state=True
    )
    fn = kda_jax.chunk_kda if impl == "chunk" else kda_jax.fused_recurrent_kda
    h0_vk = np.ascontiguousarray(np.swapaxes(x.initial_state, -1, -2))
    o, final = fn(*x.args(), initial_state=h0_vk, output_final_state=True,
                  state_v_first=True, implementation="xla")
    assert final.shape == (2, 2, 48, 32)
    assert_close(o, ref_o, "float32", "o")
    assert_close(np.swapaxes(np.asarray(final), -1, -2), ref_final, "float32", "final")


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_default_scale_is_rsqrt_k(impl):
    x = make_inputs(6, B=1, T=20, H=2, K=48, V=32)
    fn = kda_jax.chunk_kda if impl == "chunk" else kda_jax.fused_recurrent_kda
    o_default, _ = fn(*x.args(), initial_state=x.initial_state, implementation="xla")
    o_explicit, _ = fn(*x.args(), initial_state=x.initial_state, scale=48**-0.5,
                       implementation="xla")
    o_other, _ = fn(*x.args(), initial_state=x.initial_state, scale=0.5, implementation="xla")
    np.testing.assert_allclose(np.asarray(o_default), np.asarray(o_explicit), rtol=1e-6, atol=1e-7)
    assert not np.allclose(np.asarray(o_default), np.asarray(o_other), rtol=1e-3)


# --------------------------------------------------------------------------- #
# The reference against a float64 NumPy transcription of the spec.
# --------------------------------------------------------------------------- #


def _spec_kda_f64(q, k, v, g, beta, *, scale=None, initial_state=None,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                  dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, state_v_first=False, cu_seqlens=None):
    """docs/kda.md sections 1-2 in float64 loops; returns (o, final in the state layout)."""
    f64 = lambda a: np.asarray(np.asarray(a, np.float32), np.float64)
    q, k, v, g, beta = map(f64, (q, k, v, g, beta))
    b, t, h, kd = q.shape
    hv, vd = v.shape[2:]
    scale = kd**-0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    if use_gate_in_kernel:
        x = g + (0.0 if dt_bias is None else f64(dt_bias).reshape(hv, kd))
        a = None if A_log is None else np.exp(f64(A_log))[:, None]
        if lower_bound is None:
            softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
            g = -a * softplus
        else:
            g = lower_bound / (1 + np.exp(-(x if a is None else a * x)))
    if use_beta_sigmoid_in_kernel:
        beta = 1 / (1 + np.exp(-beta))
    if allow_neg_eigval:
        beta = 2 * beta
    if cu_seqlens is None:
        spans = [(i, i * t, (i + 1) * t) for i in range(b)]
        q, k, v, g, beta = (a.reshape((1, b * t) + a.shape[2:]) for a in (q, k, v, g, beta))
    else:
        cu = np.asarray(cu_seqlens)
        spans = [(i, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    n = len(spans)
    s0 = np.zeros((n, hv, kd, vd)) if initial_state is None else f64(initial_state)
    if initial_state is not None and state_v_first:
        s0 = np.swapaxes(s0, -1, -2)
    o = np.zeros(v.shape)
    final = np.zeros((n, hv, kd, vd))
    for i, lo, hi in spans:
        for head in range(hv):
            qk_head = head // (hv // h)
            s = s0[i, head].copy()
            for tok in range(lo, hi):
                s = np.exp(g[0, tok, head])[:, None] * s
                kt = k[0, tok, qk_head]
                s = s + beta[0, tok, head] * np.outer(kt, v[0, tok, head] - kt @ s)
                o[0, tok, head] = scale * (q[0, tok, qk_head] @ s)
            final[i, head] = s
    if state_v_first:
        final = np.swapaxes(final, -1, -2)
    return o.reshape(b, t, hv, vd), final


SPEC_CASES = {
    "plain": ({}, {}),
    "l2norm-scale": (dict(normalized_k=False), dict(use_qk_l2norm_in_kernel=True, scale=0.7)),
    "gate-softplus": (dict(raw_gate=True), dict(use_gate_in_kernel=True, A_log=True, dt_bias=True)),
    "gate-lb-Alog": (dict(raw_gate=True), dict(use_gate_in_kernel=True, A_log=True,
                                               dt_bias=True, lower_bound=-3.0)),
    "gate-lb-bare": (dict(raw_gate=True), dict(use_gate_in_kernel=True, lower_bound=-0.5)),
    "beta-negeig-vfirst": (dict(beta_logits=True, state_v_first=True),
                           dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                state_v_first=True)),
    "varlen": ({}, dict(cu_seqlens=np.array([0, 0, 5, 6, 6, 13]))),
}


@pytest.mark.parametrize("name", list(SPEC_CASES))
def test_reference_matches_float64_spec(name):
    make_kw, call_kw = SPEC_CASES[name]
    varlen = "cu_seqlens" in call_kw
    # H = 2, HV = 4: value heads 0, 1 read q/k head 0 and 2, 3 read head 1.
    x = make_inputs(11, B=1 if varlen else 2, T=13, H=2, HV=4, K=8, V=6,
                    N=5 if varlen else None, **make_kw)
    if make_kw.get("raw_gate"):
        # Push some pre-activations past the softplus threshold (x > 20).
        x.g[0, 3] = 25.0
    call_kw = {n: (getattr(x, n) if n in ("A_log", "dt_bias") and v is True else v)
               for n, v in call_kw.items()}
    o, final = kda_jax.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, **call_kw)
    o64, final64 = _spec_kda_f64(*x.args(), initial_state=x.initial_state, **call_kw)
    assert np.std(o64) > 1e-2
    assert_close(o, o64, "float32", "reference o")
    assert_close(final, final64, "float32", "reference final")
