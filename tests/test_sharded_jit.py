"""The Triton path under jax.jit with NamedSharding operands on 4 host CPU
devices (kda_jax.triton.partitioning): batch- and head-sharded calls run per
device with no collective around the kernels, forward and backward; other
shardings are gathered and still correct. Kernels in Triton's interpreter
without a GPU (conftest.py)."""

from __future__ import annotations

import functools
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

B, T, H, HV, K, V = 2, 24, 2, 4, 16, 16  # a GVA group of 2 value heads per q/k head
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


def _program(fn, gate: bool):
    """(q, k, v, g, beta, h0, A_log, dt_bias) -> (o, final_state, gradients of
    the present inputs for fixed random cotangents of o and the final state):
    no scalar loss, whose sum over a sharded o would need a reduction."""
    rng = np.random.default_rng(1)
    w_o = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((B, HV, K, V)), jnp.float32)
    kw = dict(use_gate_in_kernel=True, lower_bound=-5.0) if gate else {}

    def program(*arrays):
        present = [i for i, a in enumerate(arrays) if a is not None]

        def call(*xs):
            full = list(arrays)
            for i, x in zip(present, xs):
                full[i] = x
            q, k, v, g, beta, h0, A_log, dt_bias = full
            return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                      A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, **kw)

        (o, s), vjp = jax.vjp(call, *(arrays[i] for i in present))
        return o, s, vjp((w_o.astype(o.dtype), w_s))

    return program


def _triton(*args, **kw):
    return kda_jax.chunk_kda(*args, chunk_size=32, implementation="triton", **kw)


@functools.lru_cache(maxsize=None)
def _unsharded(gate: bool):
    """The unsharded Triton call's and the reference's (o, final_state, grads)."""
    arrays = _inputs(gate)
    return tuple(jax.tree.map(np.asarray, jax.jit(_program(fn, gate))(*arrays))
                 for fn in (_triton, kda_jax.naive_recurrent_kda))


@jax.jit
def _reference(q, k, v, g, beta, h0):
    return kda_jax.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                       output_final_state=True)


def _is(x, mesh, spec) -> bool:
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _collectives(compiled) -> list[str]:
    return [m.group(0) for m in COLLECTIVES.finditer(compiled.as_text())]


def _place(arrays, mesh, specs):
    return tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                 for a, s in zip(arrays, specs))


@pytest.mark.parametrize("batch, heads, gate", [
    ("data", None, False), (None, "model", True), ("data", "model", True)])
def test_forward_and_grad_stay_sharded(batch, heads, gate, check_rel_rms):
    """Forward and gradients sharded over the batch, the heads or both equal
    the unsharded call and the reference; the compiled program has no
    collective but the psum of the gate parameters' gradients over the batch."""
    arrays = _inputs(gate)
    present = [NAMES[i] for i, a in enumerate(arrays) if a is not None]
    mesh = _mesh()
    placed = _place(arrays, mesh, _specs(batch, heads))
    compiled = jax.jit(_program(_triton, gate)).lower(*placed).compile()
    o, s, grads = compiled(*placed)

    (o1, s1, grads1), (o_ref, s_ref, grads_ref) = _unsharded(gate)
    assert _is(o, mesh, P(batch, None, heads)) and _is(s, mesh, P(batch, heads))
    np.testing.assert_allclose(o, o1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, s1, rtol=1e-6, atol=1e-6)
    check_rel_rms(o, o_ref, 1e-5, "o", kind="output")
    check_rel_rms(s, s_ref, 1e-5, "final_state", kind="output")
    for name, d, d1, d_ref in zip(present, grads, grads1, grads_ref):
        np.testing.assert_allclose(d, d1, rtol=1e-5, atol=1e-5, err_msg=name)
        check_rel_rms(d, d_ref, 1e-4, f"d{name}")

    found = _collectives(compiled)
    if batch is not None and gate:
        # dA_log [HV] and ddt_bias [HV * K], sums over the rows, psum'd over the batch.
        assert found and set(found) <= {"all-reduce(", "all-reduce-start("}, found
        assert len(found) <= 2, found
    else:
        assert not found, found


