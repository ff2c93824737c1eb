"""A jitted varlen chunk_kda lowered on a CPU for ROCm (gfx950, gfx1250) and CUDA (sm90).

jax-triton compiles each Triton kernel while lowering (Triton builds HIP and
CUDA code objects without a GPU) and hands the result to jaxlib's launcher
module, ``jax._src.lib.gpu_triton``, which a CPU jaxlib lacks. A stand-in for
that module reads the code object (target, wave size, threads it was built
for) and serializes that record as the kernel call, so the checks below read
what the lowered module would launch.

The lowering runs in a child process with a clean environment: this session
imports Triton in interpreter mode (conftest.py), where triton.jit builds
kernels that cannot be compiled. Run this file directly to see the child's
JSON.
"""

from __future__ import annotations

import json
import os
import re
import sys
import zlib

import numpy as np
import pytest

from kda_jax import configs
from kda_jax.bounds import SeqBounds, packed_metadata
from kda_jax.triton import compat
from kda_jax.triton.launch import stand_in

BOUNDS = [0, 1, 1, 17, 40]  # a length-1 and an empty sequence; T = 40
SHAPES = dict(T=40, H=2, K=64, V=64)
# arch -> (platform, lanes per warp on the hardware, compute capability, code object target)
TARGETS = {"gfx950": ("rocm", 64, 95, r"gfx950$"), "gfx1250": ("rocm", 32, 125, r"gfx1250$"),
           "sm90": ("cuda", 32, 90, r"^sm_90a?$")}
# Threads per launcher warp: jaxlib/gpu/vendor.h, kNumThreadsPerWarp (HIP 64, CUDA 32).
LAUNCHER_LANES = {"rocm": 64, "cuda": 32}
# kernel -> its ForwardConfig kernel (bf16 inputs: the "16bit" variant)
KERNELS = {"kda_fwd_prepare_kernel": "prepare", "kda_fwd_state_output_kernel": "state"}


# --------------------------------------------------------------------------- #
# Child process: stand-in launcher, lowering, what the module holds.
# --------------------------------------------------------------------------- #


def _msgpack_after(data: bytes, key: bytes):
    """The msgpack int or string right after ``key`` in an AMDGPU metadata note."""
    i = data.index(key) + len(key)
    tag = data[i]
    if tag < 0x80:
        return tag
    if tag in (0xCC, 0xCD, 0xCE):
        size = {0xCC: 1, 0xCD: 2, 0xCE: 4}[tag]
        return int.from_bytes(data[i + 1:i + 1 + size], "big")
    if 0xA0 <= tag <= 0xBF:
        return data[i + 1:i + 1 + (tag & 0x1F)].decode()
    if tag == 0xD9:
        return data[i + 2:i + 2 + data[i + 1]].decode()
    raise ValueError(f"msgpack tag {tag:#x} after {key!r} is not handled")


def _code_object(binary: str) -> dict:
    """Target, wave size and threads per block of jax-triton's code object: a
    path to a HIP code object (jaxlib reads, then deletes it), or PTX text."""
    if os.path.isfile(binary):
        with open(binary, "rb") as f:
            data = f.read()
        os.remove(binary)
        return dict(target=_msgpack_after(data, b"amdhsa.target"),
                    wave=_msgpack_after(data, b".wavefront_size"),
                    threads=_msgpack_after(data, b".max_flat_workgroup_size"))
    return dict(target=re.search(r"\.target\s+(\w+)", binary).group(1), wave=32,
                threads=int(re.search(r"\.(?:req|max)ntid\s+(\d+)", binary).group(1)))


def _stand_in_launcher():
    import types

    class TritonKernel:
        def __init__(self, name, num_warps, num_ctas, shared_mem_bytes, binary, ttir,
                     compute_capability, *_, **__):
            self.record = dict(kernel=name, launcher_num_warps=num_warps,
                               compute_capability=compute_capability, **_code_object(binary))

    class TritonKernelCall:
        def __init__(self, kernel, grid_0, grid_1, grid_2, parameters):
            self.record = dict(kernel.record, grid=[grid_0, grid_1, grid_2])

        def to_proto(self, name, metadata):
            return json.dumps(self.record).encode()

    def no_device(*_):
        raise RuntimeError("the stand-in launcher has no device; the arch must come "
                           "from kda_jax.configs.target_arch")

    return types.SimpleNamespace(
        TritonKernel=TritonKernel, TritonKernelCall=TritonKernelCall,
        create_array_parameter=lambda *a: a, create_scalar_parameter=lambda *a: a,
        get_arch_details=no_device, get_compute_capability=no_device,
        get_serialized_metadata=no_device)


def _module_contents(module) -> dict:
    from jax._src.lib.mlir import ir

    calls, i32_constants, ops = [], [], set()

    def visit(op):
        op = op.operation
        ops.add(op.name)
        if op.name == "stablehlo.custom_call":
            config = ir.StringAttr(op.attributes["backend_config"]).value_bytes
            calls.append(dict(json.loads(zlib.decompress(config)),
                              target_name=ir.StringAttr(op.attributes["call_target_name"]).value))
        elif op.name == "stablehlo.constant":
            ty = ir.RankedTensorType(op.result.type)
            if ty.rank > 0 and str(ty.element_type) == "i32":
                i32_constants.append(list(ir.DenseIntElementsAttr(op.attributes["value"])))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return dict(calls=calls, i32_constants=i32_constants, ops=sorted(ops))


