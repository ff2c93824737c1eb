"""Every bad input raises the documented error before any backend runs, and the
message names the argument (and its value or shape)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import api
from kda_jax import triton as kda_triton
from kda_jax.testing import make_inputs

FNS = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}
# The reference takes the same checks (kda_jax.checks), less the arguments it lacks.
CHECKED = {**FNS, "reference": kda_jax.naive_recurrent_kda}
REFERENCE_LACKS = ("implementation", "chunk_size")
B, T, H, HV, K, V = 1, 10, 2, 4, 8, 12


class BackendRan(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_backend(monkeypatch):
    """Any backend call fails the test: errors must come from the checks."""

    def ran(*args, **kwargs):
        raise BackendRan("the backend ran before the bad input was rejected")

    for name in ("_chunk_xla", "_recurrent_xla", "_chunk_triton", "_recurrent_triton"):
        if hasattr(api, name):
            monkeypatch.setattr(api, name, ran)


def _base(**kw):
    x = make_inputs(0, B=kw.pop("B", B), T=T, H=H, HV=HV, K=K, V=V, raw_gate=True, **kw)
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    return x, args


def _call(fn, args, **kw):
    a = dict(args)
    return fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **kw)


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
def test_valid_call_reaches_the_backend(fn):
    """The sentinel works: a valid call gets past the checks."""
    x, args = _base()
    with pytest.raises(BackendRan):
        _call(fn, args, initial_state=x.initial_state, use_gate_in_kernel=True, A_log=x.A_log,
              dt_bias=x.dt_bias)
    with pytest.raises(BackendRan):
        _call(fn, args, initial_state=np.zeros((2, HV, K, V), np.float32), cu_seqlens=[0, 4, 10],
              implementation="xla")


x0, a0 = _base()
f32 = np.float32
SHAPE_CASES = {
    "q-rank3": (dict(q=a0["q"][0]), ValueError, r"q must be rank 4 \[B, T, H, K\], got shape \(10, 2, 8\)"),
    "k-rank5": (dict(k=a0["k"][None]), ValueError, r"k must be rank 4.*\(1, 1, 10, 2, 8\)"),
    "v-rank3": (dict(v=a0["v"][0]), ValueError, r"v must be rank 4 \[B, T, HV, V\]"),
    "g-rank3": (dict(g=a0["g"][0]), ValueError, r"g must be rank 4 \[B, T, HV, K\]"),
    "beta-rank4": (dict(beta=a0["beta"][..., None]), ValueError, r"beta must be rank 3 \[B, T, HV\]"),
    "k-K": (dict(k=np.zeros((1, 10, 2, 6), f32)), ValueError,
            r"k must have shape \(1, 10, 2, 8\).*got \(1, 10, 2, 6\)"),
    "k-H": (dict(k=np.zeros((1, 10, 4, 8), f32)), ValueError, r"k must have shape \(1, 10, 2, 8\)"),
    "v-T": (dict(v=np.zeros((1, 9, 4, 12), f32)), ValueError,
            r"v must have shape \(1, 10, 4, 12\).*got \(1, 9, 4, 12\)"),
    "g-heads": (dict(g=np.zeros((1, 10, 2, 8), f32)), ValueError,
                r"g must have shape \(1, 10, 4, 8\).*got \(1, 10, 2, 8\)"),
    "g-K": (dict(g=np.zeros((1, 10, 4, 12), f32)), ValueError, r"g must have shape \(1, 10, 4, 8\)"),
    "beta-heads": (dict(beta=np.zeros((1, 10, 2), f32)), ValueError,
                   r"beta must have shape \(1, 10, 4\).*got \(1, 10, 2\)"),
    "HV-not-multiple": (dict(v=np.zeros((1, 10, 3, 12), f32), g=np.zeros((1, 10, 3, 8), f32),
                             beta=np.zeros((1, 10, 3), f32)), ValueError,
                        r"HV=3 \(v.shape\[2\]\) must be a multiple of the q/k heads H=2"),
    "q-int": (dict(q=np.zeros((1, 10, 2, 8), np.int32)), TypeError,
              r"q must be floating point.*int32"),
    "v-int": (dict(v=np.zeros((1, 10, 4, 12), np.int8)), TypeError, r"v must be floating point.*int8"),
    "beta-bool": (dict(beta=np.zeros((1, 10, 4), bool)), TypeError, r"beta must be floating.*bool"),
    "q-list": (dict(q=a0["q"].tolist()), TypeError, r"q must be an array.*list"),
}


@pytest.mark.parametrize("fn", CHECKED.values(), ids=CHECKED.keys())
@pytest.mark.parametrize("name", SHAPE_CASES)
def test_bad_arrays(name, fn):
    change, error, match = SHAPE_CASES[name]
    with pytest.raises(error, match=match):
        _call(fn, {**a0, **change})


CALL_CASES = {
    "cu-with-B2": ("B2", dict(cu_seqlens=[0, 10, 20]), ValueError,
                   r"with cu_seqlens the batch must be packed.*B == 1, got B=2"),
    "cu-last-not-T": (None, dict(cu_seqlens=np.array([0, 5, 9])), ValueError,
                      r"cu_seqlens\[-1\]=9 must equal the number of tokens T=10"),
    "cu-decreasing": (None, dict(cu_seqlens=[0, 6, 5, 10]), ValueError,
                      r"cu_seqlens must be non-decreasing"),
    "cu-float": (None, dict(cu_seqlens=np.array([0.0, 10.0])), TypeError, r"cu_seqlens must hold integers"),
    "cu-jax-array": (None, dict(cu_seqlens=jnp.asarray([0, 4, 10])), TypeError,
                     r"cu_seqlens is a .*device data.*host data.*SeqBounds"),
    "h0-rows-dense": (None, dict(initial_state=np.zeros((2, 4, 8, 12), f32)), ValueError,
                      r"initial_state must have shape \(1, 4, 8, 12\) \[N, HV, K, V\] with N = B = 1, "
                      r"got \(2, 4, 8, 12\)"),
    "h0-rows-varlen": (None, dict(cu_seqlens=[0, 4, 10], initial_state=np.zeros((3, 4, 8, 12), f32)),
                       ValueError, r"initial_state must have shape \(2, 4, 8, 12\).*"
                       r"N = the number of sequences in cu_seqlens = 2, got \(3, 4, 8, 12\)"),
    "h0-K-first-with-v-first": (None, dict(state_v_first=True, initial_state=np.zeros((1, 4, 8, 12), f32)),
                                ValueError, r"initial_state must have shape \(1, 4, 12, 8\) "
                                r"\[N, HV, V, K\] \(state_v_first\).*got \(1, 4, 8, 12\)"),
    "h0-V-first-without-flag": (None, dict(initial_state=np.zeros((1, 4, 12, 8), f32)), ValueError,
                                r"initial_state must have shape \(1, 4, 8, 12\) \[N, HV, K, V\]"),
    "h0-rank3": (None, dict(initial_state=np.zeros((4, 8, 12), f32)), ValueError,
                 r"initial_state must be rank 4"),
    "h0-int": (None, dict(initial_state=np.zeros((1, 4, 8, 12), np.int32)), TypeError,
               r"initial_state must be floating point"),
    "lower_bound-6": (None, dict(use_gate_in_kernel=True, lower_bound=-6.0), ValueError,
                      r"lower_bound=-6.0 must lie in \[-5, 0\)"),
    "lower_bound-0": (None, dict(use_gate_in_kernel=True, lower_bound=0), ValueError,
                      r"lower_bound=0.0 must lie in \[-5, 0\)"),
    "lower_bound-0.5": (None, dict(use_gate_in_kernel=True, lower_bound=0.5), ValueError,
                        r"lower_bound=0.5 must lie in \[-5, 0\)"),
    "lower_bound-array": (None, dict(use_gate_in_kernel=True, lower_bound=jnp.float32(-1.0)),
                          TypeError, r"lower_bound must be a Python number"),
    "lower_bound-str": (None, dict(use_gate_in_kernel=True, lower_bound="-1"), TypeError,
                        r"lower_bound must be a real number, got '-1'"),
    "A_log-missing": (None, dict(use_gate_in_kernel=True, dt_bias="x.dt_bias"), ValueError,
                      r"use_gate_in_kernel=True with lower_bound=None needs A_log \[HV\]"),
    "A_log-shape": (None, dict(use_gate_in_kernel=True, A_log=np.zeros(2, f32)), ValueError,
                    r"A_log must have shape \(4,\) \[HV\], got \(2,\)"),
    "A_log-rank2": (None, dict(use_gate_in_kernel=True, A_log=np.zeros((4, 1), f32)), ValueError,
                    r"A_log must be rank 1 \[HV\]"),
    "dt_bias-shape": (None, dict(use_gate_in_kernel=True, A_log="x.A_log", dt_bias=np.zeros((4, 8), f32)),
                      ValueError, r"dt_bias must be rank 1 \[HV \* K\], got shape \(4, 8\)"),
    "dt_bias-length": (None, dict(use_gate_in_kernel=True, lower_bound=-1.0, dt_bias=np.zeros(8, f32)),
                       ValueError, r"dt_bias must have shape \(32,\) \[HV \* K\], got \(8,\)"),
    "A_log-without-gate": (None, dict(A_log="x.A_log"), ValueError,
                           r"A_log is only used with use_gate_in_kernel=True.*use_gate_in_kernel=False"),
    "dt_bias-without-gate": (None, dict(dt_bias="x.dt_bias"), ValueError,
                             r"dt_bias is only used with use_gate_in_kernel=True"),
    "lower_bound-without-gate": (None, dict(lower_bound=-1.0), ValueError,
                                 r"lower_bound is only used with use_gate_in_kernel=True, got lower_bound=-1.0"),
    "implementation-cuda": (None, dict(implementation="cuda"), ValueError,
                            r"implementation='cuda' is unknown; use None.*'xla'"),
    "scale-jax-array": (None, dict(scale=jnp.asarray(0.5)), TypeError,
                        r"scale must be a Python number \(it is fixed at trace time\)"),
    "scale-negative": (None, dict(scale=-1.0), ValueError, r"scale=-1.0 must be a positive finite number"),
    "scale-zero": (None, dict(scale=0), ValueError, r"scale=0.0 must be a positive finite number"),
    "scale-nan": (None, dict(scale=float("nan")), ValueError, r"scale=nan must be a positive finite"),
    "scale-str": (None, dict(scale="0.5"), TypeError, r"scale must be a real number, got '0.5'"),
    "scale-bool": (None, dict(scale=True), TypeError, r"scale must be a real number, got True"),
}
FLAGS = ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
         "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first")
for _flag in FLAGS:
    CALL_CASES[f"{_flag}-int"] = (None, {_flag: 1}, TypeError, rf"{_flag} must be a bool, got 1")
    CALL_CASES[f"{_flag}-None"] = (None, {_flag: None}, TypeError, rf"{_flag} must be a bool, got None")
CALL_CASES["flag-np-array"] = (None, dict(allow_neg_eigval=np.array([True])), TypeError,
                               r"allow_neg_eigval must be a bool, got array")
CALL_CASES["neg-eigval-without-sigmoid"] = (
    None, dict(allow_neg_eigval=True), ValueError,
    r"allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")


@pytest.mark.parametrize("fn,name", [
    pytest.param(fn, name, id=f"{name}-{fn_id}")
    for name, (_, kw, _, _) in CALL_CASES.items() for fn_id, fn in CHECKED.items()
    if fn_id != "reference" or not set(kw) & set(REFERENCE_LACKS)])
def test_bad_call(name, fn):
    batch, kw, error, match = CALL_CASES[name]
    x, args = _base(B=2) if batch == "B2" else (x0, a0)
    kw = {n: (getattr(x, v[2:]) if isinstance(v, str) and v.startswith("x.") else v)
          for n, v in kw.items()}
    with pytest.raises(error, match=match):
        _call(fn, args, **kw)


@pytest.mark.parametrize("chunk_size", [16, 128, 0, -64, np.int64(48)])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match=rf"chunk_size={int(chunk_size)} must be 32 or 64"):
        _call(kda_jax.chunk_kda, a0, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [True, np.bool_(True), 32.0, 64.5, "64", jnp.array(32),
                                        np.array(32), None], ids=repr)
def test_chunk_size_must_be_an_int(chunk_size):
    """Only a Python int (or NumPy integer scalar) selects the chunk size: a float
    equal to 32, a bool or an array is refused by name, with the value."""
    with pytest.raises(TypeError, match=r"chunk_size must be a Python int, 32 or 64 \(it is "
                                        r"fixed at trace time\), got "
                                        + re.escape(repr(chunk_size))):
        _call(kda_jax.chunk_kda, a0, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [32, np.int32(64)], ids=repr)
def test_integer_chunk_sizes_pass(chunk_size):
    with pytest.raises(BackendRan):
        _call(kda_jax.chunk_kda, a0, chunk_size=chunk_size)


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
def test_traced_cu_seqlens_inside_jit(fn):
    def f(cu, q, k, v, g, beta):
        return fn(q, k, v, g, beta, cu_seqlens=cu)[0]

    with pytest.raises(TypeError, match=r"cu_seqlens is a .*Tracer.*host data.*SeqBounds"):
        jax.jit(f)(np.array([0, 4, 10]), *a0.values())


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
def test_traced_scale_inside_jit(fn):
    def f(scale, q, k, v, g, beta):
        return fn(q, k, v, g, beta, scale=scale)[0]

    with pytest.raises(TypeError, match=r"scale must be a Python number.*Tracer"):
        jax.jit(f)(0.5, *a0.values())


def test_chunk_triton_unavailable_raises_with_the_reason(monkeypatch):
    """implementation='triton' where it cannot run raises (never falls back to XLA)."""
    monkeypatch.setattr(kda_triton, "unavailable_reason", lambda: "no GPU in this test")
    monkeypatch.setattr(kda_triton, "available", lambda: False)
    with pytest.raises(RuntimeError,
                       match=r"implementation='triton' cannot run this call: no GPU in this test"):
        _call(kda_jax.chunk_kda, a0, implementation="triton")
    # None picks XLA there (the XLA sentinel fires).
    with pytest.raises(BackendRan):
        _call(kda_jax.chunk_kda, a0)


def test_chunk_triton_head_dim_limit():
    """K beyond the Triton kernels' limit: implementation='triton' raises with a reason."""
    x = make_inputs(0, B=1, T=10, H=2, K=300, V=8)
    with pytest.raises(ValueError, match=r"implementation='triton' cannot run this call: "):
        kda_jax.chunk_kda(*x.args(), implementation="triton")


