"""The serving step with new bounds on every call: kda_jax (bucketed, static) against fla.

    python -m bench.serving [--json PATH] [--sets 128] [--static-sets 16] [--no-fla]

Mixed step: 12 one-token decodes plus prefills of 1100, 1300 and 900 tokens
(kda_jax.testing.SERVING_LENGTHS), H = 32, K = V = 128, bf16 q/k/v; call i
takes bound set i % --sets (the lengths permuted, prefills moved by up to 64
tokens: one bucket). Rows: kda_jax's bucketed form with a state pool (the batch moved by
jax.device_put, or passed as NumPy: jit's dispatch then copies it) and with
initial/final states, its static form (one compile per new bounds, reported
separately; steady state over --static-sets precompiled sets), and fla's
chunk_kda with device cu_seqlens and with cu_seqlens_cpu. Decode-only steps:
256 and 1024 one-token sequences, kda_jax's fused_recurrent_kda (bucketed with
a pool, also 8 steps chained in one program; static, dense; dense with 8 steps
chained in one program; chained steps reported
per step) against fla's fused_recurrent_kda: dense, and the serving form (packed
tokens, device cu_seqlens, a pool updated in place through ssm_state_indices).

Times are wall-clock per step as the host sees it (host metadata build and
transfer included), the median of --repeats loops of --iters calls; "host ms"
is the time the loop took to issue its calls (near ms/step: host-bound).
kda_jax's steps run under transfer_guard_device_to_host("disallow"): a
device-to-host read raises, so "0" in the d2h column is checked, not assumed.
fla's column counts its synchronizing calls per step (torch's sync debug mode).
fla runs in a child process (``--fla-child``): torch's Triton and jax-triton
clash in one process (see bench.fla_peer). GPU only; CPU timings are not results.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from bench.inputs import make, serving_length_sets

DECODE_SIZES = (256, 1024)


def wall_ms(call, sync, iters, repeats):
    """(ms, host ms) per ``call(i)``: the median over ``repeats`` loops of
    ``iters`` calls, to the end of the sync, and of the time the loop took to
    issue its calls (near the first: the step is bound by the host)."""
    for i in range(2):
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


def _pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


# --------------------------------------------------------------------------- #
# kda_jax (this process).
# --------------------------------------------------------------------------- #


def kda_rows(a, sets):
    import jax
    import jax.numpy as jnp

    import kda_jax
    from kda_jax import bounds as host_bounds

    h, d, impl, rows = a.heads, a.head_dim, a.kda_impl, []
    bucket = kda_jax.Bucket(_pow2(max(map(len, sets))), _pow2(max(map(sum, sets))))
    arrays = make(1, bucket.max_tokens, h, d, d)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in arrays[:3])
    g, beta = (jnp.asarray(x) for x in arrays[3:])
    nb = bucket.max_seqs
    pool0 = jnp.zeros((4 * nb, h, d, d), jnp.float32)  # slots: rows for 4 steps' requests
    h0 = jnp.zeros((nb, h, d, d), jnp.float32)

    def run(name, call, sync, step, **extra):
        try:
            with jax.transfer_guard_device_to_host("disallow"):
                ms, host_ms = wall_ms(call, sync, a.iters, a.repeats)
            per = extra.get("steps_per_call", 1)  # ms and host ms are per step
            rows.append(dict(step=step, implementation=name, ms=ms / per, host_ms=host_ms / per,
                             d2h_per_step=0, **extra))
        except Exception as e:  # noqa: BLE001 - a failed row is recorded, not fatal
            rows.append(dict(step=step, implementation=name, ms=None,
                             error=f"{type(e).__name__}: {str(e)[:300]}", **extra))

    # Host cost of one batch (uncached: new bounds every step).
    # build(), not from_lengths(): from_lengths reuses the buffers of lengths
    # seen recently, and the 128 rotating sets would all be seen; a serving step
    # with new bounds builds its batch anew. (The decode steps below do repeat
    # their lengths, so they take from_lengths' reuse, as a server would.)
    cus = [np.cumsum([0] + list(lens)) for lens in sets]
    start = time.perf_counter()
    for cu in cus:
        host_bounds.chunk_table.cache_clear(), host_bounds.chunk_offsets.cache_clear()
        kda_jax.VarlenBatch.build(cu, bucket)
    build_us = (time.perf_counter() - start) * 1e6 / len(sets)
    host_batch = lambda i: kda_jax.VarlenBatch.build(cus[i % len(sets)], bucket)
    batch_of = lambda i: jax.device_put(host_batch(i))
    step = f"mixed N={len(sets[0])} T~{sum(sets[0])}"

    # Bucketed, with the pool (donated) and with initial/final states.
    x = (q, k, v, g, beta)
    idx = jnp.asarray(np.r_[np.arange(len(sets[0])), -np.ones(nb - len(sets[0]))], jnp.int32)
    # idx is an argument: a device array closed over would be embedded as a
    # constant, which reads it back to the host at compile time.
    pooled = jax.jit(lambda pool, batch, idx, *x: kda_jax.chunk_kda(
        *x, cu_seqlens=batch, state_cache=pool, state_indices=idx, implementation=impl),
        donate_argnums=0)
    plain = jax.jit(lambda batch, h0, *x: kda_jax.chunk_kda(
        *x, cu_seqlens=batch, initial_state=h0, output_final_state=True, implementation=impl))
    state = {"pool": pool0.copy()}

    def call_pooled(i):
        state["o"], state["pool"] = pooled(state["pool"], batch_of(i), idx, *x)

    t0 = time.perf_counter()
    jax.block_until_ready(plain(batch_of(0), h0, *x))
    compile_s = time.perf_counter() - t0

    def call_pooled_host(i):  # the NumPy batch itself: jit's dispatch makes the one copy
        state["o"], state["pool"] = pooled(state["pool"], host_batch(i), idx, *x)

    run(f"kda_jax {impl} bucketed + pool, host batch", call_pooled_host,
        lambda: jax.block_until_ready(state["pool"]), step, bucket=str(bucket))
    run(f"kda_jax {impl} bucketed + pool", call_pooled,
        lambda: jax.block_until_ready(state["pool"]), step, host_build_us=build_us,
        bucket=str(bucket))
    run(f"kda_jax {impl} bucketed", lambda i: state.update(out=plain(batch_of(i), h0, *x)),
        lambda: jax.block_until_ready(state["out"]), step, compile_s=compile_s,
        compiles=plain._cache_size(), bucket=str(bucket))

    # Static: one trace and compile per new bounds.
    @functools.partial(jax.jit, static_argnames="bounds")
    def static(h0, q, k, v, g, beta, bounds):
        t, n = bounds.total_tokens, bounds.num_seqs
        return kda_jax.chunk_kda(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t],
                                 cu_seqlens=bounds, initial_state=h0[:n],
                                 output_final_state=True, implementation=impl)

    static_bounds = [kda_jax.SeqBounds.from_lengths(s) for s in sets[: a.static_sets]]
    t0 = time.perf_counter()
    for b in static_bounds:
        jax.block_until_ready(static(h0, *x, bounds=b))
    compile_s = (time.perf_counter() - t0) / len(static_bounds)
    run(f"kda_jax {impl} static (precompiled)",
        lambda i: state.update(out=static(h0, *x, bounds=static_bounds[i % len(static_bounds)])),
        lambda: jax.block_until_ready(state["out"]), step, compile_s=compile_s,
        compiles=static._cache_size(), sets=len(static_bounds))

    # Decode only: one token per sequence, packed [1, N] (bucketed) or dense [N, 1].
    for n in DECODE_SIZES:
        for name, (call, sync, per) in kda_decode_steps(n, h, d, impl).items():
            run(f"kda_jax {impl} fused_recurrent {name}", call, sync, f"decode N={n}",
                **({"steps_per_call": per} if per > 1 else {}))
    return rows


def kda_decode_steps(n, h, d, impl="triton"):
    """kda_jax's decode steps of ``n`` one-token sequences (H = ``h``, K = V = ``d``,
    bf16 q/k/v, zero float32 states): {name: (call(i), sync(), steps per call)}.
    "bucketed + pool": packed [1, N] tokens, the batch built on the host and
    moved by jax.device_put (", host batch": passed as NumPy), a pool donated
    and updated in place; "dense": [N, 1] tokens, a float32 initial and final
    state; ", 8 in one jit": 8 chained steps per program (as a model's layers
    share one: the host's cost per program is paid once), timed per step."""
    import jax
    import jax.numpy as jnp

    import kda_jax

    def pool_steps(pool, batch, idx, *x, steps=1):
        # ``steps`` serving decodes in one program, each over the last one's pool.
        for _ in range(steps):
            o, pool = kda_jax.fused_recurrent_kda(*x, cu_seqlens=batch, state_cache=pool,
                                                  state_indices=idx, implementation=impl)
        return o, pool

    decode = jax.jit(pool_steps, donate_argnums=0)
    decode8 = jax.jit(functools.partial(pool_steps, steps=8), donate_argnums=0)

    def dense_steps(h0, *x, steps=1):
        # ``steps`` decode steps in one program, each from the last one's states
        # (as a model's layers share one program): per-program costs counted once.
        x = [y.reshape((y.shape[1], 1) + y.shape[2:]) for y in x]
        for _ in range(steps):
            o, h0 = kda_jax.fused_recurrent_kda(*x, initial_state=h0, output_final_state=True,
                                                implementation=impl)
        return o, h0

    dense = jax.jit(dense_steps)
    dense8 = jax.jit(functools.partial(dense_steps, steps=8))
    arrays = make(1, n, h, d, d, seed=1)
    dx = tuple(jnp.asarray(y, jnp.bfloat16 if i < 3 else jnp.float32)
               for i, y in enumerate(arrays))
    dbucket, ones = kda_jax.Bucket(n, n, max_len=1), [1] * n  # a decode bucket
    didx, dh0 = jnp.arange(n, dtype=jnp.int32), jnp.zeros((n, h, d, d), jnp.float32)
    state = {"pool": jnp.zeros((n, h, d, d), jnp.float32)}

    def call_decode(i, put=jax.device_put, step=decode):
        batch = put(kda_jax.VarlenBatch.from_lengths(ones, dbucket))
        state["o"], state["pool"] = step(state["pool"], batch, didx, *dx)

    sync = lambda: jax.block_until_ready(state["pool"])
    sync_dense = lambda: jax.block_until_ready(state.get("ht"))
    return {
        "bucketed + pool, host batch": (functools.partial(call_decode, put=lambda b: b), sync, 1),
        "bucketed + pool": (call_decode, sync, 1),
        "bucketed + pool, host batch, 8 in one jit": (
            functools.partial(call_decode, put=lambda b: b, step=decode8), sync, 8),
        f"dense B={n}": (lambda i: state.update(ht=dense(dh0, *dx)[1]), sync_dense, 1),
        f"dense B={n}, 8 in one jit": (lambda i: state.update(ht=dense8(dh0, *dx)[1]),
                                       sync_dense, 8),
    }


# --------------------------------------------------------------------------- #
# fla (child process: torch only, no JAX).
# --------------------------------------------------------------------------- #


def fla_child(spec):
    import inspect
    import warnings

    import torch
    from fla.ops.kda import chunk_kda

    sets, h, d, iters, repeats = (spec[x] for x in ("sets", "heads", "head_dim", "iters",
                                                    "repeats"))
    cuda = lambda x, dt=None: torch.tensor(x, device="cuda", dtype=dt)
    arrays = make(1, max(map(sum, sets)), h, d, d)
    q, k, v = (cuda(x, torch.bfloat16) for x in arrays[:3])
    g, beta = (cuda(x) for x in arrays[3:])
    h0 = torch.zeros((max(map(len, sets)), h, d, d), device="cuda")
    sync = torch.cuda.synchronize
    rows, has_cpu = [], "cu_seqlens_cpu" in inspect.signature(chunk_kda).parameters

    def mixed(with_cpu):
        def call(i):
            lens = sets[i % len(sets)]
            cu = torch.tensor(np.r_[0, np.cumsum(lens)], dtype=torch.long).pin_memory()
            kw = dict(cu_seqlens=cu.to("cuda", non_blocking=True))
            if with_cpu:
                kw["cu_seqlens_cpu"] = cu
            t = int(sum(lens))
            chunk_kda(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t],
                      initial_state=h0[: len(lens)], output_final_state=True, **kw)
        return call

    def syncs(call):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message).lower() for w in caught)

    step = f"mixed N={len(sets[0])} T~{sum(sets[0])}"
    for name, with_cpu in (("fla chunk_kda, device cu_seqlens", False),
                           ("fla chunk_kda, + cu_seqlens_cpu", True)):
        if with_cpu and not has_cpu:
            rows.append(dict(step=step, implementation=name, ms=None,
                             error="this fla's chunk_kda has no cu_seqlens_cpu"))
            continue
        call = mixed(with_cpu)
        ms, host_ms = wall_ms(call, sync, iters, repeats)
        rows.append(dict(step=step, implementation=name, ms=ms, host_ms=host_ms,
                         syncs_per_step=syncs(call)))
    for n in DECODE_SIZES:
        for name, call in fla_decode_steps(n, h, d).items():
            try:
                ms, host_ms = wall_ms(call, sync, iters, repeats)
            except Exception as e:  # noqa: BLE001 - a failure costs this row only
                rows.append(dict(step=f"decode N={n}", implementation=name, ms=None,
                                 error=str(e)[-300:]))
                continue
            rows.append(dict(step=f"decode N={n}", implementation=name, ms=ms, host_ms=host_ms,
                             syncs_per_step=syncs(call)))
    print(json.dumps({"rows": rows, "torch": torch.__version__,
                      "fla": getattr(__import__("fla"), "__version__", "?")}))


