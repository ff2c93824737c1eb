"""The XLA path on 4 forced host CPU devices, each case in a child process with
a timeout: a hang fails the test instead of stalling the suite.

XLA's CPU runtime deadlocks on multi-device programs that contain LAPACK's
batched triangular solve (a custom call); the XLA path forms ``(I + N)^-1``
with matmuls (:func:`kda_jax.xla.unit_lower_inverse`) so that it holds none.
Cases: the context-parallel step (``jax.shard_map`` over T) and a jitted ``value_and_grad`` with batch-sharded operands
(sharded jit), at a few shapes, each step run several times. Results against
the float32 reference (:func:`kda_jax.naive_recurrent_kda`, and its autodiff)
and the unsharded call.

Run as a script (``python tests/test_xla_multidevice_stress.py CASE``) it is
the child: it prints one JSON line of error measures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

DEVICES = 4
TIMEOUT_S = 240  # a case takes seconds; a deadlock never ends
RUNS = 3  # executions of each compiled step: some programs deadlock only now and then
GRAD_TOL = 1e-4  # relative RMS per gradient, as tests/test_grad.py

# name -> (step, make_inputs kwargs, call kwargs). "cp": context parallel over
# a 4-device axis (T split); "grad": value_and_grad, the batch split over 4 devices.
CASES = {
    # q, k, v, g [1, 256, 2, 16], beta [1, 256, 2], defaults: a program that
    # deadlocks on every run with a LAPACK solve in the XLA path.
    "cp-T256-H2-K16": ("cp", dict(B=1, T=256, H=2, K=16, V=16, with_state=False), {}),
    # Varlen crossing device boundaries, GVA, chunk 32, states in and out.
    "cp-varlen-T192-HV4-K32-c32": (
        "cp", dict(B=1, T=192, H=2, HV=4, K=32, V=16, N=4),
        dict(cu_seqlens=(0, 30, 130, 131, 192), chunk_size=32, output_final_state=True)),
    "grad-B4-T96-H2-K16": ("grad", dict(B=4, T=96, H=2, K=16, V=16), {}),
    "grad-B8-T40-HV2-K24-c32": (
        "grad", dict(B=8, T=40, H=1, HV=2, K=24, V=16), dict(chunk_size=32)),
}


# --------------------------------------------------------------------------- #
# The child: runs one case, prints {"name": (rel_rms, max_abs), ...}.
# --------------------------------------------------------------------------- #


def _errors(actual, expected) -> tuple[float, float]:
    from kda_jax.testing import max_abs, rel_rms

    actual = np.asarray(actual, np.float32)
    if not np.all(np.isfinite(actual)):
        return float("inf"), float("inf")
    return rel_rms(actual, expected), max_abs(actual, expected)


def _run_cp(x, call_kw) -> dict:
    """Context parallel over T: shard_map(chunk_kda(..., context_axis="cp"))."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import kda_jax

    mesh = Mesh(np.asarray(jax.devices()[:DEVICES]), ("cp",))
    call_kw = dict(call_kw)
    cu = call_kw.pop("cu_seqlens", None)
    cu = None if cu is None else list(cu)
    with_final = call_kw.get("output_final_state", False)
    h0 = x.initial_state
    tok = P(None, "cp")

    def body(q, k, v, g, beta, *h):
        o, f = kda_jax.chunk_kda(q, k, v, g, beta, initial_state=h[0] if h else None,
                                 cu_seqlens=cu, implementation="xla", context_axis="cp",
                                 **call_kw)
        return (o, f) if with_final else o

    specs = (tok,) * 5 + ((P(),) if h0 is not None else ())
    outs = (tok, P()) if with_final else tok
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=outs))
    args = [jnp.asarray(a) for a in (*x.args(), *([h0] if h0 is not None else []))]
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    runs = [jax.block_until_ready(step(*placed)) for _ in range(RUNS)]

    whole = jax.jit(lambda q, k, v, g, beta, *h: kda_jax.chunk_kda(
        q, k, v, g, beta, initial_state=h[0] if h else None, cu_seqlens=cu,
        implementation="xla", **call_kw))(*args)
    ref = kda_jax.naive_recurrent_kda(*args[:5], initial_state=h0, cu_seqlens=cu,
                                      output_final_state=with_final,
                                      **{k: v for k, v in call_kw.items()
                                         if k not in ("chunk_size", "output_final_state")})
    got = runs[0] if with_final else (runs[0], None)
    out = {"o": _errors(got[0], ref[0]), "o vs unsharded": _errors(got[0], whole[0])}
    if with_final:
        out["final_state"] = _errors(got[1], ref[1])
        out["final_state vs unsharded"] = _errors(got[1], whole[1])
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for r in runs[1:] for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(runs[0])))
    out["runs identical"] = (0.0, 0.0) if same else (float("inf"), float("inf"))
    return out


