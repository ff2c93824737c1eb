"""chunk_kda and fused_recurrent_kda inside jax.shard_map (check_vma on, the
default) over 4 host CPU devices (tests/conftest.py) as a 2 x 2 mesh: q..beta
sharded over the batch, over the heads (H and HV together, GVA groups whole),
or both; XLA path and Triton path (interpreter). Forward and gradients equal
to the unsharded call; the forward also to the float32 reference. The
serving form (a VarlenBatch and a pool split with the heads) over the heads.

Tiny shapes (T <= 21, K = V = 16); one compile for forward and gradients.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import kda_jax
from kda_jax import reference
from kda_jax.testing import make_inputs
from kda_jax.triton import unavailable_reason

needs_triton = pytest.mark.skipif(unavailable_reason() is not None,
                                  reason="Triton path unavailable")
CU = (0, 5, 21)  # host bounds of the heads-only case (B = 1 cannot split over the batch)
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
# Array layouts: q..beta [B, T, heads, ...], initial_state [N, HV, ...], A_log and dt_bias [HV * ...].
SPECS = {
    "batch": (P("b"), P("b"), P()),
    "heads": (P(None, None, "h"), P(None, "h"), P("h")),
    "both": (P("b", None, "h"), P("b", "h"), P("h")),
}


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces host devices)")
    return _mesh()


def _mesh():
    return Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("b", "h"))


def _inputs(form, gate=False):
    shape = dict(B=2, T=12) if form == "dense" else dict(B=1, T=CU[-1], N=len(CU) - 1)
    x = make_inputs(7, H=2, HV=4, K=16, V=16, raw_gate=gate, **shape)
    return [getattr(x, n) for n in NAMES]


def _call(fn, impl, form, gate):
    kw = dict(output_final_state=True, implementation=impl, use_gate_in_kernel=gate)
    if fn == "chunk":
        kw["chunk_size"] = 32
    if form == "varlen":
        kw["cu_seqlens"] = list(CU)
    call = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}[fn]

    def f(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return call(q, k, v, g, beta, initial_state=initial_state, A_log=A_log,
                    dt_bias=dt_bias, **kw)
    return f


def _with_grads(f, grads: bool):
    """(o, final, gradients of a weighted sum of both by every argument or None)."""
    def run(args, w_o, w_f):
        if not grads:
            return (*f(*args), None)
        (o, final), vjp = jax.vjp(f, *args)
        return o, final, vjp((w_o.astype(o.dtype), w_f))
    return run


@functools.lru_cache(maxsize=None)
def _compiled(fn, impl, form, gate, spec, grads):
    """The jitted sharded call over ``spec`` (None: unsharded)."""
    f = _with_grads(_call(fn, impl, form, gate), grads)
    if spec is None:
        return jax.jit(f)
    rows, state, head = SPECS[spec]
    arg_specs = [rows] * 5 + [state] + [head if gate else None] * 2
    out = (rows, state, None if not grads else tuple(arg_specs))
    return jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=(arg_specs, rows, state),
                                 out_specs=out))


def _compare(fn, impl, form, spec, check_close, *, gate=False, grads=True):
    args = _inputs(form, gate)
    rng = np.random.default_rng(3)
    o_shape = args[2].shape
    w_o = rng.standard_normal(o_shape).astype(np.float32)
    w_f = rng.standard_normal(args[5].shape).astype(np.float32)
    o, final, d = _compiled(fn, impl, form, gate, spec, grads)(args, w_o, w_f)
    # The chunk_kda cases of one form share one unsharded compile.
    uo, uf, ud = _compiled(fn, impl, form, gate, None, fn == "chunk")(args, w_o, w_f)
    np.testing.assert_allclose(o, uo, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final, uf, rtol=1e-5, atol=1e-6)
    ro, rf = reference.naive_recurrent_kda(
        *args[:5], initial_state=args[5], A_log=args[6], dt_bias=args[7],
        output_final_state=True, use_gate_in_kernel=gate,
        cu_seqlens=list(CU) if form == "varlen" else None)
    check_close(o, ro, "float32", "o")
    check_close(final, rf, "float32", "final_state")
    if grads:
        for name, a, b in zip(NAMES, d, ud):
            if b is not None:
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("impl, spec, form, grads", [
    ("xla", "both", "dense", True),
    pytest.param("triton", "batch", "dense", False, marks=needs_triton),
    pytest.param("triton", "heads", "varlen", True, marks=needs_triton),
    pytest.param("triton", "both", "dense", True, marks=needs_triton)])
def test_chunk_kda(mesh, impl, spec, form, grads, check_close):
    """Over the batch, the heads (host bounds) or both; forward and, where
    an axis is not yet covered, gradients."""
    _compare("chunk", impl, form, spec, check_close, grads=grads)


@pytest.mark.parametrize("impl", ["xla", pytest.param("triton", marks=needs_triton)])
def test_fused_recurrent_kda_with_the_gate(mesh, impl, check_close):
    """Over both axes, the in-kernel gate's A_log and dt_bias split with the
    heads; forward (the XLA path's gradients in shard_map: test_chunk_kda;
    the Triton path is forward only)."""
    _compare("recurrent", impl, "dense", "both", check_close, gate=True, grads=False)


@needs_triton
def test_serving_step_over_heads(mesh, check_close):
    """The serving form (a VarlenBatch and a state pool whose rows are split
    with the heads) of fused_recurrent_kda on the Triton path, over the heads:
    the pool and outputs equal the unsharded call's and the reference's."""
    x = make_inputs(8, B=1, T=CU[-1], H=2, HV=4, K=16, V=16, N=len(CU) - 1)
    batch = kda_jax.VarlenBatch.build(np.array(CU), kda_jax.Bucket(max_seqs=2, max_tokens=24))
    pool = np.random.default_rng(0).standard_normal((3, 4, 16, 16)).astype(np.float32)
    idx = np.array([2, 0], np.int32)

    def step(q, k, v, g, beta, cache, indices):
        return kda_jax.fused_recurrent_kda_pool(q, k, v, g, beta, cache,
                                                kda_jax.PoolRows(indices), cu_seqlens=batch,
                                                implementation="triton")

    heads = P(None, None, "h")
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(heads,) * 5 + (P(None, "h"), P()),
                            out_specs=(heads, P(None, "h")))
    args = [batch.pad_tokens(a) for a in x.args()]
    o, cache = jax.jit(sharded)(*args, pool, idx)
    uo, ucache = jax.jit(step)(*args, pool, idx)
    np.testing.assert_allclose(o, uo, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache, ucache, rtol=1e-5, atol=1e-6)
    ro, rf = reference.naive_recurrent_kda(*x.args(), initial_state=pool[idx],
                                           output_final_state=True, cu_seqlens=list(CU))
    check_close(o[:, :CU[-1]], ro, "float32", "o")
    check_close(cache[idx], rf, "float32", "final_state")
    np.testing.assert_array_equal(cache[1], pool[1])  # a row no sequence names
