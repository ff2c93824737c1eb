"""Launch-config tables: per-arch choice, chunk-32 entries, overrides, bad values."""

import dataclasses

import pytest

from kda_jax import configs


@pytest.mark.parametrize("arch", configs.ARCHS)
def test_every_arch_has_every_kernel_family(arch):
    for chunk in (32, 64):
        assert isinstance(configs.forward_config(arch, chunk), configs.ForwardConfig)
        assert isinstance(configs.backward_config(arch, chunk), configs.BackwardConfig)
    assert isinstance(configs.recurrent_config(arch), configs.RecurrentConfig)


def test_chunk_32_entries_apply_only_at_chunk_32():
    assert configs.forward_config("sm90", 32) == configs.FORWARD_C32["sm90"]
    assert configs.forward_config("sm90", 64) == configs.FORWARD["sm90"]
    assert configs.forward_config("sm90", 32) != configs.forward_config("sm90", 64)
    assert configs.backward_config("sm90", 32) == configs.BACKWARD_C32["sm90"]
    assert configs.forward_config("gfx950", 32) == configs.FORWARD["gfx950"]


@pytest.mark.parametrize("family", ["FORWARD", "FORWARD_C32", "BACKWARD", "BACKWARD_C32",
                                    "RECURRENT"])
def test_tables_write_every_field_for_every_arch(family):
    """Each table has every arch, and every entry is a full config: no field
    is None (nothing stands in for another field)."""
    import dataclasses

    table = getattr(configs, family)
    assert set(table) == set(configs.ARCHS)
    for arch, config in table.items():
        for field in dataclasses.fields(config):
            assert getattr(config, field.name) is not None, (family, arch, field.name)


def test_a_chunk_size_without_a_table_is_named():
    with pytest.raises(ValueError, match="chunk_size=16 has no ForwardConfig table"):
        configs.forward_config("sm90", 16)


def test_override_is_scoped_to_the_with_block():
    mine = configs.ForwardConfig(prepare_block_k=16, prepare_warps=2)
    with configs.override(mine):
        assert configs.forward_config("sm90") is mine
        assert configs.forward_config("gfx950", 32) is mine
    assert configs.forward_config("sm90") == configs.FORWARD["sm90"]


def test_override_takes_one_config_of_each_kind():
    """One with block for several kinds; each table back to its own after it."""
    fwd = configs.ForwardConfig(prepare_block_k=16)
    bwd = configs.BackwardConfig(intra_block_k=16)
    rec = configs.RecurrentConfig()
    seg = configs.SegmentConfig(segment_chunks=2)
    with configs.override(fwd, bwd, rec, seg) as chosen:
        assert chosen == (fwd, bwd, rec, seg)
        assert configs.forward_config("sm90") is fwd and configs.backward_config("sm90") is bwd
        assert configs.recurrent_config("sm90") is rec and configs.segment_config("sm90") is seg
    assert configs.backward_config("sm90") == configs.BACKWARD["sm90"]
    assert configs.segment_config("sm90") == configs.SEGMENTS["sm90"]


@pytest.mark.parametrize("args, error, match", [
    ((3,), TypeError, "config must be a ForwardConfig, BackwardConfig, RecurrentConfig or "
                      "SegmentConfig, got int: 3"),
    ((configs.ForwardConfig(), configs.ForwardConfig()), ValueError,
     "two ForwardConfigs given to override"),
    ((), ValueError, r"override\(\) needs a config"),
])
def test_override_refuses_what_is_not_one_config_per_kind(args, error, match):
    with pytest.raises(error, match=match):
        with configs.override(*args):
            pass


def test_unknown_arch_is_named():
    with pytest.raises(ValueError, match="arch='sm75' has no ForwardConfig"):
        configs.forward_config("sm75")


