"""jax-triton on ROCm, and lowering for a chosen GPU without that GPU.

jax-triton 0.3.1 compiles a kernel during lowering and hands jaxlib's Triton
launcher (``jax._src.lib.gpu_triton``) the code object and a launch config.
Three gaps stand between that and kda_jax's targets (read in the sources of
jax-triton 0.3.1, Triton 3.9 and jaxlib):

1. ``num_ctas`` (Triton >= 3.7). ``HIPBackend.make_llir``
   (triton/backends/amd/compiler.py) reads ``metadata["num_ctas"]``, but
   jax-triton's ``compile_ttir_to_hsaco_inplace`` (jax_triton/triton_lib.py)
   starts the stage metadata as an empty dict, where ``triton.compile``
   (triton/compiler/compiler.py) seeds it with the compile options. Result:
   ``KeyError: 'num_ctas'``. Triton 3.6 does not read it (the failure starts
   with 3.7); the seed is harmless there.
2. Wave32 threads. jaxlib's launcher starts ``num_warps * kNumThreadsPerWarp``
   threads per block (``Kernel::Kernel`` in jaxlib/gpu/triton_kernels.cc),
   with ``kNumThreadsPerWarp = 64`` for HIP (jaxlib/gpu/vendor.h), and
   jax-triton passes it the ``num_warps`` it compiled with
   (``get_or_create_triton_kernel``). Triton builds gfx10 and newer, gfx1250
   included, for 32-lane waves (``HIPOptions.__post_init__``), so a kernel
   built for ``num_warps * 32`` threads would start with twice as many.
3. The target. jax-triton's ``get_hip_backend`` asks device 0 for its arch
   (``get_arch_details``) and ``get_or_create_triton_kernel`` asks it for the
   compute capability when the call gives none; a host without that GPU cannot
   lower, and two archs lowered in one process share a kernel-cache key.

:func:`install` fixes all three with one patch: it registers, once per
process, kda_jax's lowering rules for jax-triton's kernel-call primitive on
"rocm" and "cuda". Each rule wraps jax-triton's own
``triton_kernel_call_lowering`` (nothing is copied) and only changes what it
is given: the arch (``kda_jax.configs.target_arch``, else the device, as
jax-triton asks it), the compute capability (from that arch), and on ROCm a
Triton backend that seeds the metadata and compiles ``64 / wave size`` times
the warps the launcher is told, so launched threads == compiled threads.
Other jax-triton kernels in the process get the same rules; for them the
rules compute what jax-triton does, with the same fixes.

Nothing here imports triton or jax-triton, or touches a device, at import.
"""

from __future__ import annotations

import functools
import threading

from kda_jax import configs

__all__ = ["install", "warp_size", "launcher_num_warps", "hip_compute_capability",
           "SPLIT_BF16_MIN_TRITON", "triton_version", "check_dot_mode"]

# The first Triton release whose tl.dot takes input_precision "bf16x3" and
# "bf16x6", on NVIDIA and on AMD alike: HIPOptions.allowed_dot_input_precisions
# is ("ieee",) in 3.4.0 and 3.5.0 and ("ieee", "bf16x3", "bf16x6") in 3.6.0
# (triton/backends/amd/compiler.py); the NVIDIA list gains them in 3.6.0 too.
SPLIT_BF16_MIN_TRITON = (3, 6)

# Threads per warp in jaxlib's ROCm Triton launcher (jaxlib/gpu/vendor.h,
# jax::hip::kNumThreadsPerWarp); it launches num_warps times this many.
ROCM_LAUNCHER_LANES = 64

_LOCK = threading.Lock()
_INSTALLED = False


def warp_size(arch: str) -> int:
    """Lanes per wave/warp Triton compiles ``arch`` for: 32 on CUDA ("sm..")
    and on gfx10 and newer (RDNA, gfx1250), 64 on gfx9 (CDNA: gfx942, gfx950)."""
    if arch.startswith("sm"):
        return 32
    major = _gfx_version(arch)[0]
    return 32 if major >= 10 else 64


def launcher_num_warps(num_warps: int, arch: str) -> int:
    """The ``num_warps`` to give jaxlib's ROCm launcher for a kernel compiled
    with ``num_warps`` waves on ``arch``, so that it starts exactly the
    ``num_warps * warp_size(arch)`` threads the kernel was built for."""
    threads = num_warps * warp_size(arch)
    if threads % ROCM_LAUNCHER_LANES:
        raise ValueError(
            f"num_warps={num_warps} on {arch} is {threads} threads, but jaxlib's ROCm "
            f"launcher starts a multiple of {ROCM_LAUNCHER_LANES}; use an even num_warps "
            f"(2, 4, 8 or 16) for {arch}"
        )
    return threads // ROCM_LAUNCHER_LANES


def hip_compute_capability(arch: str) -> int:
    """``major * 10 + minor`` as HIP reports it for ``arch`` (gfx950 -> 95,
    gfx1250 -> 125, gfx90a -> 90): what jax-triton would read from the device."""
    major, minor = _gfx_version(arch)
    return major * 10 + minor


def _gfx_version(arch: str) -> tuple[int, int]:
    # "gfx" + major (decimal) + minor (hex digit) + stepping (hex digit).
    try:
        if not arch.startswith("gfx") or len(arch) < 6:
            raise ValueError
        return int(arch[3:-2]), int(arch[-2], 16)
    except ValueError:
        raise ValueError(
            f"arch={arch!r} is not an AMD GPU name like 'gfx950' or 'gfx1250'"
        ) from None


