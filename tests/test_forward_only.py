"""jax.grad / jax.jvp / jax.vmap of the forms without a rule (the Triton serving
forms, a pool or a VarlenBatch, under both; fused_recurrent_kda's Triton path
under grad and jvp) raise kda_jax's error naming the form and the alternative,
instead of JAX's internal one; their forward value under jit is unchanged, and
the XLA path keeps working under vmap and grad (against the float32
reference). jax.vmap of the batchable Triton forms: tests/test_vmap.py.

Tiny shapes; the Triton cases run in Triton's interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import Bucket, VarlenBatch, reference, testing
from kda_jax.triton import unavailable_reason
from kda_jax import NotBatchableError, NotDifferentiableError

NO_TRITON = unavailable_reason()
needs_triton = pytest.mark.skipif(NO_TRITON is not None,
                                  reason=f"Triton path unavailable: {NO_TRITON}")
H, HV, K, V, SLOTS = 1, 2, 8, 8, 3
LENS = [3, 2]
BUCKET = Bucket(max_seqs=2, max_tokens=8)


def _x():
    cu = np.cumsum([0] + LENS)
    return testing.make_inputs(5, T=int(cu[-1]), H=H, HV=HV, K=K, V=V, N=len(LENS)), cu


def _pool():
    return np.random.default_rng(1).standard_normal((SLOTS, HV, K, V)).astype(np.float32)


def _forms():
    """(form, q -> o, what its messages name): each forward-only Triton form."""
    x, cu = _x()
    rest = [jnp.asarray(a) for a in x.args()[1:]]
    batch = VarlenBatch.build(cu, BUCKET)
    padded_rest = [jnp.asarray(batch.pad_tokens(a)) for a in x.args()[1:]]
    idx = np.array([2, 0], np.int32)
    return {
        "recurrent-dense": (
            lambda q: kda_jax.fused_recurrent_kda(q, *rest, cu_seqlens=cu,
                                                  implementation="triton")[0],
            x.q, r"fused_recurrent_kda on the Triton path"),
        "recurrent-pool": (
            lambda q: kda_jax.fused_recurrent_kda_pool(q, *rest, _pool(), kda_jax.PoolRows(idx),
                                                       cu_seqlens=cu, implementation="triton")[0],
            x.q, r"fused_recurrent_kda_pool on the Triton path"),
        "chunk-pool": (
            lambda q: kda_jax.chunk_kda_pool(q, *rest, _pool(), kda_jax.PoolRows(idx),
                                             cu_seqlens=cu, implementation="triton")[0],
            x.q, r"chunk_kda_pool on the Triton path"),
        "chunk-batch": (
            lambda q: kda_jax.chunk_kda(q, *padded_rest, cu_seqlens=batch,
                                        implementation="triton")[0],
            batch.pad_tokens(x.q), r"chunk_kda on the Triton path .* with a VarlenBatch"),
    }


FORMS = list(_forms())


@needs_triton
@pytest.mark.parametrize("form", FORMS)
def test_grad_and_jvp_raise_naming_the_form(form):
    f, q, name = _forms()[form]
    loss = lambda q: jnp.sum(f(q) ** 2)
    match = (rf"jax.grad / jax.jvp of {name}.* is not supported: it is forward only.*"
             r"chunk_kda's Triton path with host bounds.*implementation='xla'")
    with pytest.raises(NotDifferentiableError, match=match):
        jax.jit(jax.grad(loss))(jnp.asarray(q))
    with pytest.raises(NotImplementedError, match=match):
        jax.jvp(f, (jnp.asarray(q),), (jnp.ones_like(q),))


@needs_triton
@pytest.mark.parametrize("form", [f for f in FORMS if f != "recurrent-dense"])
def test_vmap_raises_naming_the_form(form):
    f, q, name = _forms()[form]
    with pytest.raises(NotBatchableError, match=rf"jax.vmap of {name}.* is not supported.*"
                                                r"host bounds.*use implementation='xla'"):
        jax.vmap(f)(jnp.stack([jnp.asarray(q)] * 2))


@needs_triton
def test_forward_value_under_jit_is_unchanged(check_close):
    """The guarded forms still compute the reference's value inside jit, and a
    gradient with respect to something else (here nothing reaches the kernel
    with a tangent) does not trip the guard."""
    x, cu = _x()
    o_ref, _ = reference.naive_recurrent_kda(*x.args(), cu_seqlens=cu)
    for form in ("recurrent-dense", "chunk-batch"):
        f, q, _ = _forms()[form]
        o = jax.jit(f)(jnp.asarray(q))
        check_close(np.asarray(o)[:, :int(cu[-1])], o_ref, "float32", f"o {form}")
    f, q, _ = _forms()["recurrent-dense"]
    grad = jax.grad(lambda s, q: s * jnp.sum(jax.lax.stop_gradient(f(q))))(2.0, jnp.asarray(q))
    check_close(grad, jnp.sum(o_ref), "float32", "grad of the scale")


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_xla_path_under_vmap_and_grad(fn, check_close):
    """The XLA path keeps JAX's own rules: vmap over a leading axis equals one
    call per element, and grad matches autodiff of the reference."""
    call = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}[fn]
    xs = [testing.make_inputs(s, B=1, T=5, H=H, HV=HV, K=K, V=V) for s in (2, 3)]
    stacked = [jnp.stack([jnp.asarray(getattr(x, n)) for x in xs])
               for n in ("q", "k", "v", "g", "beta")]
    o = jax.vmap(lambda *a: call(*a, implementation="xla")[0])(*stacked)
    for i, x in enumerate(xs):
        check_close(o[i], reference.naive_recurrent_kda(*x.args())[0], "float32", f"o vmap {i}")
    x = xs[0]
    loss = lambda q: jnp.sum(call(q, *x.args()[1:], implementation="xla")[0] ** 2)
    ref = lambda q: jnp.sum(reference.naive_recurrent_kda(q, *x.args()[1:])[0] ** 2)
    check_close(jax.grad(loss)(jnp.asarray(x.q)), jax.grad(ref)(jnp.asarray(x.q)), "float32",
                "grad dq")


@needs_triton
def test_differentiable_chunk_path_keeps_its_gradient(check_close):
    """chunk_kda's Triton path with host bounds keeps its custom_vjp gradient."""
    x, cu = _x()
    rest = [jnp.asarray(a) for a in x.args()[1:]]
    loss = lambda q: jnp.sum(kda_jax.chunk_kda(q, *rest, cu_seqlens=cu,
                                               implementation="triton")[0] ** 2)
    ref = lambda q: jnp.sum(reference.naive_recurrent_kda(q, *rest, cu_seqlens=cu)[0] ** 2)
    q = jnp.asarray(x.q)
    check_close(jax.jit(jax.grad(loss))(q), jax.grad(ref)(q), "float32", "grad dq")
