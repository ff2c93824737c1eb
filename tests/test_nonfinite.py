"""Causality of NaN/Inf (issue 17 item 3) in chunk_kda, both backends.

A non-finite value in k, v, g or beta at token t makes the outputs of its
sequence from t on and its final state NaN (as the recurrence does); outputs
at tokens < t and every other sequence are bit-identical to the run with
zeros in place of the non-finite entries, forward and gradients (with the
cotangents of the NaN outputs zero). A non-finite q poisons its own token only.
"""

from __future__ import annotations

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
