"""The mixed serving step with new bounds on every call: kda_jax (bucketed, static) against fla.

    python -m bench.serving [--json PATH] [--sets 128] [--static-sets 16] [--no-fla]
                            [--tree PATH]

The step: 12 one-token decodes plus prefills of 1100, 1300 and 900 tokens
(kda_jax.testing.SERVING_LENGTHS), H = 32, K = V = 128, bf16 q/k/v; call i takes
bound set i % --sets (the lengths permuted, prefills moved by up to 64 tokens:
one bucket). Rows: kda_jax's bucketed form with a state pool (the batch passed
to jit as NumPy, or moved by jax.device_put first) and with initial/final
states; its static form (one compile per new bounds, compile time reported
separately; steady state over --static-sets precompiled sets); fla's chunk_kda
with device cu_seqlens and with cu_seqlens_cpu (in a child process,
bench.fla_peer). The decode-only steps are bench.decode.

Times are wall clock per step as the host sees it (host metadata build and
transfer included; bench.timing); "host ms" is the time the loop took to issue
its calls (near ms: host-bound). kda_jax's steps run under
transfer_guard_device_to_host("disallow"): a device-to-host read raises, so 0 in
the d2h column is checked, not assumed; fla's column counts its synchronizing
calls per step. GPU numbers only; on a CPU (--kda-impl xla) it checks the code path.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

from bench.harness import Peers, Results, add_tree_argument, tree_rows_of
from bench.inputs import add_step_arguments, make, serving_length_sets
from kda_jax.bounds import next_pow2


def kda_rows(a, sets) -> list[dict]:
    """kda_jax's rows of the mixed step over the bound ``sets``."""
    import jax
    import jax.numpy as jnp

    import kda_jax
    from bench.timing import time_calls
    from kda_jax import bounds as host_bounds

    h, d, impl, rows = a.heads, a.head_dim, a.kda_impl, []
    bucket = kda_jax.Bucket(next_pow2(max(map(len, sets))), next_pow2(max(map(sum, sets))))
    arrays = make(1, bucket.max_tokens, h, d, d)
    x = tuple(jnp.asarray(y, jnp.bfloat16 if i < 3 else jnp.float32)
              for i, y in enumerate(arrays))
    nb = bucket.max_seqs
    h0 = jnp.zeros((nb, h, d, d), jnp.float32)
    step = f"mixed N={len(sets[0])} T~{sum(sets[0])}"

    def run(name, call, sync, **extra):
        try:
            with jax.transfer_guard_device_to_host("disallow"):
                ms, host_ms = time_calls(call, sync, a.iters, a.repeats)
            rows.append(dict(step=step, implementation=name, ms=ms, host_ms=host_ms,
                             d2h_per_step=0, **extra))
        except Exception as e:  # noqa: BLE001 - a failed row is recorded, not fatal
            rows.append(dict(step=step, implementation=name, ms=None,
                             error=f"{type(e).__name__}: {str(e)[:300]}", **extra))

    # The host's cost of one batch, uncached: build(), not from_lengths(), since
    # from_lengths reuses the buffers of recently seen lengths and a serving step
    # with new bounds builds its batch anew.
    cus = [np.cumsum([0] + list(lens)) for lens in sets]
    start = time.perf_counter()
    for cu in cus:
        host_bounds.chunk_table.cache_clear(), host_bounds.chunk_offsets.cache_clear()
        kda_jax.VarlenBatch.build(cu, bucket)
    build_us = (time.perf_counter() - start) * 1e6 / len(sets)
    host_batch = lambda i: kda_jax.VarlenBatch.build(cus[i % len(sets)], bucket)
    device_batch = lambda i: jax.device_put(host_batch(i))

    # idx is an argument: a device array closed over would be embedded as a
    # constant, which reads it back to the host at compile time.
    idx = jnp.asarray(np.r_[np.arange(len(sets[0])), -np.ones(nb - len(sets[0]))], jnp.int32)
    pooled = jax.jit(lambda pool, batch, idx, *x: kda_jax.chunk_kda_pool(
        *x, pool, kda_jax.PoolRows(idx), cu_seqlens=batch, implementation=impl),
        donate_argnums=0)
    plain = jax.jit(lambda batch, h0, *x: kda_jax.chunk_kda(
        *x, cu_seqlens=batch, initial_state=h0, output_final_state=True, implementation=impl))
    state = {"pool": jnp.zeros((4 * nb, h, d, d), jnp.float32)}  # rows for 4 steps' requests

    def call_pooled(i, batch_of):
        state["o"], state["pool"] = pooled(state["pool"], batch_of(i), idx, *x)

    t0 = time.perf_counter()
    jax.block_until_ready(plain(device_batch(0), h0, *x))
    compile_s = time.perf_counter() - t0
    sync_pool = lambda: jax.block_until_ready(state["pool"])
    run(f"kda_jax {impl} bucketed + pool, host batch",
        functools.partial(call_pooled, batch_of=host_batch), sync_pool, bucket=str(bucket))
    run(f"kda_jax {impl} bucketed + pool", functools.partial(call_pooled, batch_of=device_batch),
        sync_pool, host_build_us=build_us, bucket=str(bucket))
    run(f"kda_jax {impl} bucketed", lambda i: state.update(out=plain(device_batch(i), h0, *x)),
        lambda: jax.block_until_ready(state["out"]), compile_s=compile_s,
        compiles=plain._cache_size(), bucket=str(bucket))

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
        lambda: jax.block_until_ready(state["out"]), compile_s=compile_s,
        compiles=static._cache_size(), sets=len(static_bounds))
    return rows


