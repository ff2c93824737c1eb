"""The optional input transforms of KDA (KDA_SPEC section 2), in float32 jax.numpy.

Shared by the reference and the XLA path; each is a few elementwise lines and
the Triton kernels implement the same formulas in-kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def softplus(x: jax.Array) -> jax.Array:
    """log(1 + exp(x)), and x itself above 20 (as fla's kernels do)."""
    safe = jnp.minimum(x, SOFTPLUS_THRESHOLD)
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(safe)))


def gate(
    g: jax.Array,
    A_log: jax.Array | None,
    dt_bias: jax.Array | None,
    lower_bound: float | None,
) -> jax.Array:
    """The in-kernel gate: raw g ``[..., HV, K]`` -> log-decay g_eff <= 0, float32.

    ``A_log`` is ``[HV]``, ``dt_bias`` ``[HV * K]`` (or None).
    """
    hv, k = g.shape[-2:]
    x = g.astype(jnp.float32)
    if dt_bias is not None:
        x = x + dt_bias.astype(jnp.float32).reshape(hv, k)
    if lower_bound is None:
        a = jnp.exp(A_log.astype(jnp.float32))[:, None]
        return -a * softplus(x)
    if A_log is not None:
        x = jnp.exp(A_log.astype(jnp.float32))[:, None] * x
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
    """Applies every enabled transform; returns float32 (q, k, g_eff, beta)."""
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