def fla_pool_decode_call(q, k, v, g, beta):
    """fla's serving decode, the peer of kda_jax's bucketed step with a pool:
    a no-argument call over packed [1, N] one-token sequences with device
    cu_seqlens, the states read from and written to a pool's rows in place
    through ssm_state_indices (continuous batching, fla's internal
    fused_recurrent_kda_fwd: its public function has no pool)."""
    import torch
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    n = q.shape[1]
    pool = torch.zeros((n, v.shape[2], k.shape[-1], v.shape[-1]), device="cuda")
    idx = torch.arange(n, device="cuda", dtype=torch.int32)
    cu = torch.arange(n + 1, device="cuda", dtype=torch.long)
    return lambda: fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool,
                                           inplace_final_state=True, cu_seqlens=cu,
                                           ssm_state_indices=idx)


def fla_decode_steps(n, h, d):
    """fla's decode steps of ``n`` one-token sequences, the peers of
    :func:`kda_decode_steps` (the same inputs): {name: call(i)}, dense
    fused_recurrent_kda ([N, 1] tokens, a float32 initial state and a new final
    state) and the serving form (:func:`fla_pool_decode_call`)."""
    import torch
    from fla.ops.kda import fused_recurrent_kda

    arrays = make(1, n, h, d, d, seed=1)
    x = [torch.tensor(y, device="cuda", dtype=torch.bfloat16 if i < 3 else torch.float32)
         for i, y in enumerate(arrays)]
    dense = [y.reshape((n, 1) + y.shape[2:]) for y in x]
    h0 = torch.zeros((n, h, d, d), device="cuda")
    pool_step = fla_pool_decode_call(*x)
    return {
        f"fla fused_recurrent dense B={n}": lambda i: fused_recurrent_kda(
            *dense, initial_state=h0, output_final_state=True),
        "fla fused_recurrent, pool in place (ssm_state_indices)": lambda i: pool_step(),
    }


