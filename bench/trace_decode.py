"""Where a dense decode step's time goes on the GPU: a profiler timeline of
consecutive steps, summarized as GPU busy and idle time per step.

    python -m bench.trace_decode [--n 256] [--steps 20] [--peer kda_jax|fla] [--chain 8]
        [--json PATH]

kda_jax (``jax.profiler.trace``) or fla (``torch.profiler``, run it in its own
process: torch's Triton and jax-triton clash in one) runs ``--steps`` dense
decode steps of N one-token sequences (H = 32, K = V = 128, bf16 q/k/v, a
float32 initial and final state), as bench.serving does, under the profiler.
The GPU's activities (kernels, copies, memsets) are read from the exported
trace and summarized: per step, the time from one step's first activity to the
next one's, the time the GPU was busy, and the idle gaps; per activity name,
count and mean duration. Nsight Compute times kernels one by one; this shows
what lies between them. GPU only (on a CPU the trace has no device activity).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

from bench.inputs import make


def gpu_activities(trace) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the GPU's activities in a Chrome-format
    trace: JAX's (events of processes named "/device:GPU:...") or torch's
    (events of category kernel, gpu_memcpy or gpu_memset)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device_pids = {e["pid"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    torch_cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("pid") in device_pids or e.get("cat") in torch_cats:
            out.append((str(e.get("name", "?")), float(e["ts"]), float(e["dur"])))
    return sorted(out, key=lambda a: a[1])


def summarize(activities, steps: int) -> dict:
    """Per-step window, busy and idle time (us) and per-name count / mean us.
    Busy time is the union of the activities' intervals."""
    if not activities:
        return {"error": "no GPU activity in the trace"}
    busy, end = 0.0, None
    for _, ts, dur in activities:
        if end is None or ts >= end:
            busy += dur
            end = ts + dur
        elif ts + dur > end:
            busy += ts + dur - end
            end = ts + dur
    window = max(ts + dur for _, ts, dur in activities) - activities[0][1]
    by_name = collections.defaultdict(list)
    for name, _, dur in activities:
        by_name[name].append(dur)
    return {
        "steps": steps,
        "window_us_per_step": window / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": (window - busy) / steps,
        "activities": {name[:90]: {"count": len(d), "mean_us": sum(d) / len(d)}
                       for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))},
    }


def _latest_trace(root: str) -> dict:
    paths = sorted(glob.glob(os.path.join(root, "**", "*.json.gz"), recursive=True)
                   + glob.glob(os.path.join(root, "**", "*.json"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no trace file under {root}")
    opener = gzip.open if paths[-1].endswith(".gz") else open
    with opener(paths[-1], "rt") as f:
        return json.load(f)


def trace_kda_jax(n: int, h: int, d: int, steps: int, chain: int = 1) -> dict:
    """``steps`` calls of a jitted program of ``chain`` decode steps (each from
    the last one's states); the summary is per decode step."""
    import jax
    import jax.numpy as jnp

    import kda_jax

    arrays = make(1, n, h, d, d, seed=1)
    x = [jnp.asarray(a.reshape((n, 1) + a.shape[2:]), jnp.bfloat16 if i < 3 else jnp.float32)
         for i, a in enumerate(arrays)]
    h0 = jnp.zeros((n, h, d, d), jnp.float32)
    def steps_of(h0, *x):
        for _ in range(chain):
            o, h0 = kda_jax.fused_recurrent_kda(*x, initial_state=h0, output_final_state=True)
        return o, h0

    step = jax.jit(steps_of)
    out = step(h0, *x)
    jax.block_until_ready(out)
    root = tempfile.mkdtemp(prefix="kda_trace_")
    with jax.profiler.trace(root, create_perfetto_trace=True):
        for _ in range(steps):
            out = step(h0, *x)
        jax.block_until_ready(out)
    return summarize(gpu_activities(_latest_trace(root)), steps * chain)


def trace_fla(n: int, h: int, d: int, steps: int) -> dict:
    import torch
    from fla.ops.kda import fused_recurrent_kda

    arrays = make(1, n, h, d, d, seed=1)
    q, k, v = (torch.tensor(a, device="cuda", dtype=torch.bfloat16).reshape(n, 1, h, d)
               for a in arrays[:3])
    g, beta = (torch.tensor(a, device="cuda").reshape((n, 1) + a.shape[2:]) for a in arrays[3:])
    h0 = torch.zeros((n, h, d, d), device="cuda")
    call = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    root = tempfile.mkdtemp(prefix="fla_trace_")
    prof.export_chrome_trace(os.path.join(root, "trace.json"))
    return summarize(gpu_activities(_latest_trace(root)), steps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256, help="sequences (one token each)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peer", default="kda_jax", choices=("kda_jax", "fla"))
    p.add_argument("--chain", type=int, default=1,
                   help="kda_jax: decode steps per jitted program (gaps inside one program)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.peer == "kda_jax":
        summary = trace_kda_jax(a.n, a.heads, a.head_dim, a.steps, a.chain)
    else:
        summary = trace_fla(a.n, a.heads, a.head_dim, a.steps)
    result = dict(summary, peer=a.peer, n=a.n, chain=a.chain,
                  command="python -m bench.trace_decode " + " ".join(
                      argv if argv is not None else sys.argv[1:]))
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