# Every array argument takes bf16, fp16 or fp32 only: float8 is floating point
# but no kernel reads it, and float64 would be narrowed silently.
_ARRAY_ARGS = {
    "q": lambda dt: dict(q=a0["q"].astype(dt)),
    "k": lambda dt: dict(k=a0["k"].astype(dt)),
    "v": lambda dt: dict(v=a0["v"].astype(dt)),
    "g": lambda dt: dict(g=a0["g"].astype(dt)),
    "beta": lambda dt: dict(beta=a0["beta"].astype(dt)),
    "initial_state": lambda dt: dict(initial_state=np.zeros((1, HV, K, V), dt)),
    "A_log": lambda dt: dict(use_gate_in_kernel=True, A_log=x0.A_log.astype(dt)),
    "dt_bias": lambda dt: dict(use_gate_in_kernel=True, A_log=x0.A_log,
                               dt_bias=x0.dt_bias.astype(dt)),
}
_BAD_FLOATS = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2,
               "float64": np.float64, "complex64": np.complex64}


@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
@pytest.mark.parametrize("dtype", _BAD_FLOATS, ids=_BAD_FLOATS.keys())
@pytest.mark.parametrize("arg", _ARRAY_ARGS)
def test_dtypes_other_than_bf16_fp16_fp32_are_refused(arg, dtype, fn):
    kw = _ARRAY_ARGS[arg](_BAD_FLOATS[dtype])
    with pytest.raises(TypeError, match=rf"{arg} must be floating point \(bf16, fp16 or fp32\), "
                                        rf"got dtype {dtype}; cast it"):
        _call(fn, {**a0, **{n: kw.pop(n) for n in list(kw) if n in a0}}, **kw)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16, np.float32], ids=str)
