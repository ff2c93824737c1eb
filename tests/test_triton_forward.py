"""The Triton forward against the float32 reference.

On a GPU the kernels run natively through jax-triton; without one, conftest.py
sets KDA_JAX_INTERPRET=1 and the same kernels run in Triton's interpreter
through the same glue (small shapes only: the interpreter is slow).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import configs, reference, testing
from kda_jax.bounds import SeqBounds, packed_metadata
from kda_jax.triton import interpret_mode, unavailable_reason
from kda_jax.triton.launch import stand_in
from guards import no_device_reads
from kda_jax.testing import CASES
from reference_suite import ReferenceSuite, reference as suite_reference

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"Triton path unavailable: {unavailable_reason()}"
)
ON_GPU = not interpret_mode()



class TestTriton(ReferenceSuite):
    """The Triton path (tests/reference_suite.py): every case on a GPU, the
    interpreter's small ones without one (chunk_kda only there: the decode
    kernel's token loop takes minutes a case in the interpreter, whose decode
    cases are tests/test_triton_recurrent.py's). Its final states meet the
    input dtype's bar: 16-bit intermediates (w, u, qg, kt) round the state's
    updates. Float32 inputs' gradients meet 1e-3 on a GPU: the backward's
    products there are split-bf16 or tf32, not float32 (the in-kernel gate's
    parameters' need the split-bf16 products of the shipped sm90 config)."""

    implementation = "triton"

    @classmethod
    def takes(cls, case) -> bool:
        return ON_GPU or "interpret" in case.tags

    @classmethod
    def takes_recurrent(cls, case) -> bool:
        return ON_GPU

    @classmethod
    def state_tolerance(cls, case) -> str:
        return case.dtype

    @classmethod
    def grad_tolerance(cls, case, name) -> float:
        if ON_GPU and case.dtype == "float32":
            return 1e-3
        return super().grad_tolerance(case, name)


@pytest.mark.skipif(not ON_GPU, reason="the AMD configs' product precisions need a GPU")
@pytest.mark.parametrize("arch", ["gfx950", "gfx1250", "gfx942"])
@pytest.mark.parametrize("case", [c for c in CASES if c.id.startswith(("big-", "gate-", "l2norm"))],
                         ids=str)
def test_amd_configs_forward_on_this_gpu(arch, case, check_close):
    """An AMD arch's forward config (tiles, warps, bf16 / split-bf16 products)
    forced on this GPU meets the same bars as this device's own."""
    x, ro, rs = suite_reference(case)
    with configs.override(configs.forward_config(arch, case.C)):
        o, s = kda_jax.chunk_kda(*x.args(), chunk_size=case.C, implementation="triton",
                                 **case.kwargs(x))
    check_close(o, ro, case.tolerance("o"), f"o {arch}", kind="o")
    if rs is not None:
        check_close(s, rs, case.dtype, f"final_state {arch}", kind="final_state")


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_varlen_with_empty_and_short_sequences(chunk_size, check_close):
    lens = [0, 1, 0, 70, 1, 33, 0] if ON_GPU else [0, 1, 0, 40, 1, 0]
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(5, T=int(cu[-1]), K=32, V=32, N=len(lens), gate_floor=-1000.0)
    o, s = kda_jax.chunk_kda(*x.args(), initial_state=x.initial_state, output_final_state=True,
                             cu_seqlens=cu, chunk_size=chunk_size, implementation="triton")
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, cu_seqlens=cu)
    check_close(o, ro, "float32-extreme-gates", "o")
    check_close(s, rs, "float32-extreme-gates", "final_state")
    for i, n in enumerate(lens):
        if n == 0:  # an empty sequence keeps its initial state, bit for bit
            np.testing.assert_array_equal(np.asarray(s[i]), x.initial_state[i])


def test_all_sequences_empty():
    x = testing.make_inputs(1, T=0, K=32, V=32, N=3)
    o, s = kda_jax.chunk_kda(*x.args(), initial_state=x.initial_state, output_final_state=True,
                             cu_seqlens=[0, 0, 0, 0], implementation="triton")
    assert o.shape == (1, 0, 2, 32)
    np.testing.assert_array_equal(np.asarray(s), x.initial_state)


@pytest.mark.parametrize("v_first", [False, True])
def test_split_state_with_a_pool(v_first, check_close):
    """The two K halves of the state read from and written to a pool's rows
    (a padding index reads zeros and writes nothing)."""
    hv, kd, vd, slots = 2, 100, 16, 4
    x = testing.make_inputs(11, B=2, T=40, H=1, HV=hv, K=kd, V=vd, with_state=False)
    rng = np.random.default_rng(12)
    pool = (0.5 * rng.standard_normal((slots, hv) + ((vd, kd) if v_first else (kd, vd)))
            ).astype(np.float32)
    idx = np.array([2, -1])
    o, new = kda_jax.chunk_kda_pool(*x.args(), pool, kda_jax.PoolRows(idx),
                                    state_v_first=v_first, implementation="triton")
    h0 = np.zeros((2,) + pool.shape[1:], np.float32)
    h0[0] = pool[2]
    ro, rs = reference.naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True,
                                           state_v_first=v_first)
    check_close(o, ro, "float32", "o")
    check_close(np.asarray(new)[2], rs[0], "float32", "final_state")
    for r in (0, 1, 3):
        np.testing.assert_array_equal(np.asarray(new[r]), pool[r], err_msg=f"row {r} changed")


def _varlen_step(lens):
    cu = np.cumsum([0] + lens)
    x = testing.make_inputs(7, T=int(cu[-1]), K=32, V=32, N=len(lens), dtype=jnp.bfloat16)
    args = [jax.device_put(a) for a in (*x.args(), x.initial_state)]

    @jax.jit
    def step(q, k, v, g, beta, h0, bounds):
        return kda_jax.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 cu_seqlens=bounds, implementation="triton")

    return step, args, SeqBounds(cu), x


def test_jitted_varlen_makes_no_device_to_host_transfer():
    step, args, bounds, _ = _varlen_step([3, 0, 40, 1])
    jax.block_until_ready(step(*args, bounds))  # compile outside the guard
    with no_device_reads(strict=not interpret_mode()):
        o, s = step(*args, bounds)
        jax.block_until_ready((o, s))
    if interpret_mode():
        return  # the interpreter path copies to the host by design
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(step(*args, bounds))


@pytest.mark.skipif(not ON_GPU, reason="inspects the jax-triton lowering (GPU only)")
def test_lowered_program_holds_metadata_as_one_int32_constant():
    lens = [3, 0, 40, 1]
    step, args, bounds, _ = _varlen_step(lens)
    text = step.lower(*args, bounds).as_text()
    consts = re.findall(r"stablehlo\.constant (dense<[^>]*>) : tensor<(\d+)xi32>", text)
    meta = packed_metadata(bounds, 64).buffer
    # launch.stand_in stands for an index pointer no kernel reads.
    unread = np.asarray(stand_in(np.int32)).tolist()
    is_stand_in = lambda v: [int(x) for x in re.findall(r"-?\d+", v)] == unread
    assert [n for v, n in consts if not is_stand_in(v)] == [str(meta.size)], consts
