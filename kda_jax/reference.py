"""The float32 token-by-token recurrence: ground truth for every test (docs/kda.md section 1).

Deliberately plain: one ``lax.scan`` over the tokens of each sequence, a Python
loop over sequences, no chunking and no tricks. Slow, and meant to be.

Non-finite inputs follow the one rule of every path (docs/kda.md section 6),
stated here explicitly rather than left to IEEE arithmetic (which would poison
only the value column of a +-inf in v, and give +-inf rather than NaN): the
entries that :func:`kda_jax.transforms.sanitize` flags are replaced by 0, and a
flag per sequence and value head, set from the first such token on, puts NaN
on the outputs from that token on and on the final state; a non-finite q puts
NaN on its own token's outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import transforms, vma
from kda_jax.bounds import as_seq_bounds
from kda_jax.checks import check_call

__all__ = ["naive_recurrent_kda"]


def _recurrence(q, k, v, g, beta, poison, q_bad, s0, scale):
    """One sequence, one batch of heads: q, k, g ``[T, HV, K]``, v ``[T, HV, V]``,
    beta, poison, q_bad ``[T, HV]``, s0 ``[HV, K, V]``. Returns o ``[T, HV, V]``
    and the final state."""

    def step(carry, xs):
        s, flag = carry
        q_t, k_t, v_t, g_t, b_t, bad_t, q_bad_t = xs
        s = jnp.exp(g_t)[:, :, None] * s
        kv = jnp.einsum("hk,hkv->hv", k_t, s, precision="highest")
        s = s + b_t[:, None, None] * k_t[:, :, None] * (v_t - kv)[:, None, :]
        o_t = scale * jnp.einsum("hk,hkv->hv", q_t, s, precision="highest")
        flag = flag | bad_t
        o_t = jnp.where((flag | q_bad_t)[:, None], jnp.nan, o_t)
        return (s, flag), o_t

    xs = (q, k, v, g, beta, poison, q_bad)
    flag0 = jnp.zeros(poison.shape[1:], bool)
    # Inside shard_map the carry varies over the inputs' axes.
    (s, flag), o = jax.lax.scan(step, vma.like((s0, flag0), xs), xs)
    return o, jnp.where(flag[:, None, None], jnp.nan, s)


def naive_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens=None,
):
    """KDA by its definition, in float32.

    Args:
      q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]``, HV % H == 0.
      g: ``[B, T, HV, K]`` log-decay (or the raw gate with ``use_gate_in_kernel``).
      beta: ``[B, T, HV]``.
      initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``),
        N = B, or the number of sequences with ``cu_seqlens``.
      cu_seqlens: host bounds ``[N + 1]`` (B must be 1); see ``kda_jax.SeqBounds``.
      Other flags: as :func:`kda_jax.chunk_kda`.

    Returns:
      ``(o, final_state)``: o float32 ``[B, T, HV, V]``; final_state float32 in the
      state layout, or None unless ``output_final_state``.

    Arguments are checked as :func:`kda_jax.chunk_kda`'s (kda_jax.checks).
    """
    opts, _, _ = check_call(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, chunk_size=None,
        cu_seqlens=cu_seqlens, implementation="xla")
    scale = opts.scale
    b, t, h, kd = q.shape
    hv, vd = v.shape[-2:]
    q, k, v, g, beta, poison, q_bad = transforms.sanitize(
        q, k, v, g, beta, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    q, k, g, beta = transforms.prepare_inputs(
        q, k, g, beta,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
    )
    groups = hv // h
    q = jnp.repeat(q, groups, axis=2)
    k = jnp.repeat(k, groups, axis=2)
    v = v.astype(jnp.float32)

    if cu_seqlens is None:
        cu = np.arange(b + 1) * t
        q, k, v, g, beta, poison, q_bad = (x.reshape((1, b * t) + x.shape[2:])
                                           for x in (q, k, v, g, beta, poison, q_bad))
    else:
        cu = as_seq_bounds(cu_seqlens).cu_seqlens
    n = len(cu) - 1

    if initial_state is None:
        h0 = jnp.zeros((n, hv, kd, vd), jnp.float32)
    else:
        h0 = initial_state.astype(jnp.float32)
        if state_v_first:
            h0 = jnp.swapaxes(h0, -1, -2)

    outs, finals = [], []
    for i in range(n):
        lo, hi = int(cu[i]), int(cu[i + 1])
        if hi == lo:
            finals.append(h0[i])
            continue
        o_i, s_i = _recurrence(
            *(x[0, lo:hi] for x in (q, k, v, g, beta, poison, q_bad)), h0[i], scale
        )
        outs.append(o_i)
        finals.append(s_i)
    o = jnp.concatenate(outs, axis=0) if outs else jnp.zeros((0, hv, vd), jnp.float32)
    o = o.reshape(b, t, hv, vd)

    if not output_final_state:
        return o, None
    final = jnp.stack(finals)
    if state_v_first:
        final = jnp.swapaxes(final, -1, -2)
    return o, final
