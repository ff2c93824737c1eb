"""A ROCm device on a CPU host: arch and config selection, the GPU-tier
detection, and the jax-triton compatibility patch (kda_jax.triton.compat),
with the device, jax.default_backend and jax-triton faked.

An MI355X reports platform "rocm", device_kind "AMD Instinct MI355X" and
compute_capability "gfx950" (XLA's PJRT GPU client reports the gfx version
there on ROCm, "major.minor" on CUDA). Nothing here compiles a kernel: the
jax-triton module is a stand-in that records what kda_jax's lowering rules
hand to jax-triton's own rule, and the one real piece of Triton built is its
HIP backend object (no GPU needed).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import types

import jax
import numpy as np
import pytest

from kda_jax import api, configs
from kda_jax.triton import compat, launch

ROCM_ARCHS = ("gfx950", "gfx1250", "gfx942")
TABLES = {"forward": configs.FORWARD, "backward": configs.BACKWARD,
          "recurrent": configs.RECURRENT}
# Written out rather than computed: gfx9 (CDNA) is wave64, gfx10 and newer wave32.
LANES = {"gfx950": 64, "gfx942": 64, "gfx1250": 32, "gfx90a": 64, "gfx1100": 32, "sm90": 32}
HIP_CC = {"gfx950": 95, "gfx942": 94, "gfx1250": 125, "gfx90a": 90, "gfx1100": 110}


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str
    compute_capability: str | None = None


MI355X = FakeDevice("rocm", "AMD Instinct MI355X", "gfx950")
MI300X = FakeDevice("rocm", "AMD Instinct MI300X", "gfx942")
GFX1250 = FakeDevice("rocm", "AMD Radeon gfx1250", "gfx1250")


def _use_device(monkeypatch, device):
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [device])


def _config(table, arch=None):
    return {"forward": configs.forward_config, "backward": configs.backward_config,
            "recurrent": configs.recurrent_config}[table](arch)


# --------------------------------------------------------------------------- #
# Arch and config selection from the device.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("device, arch", [
    (MI355X, "gfx950"),
    (MI300X, "gfx942"),
    (GFX1250, "gfx1250"),
    # compute_capability absent: the device kind decides.
    (FakeDevice("rocm", "gfx950"), "gfx950"),
    # Other AMD parts take the default configs.
    (FakeDevice("rocm", "AMD Instinct MI250X", "gfx90a"), "default"),
    (FakeDevice("rocm", "AMD Radeon RX 7900 XTX", "gfx1100"), "default"),
    # The CUDA side of the same function, for contrast.
    (FakeDevice("gpu", "NVIDIA H200", "9.0"), "sm90"),
    (FakeDevice("cuda", "NVIDIA A100", "8.0"), "default"),
    (FakeDevice("cpu", "cpu"), "default"),
])
def test_current_arch(monkeypatch, device, arch):
    _use_device(monkeypatch, device)
    assert configs.current_arch() == arch


def test_target_arch_wins_over_the_device(monkeypatch):
    _use_device(monkeypatch, MI355X)
    with configs.target_arch("gfx1250"):
        assert configs.current_arch() == "gfx1250"
        assert configs.forward_config() == configs.FORWARD["gfx1250"]
    assert configs.current_arch() == "gfx950"


def test_tables_tell_the_archs_apart():
    # The selection tests below compare with these entries; they would pass
    # by accident if an entry equalled the default or the other wave width's.
    # RECURRENT["gfx1250"] is the default's 4 warps of 32 lanes; its forward
    # and backward entries tell gfx1250 apart.
    for name, table in TABLES.items():
        for arch in ROCM_ARCHS:
            if (name, arch) != ("recurrent", "gfx1250"):
                assert table[arch] != table["default"], (name, arch)
        assert table["gfx950"] != table["gfx1250"], name
    assert configs.RECURRENT["gfx1250"] == configs.RECURRENT["default"]


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("device, arch", [(MI355X, "gfx950"), (MI300X, "gfx942"),
                                          (GFX1250, "gfx1250")])
def test_configs_follow_the_device(monkeypatch, table, device, arch):
    _use_device(monkeypatch, device)
    assert _config(table) == TABLES[table][arch]


def test_chunk_32_keeps_the_amd_entries(monkeypatch):
    # The AMD chunk-32 entries are their chunk-64 ones.
    _use_device(monkeypatch, MI355X)
    assert configs.forward_config(chunk_size=32) == configs.FORWARD["gfx950"]
    assert configs.backward_config(chunk_size=32) == configs.BACKWARD["gfx950"]


# --------------------------------------------------------------------------- #
# Waves: what Triton compiles and what jaxlib's 64-lane launcher starts.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("arch", sorted(LANES))
def test_warp_size(arch):
    assert compat.warp_size(arch) == LANES[arch]


@pytest.mark.parametrize("arch", sorted(HIP_CC))
def test_hip_compute_capability(arch):
    assert compat.hip_compute_capability(arch) == HIP_CC[arch]


@pytest.mark.parametrize("arch", ["MI355X", "gfx95", "sm90", ""])
def test_gfx_version_rejects_other_names(arch):
    with pytest.raises(ValueError, match="not an AMD GPU name"):
        compat.hip_compute_capability(arch)


def test_launcher_warps_wave64_vs_wave32():
    for warps in (1, 2, 4, 8, 16):
        assert compat.launcher_num_warps(warps, "gfx950") == warps
        assert compat.launcher_num_warps(warps, "gfx942") == warps
    for warps in (2, 4, 8, 16):
        assert compat.launcher_num_warps(warps, "gfx1250") == warps // 2
    with pytest.raises(ValueError, match="even num_warps"):
        compat.launcher_num_warps(1, "gfx1250")


@pytest.mark.parametrize("table", list(TABLES))
def test_gfx1250_configs_launch_whole_launcher_warps(table):
    # An odd warp count on a wave32 target cannot be launched by jaxlib's
    # 64-lane ROCm launcher (launcher_num_warps raises at lowering).
    from kda_jax import configs

    flat = configs.as_dict(TABLES[table]["gfx1250"])

    def leaves(value, path=""):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from leaves(item, f"{path}.{key}")
        else:
            yield path, value

    warps = {name: value for name, value in leaves(flat) if name.endswith(".warps")}
    assert warps
    for name, value in warps.items():
        assert value % 2 == 0, f"{table} gfx1250 {name}={value}"
        assert compat.launcher_num_warps(value, "gfx1250") * 64 == value * 32


# --------------------------------------------------------------------------- #
# The GPU tiers' detection: conftest.py, launch.unavailable_reason, api.
# --------------------------------------------------------------------------- #


@pytest.fixture
def fake_jax_triton(monkeypatch):
    """A stand-in jax_triton module in sys.modules (a CPU jaxlib cannot import
    the real one): records the lowering calls and launches it receives."""
    calls = {"lowering": [], "triton_call": [], "guard": 0, "arch_details": []}

    def triton_kernel_call_lowering(backend_fn, ctx, *args, **params):
        calls["lowering"].append(dict(params, backend_fn=backend_fn, args=args))
        return "lowered"

    def get_arch_details(device):
        calls["arch_details"].append(device)
        return calls["device_arch"]

    def guard():
        calls["guard"] += 1

    def triton_call(*args, out_shape, **kwargs):
        calls["triton_call"].append(kwargs)
        return [np.zeros(s.shape, s.dtype) for s in out_shape]

    triton_lib = types.SimpleNamespace(
        triton_kernel_call_p=object(), triton_kernel_call_lowering=triton_kernel_call_lowering,
        triton_kernel_call_lib=types.SimpleNamespace(get_arch_details=get_arch_details),
        get_cuda_backend=lambda *a: "cuda backend", _patch_hip_backend=guard)
    module = types.ModuleType("jax_triton")
    module.triton_lib, module.triton_call = triton_lib, triton_call
    monkeypatch.setitem(sys.modules, "jax_triton", module)
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", triton_lib)
    calls["device_arch"] = "gfx950:sramecc+:xnack-"
    return calls


@pytest.fixture
def native(monkeypatch):
    """Kernels would run natively (no interpreter)."""
    monkeypatch.delenv("KDA_JAX_INTERPRET", raising=False)
    assert not launch.interpret_mode()


def _load_conftest(monkeypatch, backend: str):
    """Runs tests/conftest.py's module code as a fresh module with
    jax.default_backend() returning ``backend`` and the interpreter variables
    unset (monkeypatch restores them)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    for name in ("KDA_JAX_INTERPRET", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
    spec = importlib.util.spec_from_file_location("_kda_conftest_copy", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("backend", ["rocm", "cuda", "gpu"])
def test_conftest_treats_rocm_as_a_gpu(monkeypatch, backend):
    _load_conftest(monkeypatch, backend)
    assert "KDA_JAX_INTERPRET" not in os.environ
    assert not launch.interpret_mode()  # the tiers' ON_GPU = not interpret_mode()


def test_conftest_interprets_on_a_cpu(monkeypatch):
    _load_conftest(monkeypatch, "cpu")
    assert os.environ.get("KDA_JAX_INTERPRET") == "1"
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert launch.interpret_mode()


@pytest.mark.parametrize("backend", ["rocm", "cuda", "gpu"])
def test_triton_available_on_a_gpu_backend(monkeypatch, native, fake_jax_triton, backend):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert launch.unavailable_reason() is None


def test_triton_unavailable_on_a_cpu_backend(monkeypatch, native, fake_jax_triton):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert "default JAX backend is 'cpu'" in launch.unavailable_reason()
    with configs.target_arch("gfx950"):  # lowering for the GPU without it
        assert launch.unavailable_reason() is None


def test_triton_unavailable_without_jax_triton(monkeypatch, native):
    monkeypatch.setattr(jax, "default_backend", lambda: "rocm")
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import raises ImportError
    assert "jax-triton is not importable" in launch.unavailable_reason()


@pytest.mark.parametrize("backend, k, expected", [
    ("rocm", 64, "triton"), ("rocm", 512, "xla"), ("cpu", 64, "xla")])
def test_default_backend_choice_on_rocm(monkeypatch, native, fake_jax_triton, backend, k,
                                        expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    q, v = np.zeros((1, 4, 1, k), np.float32), np.zeros((1, 4, 1, 64), np.float32)
    assert api._choose_backend(None, q, v) == expected


# --------------------------------------------------------------------------- #
# The compat patch: installed by a native launch only; what it changes.
# --------------------------------------------------------------------------- #


@pytest.fixture
def fresh_install(monkeypatch, fake_jax_triton):
    """compat.install as if never run, registering into a recorder."""
    registered = []
    from jax.interpreters import mlir

    monkeypatch.setattr(compat, "_INSTALLED", False)
    monkeypatch.setattr(mlir, "register_lowering",
                        lambda prim, rule, platform=None: registered.append(
                            (prim, rule, platform)))
    return registered


def test_install_registers_rocm_and_cuda_rules_once(fresh_install, fake_jax_triton):
    prim = sys.modules["jax_triton"].triton_lib.triton_kernel_call_p
    compat.install()
    compat.install()
    assert sorted((p is prim, rule.__name__, platform) for p, rule, platform in fresh_install) == [
        (True, "_cuda_lowering", "cuda"), (True, "_rocm_lowering", "rocm")]


def _launch_once():
    out = jax.ShapeDtypeStruct((4,), np.float32)
    return launch.launch(object(), np.ones(4, np.float32), grid=(1, 1, 1), out_shape=[out],
                         name="k", num_warps=4)


def test_native_launch_installs_the_patch(fresh_install, native, fake_jax_triton):
    _launch_once()
    assert len(fresh_install) == 2
    assert fake_jax_triton["triton_call"][0]["num_warps"] == 4  # scaling is the rule's job


def test_interpreted_launch_leaves_jax_triton_alone(monkeypatch, fresh_install, fake_jax_triton):
    monkeypatch.setenv("KDA_JAX_INTERPRET", "1")
    monkeypatch.setattr(launch, "_interpret", lambda *a, **k: ["interpreted"])
    assert _launch_once() == ["interpreted"]
    assert fresh_install == [] and fake_jax_triton["triton_call"] == []


def _rocm_lowering(num_warps=4, compute_capability=None, fn=None):
    return compat._rocm_lowering("ctx", "operand", fn=fn or object(), num_warps=num_warps,
                                 compute_capability=compute_capability, name="k")


@pytest.mark.parametrize("device_arch, arch, warps, launcher_warps", [
    ("gfx950:sramecc+:xnack-", "gfx950", 4, 4),
    ("gfx942:sramecc+:xnack-", "gfx942", 2, 2),
    ("gfx1250", "gfx1250", 4, 2),
    ("gfx1250", "gfx1250", None, 2),  # jax-triton's default, 4 warps
])
def test_rocm_rule_from_the_device(fake_jax_triton, device_arch, arch, warps, launcher_warps):
    fake_jax_triton["device_arch"] = device_arch
    assert _rocm_lowering(num_warps=warps) == "lowered"
    (call,) = fake_jax_triton["lowering"]
    assert fake_jax_triton["arch_details"] == [0]
    assert call["num_warps"] == launcher_warps
    assert call["compute_capability"] == HIP_CC[arch]
    assert call["args"] == ("operand",) and call["name"] == "k"
    backend_fn = call["backend_fn"]
    assert isinstance(backend_fn, functools.partial) and backend_fn.args == (arch,)


def test_rocm_rule_keeps_a_given_compute_capability(fake_jax_triton):
    _rocm_lowering(compute_capability=94)
    assert fake_jax_triton["lowering"][0]["compute_capability"] == 94


def test_rocm_rule_takes_the_target_arch_not_the_device(fake_jax_triton):
    fake_jax_triton["device_arch"] = "gfx950"
    with configs.target_arch("gfx1250"):
        _rocm_lowering(num_warps=8)
    (call,) = fake_jax_triton["lowering"]
    assert fake_jax_triton["arch_details"] == []  # the device was not asked
    assert call["num_warps"] == 4 and call["compute_capability"] == 125
    assert call["backend_fn"].args == ("gfx1250",)


def test_rules_reject_the_other_platforms_arch(fake_jax_triton):
    with configs.target_arch("sm90"), pytest.raises(ValueError, match="not a rocm arch"):
        _rocm_lowering()
    with configs.target_arch("gfx950"), pytest.raises(ValueError, match="not a cuda arch"):
        compat._cuda_lowering("ctx", compute_capability=None, num_warps=4)
    assert fake_jax_triton["lowering"] == []


def test_cuda_rule_changes_only_the_target(fake_jax_triton):
    compat._cuda_lowering("ctx", compute_capability=None, num_warps=4)
    with configs.target_arch("sm90"):
        compat._cuda_lowering("ctx", compute_capability=None, num_warps=4)
    device, target = fake_jax_triton["lowering"]
    assert device["compute_capability"] is None  # jax-triton asks the device
    assert target["compute_capability"] == 90
    assert device["num_warps"] == target["num_warps"] == 4  # 32-lane launcher: unscaled
    assert device["backend_fn"] is sys.modules["jax_triton"].triton_lib.get_cuda_backend


def test_autotuned_kernels_refused_on_wave32_only(fake_jax_triton):
    from triton.runtime.autotuner import Autotuner

    tuned = object.__new__(Autotuner)
    fake_jax_triton["device_arch"] = "gfx950"
    _rocm_lowering(fn=tuned)
    assert len(fake_jax_triton["lowering"]) == 1
    fake_jax_triton["device_arch"] = "gfx1250"
    with pytest.raises(NotImplementedError, match="autotuned kernel cannot launch on gfx1250"):
        _rocm_lowering(fn=tuned)


@pytest.mark.parametrize("arch, warps, compiled_warps", [
    ("gfx950", 4, 4), ("gfx942", 2, 2), ("gfx1250", 2, 4), ("gfx1250", 4, 8)])
def test_hip_backend_compiles_the_launched_threads(fake_jax_triton, arch, warps, compiled_warps):
    backend = compat._hip_backend(arch, device=0, compute_capability=None)
    assert fake_jax_triton["guard"] == 1  # jax-triton's own guard still runs
    assert (backend.target.arch, backend.target.warp_size) == (arch, LANES[arch])
    options = backend.parse_options({"num_warps": warps})
    assert options.num_warps == compiled_warps
    # Threads compiled == threads jaxlib's launcher starts for `warps`.
    assert options.num_warps * LANES[arch] == warps * 64


def test_hip_backend_seeds_the_stage_metadata(monkeypatch, fake_jax_triton):
    from triton.backends.amd.compiler import HIPBackend

    monkeypatch.setattr(HIPBackend, "make_ttir", lambda self, mod, metadata, options: metadata)
    backend = compat._hip_backend("gfx950", device=0, compute_capability=None)
    options = backend.parse_options({"num_warps": 4})
    metadata = backend.make_ttir("module", {"name": "kept"}, options)
    assert metadata["num_ctas"] == options.num_ctas  # Triton >= 3.7 reads it (KeyError)
    assert metadata["target"] == backend.target
    assert metadata["name"] == "kept"