def fla_rows(a, sets, peers) -> list[dict]:
    """fla's rows of the mixed step (the run's PyTorch child, bench.harness.Peers)."""
    step = f"mixed N={len(sets[0])} T~{sum(sets[0])}"
    job = dict(job="serving", sets=sets, heads=a.heads, head_dim=a.head_dim, iters=a.iters,
               repeats=a.repeats)
    return [dict(dict(implementation="fla"), step=step, **r) for r in peers.rows(job)]


def print_table(rows):
    print(f"{'step':<22} {'implementation':<48} {'ms/step':>9} {'host ms':>8} {'compile s':>10} "
          f"{'d2h/step':>9}")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "-"
        host = f"{r['host_ms']:.3f}" if r.get("host_ms") is not None else "-"
        comp = f"{r['compile_s']:.2f}" if r.get("compile_s") is not None else ""
        d2h = r.get("d2h_per_step", r.get("syncs_per_step", ""))
        why = r.get("error") or r.get("unavailable")
        note = f"  ({why})" if why else ""
        print(f"{r.get('step', ''):<22} {r['implementation']:<48} {ms:>9} {host:>8} {comp:>10} "
              f"{d2h!s:>9}{note}")
    print("d2h/step: kda_jax device-to-host reads (checked: the steps run with them disallowed); "
          "fla: synchronizing calls torch reports per step")


def main(argv=None):
    # No abbreviations: --tree reruns this command line less its own options (harness).
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--json", default=None)
    p.add_argument("--sets", type=int, default=128, help="rotating bound sets")
    p.add_argument("--static-sets", type=int, default=16, help="sets the static form compiles")
    p.add_argument("--lengths", default=None,
                   help="comma-separated lengths of the step (default: SERVING_LENGTHS)")
    add_step_arguments(p)
    add_tree_argument(p)
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    from kda_jax.testing import SERVING_LENGTHS

    base = SERVING_LENGTHS if a.lengths is None else [int(x) for x in a.lengths.split(",")]
    sets = serving_length_sets(base, a.sets)
    with Peers(enabled=not a.no_fla) as peers:
        results = Results("bench.serving", argv, a.json, peers, heads=a.heads,
                          head_dim=a.head_dim, dtype="bfloat16", sets=a.sets, iters=a.iters,
                          repeats=a.repeats)
        if peers.enabled:
            results.add(*fla_rows(a, sets, peers))
            peers.close()  # its memory, before kda_jax's rows
        results.add(*kda_rows(a, sets))
        for path in a.tree:
            results.add(*tree_rows_of(path, "bench.serving", argv, step="tree"))
    print_table(results.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
