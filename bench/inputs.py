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


def serving_length_sets(base, count, seed=0, jitter=64):
    """``count`` distinct length lists for a serving benchmark: ``base``
    permuted, each prefill (length > 1) moved by up to ``jitter`` tokens either
    way. N stays len(base) and the total within sum(base) + jitter per prefill,
    so every set lands in one bucket."""
    rng = np.random.default_rng(seed)
    base = np.asarray(base, np.int64)
    out, seen = [], set()
    for _ in range(100 * count):
        lens = rng.permutation(base)
        prefill = lens > 1
        lens[prefill] += rng.integers(-jitter, jitter + 1, size=int(prefill.sum()))
        lens = np.maximum(lens, 1)
        key = tuple(int(x) for x in lens)
        if key not in seen:
            seen.add(key)
            out.append(list(key))
        if len(out) == count:
            return out
    raise ValueError(f"could not draw {count} distinct length sets from {base.tolist()}")


def add_step_arguments(p):
    """The command-line options the serving and decode benchmarks share: timing repeats,
    heads and head size, kda_jax's implementation, and whether fla's columns run."""
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kda-impl", default="triton", choices=("triton", "xla"))
    p.add_argument("--no-fla", action="store_true")
