"""Gradients of the XLA path against autodiff of the float32 reference, beyond
the suite's gradient cases (tests/reference_suite.py, run by TestXla):
fused_recurrent_kda's gradient and gates of -1000.

Loss: sum(o * w) + sum(final_state * w2) with random weights, so every output
element and every state element carries its own cotangent. Each gradient is
held to relative RMS <= 1e-4 on its own (the failure names it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from kda_jax import testing
from kda_jax.testing import TOLERANCES, make_inputs
import test_xla_vs_reference

TOL = 1e-4
ALL = ("q", "k", "v", "g", "beta", "initial_state")


def _arrays(x):
    return dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, initial_state=x.initial_state,
                A_log=x.A_log, dt_bias=x.dt_bias)


def _grad_fn(fn, arrays, call_kw, wrt, w_o, w_f, jit=True):
    """grad of the weighted loss w.r.t. the names in ``wrt`` (jitted if asked)."""
    fixed = {n: a for n, a in arrays.items() if n not in wrt}

    def loss(params):
        a = {**fixed, **params}
        o, final = fn(a["q"], a["k"], a["v"], a["g"], a["beta"],
                      initial_state=a["initial_state"], output_final_state=True, **call_kw)
        return jnp.sum(o * w_o) + jnp.sum(final * w_f)

    # The API functions are jitted inside; an outer jit only adds compile time.
    return jax.jit(jax.grad(loss)) if jit else jax.grad(loss)


def test_fused_recurrent_grad_matches_reference(check_close, check_rel_rms):
    """fused_recurrent_kda's gradient on the XLA path (the Triton decode
    kernel is forward only), on the suite's varlen gradient case with empty
    and one-token sequences (chunk_kda's gradients: the suite,
    tests/test_xla_vs_reference.py)."""
    test_xla_vs_reference.TestXla().check_grads(testing.case("grad-varlen-empty-len1-c32"),
                                                check_close, check_rel_rms,
                                                fn=kda_jax.fused_recurrent_kda)


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
