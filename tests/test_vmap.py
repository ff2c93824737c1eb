"""jax.vmap of chunk_kda and fused_recurrent_kda, XLA path and Triton path
(interpreter on the CPU): equal to a Python loop of unmapped calls and to the
float32 reference, dense and host bounds, with and without initial_state, the
in-kernel gate's parameters mapped (the fold into heads), nested vmap, a
non-leading mapped axis, gradients under vmap; one launch per kernel for the
mapped batch; the errors of what cannot be mapped.

Tiny shapes (T <= 40, K = V = 16, chunk_size 32) keep the compiles short.
"""

from __future__ import annotations


import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import reference
from kda_jax.testing import make_inputs
from kda_jax.triton import unavailable_reason
from kda_jax import NotBatchableError

needs_triton = pytest.mark.skipif(unavailable_reason() is not None,
                                  reason="Triton path unavailable")
M = 2  # the mapped axis
# Host bounds: the middle sequence crosses a chunk boundary; copies of the
# bounds land at token offsets that are not multiples of the chunk size.
CU = (0, 3, 37, 40)
FNS = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _inputs(form, *, gate=False, state=True, cu=CU):
    """M stacked input sets (a dict by argument name; None where absent)."""
    if form == "dense":
        shape = dict(B=2, T=12)
    else:
        shape = dict(B=1, T=cu[-1], N=len(cu) - 1)
    xs = [make_inputs(10 + i, H=1, HV=2, K=16, V=16, raw_gate=gate, with_state=state, **shape)
          for i in range(M)]
    return {n: None if getattr(xs[0], n) is None else np.stack([getattr(x, n) for x in xs])
            for n in NAMES}


