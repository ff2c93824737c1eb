"""The one timing helper of the benchmarks (GPU numbers only; CPU timings are not results).

Every benchmark, kda_jax's side and fla's alike, times a step the same way: two
warm-up calls and a sync, then ``repeats`` loops of ``iters`` calls, each loop
ended by a sync; the result is the median over the loops of the wall time per
call as the host sees it (host work, dispatch and the device all included), and
of the time the loop took to issue its calls (near the first: the step is bound
by the host).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

WARMUP_CALLS = 2


def time_calls(call: Callable[[int], object], sync: Callable[[], object], iters: int = 20,
               repeats: int = 5) -> tuple[float, float]:
    """(ms, host ms) per ``call(i)`` (i counts the calls, so a step can rotate its inputs)."""
    for i in range(WARMUP_CALLS):
        call(i)
    sync()
    samples, issued = [], []
    for r in range(repeats):
        start = time.perf_counter()
        for i in range(iters):
            call(r * iters + i)
        issued.append((time.perf_counter() - start) * 1e3 / iters)
        sync()
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples), statistics.median(issued)


def time_jax(fn, *args, iters: int = 20, repeats: int = 5) -> float:
    """Median ms per call of a jitted ``fn(*args)`` (compilation excluded: the warm-up)."""
    import jax

    out = {}

    def call(_):
        out["y"] = fn(*args)

    return time_calls(call, lambda: jax.block_until_ready(out["y"]), iters, repeats)[0]


def time_torch(fn, iters: int = 20, repeats: int = 5) -> float:
    """Median ms per call of a PyTorch callable on the current CUDA device."""
    import torch

    return time_calls(lambda _: fn(), torch.cuda.synchronize, iters, repeats)[0]
