"""The Triton path under jax.jit with NamedSharding operands on 4 host CPU
devices (kda_jax.triton.partitioning): batch- and head-sharded calls run per
device with no collective around the kernels, forward and backward; other
shardings are gathered and still correct. Kernels in Triton's interpreter
without a GPU (conftest.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kda_jax
from kda_jax.testing import make_inputs
from kda_jax.triton import unavailable_reason

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None,
                       reason=f"Triton path unavailable: {unavailable_reason()}"),
    pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest.py)"),
]

B, T, H, HV, K, V = 4, 24, 2, 4, 16, 16  # a GVA group of 2 value heads per q/k head
COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce)(-start)?\(")
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _mesh(kind=AxisType.Auto):
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind))


def _specs(batch, heads, time=None):
    """PartitionSpecs of q, k, v, g, beta, initial_state, A_log, dt_bias."""
    rows = P(batch, time, heads, None)
    return (rows, rows, rows, rows, P(batch, time, heads), P(batch, heads), P(heads), P(heads))


def _inputs(gate: bool):
    x = make_inputs(3, B=B, T=T, H=H, HV=HV, K=K, V=V, raw_gate=gate)
    return tuple(None if a is None else jnp.asarray(a) for a in
                 (x.q, x.k, x.v, x.g, x.beta, x.initial_state, x.A_log, x.dt_bias))


def _loss(fn, gate: bool):
    rng = np.random.default_rng(1)
    w_o = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((B, HV, K, V)), jnp.float32)
    kw = dict(use_gate_in_kernel=True, lower_bound=-5.0) if gate else {}

    def loss(q, k, v, g, beta, h0, A_log, dt_bias):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                  dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, **kw)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

    return loss


def _collectives(compiled_text: str) -> list[str]:
    return [m.group(0) for m in COLLECTIVES.finditer(compiled_text)]


def _place(arrays, mesh, specs):
    return tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                 for a, s in zip(arrays, specs))


@pytest.mark.parametrize("batch, heads, gate", [
    ("data", None, False), (None, "model", True), ("data", "model", True)])
def test_value_and_grad_stays_sharded(batch, heads, gate, check_rel_rms):
    """Forward and gradients sharded over the batch, the heads or both equal
    the unsharded call and the reference; the compiled program has no
    collective but the psum of the gate parameters' gradients over the batch."""
    arrays = _inputs(gate)
    argnums = tuple(i for i, a in enumerate(arrays) if a is not None)
    grad = lambda fn: jax.value_and_grad(_loss(fn, gate), argnums=argnums, has_aux=True)
    triton = lambda *a, **kw: kda_jax.chunk_kda(*a, chunk_size=32, implementation="triton",
                                                **kw)
    mesh = _mesh()
    specs = _specs(batch, heads)
    placed = _place(arrays, mesh, specs)
    shardings = tuple(None if a is None else NamedSharding(mesh, s)
                      for a, s in zip(arrays, specs))
    sharded = jax.jit(grad(triton), in_shardings=shardings)
    (_, (o, s)), grads = sharded(*placed)

    (_, (o1, s1)), grads1 = jax.jit(grad(triton))(*arrays)
    (_, (o_ref, s_ref)), grads_ref = jax.jit(grad(kda_jax.naive_recurrent_kda))(*arrays)
    assert o.sharding.spec == P(batch, None, heads, None)
    assert s.sharding.spec == P(batch, heads)
    np.testing.assert_allclose(o, o1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, s1, rtol=1e-6, atol=1e-6)
    check_rel_rms(o, o_ref, 1e-5, "o", kind="output")
    check_rel_rms(s, s_ref, 1e-5, "final_state", kind="output")
    for i, d, d1, d_ref in zip(argnums, grads, grads1, grads_ref):
        np.testing.assert_allclose(d, d1, rtol=1e-5, atol=1e-5, err_msg=NAMES[i])
        check_rel_rms(d, d_ref, 1e-4, f"d{NAMES[i]}")

    found = _collectives(sharded.lower(*placed).compile().as_text())
    if batch is not None and gate:
        # dA_log [HV] and ddt_bias [HV * K] summed over the batch shards.
        assert found and set(found) <= {"all-reduce(", "all-reduce-start("}, found
        assert len(found) <= 2, found
    else:
        assert not found, found


def test_time_sharded_input_is_gathered():
    """T sharded (sequences are packed along T): the rule gathers it, and the
    result is still the unsharded call's."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    fn = lambda *a: kda_jax.chunk_kda(*a, initial_state=h0, output_final_state=True,
                                      chunk_size=32, implementation="triton")
    mesh = _mesh()
    placed = _place((q, k, v, g, beta), mesh, _specs(None, None, "model")[:5])
    sharded = jax.jit(fn)
    o, s = sharded(*placed)
    o1, s1 = jax.jit(fn)(q, k, v, g, beta)
    np.testing.assert_allclose(o, o1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, s1, rtol=1e-6, atol=1e-6)
    assert "all-gather" in " ".join(_collectives(sharded.lower(*placed).compile().as_text()))


def test_fused_recurrent_heads():
    """fused_recurrent_kda (the decode launch) sharded over the heads."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    fn = lambda *a: kda_jax.fused_recurrent_kda(*a, output_final_state=True,
                                                implementation="triton")
    arrays = (q, k, v, g, beta, h0)
    mesh = _mesh()
    placed = _place(arrays, mesh, _specs(None, "model")[:6])
    sharded = jax.jit(lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, initial_state=h0))
    o, s = sharded(*placed)
    o_ref, s_ref = kda_jax.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                               output_final_state=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-4)
    assert s.sharding.spec == P(None, "model")
    assert not _collectives(sharded.lower(*placed).compile().as_text())


def test_state_pool_heads():
    """chunk_kda with a state pool, its rows [slots, HV, K, V] sharded with
    the heads: the kernels read and write each device's rows in place."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    slots = 6
    idx = np.array([4, 0, 5, 2], np.int32)
    cache = np.full((slots, HV, K, V), 7.0, np.float32)
    cache[idx] = np.asarray(h0)

    def fn(q, k, v, g, beta, cache):
        return kda_jax.chunk_kda(q, k, v, g, beta, state_cache=cache, state_indices=idx,
                                 chunk_size=32, implementation="triton")

    mesh = _mesh()
    specs = _specs(None, "model")[:5] + (P(None, "model"),)
    placed = _place((q, k, v, g, beta, jnp.asarray(cache)), mesh, specs)
    sharded = jax.jit(fn)
    o, new = sharded(*placed)
    o_ref, s_ref = kda_jax.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                               output_final_state=True)
    want = cache.copy()
    want[idx] = np.asarray(s_ref)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new, want, rtol=1e-4, atol=1e-4)
    assert new.sharding.spec == P(None, "model")
    assert not _collectives(sharded.lower(*placed).compile().as_text())


def test_explicit_axes_raise():
    """Mesh axes of type Explicit: a clear error naming the fix."""
    q, k, v, g, beta, _, _, _ = _inputs(False)
    mesh = _mesh(AxisType.Explicit)
    placed = _place((q, k, v, g, beta), mesh, _specs("data", None)[:5])
    fn = jax.jit(lambda *a: kda_jax.chunk_kda(*a, chunk_size=32, implementation="triton")[0])
    with pytest.raises(NotImplementedError, match="AxisType.Auto"):
        fn(*placed)
