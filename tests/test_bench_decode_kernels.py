"""bench.decode_kernels_torch launches kda_jax's decode kernel from PyTorch with
its own argument list: checked here against the kernel and the glue, so that a
change to either shows on a CPU rather than in a GPU call."""

from __future__ import annotations

import inspect

import triton.language as tl

from bench import decode_kernels_torch as bench_torch
from kda_jax import configs
from kda_jax.options import KdaOptions
from kda_jax.triton.recurrent import recurrent_constexprs


def test_constexprs_are_the_glues_for_a_dense_decode_step():
    h, d, bv = 32, 128, 32
    glue = recurrent_constexprs(
        h=h, hv=h, kd=d, vd=d, opts=KdaOptions(scale=d ** -0.5, output_final_state=True),
        config=configs.RecurrentConfig(block_v=bv), has_a_log=False, has_dt_bias=False,
        has_initial_state=True, indexed_state=False, uniform_len=1)
    assert bench_torch.dense_decode_constexprs(h, d, bv) == glue


def test_the_kernel_loads_without_kda_jax_and_takes_those_arguments():
    kernel = bench_torch.kda_kernels().kda_fused_recurrent_kernel
    params = inspect.signature(kernel.fn).parameters  # a JITFunction or, here, interpreted
    names = list(params)
    constexprs = set(bench_torch.dense_decode_constexprs(4, 16, 16))
    assert constexprs == {n for n, p in params.items() if p.annotation is tl.constexpr}
    # 17 positional arguments: 15 inputs and scalars, then o and ht.
    assert names[:17][-2:] == ["o", "ht"] and len(names) - len(constexprs) == 17
