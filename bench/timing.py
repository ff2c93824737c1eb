"""Timing helpers shared by the benchmarks (GPU numbers only; CPU timings are not results)."""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time


def time_jax(fn, *args, iters: int = 20, repeats: int = 5) -> float:
    """Median milliseconds per call of a jitted ``fn`` (compilation excluded)."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def time_torch(fn, iters: int = 20, repeats: int = 5) -> float:
    """Median milliseconds per call of a PyTorch callable on the current CUDA device."""
    import torch

    fn()
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def versions() -> dict:
    import jax

    out = {"python": sys.version.split()[0], "jax": jax.__version__, "platform": platform.platform()}
    for name in ("jaxlib", "triton", "jax_triton", "torch", "fla"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001 - a missing peer is recorded, not fatal
            out[name] = None
    try:
        out["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        out["gpu"] = str(jax.devices()[0].device_kind)
    return out
