"""examples/kimi_tiny.py: a tiny KDA decoder (Flax NNX) trained with optax, then
generating with caches (bucketed varlen prefill into pools + a jitted decode
loop); the cached generation must equal recomputing every prefix without a
cache. Few steps on the CPU (XLA path); the Triton path on a GPU."""

from __future__ import annotations


import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("flax.nnx")

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")



@pytest.mark.parametrize("implementation", ["triton", "xla"] if ON_GPU else ["xla"])
def test_kimi_tiny_trains_and_generates_with_caches(implementation, example):
    script = example("kimi_tiny")
    steps = 300 if ON_GPU else 30
    model, losses = script.train(steps=steps, implementation=implementation, batch=16)
    assert np.all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.85 * first, f"loss {first:.3f} -> {last:.3f} did not fall"
    prompts, _ = script.copy_prompts(np.random.default_rng(2), 3)
    cached = script.generate(model, prompts, 4, slots=5)
    np.testing.assert_array_equal(cached, script.generate_without_cache(model, prompts, 4))
