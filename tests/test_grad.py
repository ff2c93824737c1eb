"""Gradients of the XLA path against autodiff of the float32 reference.

Loss: sum(o * w) + sum(final_state * w2) with random weights, so every output
element and every state element carries its own cotangent. Each gradient is
held to relative RMS <= 1e-4 on its own (the failure names it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax.testing import TOLERANCES, make_inputs

TOL = 1e-4
ALL = ("q", "k", "v", "g", "beta", "initial_state")

# id -> (make_inputs kwargs, call kwargs, chunk size, names to differentiate)
# The XLA path and the reference apply the in-kernel transforms with the same
# kda_jax.transforms code, so a gate case here holds the chunked recurrence's
# gradient under a transformed gate (with and without lower_bound); the gate
# form without A_log and dt_bias is held by tests/test_triton_grad.py's
# gate-lb-bare (the kernels' own backward) and tests/test_gate_extremes.py.
CASES = {
    "plain-B2-T80-K20-V28-c32": (dict(B=2, T=80, H=2, K=20, V=28), {}, 32, ALL),
    "gate-softplus-Alog-dtbias": (
        dict(B=1, T=40, H=2, K=16, V=16, raw_gate=True),
        dict(use_gate_in_kernel=True, A_log=True, dt_bias=True), 32,
        ALL + ("A_log", "dt_bias"),
    ),
    "gate-lb-Alog-dtbias": (
        dict(B=2, T=33, H=1, K=16, V=24, raw_gate=True),
        dict(use_gate_in_kernel=True, A_log=True, dt_bias=True, lower_bound=-2.0), 64,
        ("g", "A_log", "dt_bias", "k"),
    ),
    "l2norm-beta-sigmoid-negeig": (
        dict(B=1, T=50, H=2, K=32, V=16, normalized_k=False, beta_logits=True),
        dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             allow_neg_eigval=True), 32, ALL,
    ),
    "gva-HV2H-vfirst-scale": (
        dict(B=1, T=70, H=2, HV=4, K=24, V=16, state_v_first=True),
        dict(state_v_first=True, scale=0.3), 64, ALL,
    ),
    "varlen-empty-len1": (
        dict(B=1, T=61, H=1, HV=2, K=16, V=16, N=5),
        dict(cu_seqlens=np.array([0, 0, 1, 41, 41, 61])), 32, ALL,
    ),
    "varlen-no-h0-c64": (
        dict(B=1, T=70, H=2, K=16, V=16, N=4, with_state=False),
        dict(cu_seqlens=np.array([0, 1, 1, 66, 70])), 64, ("q", "k", "v", "g", "beta"),
    ),
}


def _arrays(x):
    return dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, initial_state=x.initial_state,
                A_log=x.A_log, dt_bias=x.dt_bias)


def _resolve(call_kw, arrays):
    """Call kwargs with ``A_log=True`` / ``dt_bias=True`` replaced by the arrays."""
    return {n: (arrays[n] if n in ("A_log", "dt_bias") and v is True else v)
            for n, v in call_kw.items()}


def _grad_fn(fn, arrays, call_kw, wrt, w_o, w_f, jit=True):
    """grad of the weighted loss w.r.t. the names in ``wrt`` (jitted if asked)."""
    fixed = {n: a for n, a in arrays.items() if n not in wrt}

    def loss(params):
        a = {**fixed, **params}
        kw = _resolve(call_kw, a)
        o, final = fn(a["q"], a["k"], a["v"], a["g"], a["beta"],
                      initial_state=a["initial_state"], output_final_state=True, **kw)
        return jnp.sum(o * w_o) + jnp.sum(final * w_f)

    # The API functions are jitted inside; an outer jit only adds compile time.
    return jax.jit(jax.grad(loss)) if jit else jax.grad(loss)


# Every case through chunk_kda; fused_recurrent_kda's gradient once (varlen).
GRAD_PARAMS = [(name, "chunk") for name in CASES] + [("varlen-empty-len1", "recurrent")]


@pytest.mark.parametrize("name,impl", GRAD_PARAMS)
def test_grad_matches_reference(name, impl, check_rel_rms):
    make_kw, call_kw, chunk, wrt = CASES[name]
    x = make_inputs(17, **make_kw)
    arrays = _arrays(x)
    rng = np.random.default_rng(1)
    ref_o, ref_final = kda_jax.naive_recurrent_kda(
        *x.args(), initial_state=x.initial_state, output_final_state=True,
        **_resolve(call_kw, arrays))
    w_o = rng.standard_normal(ref_o.shape).astype(np.float32)
    w_f = rng.standard_normal(ref_final.shape).astype(np.float32)
    params = {n: arrays[n] for n in wrt}

    ref = _grad_fn(kda_jax.naive_recurrent_kda, arrays, call_kw, wrt, w_o, w_f)(params)
    fast_fn = (functools.partial(kda_jax.chunk_kda, implementation="xla", chunk_size=chunk)
               if impl == "chunk"
               else functools.partial(kda_jax.fused_recurrent_kda, implementation="xla"))
    got = _grad_fn(fast_fn, arrays, call_kw, wrt, w_o, w_f, jit=False)(params)

    failures = []
    for n in wrt:
        assert got[n].shape == params[n].shape and got[n].dtype == params[n].dtype, n
        # The gradient is not trivially zero.
        assert np.abs(np.asarray(ref[n])).max() > 1e-6, f"d{n} of the reference is ~0"
        try:
            check_rel_rms(got[n], ref[n], TOL, f"d{n}")
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{name} {impl}: " + "; ".join(failures)

    cu = call_kw.get("cu_seqlens")
    if cu is not None and "initial_state" in wrt:
        # An empty sequence's final state is its initial state: the gradient is w2.
        empty = np.diff(cu) == 0
        np.testing.assert_array_equal(np.asarray(got["initial_state"])[empty], w_f[empty])


def test_grad_with_gate_floor_minus_1000(check_rel_rms):
    """exp(-1000) gates: finite gradients that match the reference, within the
    documented testing.TOLERANCES["float32-extreme-gates"] relative RMS."""
    tol = TOLERANCES["float32-extreme-gates"]["rel_rms"]
    x = make_inputs(3, B=1, T=64, H=1, K=16, V=16, gate_floor=-1000.0)
    arrays = _arrays(x)
    rng = np.random.default_rng(2)
    w_o = rng.standard_normal((1, 64, 1, 16)).astype(np.float32)
    w_f = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    params = {n: arrays[n] for n in ALL}
    ref = _grad_fn(kda_jax.naive_recurrent_kda, arrays, {}, ALL, w_o, w_f)(params)
    got = _grad_fn(functools.partial(kda_jax.chunk_kda, implementation="xla"),
                   arrays, {}, ALL, w_o, w_f, jit=False)(params)
    # Token 0 decays by exp(-1000): the initial state cannot matter at all.
    assert np.all(np.asarray(ref["initial_state"]) == 0)
    np.testing.assert_array_equal(np.asarray(got["initial_state"]), 0.0)
    failures = []
    for n in ("q", "k", "v", "g", "beta"):
        assert np.all(np.isfinite(np.asarray(got[n]))), f"d{n} is not finite"
        try:
            check_rel_rms(got[n], ref[n], tol, f"d{n}", kind="grad g=-1000")
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "; ".join(failures)
