"""Benchmark inputs (NumPy only, so a PyTorch peer can import them without JAX)."""

import numpy as np


def make(b, t, h, kd, vd, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, kd), np.float32)
    k = rng.standard_normal((b, t, h, kd), np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, vd), np.float32)
    g = -np.exp(rng.uniform(-5, -0.7, (b, t, h, kd))).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (b, t, h)).astype(np.float32)
    return q, k, v, g, beta
