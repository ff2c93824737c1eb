"""The optional input transforms of KDA (docs/kda.md section 2), in float32 jax.numpy.

Shared by the reference, the XLA path and the Triton backward (which
differentiates them). The kernels compute the same formulas with the same
constants in Triton (``kda_jax/kernels/gate.py``, whose docstring lists the two side
by side; tests/test_gate_forms.py checks that they agree).

Numerics of the log-decay. A per-token log-decay below about -103.3 already
gives exp(g) == 0 in float32, so every path floors the log-decay it uses at
``GATE_FLOOR`` (-110): no float32 result of the recurrence changes, -inf
becomes finite, and a chunk-local cumsum stays within BT * 110. The gradient
through the floor is 0 where the recurrence's is exp(g) * ... == 0 too. The
in-kernel gate is written so that it never overflows:
``-exp(A_log) * softplus(x) = -exp(min(A_log + log(softplus(x)), log 110))``
with a log-softplus that is finite for every finite x, and the sigmoid form
takes a product ``exp(A_log) * x`` clamped to [-30, 30] (sigmoid is 0 or 1 in
float32 beyond it) with ``exp(A_log)`` capped at e^88 (finite).

Non-finite inputs (:func:`sanitize`): entries that would make the recurrence
non-finite (NaN or +-inf in q, k, v; NaN or +inf in a log-decay g; NaN in a
raw gate; NaN or +-inf in beta, NaN only before a sigmoid) are replaced by 0,
and the tokens that held one are flagged so that the XLA path (chunked and
token by token) and the reference can poison outputs and states from that
token on, explicitly, instead of through 0 * NaN products that would reach
earlier tokens too (docs/kda.md section 6: one rule for every path).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6
# Floor of every log-decay the kernels and the XLA path use: exp(-110) == 0 in float32.
GATE_FLOOR = -110.0
LOG_NEG_FLOOR = math.log(-GATE_FLOOR)
# log(softplus(x)) is x below this (softplus(x) = e^x (1 - e^x / 2 ...), and
# e^x < 3.1e-7 there) and log(x) above SOFTPLUS_THRESHOLD (softplus(x) - x < 2.1e-9).
LOG_SOFTPLUS_LINEAR = -15.0
SOFTPLUS_THRESHOLD = 20.0
# The sigmoid form: exp(A_log) is capped below float32's overflow, and its
# product with x clamped where sigmoid is already 0 or 1 in float32.
A_LOG_CAP = 88.0
SIGMOID_ARG_CAP = 30.0
_F32_MAX = 3.0e38


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def log_softplus(x: jax.Array) -> jax.Array:
    """log(log(1 + e^x)), float32, finite for every finite x (-inf / +inf at
    x = -inf / +inf). Each branch sees only inputs where it is accurate
    (double where), so the gradient is finite everywhere too."""
    lin = x < LOG_SOFTPLUS_LINEAR
    big = x > SOFTPLUS_THRESHOLD
    mid = jnp.clip(x, LOG_SOFTPLUS_LINEAR, SOFTPLUS_THRESHOLD)
    x_lin = jnp.where(lin, x, LOG_SOFTPLUS_LINEAR)
    x_big = jnp.where(big, x, SOFTPLUS_THRESHOLD)
    return jnp.where(lin, x_lin, jnp.where(big, jnp.log(x_big), jnp.log(jnp.log1p(jnp.exp(mid)))))


def log_decay(g: jax.Array) -> jax.Array:
    """The log-decay the chunked paths use: g floored at GATE_FLOOR, float32
    (-inf -> GATE_FLOOR; the gradient is 0 below the floor)."""
    return jnp.maximum(g.astype(jnp.float32), GATE_FLOOR)


def gate(
    g: jax.Array,
    A_log: jax.Array | None,
    dt_bias: jax.Array | None,
    lower_bound: float | None,
) -> jax.Array:
    """The in-kernel gate: raw g ``[..., HV, K]`` -> log-decay g_eff in
    [GATE_FLOOR, 0], float32. Finite with finite gradients for every finite
    A_log and dt_bias and every non-NaN g (including +-inf).

    ``A_log`` is ``[HV]``, ``dt_bias`` ``[HV * K]`` (or None).
    """
    hv, k = g.shape[-2:]
    x = g.astype(jnp.float32)
    if dt_bias is not None:
        x = x + dt_bias.astype(jnp.float32).reshape(hv, k)
    if lower_bound is None:
        # -exp(A_log) * softplus(x), in the log domain; the exponent's cap is the floor.
        z = A_log.astype(jnp.float32)[:, None] + log_softplus(x)
        return jnp.maximum(-jnp.exp(jnp.minimum(z, LOG_NEG_FLOOR)), GATE_FLOOR)
    x = jnp.clip(x, -_F32_MAX, _F32_MAX)
    if A_log is not None:
        a = jnp.exp(jnp.minimum(A_log.astype(jnp.float32), A_LOG_CAP))[:, None]
        inside = jnp.abs(x * a) <= SIGMOID_ARG_CAP
        x = jnp.where(inside, jnp.where(inside, x, 0.0) * a, jnp.sign(x) * SIGMOID_ARG_CAP)
    return jnp.float32(lower_bound) * jax.nn.sigmoid(x)


def beta_transform(beta: jax.Array, use_sigmoid: bool, allow_neg_eigval: bool) -> jax.Array:
    """beta as used by the delta rule, float32: sigmoid if asked, then x2 if allowed."""
    b = beta.astype(jnp.float32)
    if use_sigmoid:
        b = jax.nn.sigmoid(b)
    if allow_neg_eigval:
        b = b * 2.0
    return b


def prepare_inputs(q, k, g, beta, *, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                   A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval):
    """Applies every enabled transform; returns float32 (q, k, g_eff, beta).
    g_eff is not floored here (the reference uses g as given): see log_decay."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    else:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_gate_in_kernel:
        g = gate(g, A_log, dt_bias, lower_bound)
    else:
        g = g.astype(jnp.float32)
    beta = beta_transform(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return q, k, g, beta


def _zeroed(x, bad):
    """x with the ``bad`` entries replaced by 0: the cotangent of a bad entry
    is 0 (a plain select, no 0 * NaN)."""
    return jnp.where(bad, jnp.zeros((), x.dtype), x)


def _bad_entries(q, k, v, g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel):
    """The entries that would make the recurrence non-finite, as element masks."""
    nonfinite = lambda x: ~jnp.isfinite(x)
    q_bad, k_bad, v_bad = nonfinite(q), nonfinite(k), nonfinite(v)
    g_bad = jnp.isnan(g) if use_gate_in_kernel else (jnp.isnan(g) | (g == jnp.inf))
    b_bad = jnp.isnan(beta) if use_beta_sigmoid_in_kernel else nonfinite(beta)
    return q_bad, k_bad, v_bad, g_bad, b_bad


def _flags(h, hv, q_bad, k_bad, v_bad, g_bad, b_bad):
    """(poison, q_bad) per token and value head from the element masks."""
    per_head = lambda bad: jnp.repeat(jnp.any(bad, axis=-1), hv // h, axis=-1)
    poison = per_head(k_bad) | jnp.any(v_bad, axis=-1) | jnp.any(g_bad, axis=-1) | b_bad
    return poison, per_head(q_bad)


def nonfinite_flags(q, k, v, g, beta, *, use_gate_in_kernel: bool,
                    use_beta_sigmoid_in_kernel: bool):
    """:func:`sanitize`'s ``(poison, q_bad)`` alone, bool ``[..., HV]``."""
    masks = _bad_entries(q, k, v, g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
    return _flags(q.shape[-2], v.shape[-2], *masks)


def sanitize(q, k, v, g, beta, *, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool):
    """Raw inputs -> (q, k, v, g, beta, poison, q_bad) with every entry that
    would make the recurrence non-finite replaced by 0 (see the module
    docstring for which). Shapes as the API's, any leading axes.

    ``poison`` bool ``[..., HV]``: the token holds such an entry in k (of its
    q/k head), v, g or beta: the recurrence's state is non-finite from it on.
    ``q_bad`` bool ``[..., HV]``: q of the token's q/k head holds one: only
    that token's output is non-finite.
    """
    masks = _bad_entries(q, k, v, g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
    poison, q_bad = _flags(q.shape[-2], v.shape[-2], *masks)
    zeroed = (_zeroed(x, bad) for x, bad in zip((q, k, v, g, beta), masks))
    return (*zeroed, poison, q_bad)
