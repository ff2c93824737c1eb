"""Inputs, error measures and tolerances shared by the tests, the demo and the benchmarks.

Realistic shapes live here in one list so that tests, benchmarks and tuning see
the same cases.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "KdaInputs",
    "make_inputs",
    "rel_rms",
    "max_abs",
    "TOLERANCES",
    "DENSE_SWEEP",
    "SERVING_LENGTHS",
]

# (B, T, H) of the forward benchmark sweep, K = V = 128, bf16.
DENSE_SWEEP = (
    (1, 8192, 32), (1, 8192, 64), (1, 16384, 32), (1, 32768, 32), (2, 16384, 32),
    (4, 4096, 16), (8, 4096, 16), (8, 2048, 16), (1, 65536, 12),
)
# The serving step of the seed: 12 one-token decodes plus three prefills.
SERVING_LENGTHS = (1,) * 12 + (1100, 1300, 900)

# Relative RMS and max-abs (scaled by the reference's max-abs) against the
# float32 reference, per input dtype.
TOLERANCES = {
    "float32": dict(rel_rms=1e-4, max_abs=1e-3),
    "float16": dict(rel_rms=2e-3, max_abs=2e-2),
    "bfloat16": dict(rel_rms=5e-3, max_abs=5e-2),
    # Gates of -1000 per step. The chunked paths floor the log-decay at -110
    # and take exponents that are differences of the chunk-local cumsum G as
    # partial sums of g, so they meet "float32" here too (measured about 2e-7
    # relative RMS on o, tests/test_gate_extremes.py); the looser entry is
    # kept for the tests that still name it.
    "float32-extreme-gates": dict(rel_rms=1e-3, max_abs=5e-3),
}


@dataclasses.dataclass
class KdaInputs:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    initial_state: np.ndarray | None
    A_log: np.ndarray | None = None
    dt_bias: np.ndarray | None = None

    def args(self):
        return self.q, self.k, self.v, self.g, self.beta


def make_inputs(
    seed: int,
    *,
    B: int = 1,
    T: int = 64,
    H: int = 2,
    HV: int | None = None,
    K: int = 64,
    V: int = 64,
    N: int | None = None,
    dtype=np.float32,
    raw_gate: bool = False,
    beta_logits: bool = False,
    normalized_k: bool = True,
    with_state: bool = True,
    state_v_first: bool = False,
    gate_floor: float | None = None,
) -> KdaInputs:
    """Random KDA inputs in a realistic range.

    k is L2-normalized unless ``normalized_k`` is False (then use the in-kernel
    norm). g is a log-decay in about [-0.5, 0] (or raw gate values with
    ``raw_gate``, plus A_log and dt_bias); ``gate_floor`` forces every 7th
    token's gate to that value (e.g. -1000) to test extreme decay.
    ``dtype`` applies to q, k, v; g, beta and states are float32.
    """
    rng = np.random.default_rng(seed)
    HV = H if HV is None else HV
    N = B if N is None else N
    q = rng.standard_normal((B, T, H, K), dtype=np.float32)
    k = rng.standard_normal((B, T, H, K), dtype=np.float32)
    if normalized_k:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V), dtype=np.float32)
    A_log = dt_bias = None
    if raw_gate:
        g = rng.standard_normal((B, T, HV, K), dtype=np.float32)
        A_log = rng.uniform(-1.0, 1.0, (HV,)).astype(np.float32)
        dt_bias = (0.1 * rng.standard_normal(HV * K)).astype(np.float32)
    else:
        g = -np.exp(rng.uniform(-5.0, -0.7, (B, T, HV, K))).astype(np.float32)
        if gate_floor is not None:
            g[:, ::7] = np.float32(gate_floor)
    if beta_logits:
        beta = rng.standard_normal((B, T, HV), dtype=np.float32)
    else:
        beta = rng.uniform(0.05, 1.0, (B, T, HV)).astype(np.float32)
    h0 = None
    if with_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        h0 = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    cast = lambda x: x.astype(dtype)
    return KdaInputs(cast(q), cast(k), cast(v), g, beta, h0, A_log, dt_bias)


def _f64(x) -> np.ndarray:
    return np.asarray(np.asarray(x, dtype=np.float32), dtype=np.float64)


def rel_rms(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (0 when both are empty)."""
    a, e = _f64(actual), _f64(expected)
    if e.size == 0:
        return 0.0
    denom = np.sqrt(np.mean(e**2))
    return float(np.sqrt(np.mean((a - e) ** 2)) / max(denom, 1e-30))


def max_abs(actual, expected) -> float:
    """max |actual - expected| / max |expected| (relative max-abs)."""
    a, e = _f64(actual), _f64(expected)
    if e.size == 0:
        return 0.0
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def assert_close(actual, expected, dtype_name: str, what: str = "output"):
    """Asserts relative RMS and relative max-abs within the dtype's tolerance; NaN fails."""
    a = np.asarray(np.asarray(actual, dtype=np.float32))
    if not np.all(np.isfinite(a)):
        raise AssertionError(f"{what}: non-finite values")
    tol = TOLERANCES[dtype_name]
    r, m = rel_rms(actual, expected), max_abs(actual, expected)
    if r > tol["rel_rms"] or m > tol["max_abs"]:
        raise AssertionError(
            f"{what} ({dtype_name}): rel_rms={r:.3e} (tol {tol['rel_rms']:.0e}), "
            f"max_abs={m:.3e} (tol {tol['max_abs']:.0e})"
        )
    return r, m
