"""The gates models have (docs/kda.md sections 3 and 6): one two-level
product path for every gate in the forward and the backward, against the
float32 reference in float32 and bf16. Gates: a Kimi/KDA layer's in-kernel
gate -exp(A_log) * softplus(x) with exp(A_log) in [1, 16] and x ~ N(0, 1);
plain log-decays in [-12, -3] per token; the benchmarks' regimes
(bench.inputs, docs/kda.md section 6): init, its gate in the kernel with the
L2 norm and beta sigmoid (layer), mild and strong; floored gates; on varlen
bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax.kernels import chunk_bwd, chunk_fwd
from bench.inputs import init_dt_bias, safe_gate
from kda_jax.testing import make_inputs
from kda_jax.triton import interpret_mode, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"Triton path unavailable: {unavailable_reason()}")

# A chunk of 64 rows and one of 36. The gradient tests take K = 80: two K
# slices (a partial one) of the forward and of the backward's products.
SHAPE = dict(B=1, T=100, H=2, K=32, V=16)
GRAD_SHAPE = dict(SHAPE, K=80)
GRAD_TOL = 1e-4 if (interpret_mode() or jax.default_backend() == "cpu") else 1e-3
# bf16 inputs: tests/test_triton_grad.py's targets.
GRAD_TOL_BF16 = dict(q=8e-3, k=8e-3, v=8e-3, initial_state=8e-3, g=2e-2, beta=2e-2,
                     A_log=2e-2, dt_bias=2e-2)


def _case(kind, dtype, shape=SHAPE, a=(3.0, 12.0)):
    """(inputs, chunk_kda keyword arguments). ``a``: exp(A_log) per head for
    the in-kernel gate (depths of about 150 and 600 per 64-row chunk), which
    comes with the in-kernel L2 norm of q and k."""
    gate = kind == "gate"
    x = make_inputs(11, dtype=dtype, raw_gate=gate, normalized_k=not gate, **shape)
    if gate:  # as a layer: q and k normalized in the kernel
        x.A_log[:] = np.log(np.asarray(a, np.float32))
        x.dt_bias[:] = 0.0
        return x, dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    x.g = -np.random.default_rng(12).uniform(3.0, 12.0, x.g.shape).astype(np.float32)
    return x, {}


def _call(fn, params, kw, **extra):
    gate = {n: params[n] for n in ("A_log", "dt_bias")} if "A_log" in params else {}
    return fn(params["q"], params["k"], params["v"], params["g"], params["beta"],
              initial_state=params["initial_state"], output_final_state=True, **kw, **gate,
              **extra)


def _params(x, kw):
    gate = ["A_log", "dt_bias"] if kw.get("use_gate_in_kernel") else []
    names = ["q", "k", "v", "g", "beta", "initial_state"] + gate
    return {n: jnp.asarray(getattr(x, n)) for n in names}


def _f32(params):
    return {n: jnp.asarray(p, jnp.float32) for n, p in params.items()}


def _grads_and_reference(params, kw, shape, seed, **triton_kw):
    """(Triton's, the float32 reference's) gradients of a random weighting of
    o and the final state, for every input in params; triton_kw: more
    arguments of the Triton call (chunk_size)."""
    rng = np.random.default_rng(seed)
    w_o = rng.standard_normal((1, shape["T"], shape["H"], shape["V"])).astype(np.float32)
    w_s = rng.standard_normal((1, shape["H"], shape["K"], shape["V"])).astype(np.float32)

    def grads(fn, p, **extra):
        def loss(p):
            o, s = _call(fn, p, kw, **extra)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)
        return jax.jit(jax.grad(loss))(p)

    return (grads(kda_jax.chunk_kda, params, implementation="triton", **triton_kw),
            grads(kda_jax.naive_recurrent_kda, _f32(params)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["gate", "plain"])
def test_forward_matches_reference(kind, dtype, check_close):
    x, kw = _case(kind, jnp.dtype(dtype))
    params = _params(x, kw)
    o, s = _call(kda_jax.chunk_kda, params, kw, implementation="triton")
    ro, rs = _call(kda_jax.naive_recurrent_kda, _f32(params), kw)
    check_close(o, ro, dtype, "o")
    check_close(s, rs, dtype, "final_state")


@pytest.mark.parametrize("kind,dtype", [("gate", "float32"), ("plain", "bfloat16")])
def test_gradients_match_reference(kind, dtype, check_rel_rms):
    x, kw = _case(kind, jnp.dtype(dtype), GRAD_SHAPE)
    got, ref = _grads_and_reference(_params(x, kw), kw, GRAD_SHAPE, seed=1)
    for n, r in ref.items():
        tol = GRAD_TOL if dtype == "float32" else GRAD_TOL_BF16[n]
        check_rel_rms(got[n], r, tol, f"d{n}")


def _spy(monkeypatch, module, name, calls):
    """Counts the interpreter's calls of a kernel helper (module-level names
    are looked up at each call there)."""
    orig = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def _regime_inputs(regime, shape, dtype=jnp.bfloat16, **extra):
    """(params, chunk_kda keyword arguments) for a gate regime: "mild" (fla's
    benchmark gates), "init" (a layer's safe gate at initialisation,
    -5 sigmoid(x + dt_bias), dt_bias = softplus^-1 of logU(1e-3, 1e-1),
    precomputed), "layer" (that gate in the kernel, with the L2 norm and beta
    sigmoid), "strong" (-5 sigmoid(exp(A_log) (x + dt_bias)), exp(A_log) up
    to 16, dt_bias ~ U(-0.5, 0.5), precomputed), "softplus" (Kimi Linear's
    gate in the kernel, exp(A_log) up to 16) and "floor" (log-decays of
    -1000: floored, exactly zero decay)."""
    rng = np.random.default_rng(5)
    raw = regime in ("layer", "softplus")
    x = make_inputs(13, dtype=dtype, raw_gate=raw, normalized_k=not raw,
                    beta_logits=regime == "layer", **shape, **extra)
    hv, kd = x.g.shape[2], x.g.shape[3]
    a_log = np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32)
    dt_bias = rng.uniform(-0.5, 0.5, (hv, kd)).astype(np.float32)
    init_bias = init_dt_bias(rng, hv, kd)
    if regime == "mild":
        x.g = (np.log(1 / (1 + np.exp(-rng.standard_normal(x.g.shape)))) / 16).astype(np.float32)
    elif regime == "strong":
        z = np.exp(a_log)[:, None] * (rng.standard_normal(x.g.shape) + dt_bias)
        x.g = (-5.0 / (1 + np.exp(-z))).astype(np.float32)
    elif regime == "init":
        x.g = safe_gate(rng.standard_normal(x.g.shape).astype(np.float32),
                        np.zeros(hv, np.float32), init_bias)
    elif regime == "floor":
        x.g = np.full(x.g.shape, -1000.0, np.float32)
    kw = {}
    if raw:
        x.A_log[:] = a_log if regime == "softplus" else 0.0
        x.dt_bias[:] = (dt_bias if regime == "softplus" else init_bias).reshape(x.dt_bias.shape)
        kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
        if regime == "layer":
            kw.update(lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    return _params(x, kw), kw


REGIMES = ["init", "softplus", "layer", "mild", "strong", "floor"]


@pytest.mark.skipif(not interpret_mode(), reason="observes the kernels in the interpreter")
def test_products_do_not_depend_on_the_gates(monkeypatch):
    """The forward's prepare kernel and the backward's intra kernel run the
    same products for every gate regime (one two-level path): per chunk and
    head, two _anchored_accumulate calls per K slice in the backward's
    recompute (Aqk's and Akk's; the gradient alone is asked for, so the
    forward's own launch is dead code) and one _anchored_products_bwd call
    per K block."""
    calls = {}
    _spy(monkeypatch, chunk_fwd, "_anchored_accumulate", calls)
    _spy(monkeypatch, chunk_bwd, "_anchored_products_bwd", calls)
    shape = dict(SHAPE, T=128)  # two full chunks per head, K = 32: one K slice
    counts = {}
    for regime in REGIMES:
        calls.clear()
        params, kw = _regime_inputs(regime, shape)
        jax.jit(jax.grad(lambda p: jnp.sum(
            _call(kda_jax.chunk_kda, p, kw, implementation="triton")[0].astype(jnp.float32)))
        )(params)
        counts[regime] = dict(calls)
    programs = 2 * shape["H"]  # chunks x heads
    expected = {"_anchored_accumulate": 2 * programs, "_anchored_products_bwd": programs}
    assert all(c == expected for c in counts.values()), counts


# Varlen bounds with an empty and a one-token sequence; on a GPU, T >= 4096.
_VARLEN = ([0, 1, 700, 37, 2000, 1358] if not interpret_mode() else [0, 1, 70, 37, 90])


@pytest.mark.parametrize("regime", REGIMES)
def test_regimes_varlen_match_reference(regime, check_close):
    """bf16 inputs at every gate regime, varlen bounds (empty and one-token
    sequences, partial chunks), initial states: o and the final states within
    the bf16 tolerance of the float32 reference."""
    lengths = _VARLEN
    cu = np.concatenate([[0], np.cumsum(lengths)])
    shape = dict(B=1, T=int(cu[-1]), H=2, K=32 if interpret_mode() else 128,
                 V=16 if interpret_mode() else 128)
    params, kw = _regime_inputs(regime, shape)
    params["initial_state"] = jnp.asarray(np.random.default_rng(3).standard_normal(
        (len(lengths),) + params["initial_state"].shape[1:]).astype(np.float32))
    bounds = kda_jax.SeqBounds(cu)
    o, s = _call(kda_jax.chunk_kda, params, kw, implementation="triton", cu_seqlens=bounds)
    ro, rs = _call(kda_jax.naive_recurrent_kda, _f32(params), kw, cu_seqlens=bounds)
    check_close(o, ro, "bfloat16", "o")
    check_close(s, rs, "bfloat16", "final_state")


@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("regime", ["strong", "layer"])
def test_regimes_awkward_shapes(regime, chunk, check_close):
    """float32 inputs at the model gates with two value heads per q/k head,
    K = 60 and V = 40 (masked K slices and V blocks), V-first states and
    three sequences (one of them empty): o and the final states within the
    float32 tolerance of the reference."""
    lengths = [75, 0, 76]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    shape = dict(B=1, T=int(cu[-1]), H=1, HV=2, K=60, V=40, N=len(lengths))
    params, kw = _regime_inputs(regime, shape, dtype=jnp.float32, state_v_first=True)
    kw = dict(kw, state_v_first=True)
    bounds = kda_jax.SeqBounds(cu)
    o, s = _call(kda_jax.chunk_kda, params, kw, implementation="triton", cu_seqlens=bounds,
                 chunk_size=chunk)
    ro, rs = _call(kda_jax.naive_recurrent_kda, params, kw, cu_seqlens=bounds)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")


@pytest.mark.parametrize("regime", REGIMES)
def test_regimes_gradients_match_reference(regime, check_rel_rms):
    """Every gradient at every gate regime (bf16 inputs, two chunks, a partial
    K slice in the backward's intra kernel at K = 80 on a GPU) against
    autodiff of the float32 reference, at tests/test_triton_grad.py's bf16
    bars."""
    shape = dict(SHAPE, T=100, K=32 if interpret_mode() else 80)
    params, kw = _regime_inputs(regime, shape)
    got, ref = _grads_and_reference(params, kw, shape, seed=4)
    for n, r in ref.items():
        check_rel_rms(got[n], r, GRAD_TOL_BF16[n], f"d{n} ({regime})")


@pytest.mark.parametrize("kind", ["gate", "plain"])
def test_split_passes_match_reference(kind, check_close, check_rel_rms):
    """The prepare kernel with Aqk and Akk in a pass each (PrepareConfig.split, the
    sm90 backward's recompute), in the forward (the in-kernel gate's
    log-decays carried between the passes in gc) and the backward: o, the
    final state and every gradient against the float32 reference, float32
    inputs, steep gates (two chunks, a partial K slice on a GPU)."""
    from kda_jax import configs

    x, kw = _case(kind, jnp.dtype("float32"), GRAD_SHAPE)
    params = _params(x, kw)
    fwd = configs.replace(configs.forward_config(), "prepare.*.split", True)
    bwd = configs.replace(configs.backward_config(), "recompute.*.split", True)
    with configs.override(fwd, bwd):
        o, s = _call(kda_jax.chunk_kda, params, kw, implementation="triton")
        got, ref = _grads_and_reference(params, kw, GRAD_SHAPE, seed=1)
    ro, rs = _call(kda_jax.naive_recurrent_kda, params, kw)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")
    for n, r in ref.items():
        check_rel_rms(got[n], r, GRAD_TOL, f"d{n}")


def _level1(batched: bool, chunk=64, split=False):
    """configs.override with level 1 batched over diagonal blocks or as
    whole-chunk products (PrepareConfig.batched_l1 and IntraConfig.batched_l1),
    over 16-wide K slices (several per chunk), Aqk and Akk split into a pass
    each or not: this arch's configs otherwise."""
    from kda_jax import configs

    prepare = {"*.batched_l1": batched, "*.block_k": 16, "*.split": split}
    return configs.override(
        configs.replace(configs.forward_config(chunk_size=chunk),
                        {"prepare." + k: v for k, v in prepare.items()}),
        configs.replace(configs.backward_config(chunk_size=chunk),
                        {"recompute." + k: v for k, v in prepare.items()}
                        | {"intra.*.batched_l1": batched, "intra.*.block_k": 16}))


@pytest.mark.parametrize("kind,split,chunk,batched", [
    ("gate", False, 64, True), ("plain", False, 64, False), ("gate", True, 64, True),
    ("plain", True, 32, False)])
def test_level1_forms_match_reference(kind, split, chunk, batched, check_close, check_rel_rms):
    """The two-level products with level 1 batched over 16-row diagonal
    blocks (every arch's chunk-64 form, in one pass and in the split passes
    of sm90's float32 inputs and gfx950's 16-bit ones) or as whole-chunk
    products masked to its pairs (sm90's chunk-32 form, its split passes at
    chunk 32), in the forward's prepare, the backward's recompute and intra
    kernel, over 16-wide K slices (several per chunk): o, the final state
    and every gradient against the float32 reference, float32 inputs, steep
    gates."""
    x, kw = _case(kind, jnp.dtype("float32"), GRAD_SHAPE)
    params = _params(x, kw)
    with _level1(batched, chunk, split):
        o, s = _call(kda_jax.chunk_kda, params, kw, implementation="triton", chunk_size=chunk)
        got, ref = _grads_and_reference(params, kw, GRAD_SHAPE, seed=1, chunk_size=chunk)
    ro, rs = _call(kda_jax.naive_recurrent_kda, params, kw)
    check_close(o, ro, "float32", "o")
    check_close(s, rs, "float32", "final_state")
    for n, r in ref.items():
        check_rel_rms(got[n], r, GRAD_TOL, f"d{n}")


@pytest.mark.parametrize("batched", [False, True], ids=["whole-chunk-l1", "batched-l1"])
@pytest.mark.parametrize("field", ["k", "q"])
def test_nonfinite_stays_causal(field, batched):
    """A NaN in k (q) at token 20 of a chunk with strong gates: outputs before it
    (and the gradients there, with its outputs' cotangents zero) are
    bit-identical to the run with a zero there; o from token 20 on (at token
    20 only) is NaN (tests/test_nonfinite.py's contract on mild gates); with
    level 1 in either form (batched: its non-finite rows reduced per K
    slice)."""
    with _level1(batched):
        _nonfinite_stays_causal(field)


def _nonfinite_stays_causal(field):
    x, kw = _case("plain", jnp.dtype("float32"), dict(SHAPE, T=64, H=1))
    tok = 20
    bad, clean = _params(x, kw), _params(x, kw)
    bad[field] = bad[field].at[0, tok, 0, 3].set(jnp.nan)
    clean[field] = clean[field].at[0, tok, 0, 3].set(0.0)
    out = lambda p: _call(kda_jax.chunk_kda, p, kw, implementation="triton")[0]
    o, oc = np.asarray(out(bad)), np.asarray(out(clean))
    np.testing.assert_array_equal(o[0, :tok], oc[0, :tok])
    assert np.isnan(o[0, tok]).all()
    if field == "q":
        np.testing.assert_array_equal(o[0, tok + 1:], oc[0, tok + 1:])
    else:
        assert np.isnan(o[0, tok:]).all()
    w = np.random.default_rng(2).standard_normal(o.shape).astype(np.float32)
    w[0, tok:] = 0.0

    def grads(p):
        return jax.grad(lambda p: jnp.sum(jnp.where(w != 0, out(p), 0.0) * w))(p)

    gb, gc = jax.jit(grads)(bad), jax.jit(grads)(clean)
    for n in gb:
        assert np.isfinite(np.asarray(gb[n])).all(), f"d{n} is not finite"
        rows = slice(None) if n == "initial_state" else (0, slice(0, tok))
        np.testing.assert_array_equal(np.asarray(gb[n])[rows], np.asarray(gc[n])[rows],
                                      err_msg=n)
