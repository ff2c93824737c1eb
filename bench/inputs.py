"""Benchmark inputs (NumPy only, so a PyTorch peer can import them without JAX).

The sweeps (bench.forward, bench.backward) draw their inputs with :func:`make_gated`
at one of five gate regimes, and every library gets the same arrays. x ~ N(0, 1) per
[token, head, channel]; dt ~ logU(1e-3, 1e-1) per [head, channel] and dt_bias =
softplus^-1(dt) (the initialisation of fla's KimiDeltaAttention layer, as Mamba's):

- ``init``: g = -5 sigmoid(x + dt_bias), a layer's safe gate at initialisation (lower bound
  -5, A_log = 0; about -0.16 a token): headline;
- ``softplus``: g = -exp(A_log) softplus(x + dt_bias), A_log = log U(1, 16) per head (the
  layer's default gate; about -0.33 a token, steep on some heads): headline;
- ``layer``: the init gate computed in the kernel from the raw x (A_log = 0, dt_bias, lower
  bound -5), with the q/k L2 norm and the beta sigmoid in the kernel too (:func:`options`
  gives each library's flags): headline, what a model layer calls;
- ``mild``: g = logsigmoid(x) / 16 (fla's benchmark gates, about -0.05 a token): comparison;
- ``strong``: g = -5 sigmoid(exp(A_log) (x + dt_bias)), A_log = log U(1, 16), dt_bias ~
  U(-0.5, 0.5) (about -2.5 a token: every chunk forgets everything): robustness.

The precomputed regimes pass L2-normalised q and k and beta = sigmoid(b) in (0, 1); layer
passes the raw q, k, b and x of the same draws, so layer and init compute the same function.
"""

import numpy as np

GATES = ("init", "softplus", "layer", "mild", "strong")
# The regimes whose log-decays are bounded by LOWER_BOUND (fla's safe_gate path).
BOUNDED = ("init", "layer", "strong")
LOWER_BOUND = -5.0
SIGMOID_ARG_CAP = 30.0  # sigmoid is 0 or 1 in float32 beyond it (as kda_jax.transforms)


def make(b, t, h, kd, vd, seed=0):
    """The serving, decode and tuning benchmarks' inputs: normalised q, k; g = -exp(U(-5, -0.7))."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, kd), np.float32)
    k = rng.standard_normal((b, t, h, kd), np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, vd), np.float32)
    g = -np.exp(rng.uniform(-5, -0.7, (b, t, h, kd))).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (b, t, h)).astype(np.float32)
    return q, k, v, g, beta


def safe_gate(x, A_log, dt_bias, lower_bound=LOWER_BOUND):
    """lower_bound * sigmoid(exp(A_log) * (x + dt_bias)) in float32: x [..., H, K], A_log [H],
    dt_bias [H, K]."""
    z = np.exp(A_log.astype(np.float32))[:, None] * (x + dt_bias).astype(np.float32)
    z = np.clip(z, -SIGMOID_ARG_CAP, SIGMOID_ARG_CAP)
    return (np.float32(lower_bound) / (1 + np.exp(-z))).astype(np.float32)


def softplus_gate(x, A_log, dt_bias):
    """-exp(A_log) * softplus(x + dt_bias) in float32 (softplus through log1p(e^-|z|))."""
    z = (x + dt_bias).astype(np.float32)
    sp = np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z)))
    return (-np.exp(A_log.astype(np.float32))[:, None] * sp).astype(np.float32)


def init_dt_bias(rng, h, kd):
    """softplus^-1(dt), dt ~ logU(1e-3, 1e-1) per [H, K]: fla's KimiDeltaAttention (and
    Mamba's) initialisation, dt + log(-expm1(-dt))."""
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (h, kd)))
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)


def make_gated(b, t, h, kd, vd, gates="init", seed=0) -> dict:
    """float32 inputs of one gate regime: q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K],
    beta [B, T, H]; layer adds A_log [H] (zeros) and dt_bias [H, K]. The draws do not depend
    on ``gates``, only their transforms do."""
    if gates not in GATES:
        raise ValueError(f"gates={gates!r}: one of {GATES}")
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, np.float32)
    q, k, v, x, b_raw = (normal(b, t, h, kd), normal(b, t, h, kd), normal(b, t, h, vd),
                         normal(b, t, h, kd), normal(b, t, h))
    A_log = np.log(rng.uniform(1, 16, h)).astype(np.float32)
    strong_bias = rng.uniform(-0.5, 0.5, (h, kd)).astype(np.float32)
    dt_bias = init_dt_bias(rng, h, kd)
    zero_log = np.zeros(h, np.float32)
    if gates == "layer":
        return dict(q=q, k=k, v=v, g=x, beta=b_raw, A_log=zero_log, dt_bias=dt_bias)
    if gates == "mild":
        g = (np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))) / 16
    elif gates == "init":
        g = safe_gate(x, zero_log, dt_bias)
    elif gates == "softplus":
        g = softplus_gate(x, A_log, dt_bias)
    else:
        g = safe_gate(x, A_log, strong_bias)
    l2 = lambda a: a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-b_raw))
    return dict(q=l2(q), k=l2(k), v=v, g=g.astype(np.float32), beta=beta.astype(np.float32))


def options(gates: str, library: str) -> dict:
    """Each library's keyword flags for a regime ("kda_jax", "fla" or "cudnn"); A_log and
    dt_bias (layer) the caller passes in its own layout: kda_jax and fla take dt_bias
    [H * K], cuDNN [H, K]. fla gets safe_gate=True for the bounded gates (its M=16 path);
    cuDNN takes the precomputed log-decays as they are and reads layer's safe gate from the
    raw g with safe_gate=True."""
    if gates not in GATES or library not in ("kda_jax", "fla", "cudnn"):
        raise ValueError(f"gates={gates!r}, library={library!r}: one of {GATES}, one of "
                         "kda_jax, fla, cudnn")
    bounded = {"fla": dict(safe_gate=True)}.get(library, {}) if gates in BOUNDED else {}
    if gates != "layer":
        return bounded
    in_kernel = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if library == "cudnn":
        return dict(in_kernel, safe_gate=True, gate_lower_bound=LOWER_BOUND)
    return {**in_kernel, **bounded, "use_gate_in_kernel": True, "lower_bound": LOWER_BOUND}


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