@pytest.mark.parametrize("kwargs, message", [
    (dict(prepare_block_k=24), "prepare_block_k=24 must be a power of two"),
    (dict(state_block_v_wide=8), "state_block_v_wide=8 must be a power of two"),
    (dict(prepare_warps=3), "prepare_warps=3 must be one of"),
    (dict(state_warps_wide=6), "state_warps_wide=6 must be one of"),
    (dict(state_stages=0), "state_stages=0 must be one of"),
    (dict(prepare_dot="fp16"), "prepare_dot='fp16' must be one of"),
    (dict(fp32_dot="tf64"), "fp32_dot='tf64' must be one of"),
    (dict(inverse_dot="tf16"), "inverse_dot='tf16' must be one of"),
    (dict(inverse_dot="bf16"), "inverse_dot='bf16' must be 'ieee', 'tf32x3', 'tf32', 'bf16x3' or 'bf16x6'"),
    (dict(state_warps_fp32=3), "state_warps_fp32=3 must be one of"),
    (dict(state_block_v_fp32=None), "state_block_v_fp32=None must be a power of two"),
    (dict(prepare_block_k_fp32=48), "prepare_block_k_fp32=48 must be a power of two"),
    (dict(prepare_split=1), "prepare_split=1 must be True or False"),
    (dict(prepare_split_fp32=None), "prepare_split_fp32=None must be True or False"),
])
def test_forward_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        configs.ForwardConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(wy_dot="tf64"), "wy_dot='tf64' must be one of"),
    (dict(wy_dot_fp32="tf32"), "wy_dot_fp32='tf32' must be 'ieee', 'tf32x3' or 'bf16x6'"),
    (dict(inverse_dot="bf16"), "inverse_dot='bf16' must be 'ieee', 'tf32x3', 'tf32', 'bf16x3' or 'bf16x6'"),
    (dict(prepare_block_k_fp32=24), "prepare_block_k_fp32=24 must be a power of two"),
    (dict(inter_block_v_fp32=8), "inter_block_v_fp32=8 must be a power of two"),
    (dict(state_stages_fp32=0), "state_stages_fp32=0 must be one of"),
    (dict(dstate_split_k=1), "dstate_split_k=1 must be True or False"),
    (dict(prepare_split="yes"), "prepare_split='yes' must be True or False"),
])
def test_backward_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        configs.BackwardConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_v=12), "block_v=12 must be a power of two"),
    (dict(block_v_wide=4), "block_v_wide=4 must be a power of two"),
    (dict(block_v_bounds=48), "block_v_bounds=48 must be a power of two"),
    (dict(warps=3), "warps=3 must be one of"),
])
def test_recurrent_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        configs.RecurrentConfig(**kwargs)


@pytest.mark.parametrize("kd, bv", [(128, 64), (100, 64), (129, 32), (256, 32)])
def test_decode_v_block_narrows_past_k_128(kd, bv):
    from kda_jax.options import KdaOptions
    from kda_jax.triton.recurrent import recurrent_constexprs

    config = configs.RecurrentConfig(block_v=64, block_v_bounds=64, block_v_wide=32)
    c = recurrent_constexprs(h=2, hv=2, kd=kd, vd=128, opts=KdaOptions(scale=0.1), config=config,
                             has_a_log=False, has_dt_bias=False, has_initial_state=True,
                             indexed_state=False)
    assert c["BV"] == bv


@pytest.mark.parametrize("kd, uniform_len, bv", [
    (128, 1, 64),      # the dense decode: host bounds, one length
    (128, None, 16),   # bounds loaded from metadata (varlen, bucketed, serving)
    (256, None, 32),   # past K = 128 the wide block wins over both
    (256, 1, 32),
])
def test_decode_v_block_with_loaded_bounds(kd, uniform_len, bv):
    from kda_jax.options import KdaOptions
    from kda_jax.triton.recurrent import recurrent_constexprs

    config = configs.RecurrentConfig(block_v=64, block_v_wide=32, block_v_bounds=16)
    c = recurrent_constexprs(h=2, hv=2, kd=kd, vd=128, opts=KdaOptions(scale=0.1), config=config,
                             has_a_log=False, has_dt_bias=False, has_initial_state=True,
                             indexed_state=True, uniform_len=uniform_len)
    assert c["BV"] == bv and c["UNIFORM"] == (uniform_len is not None)


