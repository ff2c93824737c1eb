"""examples/train_tiny.py: a tiny KDA model trained with optax inside jax.jit;
the loss must fall. On CPU through the XLA path (briefly); on a GPU through
the Triton path (its custom_vjp), the whole 300 steps.

On the CPU the training runs in a child process with XLA's default backend
optimization: tests/conftest.py lowers it for the rest of the suite (bound by
compiles), while this test is bound by its training steps' run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("optax")

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import json, sys
sys.path.insert(0, "examples")
import train_tiny
steps, implementation, batch = json.loads(sys.argv[1])
print(json.dumps(train_tiny.train(steps=steps, implementation=implementation, batch=batch)))
"""


def _train_in_child(steps, implementation, batch):
    """The example's ``train`` in a child process without the suite's
    ``--xla_backend_optimization_level=0``; returns its losses."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_backend_optimization_level"))
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([steps, implementation, batch])],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"the training child failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("implementation", ["triton", "xla"] if ON_GPU else ["xla"])
def test_tiny_model_learns_recall(implementation, example):
    steps = 300 if ON_GPU else 120
    if ON_GPU:
        losses = example("train_tiny").train(steps=steps, implementation=implementation,
                                             batch=32)
    else:
        losses = _train_in_child(steps, implementation, 32)
    assert np.all(np.isfinite(losses))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f} did not fall"
