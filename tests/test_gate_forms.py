"""The in-kernel gate in Triton (kda_jax/kernels/gate.py) and in JAX
(kda_jax.transforms) agree: the same constants, and the same log-decay for
every form on hostile inputs (+-inf, +-3e38, the branch edges of the
log-softplus, A_log far past exp's range). Interpreter on a CPU, native on a GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from kda_jax import transforms
from kda_jax.triton.launch import kernels, launch, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"Triton path unavailable: {unavailable_reason()}")

GATE = kernels("gate")

# Raw gate values x = g + dt_bias: the infinities, float32's edge, the
# log-softplus branch edges (-15, 20) on both sides, and ordinary values.
X = np.array([-np.inf, -3.3e38, -1e30, -1e4, -100., -30., -15.5, -15., -14.9, -5., -1.,
              -1e-3, -1e-30, 0., 1e-30, 1e-3, 0.5, 1., 5., 19.9, 20., 20.5, 30., 88.,
              1e4, 1e30, 3.3e38, np.inf, 2.5, -2.5, 1e-8, 7.], np.float32)
A_LOG = np.array([-100., -20., -1., 0., 0.5, 3., 20., 88., 100.], np.float32)


@triton.jit
def _gate_table(x, a_log, out, N: tl.constexpr, HAS_A_LOG: tl.constexpr,
                HAS_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """Row i: the gate of every x at A_log[i]."""
    i = tl.program_id(0)
    o_n = tl.arange(0, N)
    b_g = GATE.gate(tl.load(x + o_n), tl.load(a_log + i), HAS_A_LOG, HAS_LOWER_BOUND,
                    LOWER_BOUND)
    tl.store(out + i * N + o_n, b_g)


def test_constants_are_the_same():
    for name in ("GATE_FLOOR", "LOG_NEG_FLOOR", "LOG_SOFTPLUS_LINEAR", "SOFTPLUS_THRESHOLD",
                 "A_LOG_CAP", "SIGMOID_ARG_CAP"):
        assert getattr(GATE, name).value == getattr(transforms, name), name
    assert GATE.LOG_NEG_FLOOR.value == pytest.approx(math.log(-transforms.GATE_FLOOR), rel=1e-15)
    assert GATE.F32_MAX.value == transforms._F32_MAX


@pytest.mark.filterwarnings("ignore:overflow encountered")  # x * e^A_log, clamped after
@pytest.mark.parametrize("lower_bound, has_a_log", [(None, True), (-5.0, True), (-0.5, False)])
def test_kernel_gate_matches_transforms_gate(lower_bound, has_a_log):
    g, = launch(_gate_table, jnp.asarray(X), jnp.asarray(A_LOG), grid=(len(A_LOG), 1, 1),
                out_shape=[jax.ShapeDtypeStruct((len(A_LOG), len(X)), jnp.float32)],
                name="gate_table", num_warps=1, num_stages=1, N=len(X), HAS_A_LOG=has_a_log,
                HAS_LOWER_BOUND=lower_bound is not None,
                LOWER_BOUND=float(lower_bound if lower_bound is not None else 0.0))
    g = np.asarray(g)
    # transforms.gate takes g [..., HV, K]: one head per A_log, K = the x values.
    want = np.asarray(transforms.gate(jnp.broadcast_to(jnp.asarray(X), (len(A_LOG), len(X))),
                                      jnp.asarray(A_LOG) if has_a_log else None, None,
                                      lower_bound))
    assert np.isfinite(g).all() and (g <= 0).all() and (g >= transforms.GATE_FLOOR).all()
    # A few ulps: exp and log differ in the last bits between the two.
    np.testing.assert_allclose(g, want, rtol=4e-6, atol=1e-35)
