"""Shared fixtures for the CPU suite.

Largest errors against the float32 reference are recorded per (input dtype,
quantity) by the ``check_close`` fixture and printed in the terminal summary.
"""

from __future__ import annotations

import os
import sys

# Four host CPU devices, so that the sharding tests (shard_map, sharded jit,
# context parallel) run on any machine; XLA reads this when the CPU backend
# starts, so it must precede the first use of jax. Single-device tests are
# unaffected: arrays live on the first device unless placed.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
# The CPU suite is bound by XLA's compiles (each test's shapes and flags are
# new programs that run once or twice on tiny arrays): LLVM's optimization of
# the CPU code is skipped (the HLO passes, and so every program's semantics,
# are unchanged). The child processes the tests start inherit it; a test bound
# by run time (tests/test_example_train.py) runs in a child without it. Only
# where no GPU is present (the flag also sets the GPU backend's LLVM level);
# the check reads device nodes, since asking jax would start its backends
# before the flags are set.
_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")
if ("xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
        and not any(os.path.exists(p) for p in _GPU_NODES)):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax
import numpy as np
import pytest

# Tier 2: without a GPU the Triton kernels run in Triton's interpreter. Triton
# reads TRITON_INTERPRET when it decorates a function, so this must happen
# before any test module imports triton.
if jax.default_backend() not in ("gpu", "cuda", "rocm"):
    os.environ.setdefault("KDA_JAX_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kda_jax.testing import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

jax.config.update("jax_enable_x64", False)

# (dtype name, quantity) -> {"rel_rms": (worst, test), "max_abs": (worst, test)}.
ERROR_RECORD: dict[tuple[str, str], dict[str, tuple[float, str]]] = {}


def _record(key, r, m, test_id):
    entry = ERROR_RECORD.setdefault(key, {"rel_rms": (-1.0, ""), "max_abs": (-1.0, "")})
    for name, value in (("rel_rms", r), ("max_abs", m)):
        if value > entry[name][0]:
            entry[name] = (value, test_id)


def _label(request, outcome=None):
    """The test's name, tagged when it is an expected failure (a known issue)."""
    if request.node.get_closest_marker("xfail") is not None:
        outcome = "xfail, known issue"
    return request.node.name + (f" ({outcome})" if outcome else "")


@pytest.fixture
def check_close(request):
    """``check_close(actual, expected, dtype_name, what, kind=None)``: assert_close plus
    recording under (dtype_name, kind); kind defaults to the first word of ``what``."""

    def check(actual, expected, dtype_name, what="o", kind=None):
        actual = np.asarray(actual, dtype=np.float32)
        expected = np.asarray(expected, dtype=np.float32)
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        kind = kind or what.split("[")[0].split(" ")[0]
        try:
            r, m = assert_close(actual, expected, dtype_name, what)
        except AssertionError:
            from kda_jax.testing import max_abs, rel_rms

            if np.all(np.isfinite(actual)):
                _record((dtype_name, kind), rel_rms(actual, expected),
                        max_abs(actual, expected), _label(request, "FAILED"))
            raise
        _record((dtype_name, kind), r, m, _label(request))
        return r, m

    return check


@pytest.fixture
def check_rel_rms(request):
    """``check_rel_rms(actual, expected, tol, what, kind="grad")``: relative RMS only
    (gradients), recorded under ("float32", kind)."""
    from kda_jax.testing import max_abs, rel_rms

    def check(actual, expected, tol, what, kind="grad"):
        actual = np.asarray(actual, dtype=np.float32)
        expected = np.asarray(expected, dtype=np.float32)
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
        r, m = rel_rms(actual, expected), max_abs(actual, expected)
        _record(("float32", kind), r, m, f"{_label(request)} {what}")
        assert r <= tol, f"{what}: rel_rms={r:.3e} > {tol:.0e} (max_abs={m:.3e})"
        return r

    return check


def pool_dtype_checks(impl: str, dtype):
    """(same, same_rows): how a 16-bit pool's results compare with the float32
    pool's (rows rounded to ``dtype``). Bit for bit, except natively on the
    Triton path, where the two pools' kernels are different binaries (a 16-bit or a
    float32 state load), whose float32 arithmetic the compiler may contract
    differently (3e-8 apart on an H100): o within float32 rounding, each row
    within one unit of the pool's last place."""
    import jax.numpy as jnp

    from kda_jax.triton import interpret_mode

    same = same_rows = np.testing.assert_array_equal
    if impl == "triton" and not interpret_mode():
        same = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
        ulp = float(jnp.finfo(dtype).eps)
        same_rows = lambda a, b: np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=ulp, atol=1e-7)
    return same, same_rows


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its record to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["kda_error_record"] = [
            [list(key), {name: list(v) for name, v in entry.items()}]
            for key, entry in ERROR_RECORD.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: merges a finished worker's record."""
    for key, entry in getattr(node, "workeroutput", {}).get("kda_error_record", []):
        for name, (value, test_id) in entry.items():
            if name == "rel_rms":
                _record(tuple(key), value, -1.0, test_id)
            else:
                _record(tuple(key), -1.0, value, test_id)


def pytest_terminal_summary(terminalreporter):
    if not ERROR_RECORD:
        return
    terminalreporter.section("largest errors vs the float32 reference")
    for (dtype, what), entry in sorted(ERROR_RECORD.items()):
        (r, r_test), (m, m_test) = entry["rel_rms"], entry["max_abs"]
        terminalreporter.write_line(
            f"{dtype:9s} {what:12s} rel_rms={r:.2e} [{r_test}]  max_abs={m:.2e} [{m_test}]"
        )


def run_lowering_child(test_file: str, targets: list[str]) -> dict:
    """Runs ``test_file`` as a script in a clean child process (JAX on the CPU,
    no interpreter mode: this session imported Triton for its interpreter,
    which cannot compile for a GPU target) and returns the JSON it prints last.
    The lowering tests use it; the child skips with {"skip": reason}."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("KDA_JAX_INTERPRET", "TRITON_INTERPRET")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, env.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, os.path.abspath(test_file), *targets], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        pytest.fail(f"lowering child failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


@pytest.fixture
def example():
    """``example(name)``: imports ``examples/<name>.py`` of the checkout as a module."""
    import importlib.util

    def load(name):
        spec = importlib.util.spec_from_file_location(
            f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        # Registered before it runs, as an import does: dataclasses look
        # their module up in sys.modules.
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    return load

