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


def _values(config, where=""):
    """(path, value) of every leaf value of a config."""
    if isinstance(config, configs.Variants) or isinstance(config, dict):
        for key, value in config.items():
            yield from _values(value, f"{where}.{key}")
    elif dataclasses.is_dataclass(config):
        for field in dataclasses.fields(config):
            yield from _values(getattr(config, field.name), f"{where}.{field.name}")
    else:
        yield where, config


@pytest.mark.parametrize("family", ["FORWARD", "FORWARD_C32", "BACKWARD", "BACKWARD_C32",
                                    "RECURRENT", "SEGMENTS"])
def test_tables_write_every_value_for_every_arch(family):
    """Each table has every arch, and every entry is a full config: no value
    is None but a forced segment length (nothing stands in for another)."""
    table = getattr(configs, family)
    assert set(table) == set(configs.ARCHS)
    for arch, config in table.items():
        for path, value in _values(config):
            assert value is not None or path == ".segment_chunks", (family, arch, path)


def test_a_chunk_size_without_a_table_is_named():
    with pytest.raises(ValueError, match="chunk_size=16 has no ForwardConfig table"):
        configs.forward_config("sm90", 16)


def test_override_is_scoped_to_the_with_block():
    mine = configs.replace(configs.FORWARD["default"], "prepare.*.warps", 2)
    with configs.override(mine):
        assert configs.forward_config("sm90") is mine
        assert configs.forward_config("gfx950", 32) is mine
    assert configs.forward_config("sm90") == configs.FORWARD["sm90"]


def test_override_takes_one_config_of_each_kind():
    """One with block for several kinds; each table back to its own after it."""
    fwd = configs.replace(configs.FORWARD["default"], "prepare.*.block_k", 16)
    bwd = configs.replace(configs.BACKWARD["default"], "intra.*.block_k", 16)
    rec = configs.RECURRENT["default"]
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
    ((configs.FORWARD["sm90"], configs.FORWARD["default"]), ValueError,
     "two ForwardConfigs given to override"),
    ((), ValueError, r"override\(\) needs a config"),
])
def test_override_refuses_what_is_not_one_config_per_kind(args, error, match):
    with pytest.raises(error, match=match):
        with configs.override(*args):
            pass


def test_configs_are_hashable_and_equal_by_value():
    """Family configs key the jit cache: equal values hash equal."""
    again = configs.replace(configs.FORWARD["sm90"], "prepare.16bit.warps",
                            configs.FORWARD["sm90"].prepare["16bit"].warps)
    assert again == configs.FORWARD["sm90"] and hash(again) == hash(configs.FORWARD["sm90"])
    assert again != configs.FORWARD["default"]
    assert len({configs.BACKWARD[a] for a in configs.ARCHS}) == len(configs.ARCHS)


def test_unknown_arch_is_named():
    with pytest.raises(ValueError, match="arch='sm75' has no ForwardConfig"):
        configs.forward_config("sm75")


_PREPARE = dict(block_k=16, warps=4, stages=1, dot="ieee", wu_dot="ieee", inverse_dot="ieee")


