"""Where a decode step's time goes on the GPU: a profiler timeline of
consecutive steps, summarized as GPU busy and idle time per step.

    python -m bench.trace_decode [--n 256] [--steps 20] [--peer kda_jax|fla] [--chain 8]
        [--form dense|pool] [--json PATH]

kda_jax (``jax.profiler.trace``) or fla (``torch.profiler``, run it in its own
process: torch's Triton and jax-triton clash in one) runs ``--steps`` decode
steps of N one-token sequences (H = 32, K = V = 128, bf16 q/k/v), as
bench.serving does, under the profiler: dense (a float32 initial and final
state) or the serving form (--form pool: packed tokens, device bounds, a
float32 pool updated in place; fla's through ssm_state_indices), or for
kda_jax the serving decode's bounds with dense states (--form varlen).
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


def trace_kda_jax(n: int, h: int, d: int, steps: int, chain: int = 1,
                  form: str = "dense") -> dict:
    """``steps`` calls of a jitted program of ``chain`` decode steps (each from
    the last one's states); the summary is per decode step. ``form``: "dense"
    ([N, 1] tokens, an initial and a new final state) or "pool" (bench.serving's
    serving decode: packed [1, N] tokens in a decode bucket, device bounds, a
    donated pool updated in place) or "varlen" (the same tokens and bounds, the
    states in and out as in "dense": what the pool itself costs)."""
    import jax
    import jax.numpy as jnp

    import kda_jax

    arrays = make(1, n, h, d, d, seed=1)
    dtypes = [jnp.bfloat16] * 3 + [jnp.float32] * 2
    states = jnp.zeros((n, h, d, d), jnp.float32)
    if form == "dense":
        x = [jnp.asarray(a.reshape((n, 1) + a.shape[2:]), t) for a, t in zip(arrays, dtypes)]

        def steps_of(h0, *x):
            for _ in range(chain):
                o, h0 = kda_jax.fused_recurrent_kda(*x, initial_state=h0, output_final_state=True)
            return h0

        step = jax.jit(steps_of)
        call = lambda: step(states, *x)
    else:
        x = [jnp.asarray(a, t) for a, t in zip(arrays, dtypes)]
        batch = jax.device_put(kda_jax.VarlenBatch.from_lengths([1] * n, kda_jax.Bucket(
            n, n, max_len=1)))
        idx = jnp.arange(n, dtype=jnp.int32)

        if form == "varlen":  # the serving decode's bounds, dense states in and out
            def steps_of(h0, batch, *x):
                for _ in range(chain):
                    o, h0 = kda_jax.fused_recurrent_kda(*x, cu_seqlens=batch, initial_state=h0,
                                                        output_final_state=True)
                return h0

            step = jax.jit(steps_of)
            call = lambda: step(states, batch, *x)
        else:
            def steps_of(pool, batch, idx, *x):  # the batch an argument: device bounds
                for _ in range(chain):
                    o, pool = kda_jax.fused_recurrent_kda(*x, cu_seqlens=batch, state_cache=pool,
                                                          state_indices=idx)
                return pool

            step = jax.jit(steps_of, donate_argnums=0)
            held = {"pool": states}

            def call():
                held["pool"] = step(held["pool"], batch, idx, *x)
                return held["pool"]

    jax.block_until_ready(call())
    root = tempfile.mkdtemp(prefix="kda_trace_")
    with jax.profiler.trace(root, create_perfetto_trace=True):
        for _ in range(steps):
            out = call()
        jax.block_until_ready(out)
    return summarize(gpu_activities(_latest_trace(root)), steps * chain)


def trace_fla(n: int, h: int, d: int, steps: int, form: str = "dense") -> dict:
    """fla's decode steps under torch.profiler: dense (fused_recurrent_kda with an
    initial and a final state) or pool (packed tokens, device cu_seqlens, the
    pool updated in place through ssm_state_indices, as bench.serving's peer)."""
    import torch

    arrays = make(1, n, h, d, d, seed=1)
    dtypes = [torch.bfloat16] * 3 + [torch.float32] * 2
    states = torch.zeros((n, h, d, d), device="cuda")
    if form == "dense":
        from fla.ops.kda import fused_recurrent_kda

        q, k, v, g, beta = (torch.tensor(a, device="cuda", dtype=t).reshape((n, 1) + a.shape[2:])
                            for a, t in zip(arrays, dtypes))
        call = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=states,
                                           output_final_state=True)
    else:
        from bench.serving import fla_pool_decode_call

        call = fla_pool_decode_call(*(torch.tensor(a, device="cuda", dtype=t)
                                      for a, t in zip(arrays, dtypes)))
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
    p.add_argument("--form", default="dense", choices=("dense", "pool", "varlen"),
                   help="dense [N, 1] steps with states in and out, the serving decode "
                   "with a pool updated in place, or (kda_jax) the serving decode's "
                   "bounds with states in and out (no pool)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.peer == "fla" and a.chain != 1:
        p.error(f"--chain={a.chain} applies to kda_jax only (fla has no jitted program)")
    if a.peer == "fla" and a.form == "varlen":
        p.error("--form=varlen applies to kda_jax only (it splits kda_jax's pool decode "
                "into its bounds and its pool)")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.peer == "kda_jax":
        summary = trace_kda_jax(a.n, a.heads, a.head_dim, a.steps, a.chain, a.form)
    else:
        summary = trace_fla(a.n, a.heads, a.head_dim, a.steps, a.form)
    result = dict(summary, peer=a.peer, n=a.n, chain=a.chain, form=a.form,
                  command="python -m bench.trace_decode " + " ".join(
                      argv if argv is not None else sys.argv[1:]))
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
