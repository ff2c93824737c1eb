"""Host bounds and jit: compilation cache keyed on bounds contents, no host
callbacks, no device-array constants, no transfers after compilation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import SeqBounds
from kda_jax.testing import assert_close, make_inputs
from guards import no_device_reads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (0, 7, 1, 0, 40)  # T = 48; an empty first and middle sequence
CU = np.array([0, 0, 7, 8, 8, 48])


def _inputs():
    x = make_inputs(21, B=1, T=48, H=1, HV=2, K=16, V=16, N=5)
    return x, [jax.device_put(a) for a in (*x.args(), x.initial_state)]


def _counting_model():
    """A 'model' that counts how often it is traced."""
    traces = []

    def model(q, k, v, g, beta, h0, bounds):
        traces.append(bounds)
        o, final = kda_jax.chunk_kda(q, k, v, g, beta, initial_state=h0,
                                     output_final_state=True, cu_seqlens=bounds,
                                     implementation="xla")
        return o * 2.0, final

    return model, traces


def test_static_bounds_trace_once_per_contents():
    model, traces = _counting_model()
    f = jax.jit(model, static_argnames="bounds")
    x, args = _inputs()
    o1, _ = f(*args, bounds=SeqBounds(np.array(CU)))
    o2, _ = f(*args, bounds=SeqBounds(np.array(CU.tolist(), dtype=np.int32)))  # new object
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    # New bounds (same T): one more trace, and the answer changes.
    o3, _ = f(*args, bounds=SeqBounds(np.array([0, 10, 10, 20, 30, 48])))
    assert len(traces) == 2
    assert not np.allclose(np.asarray(o3), np.asarray(o1))
    f(*args, bounds=SeqBounds(np.array(CU)))  # back to the first: cached
    assert len(traces) == 2
    ref_o, _ = kda_jax.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           cu_seqlens=CU)
    assert_close(np.asarray(o1) / 2.0, ref_o, "float32")


def test_bounds_as_plain_argument_is_static_pytree():
    model, traces = _counting_model()
    f = jax.jit(model)  # bounds is an ordinary argument: a pytree with no leaves
    _, args = _inputs()
    assert jax.tree_util.tree_leaves(SeqBounds(CU)) == []
    o1, _ = f(*args, SeqBounds(np.array(CU)))
    o2, _ = f(*args, SeqBounds(list(CU)))
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    assert isinstance(traces[0], SeqBounds)  # not turned into a tracer
    f(*args, SeqBounds(np.array([0, 1, 2, 3, 4, 48])))
    assert len(traces) == 2


def _compiled_varlen():
    model, traces = _counting_model()
    bounds = SeqBounds(CU)
    f = jax.jit(lambda *a: model(*a, bounds))
    return f, traces


def test_no_transfers_after_compilation():
    f, traces = _compiled_varlen()
    x, args = _inputs()
    expected = jax.block_until_ready(f(*args))
    with jax.transfer_guard("disallow"):
        out = jax.block_until_ready(f(*args))
        out = jax.block_until_ready(f(*args))
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(expected[0]))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(expected[1]))


def test_no_device_reads_fires():
    """The guard the tests below run under raises on every kind of read, on a
    CPU too (where jax's own device-to-host guard never fires)."""
    x = jax.numpy.arange(3.0) + 1
    reads = (lambda a: np.asarray(a), lambda a: np.array(a), lambda a: float(a[0]),
             lambda a: a.tolist(), jax.device_get)
    for read in reads:
        with no_device_reads(), pytest.raises(RuntimeError, match="no_device_reads"):
            read(x)
    np.testing.assert_array_equal(np.asarray(x), [1.0, 2.0, 3.0])  # restored after


def test_device_to_host_guard():
    """No device-to-host read in a varlen call, traced and compiled under the
    guard."""
    _, args = _inputs()
    bounds = SeqBounds(np.array([0, 3, 48, 48, 48, 48]))
    with no_device_reads():
        f = jax.jit(lambda *a: kda_jax.chunk_kda(*a[:5], initial_state=a[5], cu_seqlens=bounds,
                                                 output_final_state=True, implementation="xla"))
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
        jax.block_until_ready(kda_jax.fused_recurrent_kda(*args[:5], cu_seqlens=bounds,
                                                          implementation="xla"))


def _walk(closed):
    """All (primitive names, consts and literal values) of a closed jaxpr, recursively."""
    names, values = [], list(closed.consts)
    stack = [closed.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            names.append(eqn.primitive.name)
            values.extend(getattr(v, "val", None) for v in eqn.invars if hasattr(v, "val"))
            for param in eqn.params.values():
                for p in param if isinstance(param, (list, tuple)) else (param,):
                    if hasattr(p, "consts") and hasattr(p, "jaxpr"):  # ClosedJaxpr
                        values.extend(p.consts)
                        stack.append(p.jaxpr)
                    elif hasattr(p, "eqns"):  # Jaxpr
                        stack.append(p)
    return names, values


def test_jaxpr_has_no_callbacks_and_no_device_constants():
    f, _ = _compiled_varlen()
    _, args = _inputs()
    closed = jax.make_jaxpr(f)(*args)
    names, values = _walk(closed)
    assert "scan" in names  # the walk reaches inside the nested jits
    assert not [n for n in names if "callback" in n]
    device = [type(v).__name__ for v in values if isinstance(v, jax.Array)]
    assert not device, f"jax.Array constants in the jaxpr: {device}"
    # The varlen metadata is there, as a host (NumPy) int32 constant.
    host_int = [v for v in values if isinstance(v, np.ndarray) and v.dtype == np.int32 and v.size > 1]
    assert host_int, "no NumPy int32 metadata constant found"


def test_the_checks_can_fail():
    """The walker sees device constants and callbacks; the guard sees transfers."""
    c = jnp.arange(3.0)
    _, values = _walk(jax.make_jaxpr(jax.jit(lambda x: x + c))(1.0))
    assert any(isinstance(v, jax.Array) for v in values)
    callback = lambda x: jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((), jnp.float32), x)
    names, _ = _walk(jax.make_jaxpr(jax.jit(callback))(1.0))
    assert any("callback" in n for n in names)
    f, _ = _compiled_varlen()
    x, args = _inputs()
    jax.block_until_ready(f(*args))
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="host-to-device"):
        f(*x.args(), x.initial_state)  # NumPy inputs need a transfer


def test_simplified_jaxpr_constants_in_subprocess():
    """The same checks with JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1 (read at import)."""
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, "tests")
        import jax, numpy as np
        assert jax.config.jax_use_simplified_jaxpr_constants
        import test_jit_and_transfers as t
        t.test_no_transfers_after_compilation()
        t.test_jaxpr_has_no_callbacks_and_no_device_constants()
        t.test_device_to_host_guard()
        t.test_static_bounds_trace_once_per_contents()
        t.test_the_checks_can_fail()
        print("SUBPROCESS-OK")
        """
    )
    env = dict(os.environ)
    env["JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SUBPROCESS-OK" in proc.stdout, (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