@pytest.mark.parametrize("work, expected", [("bfloat16", "tf32"), ("float32", "tf32x3")])
def test_float32_inputs_merge_the_inverse_at_fp32_dot(work, expected):
    """A tf32 merge is a 16-bit inputs' choice: float32 inputs take fp32_dot."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.forward import forward_launches

    config = configs.ForwardConfig(inverse_dot="tf32", fp32_dot="tf32x3")
    prepare, _ = forward_launches(h=2, hv=2, kd=64, vd=64, opts=KdaOptions(scale=0.125), config=config,
                                  work=jnp.dtype(work), has_a_log=False, has_dt_bias=False,
                                  has_initial_state=False)
    assert prepare.constexprs["DOT_INV"] == expected


@pytest.mark.parametrize("work, split, bv, warps", [("bfloat16", False, 32, 4),
                                                    ("float32", True, 16, 2)])
def test_float32_values_apply_to_float32_intermediates_only(work, split, bv, warps):
    """The *_fp32 fields and the state's two K halves (K > 64) take effect with
    float32 intermediates; 16-bit ones keep the 16-bit values."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.backward import backward_launches, recompute_launch
    from kda_jax.triton.forward import forward_launches

    opts = KdaOptions(scale=0.1)
    fwd = configs.ForwardConfig(state_warps=4, state_block_v=32, state_block_v_wide=32,
                                state_warps_fp32=2, state_block_v_fp32=16)
    _, state = forward_launches(h=2, hv=2, kd=100, vd=64, opts=opts, config=fwd,
                                work=jnp.dtype(work), has_a_log=False, has_dt_bias=False,
                                has_initial_state=True)
    assert state.constexprs["SPLIT_K"] is split and state.num_warps == warps
    assert state.constexprs["BK"] == (64 if split else 128) and state.constexprs["BV"] == bv
    bwd = configs.BackwardConfig(inter_block_v=32, inter_block_v_fp32=16, state_stages=2,
                                 state_stages_fp32=1, dstate_stages=2, dstate_stages_fp32=1,
                                 prepare_block_k=64, prepare_block_k_fp32=32,
                                 prepare_warps=8, prepare_stages=3, prepare_warps_fp32=4,
                                 prepare_stages_fp32=1, prepare_split=False,
                                 prepare_split_fp32=True, dstate_split_k=False,
                                 wy_block_k=32, wy_block_k_fp32=16)
    launches = backward_launches(h=2, hv=2, kd=100, vd=64, opts=opts, config=bwd,
                                 has_initial_state=True, has_final_grad=True,
                                 work=jnp.dtype(work))
    state, dstate = launches["kda_bwd_state_kernel"], launches["kda_bwd_dstate_kernel"]
    assert state.constexprs["SPLIT_K"] is split and not dstate.constexprs["SPLIT_K"]
    assert dstate.constexprs["BK"] == 128
    assert launches["kda_bwd_inter_kernel"].constexprs["BV"] == bv
    assert launches["kda_bwd_wy_kernel"].constexprs["BK"] == (16 if split else 32)
    assert state.num_stages == dstate.num_stages == (1 if split else 2)
    prepare = recompute_launch(h=2, hv=2, kd=100, vd=64, opts=opts, config=bwd,
                               work=jnp.dtype(work))
    assert prepare.constexprs["BK"] == (32 if split else 64)
    assert prepare.constexprs["SPLIT_PASSES"] is split
    assert (prepare.num_warps, prepare.num_stages) == ((4, 1) if split else (8, 3))


@pytest.mark.parametrize("work, mode", [("bfloat16", "tf32"), ("float16", "tf32x3"),
                                        ("float32", "ieee")])