def _child(archs) -> dict:
    import jax._src.lib

    jax._src.lib.gpu_triton = _stand_in_launcher()  # before jax_triton imports it
    try:
        import jax_triton  # noqa: F401
        import triton.backends.amd.compiler  # noqa: F401
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as e:
        return {"skip": f"jax-triton or a Triton GPU backend is not importable: {e}"}
    import jax
    import jax.numpy as jnp

    import kda_jax

    t, h, k, v = (SHAPES[n] for n in "THKV")
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    specs = (bf16(1, t, h, k), bf16(1, t, h, k), bf16(1, t, h, v), bf16(1, t, h, k), bf16(1, t, h))
    cu_seqlens = np.array(BOUNDS, np.int32)
    out = {}
    for arch in archs:
        def step(q, k, v, g, beta):  # a new function per arch: jax caches per function
            return kda_jax.chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens,
                                     implementation="triton")[0]

        with configs.target_arch(arch):
            lowered = jax.jit(step).trace(*specs).lower(lowering_platforms=(TARGETS[arch][0],))
            out[arch] = _module_contents(lowered.compiler_ir("stablehlo"))
    return out


# --------------------------------------------------------------------------- #
# Tests.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def lowered():
    # Imported here, not at the top: the child runs this file as a script and
    # must not import conftest (it turns interpret mode on without a GPU).
    from conftest import run_lowering_child

    return run_lowering_child(__file__, list(TARGETS))


@pytest.mark.parametrize("arch", list(TARGETS))
def test_kernels_compiled_for_the_target(lowered, arch):
    platform, lanes, cc, built_for = TARGETS[arch]
    calls = lowered[arch]["calls"]
    assert sorted(c["kernel"] for c in calls) == sorted(KERNELS), calls
    config = configs.FORWARD[arch]
    for call in calls:
        what = f"{arch} {call['kernel']}"
        assert call["target_name"] == "triton_kernel_call", what
        assert re.search(built_for, call["target"]), f"{what}: built for {call['target']}"
        assert call["compute_capability"] == cc, what
        assert call["wave"] == lanes, f"{what}: wave {call['wave']}"
        warps = getattr(config, KERNELS[call["kernel"]])["16bit"].warps
        assert call["threads"] == warps * lanes, f"{what}: built for {call['threads']} threads"
        launched = call["launcher_num_warps"] * LAUNCHER_LANES[platform]
        assert launched == call["threads"], (
            f"{what}: the launcher starts {launched} threads for a kernel built for "
            f"{call['threads']}")


@pytest.mark.parametrize("arch", list(TARGETS))
def test_varlen_metadata_is_one_int32_constant(lowered, arch):
    expected = packed_metadata(SeqBounds(np.array(BOUNDS)), 64).buffer.tolist()
    unread = np.asarray(stand_in(np.int32)).tolist()  # an index pointer no kernel reads
    assert [c for c in lowered[arch]["i32_constants"] if c != unread] == [expected]


@pytest.mark.parametrize("arch", list(TARGETS))
def test_no_xla_kernel_around_the_triton_kernels(lowered, arch):
    # Stand-in arguments are constants of the program: a jnp.zeros there was a
    # kernel launch of its own per call (seen around the decode kernel).
    assert "stablehlo.broadcast_in_dim" not in lowered[arch]["ops"]


def _optimized_hlo(constant) -> str:
    """XLA's optimized program (this machine's backend) of a call that takes
    ``constant`` as an operand, as a kernel's pointer argument is taken."""
    import jax

    def step():
        return jax.pure_callback(lambda c: np.zeros((), np.float32),
                                 jax.ShapeDtypeStruct((), np.float32), constant)

    return jax.jit(step).lower().compile().as_text()


def test_stand_ins_stay_literals_after_xla_optimizes():
    # XLA's simplifier turns a constant whose elements are all equal into a
    # broadcast (and arange-like values into an iota): on the GPU, a kernel
    # launch per call beside the Triton kernel, which the StableHLO check above
    # cannot see. The stand-ins must reach the call as literals.
    for dtype in (np.float32, np.int32):
        text = _optimized_hlo(stand_in(dtype))
        assert re.search(r"constant\(\{1, 0, 0, 0\}\)", text), text
        assert not re.search(r"broadcast|iota", text), text
    # The check fails on the kinds of constant it guards against.
    import jax.numpy as jnp

    assert re.search(r"broadcast", _optimized_hlo(jnp.asarray(np.zeros(4, np.float32))))


def test_wave32_launcher_warps():
    assert [compat.warp_size(a) for a in ("gfx942", "gfx950", "gfx1250", "sm90")] == [64, 64, 32, 32]
    assert compat.launcher_num_warps(4, "gfx1250") == 2
    assert compat.launcher_num_warps(4, "gfx950") == 4
    with pytest.raises(ValueError, match=r"num_warps=1 on gfx1250 is 32 threads"):
        compat.launcher_num_warps(1, "gfx1250")
    assert [compat.hip_compute_capability(a) for a in ("gfx950", "gfx1250", "gfx90a")] == [95, 125, 90]
    with pytest.raises(ValueError, match=r"arch='sm90' is not an AMD GPU name"):
        compat.hip_compute_capability("sm90")


def test_target_arch_chooses_the_config():
    assert configs.explicit_arch() is None
    with configs.target_arch("gfx1250"):
        assert configs.current_arch() == "gfx1250"
        assert configs.forward_config() == configs.FORWARD["gfx1250"]
    assert configs.explicit_arch() is None
    for bad in ("default", "gfx90a"):
        with pytest.raises(ValueError, match=f"arch='{bad}' is not a target"):
            with configs.target_arch(bad):
                pass


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:] or list(TARGETS))))