@pytest.mark.parametrize("where", ["forward", "prepare"])
def test_grad_with_the_forwards_nonfinite_flags_stays_sharded(where, monkeypatch):
    """BackwardConfig.nonfinite_flags "forward" and "prepare" (bf16 q, k, v:
    the prepare kernel stores them): the flags kept by the forward (one int8
    per token and value head) shard with the rows and heads. With a NaN in k
    of the second row's second q/k head, the sharded gradients equal the
    unsharded call's (NaN where it has NaN), and no collective is added."""
    from kda_jax import configs, transforms

    xla_flags = []
    flags_of = transforms.nonfinite_flags
    monkeypatch.setattr(transforms, "nonfinite_flags",
                        lambda *a, **kw: xla_flags.append(1) or flags_of(*a, **kw))
    arrays = list(_inputs(True))
    if where == "prepare":
        arrays[:3] = [a.astype(jnp.bfloat16) for a in arrays[:3]]
    arrays[1] = arrays[1].at[1, 7, 1, 3].set(jnp.nan)
    mesh = _mesh()
    placed = _place(arrays, mesh, _specs("data", "model"))
    bwd = configs.replace(configs.backward_config(), {"nonfinite_flags": where})
    with configs.override(bwd):
        compiled = jax.jit(_program(_triton, True)).lower(*placed).compile()
        o1, s1, grads1 = jax.jit(_program(_triton, True))(*arrays)
    assert "s8[" in compiled.as_text()  # the flags cross to the backward
    assert bool(xla_flags) == (where == "forward")  # "prepare": the kernel's flags
    o, s, grads = compiled(*placed)
    np.testing.assert_allclose(o, o1, rtol=1e-6, atol=1e-6)
    assert np.isnan(np.asarray(o1)[1, 7:, 2:]).all() and not np.isnan(np.asarray(o1)[0]).any()
    for d, d1 in zip(grads, grads1):
        np.testing.assert_allclose(d, d1, rtol=1e-5, atol=1e-5)  # NaNs in the same places
    found = _collectives(compiled)
    assert set(found) <= {"all-reduce(", "all-reduce-start("} and len(found) <= 2, found


def test_time_sharded_input_is_gathered():
    """T sharded (sequences are packed along T): the rule gathers it, and the
    result is still the unsharded call's."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    fn = lambda *a: kda_jax.chunk_kda(*a, initial_state=h0, output_final_state=True,
                                      chunk_size=32, implementation="triton")
    mesh = _mesh()
    placed = _place((q, k, v, g, beta), mesh, _specs(None, None, "model")[:5])
    compiled = jax.jit(fn).lower(*placed).compile()
    o, s = compiled(*placed)
    o_ref, s_ref = _reference(q, k, v, g, beta, h0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-4)
    assert "all-gather(" in _collectives(compiled)


def test_fused_recurrent_heads():
    """fused_recurrent_kda (the decode launch) sharded over the heads."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    fn = lambda q, k, v, g, beta, h0: kda_jax.fused_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, implementation="triton")
    mesh = _mesh()
    placed = _place((q, k, v, g, beta, h0), mesh, _specs(None, "model")[:6])
    compiled = jax.jit(fn).lower(*placed).compile()
    o, s = compiled(*placed)
    o_ref, s_ref = _reference(q, k, v, g, beta, h0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-4)
    assert _is(s, mesh, P(None, "model"))
    assert not _collectives(compiled)


def test_state_pool_heads():
    """chunk_kda_pool, its pool's rows [slots, HV, K, V] sharded with
    the heads: the kernels read and write each device's rows in place."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    slots = 6
    idx = np.array([4, 0], np.int32)
    cache = np.full((slots, HV, K, V), 7.0, np.float32)
    cache[idx] = np.asarray(h0)

    def fn(q, k, v, g, beta, cache):
        return kda_jax.chunk_kda_pool(q, k, v, g, beta, cache, kda_jax.PoolRows(idx),
                                      chunk_size=32, implementation="triton")

    mesh = _mesh()
    specs = _specs(None, "model")[:5] + (P(None, "model"),)
    placed = _place((q, k, v, g, beta, jnp.asarray(cache)), mesh, specs)
    compiled = jax.jit(fn).lower(*placed).compile()
    o, new = compiled(*placed)
    o_ref, s_ref = _reference(q, k, v, g, beta, h0)
    want = cache.copy()
    want[idx] = np.asarray(s_ref)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new, want, rtol=1e-4, atol=1e-4)
    assert _is(new, mesh, P(None, "model"))
    assert not _collectives(compiled)


def test_explicit_axes_raise():
    """Mesh axes of type Explicit: a clear error naming the fix."""
    q, k, v, g, beta, _, _, _ = _inputs(False)
    mesh = _mesh(AxisType.Explicit)
    placed = _place((q, k, v, g, beta), mesh, _specs("data", None)[:5])
    fn = jax.jit(lambda *a: kda_jax.chunk_kda(*a, chunk_size=32, implementation="triton")[0])
    with pytest.raises(NotImplementedError, match="AxisType.Auto"):
        fn(*placed)


def test_gspmd_partitioner():
    """The GSPMD callbacks (Shardy off): batch and heads stay sharded."""
    q, k, v, g, beta, h0, _, _ = _inputs(False)
    fn = lambda q, k, v, g, beta, h0: _triton(q, k, v, g, beta, initial_state=h0,
                                              output_final_state=True)
    mesh = _mesh()
    placed = _place((q, k, v, g, beta, h0), mesh, _specs("data", "model")[:6])
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        compiled = jax.jit(fn).lower(*placed).compile()
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
    o, s = compiled(*placed)
    o_ref, s_ref = _reference(q, k, v, g, beta, h0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-4)
    assert _is(o, mesh, P("data", None, "model")) and _is(s, mesh, P("data", "model"))
    assert not _collectives(compiled)