def _run_grad(x, call_kw) -> dict:
    """jit(value_and_grad) of sum(o * w) + sum(final * w2), operands sharded
    over the batch (the states over their rows)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import kda_jax

    mesh = Mesh(np.asarray(jax.devices()[:DEVICES]), ("b",))
    args = [jnp.asarray(a) for a in (*x.args(), x.initial_state)]
    rng = np.random.default_rng(11)
    b, t, hv, vd = x.v.shape
    w_o = jnp.asarray(rng.standard_normal((b, t, hv, vd)), jnp.float32)
    w_f = jnp.asarray(rng.standard_normal(x.initial_state.shape), jnp.float32)

    def loss_of(fn):
        def loss(q, k, v, g, beta, h0):
            o, f = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            return jnp.sum(o * w_o) + jnp.sum(f * w_f)
        return loss

    fast = lambda *a, **kw: kda_jax.chunk_kda(*a, implementation="xla", **call_kw, **kw)
    step = jax.jit(jax.value_and_grad(loss_of(fast), argnums=tuple(range(6))))
    placed = [jax.device_put(a, NamedSharding(mesh, P("b"))) for a in args]
    runs = [jax.block_until_ready(step(*placed)) for _ in range(RUNS)]
    value, grads = runs[0]
    ref_value, ref_grads = jax.jit(jax.value_and_grad(
        loss_of(kda_jax.naive_recurrent_kda), argnums=tuple(range(6))))(*args)
    out = {"loss": _errors(value, ref_value)}
    for name, a, r in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, ref_grads):
        out[f"d{name}"] = _errors(a, r)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for r in runs[1:] for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(runs[0])))
    out["runs identical"] = (0.0, 0.0) if same else (float("inf"), float("inf"))
    return out


def _child(name: str) -> dict:
    import jax

    from kda_jax.testing import make_inputs

    assert len(jax.devices()) >= DEVICES, f"{len(jax.devices())} devices; XLA_FLAGS unset?"
    step, shape_kw, call_kw = CASES[name]
    x = make_inputs(3, **shape_kw)
    return (_run_cp if step == "cp" else _run_grad)(x, call_kw)


# --------------------------------------------------------------------------- #
# The test: one child per case.
# --------------------------------------------------------------------------- #


def _child_env() -> dict:
    """The parent's environment on 4 host CPU devices, without Triton's
    interpreter switches (the cases run the XLA path only)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KDA_JAX_INTERPRET", "TRITON_INTERPRET")}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={DEVICES}"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p))
    return env


@pytest.mark.parametrize("name", list(CASES))
def test_multidevice_step_finishes_and_matches_reference(name):
    from kda_jax.testing import TOLERANCES

    start = time.monotonic()
    try:
        run = subprocess.run([sys.executable, os.path.abspath(__file__), name],
                             env=_child_env(), capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the child did not finish in {TIMEOUT_S} s (a deadlock in "
                    "XLA's CPU runtime; is a LAPACK custom call back in the XLA path?)")
    assert run.returncode == 0, f"{name}: child exit {run.returncode}:\n{run.stderr[-4000:]}"
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{name}: {time.monotonic() - start:.1f} s")
    tol = TOLERANCES["float32"]
    for what, (r, m) in errors.items():
        if what.startswith("d"):
            assert r <= GRAD_TOL, f"{name} {what}: rel_rms={r:.3e} > {GRAD_TOL:.0e}"
        else:
            assert r <= tol["rel_rms"] and m <= tol["max_abs"], (
                f"{name} {what}: rel_rms={r:.3e}, max_abs={m:.3e} (tolerance {tol})")


# --------------------------------------------------------------------------- #
# In process: the inverse against float64, and no LAPACK call in the programs.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("c", [1, 2, 5, 32, 33, 64])
def test_unit_lower_inverse_matches_float64(c):
    import jax.numpy as jnp

    from kda_jax.xla import unit_lower_inverse

    rng = np.random.default_rng(c)
    n = np.tril(0.3 * rng.standard_normal((3, 2, c, c)), -1)  # a KDA-like L: |L_ij| < 1
    want = np.linalg.inv(np.eye(c) + n)
    got = unit_lower_inverse(jnp.asarray(n, jnp.float32))
    assert got.shape == n.shape and got.dtype == jnp.float32
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    assert err <= 1e-6, f"C={c}: relative max-abs error {err:.2e} against float64"


def test_xla_programs_hold_no_lapack_call():
    """The compiled forward and gradient of the XLA path (chunk 32 and 64) call
    no LAPACK routine: a batched triangular solve is the call that deadlocks."""
    import jax

    import kda_jax
    from kda_jax.testing import make_inputs

    x = make_inputs(5, B=1, T=70, H=1, K=16, V=16)
    for c in (32, 64):
        loss = lambda *a: kda_jax.chunk_kda(*a, implementation="xla", chunk_size=c)[0].sum()
        hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
            *x.args()).compile().as_text()
        targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
        assert not [t for t in targets if "lapack" in t.lower()], f"chunk {c}: {targets}"
        assert "triangular-solve(" not in hlo, f"chunk {c}: a triangular-solve op"


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