def test_product_precisions_follow_the_intermediates_dtype(work, mode):
    """The intra kernel's and the wy kernel's precisions: product_dot / wy_dot
    for bfloat16 intermediates, the *_fp16 fields for float16 ones (a tighter
    bar), the *_fp32 fields for float32 ones."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.backward import backward_launches

    bwd = configs.BackwardConfig(product_dot="tf32", product_dot_fp16="tf32x3",
                                 product_dot_fp32="ieee", wy_dot="tf32", wy_dot_fp16="tf32x3",
                                 wy_dot_fp32="ieee")
    launches = backward_launches(h=2, hv=2, kd=64, vd=64, opts=KdaOptions(scale=0.1),
                                 config=bwd, has_initial_state=False, has_final_grad=False,
                                 work=jnp.dtype(work))
    assert launches["kda_bwd_intra_kernel"].constexprs["DOT_A"] == mode
    assert launches["kda_bwd_wy_kernel"].constexprs["DOT_X"] == mode


def test_split_bf16_modes_are_valid_and_run_as_ieee_in_the_interpreter(monkeypatch):
    """bf16x3 / bf16x6 are accepted where their accuracy fits (not for the
    float32-grade fields but bf16x6), and Triton's interpreter, which knows
    only ieee/tf32/tf32x3, gets "ieee" for them."""
    import dataclasses

    from kda_jax.triton.launch import dot_precision

    base = configs.BackwardConfig()
    for mode in ("bf16x3", "bf16x6"):
        cfg = dataclasses.replace(base, product_dot=mode, wy_dot=mode, inverse_dot=mode)
        assert cfg.product_dot == mode
    dataclasses.replace(base, wy_dot_fp32="bf16x6")
    with pytest.raises(ValueError, match="float32-grade"):
        dataclasses.replace(base, wy_dot_fp32="bf16x3")
    monkeypatch.setenv("KDA_JAX_INTERPRET", "1")
    assert dot_precision("bf16x3") == dot_precision("bf16x6") == "ieee"
    assert dot_precision("tf32") == "tf32"
    monkeypatch.setenv("KDA_JAX_INTERPRET", "0")
    assert dot_precision("bf16x3") == "bf16x3"
    with pytest.raises(ValueError, match="'fp16'.*one of ieee"):
        dot_precision("fp16")


@pytest.mark.parametrize("version, ok", [("3.5.0+rocm7.0.0", False), ("3.5.1", False),
                                         ("3.6.0", True), ("3.10.0rc1", True)])
def test_split_bf16_modes_need_triton_3_6(monkeypatch, version, ok):
    """A Triton before 3.6 (a ROCm stack's own build, say) cannot compile
    bf16x3 / bf16x6: the launch names the floor and the fix instead of failing
    inside Triton; other modes are unaffected."""
    import triton

    from kda_jax.triton.launch import dot_precision

    monkeypatch.setenv("KDA_JAX_INTERPRET", "0")
    monkeypatch.setattr(triton, "__version__", version)
    assert dot_precision("ieee") == "ieee"
    if ok:
        assert dot_precision("bf16x6") == "bf16x6"
    else:
        with pytest.raises(RuntimeError, match=r"'bf16x3' products.*triton>=3\.6"):
            dot_precision("bf16x3")


@pytest.mark.parametrize("work, kd, vd, want", [
    ("bfloat16", 128, 128, 16), ("float32", 128, 128, 32), ("float32", 64, 64, 32),
    ("float32", 100, 60, 16), ("float32", 128, 60, 16), ("float32", 100, 128, 16)])
def test_float32_state_passes_take_their_own_v_block(work, kd, vd, want):
    """sm90's state passes: 16-wide V blocks with 16-bit intermediates, 32 with
    float32 ones, but 16 where K or V is not a power of two (32 spills there)."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.backward import backward_launches

    launches = backward_launches(h=2, hv=2, kd=kd, vd=vd, opts=KdaOptions(scale=0.1),
                                 config=configs.BACKWARD["sm90"], has_initial_state=False,
                                 has_final_grad=False, work=jnp.dtype(work))
    for name in ("kda_bwd_state_kernel", "kda_bwd_dstate_kernel"):
        assert launches[name].constexprs["BV"] == want, name
