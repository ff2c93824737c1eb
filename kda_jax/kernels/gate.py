"""The log-decay numerics shared by every kernel: the in-kernel gate, its
floor, and the non-finite checks (docs/kda.md section 2).

This is the Triton home of these formulas; kda_jax/transforms.py is the JAX
one (the reference, the XLA path and the Triton backward's vjp use it). The
two compute the same thing, function by function, with the same constants
(tests/test_gate_forms.py checks both):

  kernels/gate.py          kda_jax/transforms.py
  log_softplus(x)          log_softplus(x)   log(log(1 + e^x)), finite for finite x
  sigmoid(x)               jax.nn.sigmoid    through e^-|x|: no overflow
  gate(x, A_log, ...)      gate(g, A_log, dt_bias, lower_bound), x = g + dt_bias
  GATE_FLOOR               log_decay's floor

  softplus form:  g = max(-exp(min(A_log + log_softplus(x), log(-GATE_FLOOR))), GATE_FLOOR)
  sigmoid form:   g = LOWER_BOUND * sigmoid(clamp(min(e^A_log, e^88) * x, -30, 30))
                  (without A_log: LOWER_BOUND * sigmoid(x))

Where the two differ in the letter, not in the value: log(1 + y) is _log1p
here (Triton has no portable log1p) and jnp.log1p there; the sigmoid form's
clamp is a select there (so that its gradient is 0 outside, not NaN).
Every log-decay a chunked kernel uses is floored at GATE_FLOOR (exp == 0 in
float32 below about -103.3), as transforms.log_decay floors it.
"""

import triton
import triton.language as tl

GATE_FLOOR = tl.constexpr(-110.0)
LOG_NEG_FLOOR = tl.constexpr(4.700480365792417)  # log(110)
LOG_SOFTPLUS_LINEAR = tl.constexpr(-15.0)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
A_LOG_CAP = tl.constexpr(88.0)
SIGMOID_ARG_CAP = tl.constexpr(30.0)
F32_MAX = tl.constexpr(3.0e38)


@triton.jit
def sigmoid(x):
    """1 / (1 + e^-x), through e^-|x| for either sign of x."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1. / (1. + e), e / (1. + e))


@triton.jit
def _log1p(y):
    """log(1 + y) for y >= 0, accurate for small y: log(u) * y / (u - 1) with
    u = 1 + y rounded (the rounding error of u cancels in the ratio)."""
    u = 1. + y
    return tl.where(u == 1., y, tl.log(u) * (y / (u - 1.)))


@triton.jit
def log_softplus(x):
    """log(log(1 + e^x)): x below -15, log(x) above 20; finite for finite x."""
    b_mid = tl.log(_log1p(tl.exp(tl.minimum(tl.maximum(x, LOG_SOFTPLUS_LINEAR),
                                            SOFTPLUS_THRESHOLD))))
    b_big = tl.log(tl.maximum(x, SOFTPLUS_THRESHOLD))
    return tl.where(x < LOG_SOFTPLUS_LINEAR, x, tl.where(x > SOFTPLUS_THRESHOLD, b_big, b_mid))


@triton.jit
def gate(b_x, b_alog, HAS_A_LOG: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
         LOWER_BOUND: tl.constexpr):
    """Raw gate plus dt_bias ``b_x`` (any shape, float32, not NaN) -> the
    log-decay in [GATE_FLOOR, 0]; ``b_alog`` the head's A_log (float32
    scalar; unused without HAS_A_LOG in the sigmoid form)."""
    if HAS_LOWER_BOUND:
        b_x = tl.minimum(tl.maximum(b_x, -F32_MAX), F32_MAX)
        if HAS_A_LOG:
            b_a = tl.exp(tl.minimum(b_alog, A_LOG_CAP))
            b_x = tl.minimum(tl.maximum(b_x * b_a, -SIGMOID_ARG_CAP), SIGMOID_ARG_CAP)
        b_g = LOWER_BOUND * sigmoid(b_x)
    else:
        b_g = tl.maximum(-tl.exp(tl.minimum(b_alog + log_softplus(b_x), LOG_NEG_FLOOR)),
                         GATE_FLOOR)
    return b_g


@triton.jit
def nonfinite(x):
    """NaN or +-inf, elementwise."""
    return ~(tl.abs(x) < float("inf"))


@triton.jit
def bad_log_decay(b_g, USE_GATE: tl.constexpr):
    """The raw g entries that poison the recurrence: NaN, or +inf without the
    gate (-inf is a full decay; the gate maps +-inf to finite values)."""
    if USE_GATE:
        b_bad = b_g != b_g
    else:
        b_bad = (b_g != b_g) | (b_g == float("inf"))
    return b_bad