@pytest.mark.parametrize("arg", _ARRAY_ARGS)
def test_bf16_fp16_fp32_pass(arg, dtype):
    kw = _ARRAY_ARGS[arg](dtype)
    with pytest.raises(BackendRan):
        _call(kda_jax.chunk_kda, {**a0, **{n: kw.pop(n) for n in list(kw) if n in a0}}, **kw)


def _sized(B=1, T=4, H=1, HV=1, K=4, V=4, dtype=np.float32):
    z = lambda *s: np.zeros(s, dtype)
    return dict(q=z(B, T, H, K), k=z(B, T, H, K), v=z(B, T, HV, V), g=z(B, T, HV, K),
                beta=z(B, T, HV))


# (sizes, message) for zero-size head dimensions: refused by name (they used
# to raise ZeroDivisionError, or to run on one backend and not the other).
ZERO_HEADS = {
    "H": (dict(H=0, HV=0), r"H \(q/k heads\)=0 \(q.shape\[2\]\) must be >= 1"),
    "H-with-HV": (dict(H=0, HV=2), r"H \(q/k heads\)=0 \(q.shape\[2\]\) must be >= 1"),
    "HV": (dict(H=1, HV=0), r"HV \(value heads\)=0 \(v.shape\[2\]\) must be >= 1"),
    "K": (dict(K=0), r"K \(key head size\)=0 \(q.shape\[3\]\) must be >= 1"),
    "V": (dict(V=0), r"V \(value head size\)=0 \(v.shape\[3\]\) must be >= 1"),
}


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
@pytest.mark.parametrize("case", ZERO_HEADS)
def test_zero_size_heads_are_refused(case, fn, impl):
    sizes, match = ZERO_HEADS[case]
    with pytest.raises(ValueError, match=match + r".*skip the call instead"):
        _call(fn, _sized(**sizes), implementation=impl, output_final_state=True)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("fn", FNS.values(), ids=FNS.keys())