@pytest.mark.parametrize("kind, kwargs, message", [
    (configs.PrepareConfig, dict(_PREPARE, block_k=24),
     "PrepareConfig: block_k=24 must be a power of two >= 16"),
    (configs.PrepareConfig, dict(_PREPARE, warps=3), "PrepareConfig: warps=3 must be one of"),
    (configs.PrepareConfig, dict(_PREPARE, stages=0), "PrepareConfig: stages=0 must be one of"),
    (configs.PrepareConfig, dict(_PREPARE, dot="fp16"), "dot='fp16' must be one of"),
    (configs.PrepareConfig, dict(_PREPARE, inverse_dot="bf16"),
     "inverse_dot='bf16' must be one of 'ieee', 'tf32x3', 'tf32', 'bf16x3', 'bf16x6'"),
    (configs.PrepareConfig, dict(_PREPARE, split=1), "split=1 must be True or False"),
    (configs.PrepareConfig, dict(_PREPARE, batched_l1=None), "batched_l1=None must be True or"),
    (configs.StateConfig, dict(block_v=8, warps=4, stages=1),
     "StateConfig: block_v=8 must be a power of two >= 16"),
    (configs.StateConfig, dict(block_v=16, warps=6, stages=1), "warps=6 must be one of"),
    (configs.StateConfig, dict(block_v=16, warps=4, stages=1, dot="tf64"), "dot='tf64'"),
    (configs.StateConfig, dict(block_v=16, warps=4, stages=1, split_k=1), "split_k=1 must be"),
    (configs.BlockConfig, dict(block_k=16, block_v=48, warps=4, dot="ieee"),
     "BlockConfig: block_v=48 must be a power of two"),
    (configs.IntraConfig, dict(block_k=16, warps=4, dot="bf15"), "IntraConfig: dot='bf15'"),
    (configs.FoldConfig, dict(block_j=16, warps=4, dot="tf32"),
     "FoldConfig: dot='tf32' must be one of 'ieee', 'tf32x3', 'bf16x3', 'bf16x6'"),
    (configs.FoldConfig, dict(block_j=24, warps=4, dot="ieee"), "block_j=24 must be a power"),
    (configs.DecodeConfig, dict(block_v=12, warps=4, stages=2), "block_v=12 must be a power"),
    (configs.DecodeConfig, dict(block_v=16, warps=4, stages=0), "stages=0 must be >= 1"),
    (configs.SegmentRule, dict(min_programs=-1), "SegmentRule: min_programs=-1 must be >= 0"),
    (configs.SegmentRule, dict(min_segment_chunks=0), "min_segment_chunks=0 must be >= 1"),
    (configs.SegmentConfig, dict(segment_chunks=0), "segment_chunks=0 must be >= 1"),
    (configs.SegmentConfig, dict(min_segments=1), "min_segments=1 must be >= 2"),
    (configs.SegmentConfig, dict(xla=1), "xla=1 must be True or False"),
    (configs.SegmentConfig, dict(forward=8), "forward=8 must be a SegmentRule"),
])
def test_kernel_configs_refuse_bad_values(kind, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kind(**kwargs)


def test_families_refuse_missing_or_unknown_variants():
    """A family names the kernel and the variant that is missing, unknown or
    of the wrong type, and the wide state variants must run one stage."""
    fwd = configs.FORWARD["default"]
    no_fp32 = {"16bit": fwd.prepare["16bit"]}
    with pytest.raises(ValueError, match="ForwardConfig: prepare=.* lacks a variant for float32"):
        dataclasses.replace(fwd, prepare=no_fp32)
    with pytest.raises(ValueError, match="has the variant 'fp64'"):
        dataclasses.replace(fwd, prepare=dict(fwd.prepare, fp64=fwd.prepare["fp32"]))
    with pytest.raises(ValueError, match=r"prepare\['fp32'\]=.* must be a PrepareConfig"):
        dataclasses.replace(fwd, prepare=dict(fwd.prepare, fp32=fwd.state["fp32"]))
    narrow = {k: v for k, v in fwd.state.items() if k != "fp32_wide"}
    with pytest.raises(ValueError, match="lacks a '_wide' variant for float32"):
        dataclasses.replace(fwd, state=narrow)
    two = dict(fwd.state, fp32_wide=dataclasses.replace(fwd.state["fp32_wide"], stages=2))
    with pytest.raises(ValueError, match=r"state\['fp32_wide'\].stages=2 must be 1"):
        dataclasses.replace(fwd, state=two)
    bwd = configs.BACKWARD["default"]
    with pytest.raises(ValueError, match="wy\\['fp32'\\].dot='bf16x3' must be one of 'ieee', "
                                         "'tf32x3', 'bf16x6'"):
        configs.replace(bwd, "wy.fp32.dot", "bf16x3")
    with pytest.raises(ValueError, match="RecurrentConfig: decode=.* must be a dict with the "
                                         "variants dense, varlen, wide"):
        configs.RecurrentConfig(decode={"dense": configs.RECURRENT["default"].decode["dense"]})


@pytest.mark.parametrize("keys, work, kd, want", [
    (("16bit", "fp32"), "bfloat16", 128, "16bit"),
    (("16bit", "fp32"), "float16", 256, "16bit"),
    (("16bit", "fp32"), "float32", 256, "fp32"),
    (("16bit", "16bit_wide", "fp32", "fp32_wide"), "bfloat16", 129, "16bit_wide"),
    (("16bit", "16bit_wide", "fp32", "fp32_wide"), "float32", 256, "fp32_wide"),
    (("16bit", "16bit_wide", "fp32", "fp32_wide"), "float32", 128, "fp32"),
    (("bf16", "fp16", "fp32"), "float16", 64, "fp16"),
    (("16bit", "fp16", "fp32"), "bfloat16", 64, "16bit"),
])
def test_variant_key_takes_the_most_specific_variant(keys, work, kd, want):
    assert configs.variant_key(dict.fromkeys(keys), work, kd) == want


def test_variant_key_names_what_it_tried():
    with pytest.raises(KeyError, match=r"no variant for float32 intermediates at K = 64: tried "
                                       r"\['fp32', 'fp32'\]"):
        configs.variant_key({"16bit": 1}, "float32", 64)
    with pytest.raises(ValueError, match="work='int8' must be one of"):
        configs.variant_key({"16bit": 1}, "int8", 64)


def test_replace_walks_kernels_variants_and_fields():
    fwd = configs.FORWARD["sm90"]
    one = configs.replace(fwd, "prepare.16bit.warps", 4)
    assert one.prepare["16bit"].warps == 4 and one.prepare["fp32"] == fwd.prepare["fp32"]
    every = configs.replace(fwd, "prepare.*.batched_l1", True)
    assert all(c.batched_l1 for c in every.prepare.values())
    assert configs.replace(fwd, "fold.block_j", 16).fold.block_j == 16
    seg = configs.replace(configs.SEGMENTS["sm90"], "backward.min_programs", 0)
    assert seg.backward.min_programs == 0 and seg.forward == configs.SEGMENTS["sm90"].forward
    for path, message in (("prepare.16bit.wraps", "PrepareConfig has no field 'wraps'"),
                          ("prepare.fp64.warps", "no variant 'fp64'; have 16bit, fp32"),
                          ("prepare.16bit", "names a variant, not a field"),
                          ("fold.block_j.x", "128 has no field .x."),
                          ("prepare.16bit.warps", "warps=3 must be one of")):
        with pytest.raises(ValueError, match=message):
            configs.replace(fwd, path, 3)


def _decode(**block_v):
    """A RecurrentConfig with these V blocks per variant (2 warps, 2 stages)."""
    return configs.RecurrentConfig(decode={k: configs.DecodeConfig(block_v=bv, warps=2, stages=2)
                                           for k, bv in block_v.items()})


@pytest.mark.parametrize("kd, bv", [(128, 64), (100, 64), (129, 32), (256, 32)])
def test_decode_v_block_narrows_past_k_128(kd, bv):
    from kda_jax.options import KdaOptions
    from kda_jax.triton.recurrent import recurrent_constexprs

    config = _decode(dense=64, varlen=64, wide=32)
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

    config = _decode(dense=64, varlen=16, wide=32)
    c = recurrent_constexprs(h=2, hv=2, kd=kd, vd=128, opts=KdaOptions(scale=0.1), config=config,
                             has_a_log=False, has_dt_bias=False, has_initial_state=True,
                             indexed_state=True, uniform_len=uniform_len)
    assert c["BV"] == bv and c["UNIFORM"] == (uniform_len is not None)


@pytest.mark.parametrize("cast, interpreted, native", [
    ("bits", False, False), ("native", False, True),
    ("native", True, False),  # the interpreter's conversion truncates: always on the bits
])
def test_decode_state_cast(cast, interpreted, native, monkeypatch):
    from kda_jax.options import KdaOptions
    from kda_jax.triton import recurrent

    monkeypatch.setattr(recurrent, "interpret_mode", lambda: interpreted)
    config = configs.RecurrentConfig(decode={k: configs.DecodeConfig(32, 2, 2, state_cast=cast)
                                             for k in ("dense", "varlen", "wide")})
    c = recurrent.recurrent_constexprs(h=2, hv=2, kd=128, vd=128, opts=KdaOptions(scale=0.1),
                                       config=config, has_a_log=False, has_dt_bias=False,
                                       has_initial_state=True, indexed_state=True)
    assert c["NATIVE_CAST"] is native
    with pytest.raises(ValueError, match="state_cast='rtz'.*'bits', 'native'"):
        configs.DecodeConfig(32, 2, 2, state_cast="rtz")


@pytest.mark.parametrize("work, expected", [("bfloat16", "tf32"), ("float32", "tf32x3")])
def test_float32_inputs_merge_the_inverse_at_fp32_dot(work, expected):
    """A tf32 merge is a 16-bit inputs' choice: float32 inputs take their own
    variant's."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.forward import forward_launches

    config = configs.replace(configs.replace(configs.FORWARD["default"], "prepare.16bit.inverse_dot",
                                             "tf32"), "prepare.fp32.inverse_dot", "tf32x3")
    prepare, _ = forward_launches(h=2, hv=2, kd=64, vd=64, opts=KdaOptions(scale=0.125), config=config,
                                  work=jnp.dtype(work), has_a_log=False, has_dt_bias=False,
                                  has_initial_state=False)
    assert prepare.constexprs["DOT_INV"] == expected


@pytest.mark.parametrize("work, split, bv, warps", [("bfloat16", False, 32, 4),
                                                    ("float32", True, 16, 2)])
def test_float32_values_apply_to_float32_intermediates_only(work, split, bv, warps):
    """The "fp32" variants and the state's two K halves (K > 64) take effect
    with float32 intermediates; 16-bit ones keep the "16bit" variants."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.backward import backward_launches, recompute_launch
    from kda_jax.triton.forward import forward_launches

    opts = KdaOptions(scale=0.1)
    S, P, B = configs.StateConfig, configs.PrepareConfig, configs.BlockConfig
    fwd = dataclasses.replace(configs.FORWARD["default"], state={
        "16bit": S(block_v=32, warps=4, stages=2), "16bit_wide": S(block_v=32, warps=4, stages=1),
        "fp32": S(block_v=16, warps=2, stages=2), "fp32_wide": S(block_v=16, warps=2, stages=1)})
    _, state = forward_launches(h=2, hv=2, kd=100, vd=64, opts=opts, config=fwd,
                                work=jnp.dtype(work), has_a_log=False, has_dt_bias=False,
                                has_initial_state=True)
    assert state.constexprs["SPLIT_K"] is split and state.num_warps == warps
    assert state.constexprs["BK"] == (64 if split else 128) and state.constexprs["BV"] == bv
    base = configs.BACKWARD["default"]
    bwd = dataclasses.replace(
        base,
        recompute={"16bit": P(block_k=64, warps=8, stages=3, dot="ieee", wu_dot="ieee",
                              inverse_dot="ieee"),
                   "fp32": P(block_k=32, warps=4, stages=1, dot="ieee", wu_dot="ieee",
                             inverse_dot="ieee", split=True)},
        state=dict(base.state, fp32=S(block_v=32, warps=4, stages=1)),
        dstate=dict(base.dstate, fp32=S(block_v=32, warps=4, stages=1, split_k=False)),
        inter={"16bit": B(block_k=64, block_v=32, warps=4, dot="ieee"),
               "fp32": B(block_k=64, block_v=16, warps=4, dot="ieee")},
        wy={"bf16": B(block_k=32, block_v=32, warps=4, dot="ieee"),
            "fp16": B(block_k=32, block_v=32, warps=4, dot="ieee"),
            "fp32": B(block_k=16, block_v=32, warps=4, dot="ieee")})
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
    """The intra kernel's and the wy kernel's precisions: their "bf16",
    "fp16" (a tighter bar) and "fp32" variants by the intermediates' dtype."""
    import jax.numpy as jnp

    from kda_jax.options import KdaOptions
    from kda_jax.triton.backward import backward_launches

    bwd = configs.BACKWARD["default"]
    for key, each in (("bf16", "tf32"), ("fp16", "tf32x3"), ("fp32", "ieee")):
        bwd = configs.replace(configs.replace(bwd, f"intra.{key}.dot", each), f"wy.{key}.dot", each)
    launches = backward_launches(h=2, hv=2, kd=64, vd=64, opts=KdaOptions(scale=0.1),
                                 config=bwd, has_initial_state=False, has_final_grad=False,
                                 work=jnp.dtype(work))
    assert launches["kda_bwd_intra_kernel"].constexprs["DOT_A"] == mode
    assert launches["kda_bwd_wy_kernel"].constexprs["DOT_X"] == mode


def test_split_bf16_modes_are_valid_and_run_as_ieee_in_the_interpreter(monkeypatch):
    """bf16x3 / bf16x6 are accepted where their accuracy fits (not for the
    float32-grade values but bf16x6), and Triton's interpreter, which knows
    only ieee/tf32/tf32x3, gets "ieee" for them."""
    from kda_jax.triton.launch import dot_precision

    base = configs.BACKWARD["default"]
    for mode in ("bf16x3", "bf16x6"):
        for path in ("intra.bf16.dot", "wy.bf16.dot", "recompute.16bit.inverse_dot"):
            assert configs.as_dict(configs.replace(base, path, mode))[path.split(".")[0]][
                path.split(".")[1]][path.split(".")[2]] == mode
    configs.replace(base, "wy.fp32.dot", "bf16x6")
    with pytest.raises(ValueError, match="float32-grade"):
        configs.replace(base, "wy.fp32.dot", "bf16x3")
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
