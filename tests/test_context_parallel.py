"""Context parallelism: chunk_kda(..., context_axis="cp") inside jax.shard_map over
4 host CPU devices (tests/conftest.py), each holding 1/4 of the tokens; forward
and gradients against the float32 reference and the unsharded call, on the XLA
path and the Triton path (interpreter on the CPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kda_jax
from kda_jax.testing import make_inputs
from kda_jax.triton import unavailable_reason

DEVICES = 4
TOK = P(None, "cp")
# 4 x 24 tokens: sequence 1 crosses two boundaries (devices 0-2), sequence 2
# ends on a boundary, two empty sequences sit on it (72), then a one-token
# sequence, and an empty one at the very end.
CU = [0, 10, 70, 72, 72, 72, 73, 96, 96]
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
needs_triton = pytest.mark.skipif(unavailable_reason() is not None,
                                  reason="Triton path unavailable")


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < DEVICES:
        pytest.skip(f"needs {DEVICES} devices (tests/conftest.py forces host devices)")
    return _mesh(DEVICES)


def _mesh(devices):
    return Mesh(np.asarray(jax.devices()[:devices]), ("cp",))


def _call(impl, cu, **kw):
    return functools.partial(kda_jax.chunk_kda, output_final_state=True, cu_seqlens=cu,
                             chunk_size=32, implementation=impl, **kw)


def _sharded(mesh, fn):
    body = lambda q, k, v, g, b, h: fn(q, k, v, g, b, initial_state=h, context_axis="cp")
    return jax.shard_map(body, mesh=mesh, in_specs=(TOK,) * 5 + (P(),),
                         out_specs=(TOK, P()))


def _loss(fn):
    def loss(q, k, v, g, b, h, w_o, w_f):
        o, f = fn(q, k, v, g, b, h)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(f * w_f)
    return loss


@functools.lru_cache(maxsize=None)
def _compiled(impl, cu, devices, kw=()):
    """Jitted (sharded forward, unsharded forward, sharded gradients) of one
    configuration, shared by the tests that use it (compiles are the cost)."""
    fn = _call(impl, None if cu is None else list(cu), **dict(kw))
    cp = _sharded(_mesh(devices), fn)
    whole = lambda q, k, v, g, b, h: fn(q, k, v, g, b, initial_state=h)
    return jax.jit(cp), jax.jit(whole), jax.jit(jax.grad(_loss(cp), argnums=tuple(range(6))))


def _placed(mesh, x):
    args = (*x.args(), x.initial_state)
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
    return args, [put(a, TOK) for a in args[:5]] + [put(args[5], P())]


def _compare(x, impl, cu, check_close, check_rel_rms, *, devices=DEVICES, grads=True,
             unsharded=False, **kw):
    """The sharded call against the reference (forward, and gradients with
    ``grads``) and, with ``unsharded``, against the same backend unsharded."""
    cp, whole, cp_grad = _compiled(impl, None if cu is None else tuple(cu), devices,
                                   tuple(sorted(kw.items())))
    args, sharded_args = _placed(_mesh(devices), x)
    o, f = cp(*sharded_args)
    reference = lambda q, k, v, g, b, h: kda_jax.naive_recurrent_kda(
        q, k, v, g, b, initial_state=h, output_final_state=True, cu_seqlens=cu, **kw)
    f32 = [np.asarray(a, np.float32) for a in args]
    ro, rf = reference(*f32)
    check_close(o, ro, "float32", "o")
    check_close(f, rf, "float32", "final_state")
    if unsharded:
        uo, uf = whole(*args)
        check_close(o, uo, "float32", "o vs unsharded")
        check_close(f, uf, "float32", "final_state vs unsharded")
    if not grads:
        return
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(ro.shape).astype(np.float32),
         rng.standard_normal(rf.shape).astype(np.float32))
    got = cp_grad(*sharded_args, *w)
    want = jax.jit(jax.grad(_loss(reference), argnums=tuple(range(6))))(*f32, *w)
    for name, a, b in zip(NAMES, got, want):
        check_rel_rms(a, b, 1e-4, f"d{name}")


def test_xla_varlen_crossing_and_empty_sequences(mesh, check_close, check_rel_rms):
    """Forward (the gradients: the dense test below, and the Triton path's)."""
    x = make_inputs(0, B=1, T=96, H=1, HV=2, K=16, V=16, N=len(CU) - 1, gate_floor=-1e4)
    _compare(x, "xla", CU, check_close, check_rel_rms, grads=False, unsharded=True)


def test_xla_dense_rows_state_v_first_grads(mesh, check_close, check_rel_rms):
    """Dense B = 2 (each row one sequence crossing the boundary), V-first
    states, forward and gradients, over 2 of the devices (half the compile)."""
    x = make_inputs(1, B=2, T=64, H=1, HV=2, K=16, V=8, state_v_first=True)
    _compare(x, "xla", None, check_close, check_rel_rms, devices=2, state_v_first=True)


@needs_triton
def test_triton_varlen(mesh, check_close, check_rel_rms):
    x = make_inputs(2, B=1, T=96, H=1, K=16, V=16, N=len(CU) - 1)
    _compare(x, "triton", CU, check_close, check_rel_rms, unsharded=True)


def test_xla_gate_parameters_gva_grads(mesh, check_close, check_rel_rms):
    """The in-kernel gate with A_log and dt_bias replicated over the axis
    (their gradients are sums over the devices), two value heads per q/k
    head, varlen over 2 devices: forward and every gradient against the
    reference."""
    x = make_inputs(6, B=1, T=96, H=1, HV=2, K=16, V=16, N=len(CU) - 1, raw_gate=True)
    kw = dict(use_gate_in_kernel=True, output_final_state=True, cu_seqlens=CU)
    fn = lambda q, k, v, g, b, h, a, d, **c: kda_jax.chunk_kda(
        q, k, v, g, b, initial_state=h, A_log=a, dt_bias=d, chunk_size=32, **kw, **c)
    cp = jax.shard_map(lambda *a: fn(*a, context_axis="cp", implementation="xla"),
                       mesh=_mesh(2), in_specs=(TOK,) * 5 + (P(),) * 3, out_specs=(TOK, P()))
    args = [jnp.asarray(a) for a in (*x.args(), x.initial_state, x.A_log, x.dt_bias)]
    reference = lambda *a: kda_jax.naive_recurrent_kda(
        *a[:5], initial_state=a[5], A_log=a[6], dt_bias=a[7], **kw)
    ro, rf = reference(*args)
    o, f = jax.jit(cp)(*args)
    check_close(o, ro, "float32", "o")
    check_close(f, rf, "float32", "final_state")
    rng = np.random.default_rng(6)
    w = (rng.standard_normal(ro.shape).astype(np.float32),
         rng.standard_normal(rf.shape).astype(np.float32))

    def loss(fun):
        def value(*a):
            o, f = fun(*a)
            return jnp.sum(o.astype(jnp.float32) * w[0]) + jnp.sum(f * w[1])
        return value
    got = jax.jit(jax.grad(loss(cp), argnums=tuple(range(8))))(*args)
    want = jax.jit(jax.grad(loss(reference), argnums=tuple(range(8))))(*args)
    for name, a, b in zip(NAMES + ("A_log", "dt_bias"), got, want):
        check_rel_rms(a, b, 1e-4, f"d{name}")


def _as_unsharded(mesh, x):
    """(o, final) of the XLA path's sharded call on ``x`` (over CU), after
    checking they are NaN where the unsharded call's are and equal elsewhere."""
    cp, whole, _ = _compiled("xla", tuple(CU), DEVICES, ())
    args, sharded_args = _placed(mesh, x)
    o, f = (np.asarray(y) for y in cp(*sharded_args))
    uo, uf = (np.asarray(y) for y in whole(*args))
    np.testing.assert_array_equal(np.isnan(o), np.isnan(uo))
    np.testing.assert_array_equal(np.isnan(f), np.isnan(uf))
    ok = ~np.isnan(uo)
    np.testing.assert_allclose(o[ok], uo[ok], rtol=1e-4, atol=1e-5)
    return o, f


def test_nonfinite_on_a_device_boundary_piece(mesh):
    """A NaN in the piece that leaves device 0: sequence 1 is NaN from that
    token on, on every device it reaches (the flag crosses the fold);
    everything else as the unsharded call's."""
    x = make_inputs(3, B=1, T=96, H=1, HV=2, K=16, V=16, N=len(CU) - 1)
    x.k[0, 20, 0, 2] = np.nan
    o, f = _as_unsharded(mesh, x)
    assert np.isnan(o[0, 20:70]).all() and not np.isnan(o[0, 70:]).any()
    assert np.isnan(f[1]).all() and not np.isnan(f[2:]).any()


def test_nonfinite_initial_state_crosses_devices_by_column(mesh):
    """A NaN in one entry of the initial state of sequence 1 (tokens 10..70,
    over three devices): only that value column of its outputs and final
    state is NaN, on every device, as unsharded."""
    x = make_inputs(3, B=1, T=96, H=1, HV=2, K=16, V=16, N=len(CU) - 1)
    x.initial_state[1, 0, 5, 7] = np.nan
    o, f = _as_unsharded(mesh, x)
    assert np.isnan(o[0, 10:70, 0, 7]).all() and np.isnan(o).sum() == 60
    assert np.isnan(f[1, 0, :, 7]).all() and np.isnan(f).sum() == 16


def test_errors(mesh):
    x = make_inputs(4, B=1, T=96, H=1, K=16, V=16, N=1)
    args = x.args()
    with pytest.raises(ValueError, match="not a mesh axis bound here"):
        kda_jax.chunk_kda(*args, context_axis="cp", implementation="xla")
    with pytest.raises(TypeError, match="context_axis"):
        kda_jax.chunk_kda(*args, context_axis=3, implementation="xla")
    batch = kda_jax.VarlenBatch.from_lengths([96], kda_jax.Bucket(max_seqs=1, max_tokens=96))
    with pytest.raises(ValueError, match="VarlenBatch"):
        kda_jax.chunk_kda(*args, cu_seqlens=batch, context_axis="cp", implementation="xla")

    def inside(fn):
        put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, TOK))
        body = jax.shard_map(fn, mesh=mesh, in_specs=(TOK,) * 5, out_specs=TOK)
        return jax.jit(body)(*(put(a) for a in args))

    # The global bounds must cover all 4 devices' tokens (4 x 24 here).
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=24 must equal the number of tokens "
                       r"T=96 \(24 per device x 4 devices of the context axis"):
        inside(lambda *a: kda_jax.chunk_kda(*a, cu_seqlens=[0, 24], context_axis="cp",
                                            implementation="xla")[0])
    # Tokens replicated over the axis (in_specs that do not split T; one input
    # alone would fail the shape checks): shard_map's vma types tell.
    with pytest.raises(ValueError, match=r"context_axis='cp': q is the same on every device "
                       r"of the axis.*in_specs=P\(None, 'cp'\)"):
        jax.jit(jax.shard_map(
            lambda *a: kda_jax.chunk_kda(*a, context_axis="cp", implementation="xla")[0],
            mesh=mesh, in_specs=(P(),) * 5, out_specs=P()))(*(jnp.asarray(a) for a in args))
    wide = make_inputs(4, B=1, T=8, H=1, K=144, V=128, N=1, with_state=False)
    if unavailable_reason() is None:
        with pytest.raises(ValueError, match="V \\+ K"):
            jax.jit(jax.shard_map(
                lambda *a: kda_jax.chunk_kda(*a, context_axis="cp", implementation="triton")[0],
                mesh=mesh, in_specs=(TOK,) * 5, out_specs=TOK))(
                *(jax.device_put(jnp.asarray(a), NamedSharding(mesh, TOK))
                  for a in wide.args()))