def test_zero_batch_gives_the_empty_result(fn, impl):
    """B = 0: no sequence, so o is [0, T, HV, V] in q's dtype and the final state
    [0, HV, K, V] float32, without running a backend (inside jit too)."""
    args = _sized(B=0, T=5, H=2, HV=4, K=8, V=6, dtype=jnp.bfloat16)
    o, final = _call(fn, args, implementation=impl, output_final_state=True)
    assert (o.shape, o.dtype) == ((0, 5, 4, 6), jnp.bfloat16)
    assert (final.shape, final.dtype) == ((0, 4, 8, 6), jnp.float32)
    o_ref, _ = kda_jax.naive_recurrent_kda(*args.values())
    assert o_ref.shape == o.shape
    # State-first layout, an initial state with N = B = 0, and inside jit.
    h0 = jnp.zeros((0, 4, 6, 8), jnp.float32)
    o, final = jax.jit(lambda a, h: _call(fn, a, implementation=impl, initial_state=h,
                                          output_final_state=True, state_v_first=True))(args, h0)
    assert o.shape == (0, 5, 4, 6) and final.shape == (0, 4, 6, 8)
    o, final = _call(fn, args, implementation=impl)
    assert o.shape == (0, 5, 4, 6) and final is None
    with pytest.raises(ValueError, match=r"initial_state must have shape \(0, 4, 8, 6\).*"
                                         r"N = B = 0, got \(1, 4, 8, 6\)"):
        _call(fn, args, initial_state=np.zeros((1, 4, 8, 6), np.float32))


POOL_FNS = {"chunk": kda_jax.chunk_kda_pool, "recurrent": kda_jax.fused_recurrent_kda_pool}


@pytest.mark.parametrize("fn", POOL_FNS.values(), ids=POOL_FNS.keys())
def test_zero_batch_with_a_pool_leaves_it_unchanged(fn):
    args = _sized(B=0, T=3, H=1, HV=2, K=4, V=4)
    pool = np.random.default_rng(0).standard_normal((3, 2, 4, 4)).astype(np.float32)
    o, new = fn(*args.values(), pool, kda_jax.PoolRows(np.zeros(0, np.int32)),
                implementation="xla")
    assert o.shape == (0, 3, 2, 4)
    np.testing.assert_array_equal(np.asarray(new), pool)
