"""examples/train_tiny.py: a tiny KDA model trained with optax inside jax.jit;
the loss must fall. On CPU through the XLA path (briefly); on a GPU through
the Triton path (its custom_vjp), the whole 300 steps."""

from __future__ import annotations


import jax
import numpy as np
import pytest

pytest.importorskip("optax")

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")



@pytest.mark.parametrize("implementation", ["triton", "xla"] if ON_GPU else ["xla"])
def test_tiny_model_learns_recall(implementation, example):
    script = example("train_tiny")
    steps = 300 if ON_GPU else 120
    losses = script.train(steps=steps, implementation=implementation, batch=32)
    assert np.all(np.isfinite(losses))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f} did not fall"
