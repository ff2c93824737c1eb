"""bench.decode_kernels_torch launches kda_jax's decode kernel from PyTorch with
its own argument list: checked here against the kernel and the glue, so that a
change to either shows on a CPU rather than in a GPU call."""

from __future__ import annotations

import inspect

import pytest
import triton.language as tl

from bench import decode_kernels_torch as bench_torch
from kda_jax import configs
from kda_jax.options import KdaOptions
from kda_jax.triton.recurrent import recurrent_constexprs


@pytest.mark.parametrize("form", ["dense", "pool"])
def test_constexprs_are_the_glues_for_a_decode_step(form):
    h, d, bv = 32, 128, 32
    pool = form == "pool"
    glue = recurrent_constexprs(
        h=h, hv=h, kd=d, vd=d, opts=KdaOptions(scale=d ** -0.5, output_final_state=True),
        config=configs.RecurrentConfig(block_v=bv), has_a_log=False, has_dt_bias=False,
        has_initial_state=True, indexed_state=pool, uniform_len=None if pool else 1)
    assert bench_torch.decode_constexprs(h, d, bv, form) == glue
    with pytest.raises(ValueError, match="form='paged' must be one of"):
        bench_torch.decode_constexprs(h, d, bv, "paged")


def test_variants_name_kernel_directories(tmp_path):
    assert bench_torch.variants_of(None) == {"kda_jax": bench_torch.KERNELS_DIR}
    (tmp_path / "fused_recurrent.py").write_text("")
    got = bench_torch.variants_of(f"old={tmp_path}")
    assert got == {"kda_jax": bench_torch.KERNELS_DIR, "old": str(tmp_path)}
    with pytest.raises(ValueError, match="must be NAME=DIR"):
        bench_torch.variants_of(f"kda_jax={tmp_path}")
    with pytest.raises(ValueError, match="holds no fused_recurrent.py"):
        bench_torch.variants_of(f"empty={tmp_path / 'nothing'}")


def test_a_variant_loads_as_its_own_package(tmp_path):
    # A copy of the kernels directory (as `git archive` of a past commit gives)
    # loads beside the checkout's, each under its own package name.
    import shutil

    copy = tmp_path / "kernels"
    shutil.copytree(bench_torch.KERNELS_DIR, copy)
    ours = bench_torch.kda_kernels()
    other = bench_torch.kda_kernels(str(copy), "kda_kernels_copy")
    assert other is not ours and other.__file__.startswith(str(copy))
    assert list(inspect.signature(other.kda_fused_recurrent_kernel.fn).parameters) == list(
        inspect.signature(ours.kda_fused_recurrent_kernel.fn).parameters)


def test_the_kernel_loads_without_kda_jax_and_takes_those_arguments():
    kernel = bench_torch.kda_kernels().kda_fused_recurrent_kernel
    params = inspect.signature(kernel.fn).parameters  # a JITFunction or, here, interpreted
    names = list(params)
    constexprs = set(bench_torch.decode_constexprs(4, 16, 16))
    assert constexprs == {n for n, p in params.items() if p.annotation is tl.constexpr}
    # 17 positional arguments: 15 inputs and scalars, then o and ht.
    assert names[:17][-2:] == ["o", "ht"] and len(names) - len(constexprs) == 17


def test_a_variant_from_before_a_constexpr_gets_only_its_own():
    def old_kernel(q, k, H: tl.constexpr, SEQ_LEN: tl.constexpr):  # no LOOP_STAGES
        pass

    consts = bench_torch.decode_constexprs(4, 16, 16)
    assert consts["LOOP_STAGES"] == 2
    assert bench_torch.kernel_constexprs(old_kernel, consts) == {"H": 4, "SEQ_LEN": 1}
    kernel = bench_torch.kda_kernels().kda_fused_recurrent_kernel
    assert bench_torch.kernel_constexprs(kernel, consts) == consts
