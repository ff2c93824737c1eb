"""The static options of one KDA call, as one hashable value every backend takes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KdaOptions:
    """Everything about a call that is fixed at trace time, except the bounds.

    Hashable, so it can be a ``jax.jit`` static argument. Built and checked by
    :mod:`kda_jax.api`; backends trust it.
    """

    scale: float
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    lower_bound: float | None = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False
    chunk_size: int = 64

    def transform_flags(self, A_log, dt_bias) -> dict:
        """Keyword arguments for :func:`kda_jax.transforms.prepare_inputs`."""
        return dict(
            use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=self.use_gate_in_kernel,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=self.lower_bound,
            use_beta_sigmoid_in_kernel=self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval=self.allow_neg_eigval,
        )