def fla_rows(a, sets):
    spec = dict(sets=sets, heads=a.heads, head_dim=a.head_dim, iters=a.iters, repeats=a.repeats)
    proc = subprocess.run([sys.executable, "-m", "bench.serving", "--fla-child", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  fla failed: {proc.stderr.strip()[-600:]}", file=sys.stderr)
        return [dict(step="all", implementation="fla", ms=None,
                     error=proc.stderr.strip()[-300:])], {}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["rows"], {"torch": out["torch"], "fla": out["fla"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--sets", type=int, default=128, help="rotating bound sets")
    p.add_argument("--static-sets", type=int, default=16, help="sets the static form compiles")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kda-impl", default="triton", choices=("triton", "xla"))
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--fla-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.fla_child is not None:
        return fla_child(json.loads(a.fla_child))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts
    from bench.timing import versions
    from kda_jax.testing import SERVING_LENGTHS

    sets = serving_length_sets(SERVING_LENGTHS, a.sets)
    fla, fla_versions = ([], {}) if a.no_fla else fla_rows(a, sets)
    rows = kda_rows(a, sets) + fla
    meta = dict(versions(), **fla_versions, heads=a.heads, head_dim=a.head_dim, dtype="bfloat16",
                sets=a.sets, iters=a.iters, repeats=a.repeats,
                command="python -m bench.serving " + " ".join(
                    argv if argv is not None else sys.argv[1:]))
    print(f"{'step':<22} {'implementation':<56} {'ms/step':>9} {'host ms':>8} {'compile s':>10} "
          f"{'d2h/step':>9}")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "-"
        comp = f"{r['compile_s']:.2f}" if r.get("compile_s") is not None else ""
        d2h = r.get("d2h_per_step", r.get("syncs_per_step", ""))
        note = f"  ({r['error']})" if r.get("error") else ""
        host = f"{r['host_ms']:.3f}" if r.get("host_ms") is not None else "-"
        print(f"{r['step']:<22} {r['implementation']:<56} {ms:>9} {host:>8} {comp:>10} "
              f"{d2h!s:>9}{note}")
    print("d2h/step: kda_jax device-to-host reads (checked: the steps run with them disallowed); "
          "fla: synchronizing calls torch reports per step")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([dict(r, **meta) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