def install() -> None:
    """Registers kda_jax's "rocm" and "cuda" lowering rules for jax-triton's
    kernel-call primitive. Idempotent; :func:`kda_jax.triton.launch.launch`
    calls it before its first jax-triton launch. Needs jax-triton importable."""
    global _INSTALLED
    if _INSTALLED:  # every launch calls this; skip the lock once done
        return
    with _LOCK:
        if _INSTALLED:
            return
        from jax.interpreters import mlir
        from jax_triton import triton_lib

        mlir.register_lowering(triton_lib.triton_kernel_call_p, _rocm_lowering,
                               platform="rocm")
        mlir.register_lowering(triton_lib.triton_kernel_call_p, _cuda_lowering,
                               platform="cuda")
        _INSTALLED = True


_FAMILIES = {"rocm": ("gfx", "gfx950, gfx1250 or gfx942"), "cuda": ("sm", "sm90")}


def _target(platform: str) -> str | None:
    """The arch chosen with configs.target_arch (None: ask the device),
    checked against the platform being lowered for."""
    arch = configs.explicit_arch()
    prefix, examples = _FAMILIES[platform]
    if arch is not None and not arch.startswith(prefix):
        raise ValueError(
            f"kda_jax.configs.target_arch is {arch!r}, which is not a {platform} arch; "
            f"lower for its own platform, or choose one of {examples} for {platform!r}"
        )
    return arch


def _rocm_lowering(ctx, *args, fn, num_warps, compute_capability, **params):
    from jax_triton import triton_lib as jt_lib

    arch = _target("rocm")
    if arch is None:
        # As jax-triton's get_hip_backend: device 0, target features dropped.
        arch = jt_lib.triton_kernel_call_lib.get_arch_details(0).split(":")[0]
    num_warps = 4 if num_warps is None else num_warps  # jax-triton's default
    if warp_size(arch) != ROCM_LAUNCHER_LANES:
        from triton.runtime.autotuner import Autotuner

        if isinstance(fn, Autotuner):
            raise NotImplementedError(
                f"an autotuned kernel cannot launch on {arch}: its configs' num_warps "
                "reach jaxlib's 64-lane launcher unscaled; launch one config at a time"
            )
    if compute_capability is None:
        compute_capability = hip_compute_capability(arch)
    # jax-triton hands this one count to the backend, which compiles it times
    # waves_per_launcher_warp waves of warp_size(arch) lanes, and to jaxlib's
    # launcher, which starts it times 64 threads: the same number of threads.
    return jt_lib.triton_kernel_call_lowering(
        functools.partial(_hip_backend, arch), ctx, *args, fn=fn,
        num_warps=launcher_num_warps(num_warps, arch),
        compute_capability=compute_capability, **params,
    )


def _cuda_lowering(ctx, *args, compute_capability, **params):
    from jax_triton import triton_lib as jt_lib

    arch = _target("cuda")
    if arch is not None and compute_capability is None:
        compute_capability = int(arch[2:])  # "sm90" -> 90
    return jt_lib.triton_kernel_call_lowering(
        jt_lib.get_cuda_backend, ctx, *args, compute_capability=compute_capability, **params,
    )


def _hip_backend(arch, device, compute_capability):
    """Stands in for jax-triton's get_hip_backend (same call signature)."""
    del device, compute_capability  # the arch is already known
    from jax_triton import triton_lib as jt_lib

    # jax-triton's own guard against Triton's torch import, which its
    # get_hip_backend applies before building a backend (absent in some versions).
    guard = getattr(jt_lib, "_patch_hip_backend", None)
    if guard is not None:
        guard()
    return _hip_backend_class()(arch)


@functools.cache
def _hip_backend_class():
    from triton.backends.amd.compiler import HIPBackend
    from triton.backends.compiler import GPUTarget

    class KdaHipBackend(HIPBackend):
        """Triton's HIP backend as jax-triton's compile steps need it."""

        def __init__(self, arch: str):
            super().__init__(GPUTarget("hip", arch, warp_size(arch)))
            # jax-triton passes one num_warps to this backend and to the
            # launcher; the launcher's warp is 64 lanes, the hardware's may be 32.
            self.waves_per_launcher_warp = ROCM_LAUNCHER_LANES // warp_size(arch)

        def parse_options(self, opts):
            opts = dict(opts)
            opts["num_warps"] = opts["num_warps"] * self.waves_per_launcher_warp
            return super().parse_options(opts)

        def make_ttir(self, mod, metadata, options):
            # The first stage jax-triton runs: seed what triton.compile seeds.
            metadata.setdefault("target", self.target)
            for key, value in options.__dict__.items():
                metadata.setdefault(key, value)
            return super().make_ttir(mod, metadata, options)

    return KdaHipBackend


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton ("3.5.0+rocm7.0.0" -> (3, 5))."""
    import triton

    parts = triton.__version__.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def check_dot_mode(mode: str) -> None:
    """Raises when the installed Triton cannot compile product precision
    ``mode`` (an entry of kda_jax.configs.DOT_MODES): the split-bf16 modes need
    Triton >= 3.6, which a ROCm stack may predate (its own Triton build)."""
    if mode in ("bf16x3", "bf16x6") and triton_version() < SPLIT_BF16_MIN_TRITON:
        import triton

        floor = ".".join(map(str, SPLIT_BF16_MIN_TRITON))
        raise RuntimeError(
            f"the launch config asks for {mode!r} products, which Triton {triton.__version__} "
            f"cannot compile (input_precision {mode!r} arrived in Triton {floor}); install "
            f"triton>={floor}, or override the config with 'ieee' products "
            "(kda_jax.configs.override)")