def _call(fn, impl, form, gate=False, cu=CU):
    """The unmapped call ``f(q, k, v, g, beta, initial_state, A_log, dt_bias)``."""
    kw = dict(output_final_state=True, implementation=impl)
    if fn == "chunk":
        kw["chunk_size"] = 32
    if form == "varlen":
        kw["cu_seqlens"] = list(cu)
    if gate:
        kw["use_gate_in_kernel"] = True

    def f(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return FNS[fn](q, k, v, g, beta, initial_state=initial_state, A_log=A_log,
                       dt_bias=dt_bias, **kw)
    return f


def _reference(form, gate, element):
    kw = dict(use_gate_in_kernel=gate, cu_seqlens=list(CU) if form == "varlen" else None)
    return reference.naive_recurrent_kda(
        *(element[n] for n in NAMES[:5]), initial_state=element["initial_state"],
        A_log=element["A_log"], dt_bias=element["dt_bias"], output_final_state=True, **kw)


def _element(x, axes, m):
    return {n: None if x[n] is None else x[n][m] if axes[i] == 0 else x[n]
            for i, n in enumerate(NAMES)}


def _check(fn, impl, form, x, axes, check_close, gate=False):
    """jit(vmap(f, in_axes=axes)) against a loop of jit(f) and the reference;
    ``x[name]`` is stacked for a mapped argument (axes 0), else one set."""
    f = _call(fn, impl, form, gate)
    o, final = jax.jit(jax.vmap(f, in_axes=axes))(*(x[n] for n in NAMES))
    assert o.shape[0] == M and final.shape[0] == M
    one = jax.jit(f)
    for m in range(M):
        element = _element(x, axes, m)
        lo, lf = one(*(element[n] for n in NAMES))
        np.testing.assert_allclose(o[m], lo, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(final[m], lf, rtol=1e-5, atol=1e-6)
    # The last element: its tokens and states sit past the first's in the fold.
    ro, rf = _reference(form, gate, element)
    check_close(o[-1], ro, "float32", "o[-1]")
    check_close(final[-1], rf, "float32", "final_state[-1]")


@pytest.mark.parametrize("fn, impl, form, state", [
    ("chunk", "xla", "dense", True), ("recurrent", "xla", "varlen", False),
    pytest.param("chunk", "triton", "dense", True, marks=needs_triton),
    pytest.param("chunk", "triton", "varlen", False, marks=needs_triton),
    pytest.param("recurrent", "triton", "varlen", True, marks=needs_triton)])
def test_vmap_equals_loop_and_reference(fn, impl, form, state, check_close):
    """Dense inputs or host bounds, with mapped initial states or none. The
    Triton path folds by sequences (dense recurrent: the gate test below)."""
    x = _inputs(form, state=state)
    axes = (0,) * 5 + ((0,) if state else (None,)) + (None, None)
    _check(fn, impl, form, x, axes, check_close)


@needs_triton
def test_mapped_gate_parameters_fold_into_heads(check_close):
    """A_log and dt_bias mapped (the fold into heads, GVA groups whole: H = 1,
    HV = 2), with one initial_state for every element (broadcast). The
    decode launch shares the rule and the layouts (kda_jax.triton.batching)."""
    x = _inputs("dense", gate=True)
    x["initial_state"] = x["initial_state"][0]
    _check("chunk", "triton", "dense", x, (0,) * 5 + (None, 0, 0), check_close, gate=True)


@needs_triton
def test_nested_vmap_over_a_non_leading_axis():
    """vmap(vmap(f), in_axes=1): two folds into one launch, the outer over
    axis 1 of every argument; equal to the loop over both axes."""
    x = _inputs("dense")
    f = lambda *a: _call("chunk", "triton", "dense")(*a, None, None)
    # [M, 2, ...]: element (m, j) scaled by 1 - j / 4, mapped as [2 (outer, axis 1), M].
    scale = np.array([1.0, 0.75], np.float32)
    args = [x[n][:, None] * scale.reshape((1, 2) + (1,) * (x[n].ndim - 1))
            for n in NAMES[:6]]
    o, final = jax.jit(jax.vmap(jax.vmap(f), in_axes=1))(*args)
    assert o.shape[:2] == (2, M)
    one = jax.jit(f)
    for j in range(2):
        for m in range(M):
            lo, lf = one(*(a[m, j] for a in args))
            np.testing.assert_allclose(o[j, m], lo, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(final[j, m], lf, rtol=1e-5, atol=1e-6)


def _loss(f):
    def loss(*args):
        o, final = f(*args, None, None)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o * w) + jnp.sum(jnp.sin(final))
    return loss


@needs_triton
def test_grad_under_vmap_and_vmap_of_grad(check_rel_rms):
    """Host bounds, mapped q..beta and one initial_state for all elements:
    vmap(grad) gives each element's gradients (the initial state's too),
    equal to the loop of the Triton path's gradients and, for the last
    element, the reference's; grad(sum of vmap) the same for q..beta and
    their sum for the state."""
    cu = (0, 5, 21)  # small: the interpreted backward is the cost
    x = _inputs("varlen", cu=cu)
    args = [x[n] for n in NAMES[:5]] + [x["initial_state"][0]]
    axes = (0,) * 5 + (None,)
    loss = _loss(_call("chunk", "triton", "varlen", cu=cu))
    grad = jax.grad(loss, argnums=tuple(range(6)))
    per = jax.jit(jax.vmap(grad, in_axes=axes))(*args)
    total = jax.jit(jax.grad(lambda *a: jnp.sum(jax.vmap(loss, in_axes=axes)(*a)),
                             argnums=tuple(range(6))))(*args)
    one = jax.jit(grad)
    for m in range(M):
        element = [a[m] for a in args[:5]] + [args[5]]
        for i, (got, want) in enumerate(zip(per, one(*element))):
            np.testing.assert_allclose(got[m], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"vmap(grad) d{NAMES[i]}[{m}]")
    ref_loss = _loss(lambda *a: reference.naive_recurrent_kda(
        *a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=list(cu)))
    ref = jax.jit(jax.grad(ref_loss, argnums=tuple(range(6))))(*element)
    for i, name in enumerate(NAMES[:6]):
        check_rel_rms(per[i][-1], ref[i], 1e-4, f"vmap(grad) d{name}[-1]")
        want = per[i] if i < 5 else jnp.sum(per[i], axis=0)
        np.testing.assert_allclose(total[i], want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"grad(vmap) d{name}")


def _launches(jaxpr, in_loop=False) -> list[tuple[bool, tuple]]:
    """(inside a loop, first output shape) of every kernel launch in a jaxpr
    and the jaxprs it holds (Triton's interpreter: pure_callback; a GPU:
    jax-triton's custom call)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pure_callback", "triton_kernel_call"):
            found.append((in_loop, tuple(eqn.outvars[0].aval.shape)))
        loop = in_loop or eqn.primitive.name in ("scan", "while")
        for sub in _params_jaxprs(eqn.params):
            found += _launches(sub, loop)
    return found


def _params_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex.Jaxpr):
                yield v


@needs_triton
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_one_launch_per_kernel_for_the_mapped_batch(fn):
    """The mapped call launches each kernel once, outside any loop, over M
    times the tokens (traced only: nothing runs). For chunk_kda the gradient
    too: 2 forward and 6 backward launches."""
    x = _inputs("varlen")
    f = _call(fn, "triton", "varlen")
    args = [x[n] for n in NAMES[:6]]
    fwd = lambda *a: f(*a, None, None)
    single = _launches(jax.make_jaxpr(fwd)(*(a[0] for a in args)).jaxpr)
    mapped = _launches(jax.make_jaxpr(jax.vmap(fwd))(*args).jaxpr)
    assert len(single) == {"chunk": 2, "recurrent": 1}[fn]
    assert len(mapped) == len(single) and not any(loop for loop, _ in mapped)
    tokens = CU[-1]
    assert [s[0] for _, s in single] == [tokens] * len(single)
    assert [s[0] for _, s in mapped] == [M * tokens] * len(single)
    if fn == "chunk":
        loss = _loss(f)
        grads = jax.make_jaxpr(jax.vmap(jax.grad(loss, argnums=tuple(range(6)))))(*args)
        launched = _launches(grads.jaxpr)
        assert len(launched) == 8 and not any(loop for loop, _ in launched)


@needs_triton
def test_errors_for_what_cannot_be_mapped():
    x = _inputs("varlen", state=False)
    qkvgb = [x[n] for n in NAMES[:5]]
    cus = np.array([CU, (0, 10, 20, 40)])
    with pytest.raises(ValueError, match="cu_seqlens is mapped by jax.vmap.*host data"):
        jax.vmap(lambda *a: kda_jax.chunk_kda(*a[:5], cu_seqlens=a[5], implementation="triton",
                                              chunk_size=32))(*qkvgb, cus)
    pool = jnp.zeros((4, 2, 16, 16), jnp.float32)
    rows = kda_jax.PoolRows(np.array([0, 1, 2], np.int32))
    serve = lambda *a: kda_jax.fused_recurrent_kda_pool(*a, pool, rows, cu_seqlens=list(CU),
                                                         implementation="triton")
    with pytest.raises(NotBatchableError, match="jax.vmap of fused_recurrent_kda_pool on the "
                                                "Triton path.* is not supported.*host bounds.*"
                                                "use implementation='xla'"):
        jax.vmap(serve)(*qkvgb)


# --------------------------------------------------------------------------- #
# Bounds under vmap: host bounds cannot be mapped (either path); a VarlenBatch
# can on the XLA path (each element its own bounds, one bucket), and raises on
# the Triton path (no batching rule for the serving forms).
# --------------------------------------------------------------------------- #

BUCKET_LENGTHS = ([3, 30, 7], [40, 0, 1, 2])  # per mapped element, one bucket


def _mapped_batch():
    """(stacked q..beta [M, 1, 64, ...], the VarlenBatches, their stack)."""
    bucket = kda_jax.Bucket(max_seqs=4, max_tokens=64)  # chunk_kda's chunk: 64
    batches = [kda_jax.VarlenBatch.from_lengths(n, bucket) for n in BUCKET_LENGTHS]
    xs = [make_inputs(20 + m, B=1, T=64, H=1, HV=2, K=16, V=16, with_state=False)
          for m in range(M)]
    args = [np.stack([getattr(x, n) for x in xs]) for n in NAMES[:5]]
    return args, batches, jax.tree.map(lambda *a: np.stack(a), *batches)


def _with_batch(impl):
    return lambda q, k, v, g, beta, batch: kda_jax.chunk_kda(
        q, k, v, g, beta, cu_seqlens=batch, output_final_state=True, implementation=impl)


def test_xla_mapped_varlen_batch_equals_reference(check_close):
    args, _, stacked = _mapped_batch()
    o, final = jax.jit(jax.vmap(_with_batch("xla")))(*args, stacked)
    for m, lengths in enumerate(BUCKET_LENGTHS):
        cu = np.r_[0, np.cumsum(lengths)]
        ro, rf = reference.naive_recurrent_kda(*(a[m][:, :cu[-1]] for a in args),
                                               cu_seqlens=cu, output_final_state=True)
        check_close(o[m][:, :cu[-1]], ro, "float32", f"o[{m}]")
        check_close(final[m][:len(lengths)], rf, "float32", f"final_state[{m}]")
        assert np.all(np.asarray(o[m][:, cu[-1]:]) == 0), "rows past the real tokens"
        assert np.all(np.asarray(final[m][len(lengths):]) == 0), "slots past the real sequences"


def test_xla_mapped_host_bounds_raise():
    x = _inputs("varlen", state=False)
    cus = np.array([CU, (0, 10, 20, 40)])
    with pytest.raises(ValueError, match="cu_seqlens is mapped by jax.vmap.*host data"):
        jax.vmap(lambda *a: kda_jax.chunk_kda(*a[:5], cu_seqlens=a[5], implementation="xla",
                                              chunk_size=32))(*(x[n] for n in NAMES[:5]), cus)


@needs_triton
def test_triton_varlen_batch_under_vmap_raises():
    args, batches, stacked = _mapped_batch()
    for batch, axes in ((stacked, 0), (batches[0], (0,) * 5 + (None,))):
        with pytest.raises(NotBatchableError, match="with a VarlenBatch as cu_seqlens is not "
                                                    "supported.*use implementation='xla'"):
            jax.vmap(_with_batch("triton"), in_axes=axes)(*args, batch)
