"""Decode steps (one token per sequence): kda_jax's fused_recurrent_kda against fla's.

    python -m bench.decode [--sizes 256,1024] [--rounds 0] [--json PATH] [--no-fla]
                           [--tree PATH]

Forms over N one-token sequences, H = 32, K = V = 128, bf16 q/k/v:
  dense  [N, 1] tokens, a float32 initial and final state per sequence (fla's
         public fused_recurrent_kda);
  pool   the serving decode: packed [1, N] tokens in a decode bucket
         (Bucket(N, N, max_len=1)), a float32 pool donated and updated in place
         (fla: its pool updated in place through ssm_state_indices, device
         cu_seqlens). kda_jax's batch goes to jit as NumPy ("host batch": jit's
         dispatch copies it) or through jax.device_put first.
  pool bf16  the same over a bfloat16 pool (half the state bytes moved).
  verify N sequences of 1 + S tokens (--drafts S, default 3): ssm_state_indices
         [N, 1 + S] with num_accepted_tokens [N] (vLLM's speculative verify),
         the state after every token written to its row; fla's
         fused_recurrent_kda_fwd with the same ssm_state_indices and counts.
kda_jax's steps are also timed 8 to a program ("8 in one jit", per step), as a
model's layers share one program and its host cost. Times per step are wall
clock as the host sees it (bench.timing); "host ms" is the time to issue a step.

--rounds R adds R alternating rounds per form at the first size: fla's process
stays alive and the two sides take turns (the order swapped every round), so a
drift of the GPU's clocks between processes falls on both; the result is the
median of the per-round ratios and their range. GPU numbers only; on a CPU
(--kda-impl xla --no-fla) it checks the code path.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

from bench.harness import Peers, Results, add_tree_argument, tree_rows_of
from bench.inputs import add_step_arguments, make

FORMS = ("dense", "pool", "pool bf16", "verify")


def kda_steps(n, h, d, impl="triton", drafts=3) -> dict:
    """kda_jax's decode steps over ``n`` one-token sequences (zero states):
    {(form, name): (call(i), sync(), steps per call)}; the verify form runs
    ``n`` sequences of 1 + drafts tokens."""
    import jax
    import jax.numpy as jnp

    import kda_jax

    def pool_steps(pool, batch, idx, *x, steps=1):
        for _ in range(steps):  # each step over the last one's pool
            o, pool = kda_jax.fused_recurrent_kda_pool(*x, pool, kda_jax.PoolRows(idx),
                                                       cu_seqlens=batch, implementation=impl)
        return o, pool

    def dense_steps(h0, *x, steps=1):
        x = [y.reshape((y.shape[1], 1) + y.shape[2:]) for y in x]
        for _ in range(steps):  # each step from the last one's states
            o, h0 = kda_jax.fused_recurrent_kda(*x, initial_state=h0, output_final_state=True,
                                                implementation=impl)
        return o, h0

    def verify_steps(pool, rows, accepted, *x):
        return kda_jax.fused_recurrent_kda_pool(
            *x, pool, kda_jax.PoolRows(rows, num_accepted_tokens=accepted),
            implementation=impl)

    pool1 = jax.jit(pool_steps, donate_argnums=0)
    verify1 = jax.jit(verify_steps, donate_argnums=0)
    pool8 = jax.jit(functools.partial(pool_steps, steps=8), donate_argnums=0)
    dense1 = jax.jit(dense_steps)
    dense8 = jax.jit(functools.partial(dense_steps, steps=8))
    x = tuple(jnp.asarray(y, jnp.bfloat16 if i < 3 else jnp.float32)
              for i, y in enumerate(make(1, n, h, d, d, seed=1)))
    bucket, ones = kda_jax.Bucket(n, n, max_len=1), [1] * n
    idx, h0 = jnp.arange(n, dtype=jnp.int32), jnp.zeros((n, h, d, d), jnp.float32)
    state = {"pool": jnp.zeros((n, h, d, d), jnp.float32),
             "pool bf16": jnp.zeros((n, h, d, d), jnp.bfloat16),
             "verify": jnp.zeros((n * (1 + drafts), h, d, d), jnp.float32)}
    # The verify: N sequences of 1 + S tokens, [N, 1 + S] rows, the counts
    # cycling through 1..1 + S (as fla's peer row).
    w = 1 + drafts
    xv = tuple(jnp.asarray(y, jnp.bfloat16 if i < 3 else jnp.float32).reshape(
        (n, w) + y.shape[2:]) for i, y in enumerate(make(1, n * w, h, d, d, seed=2)))
    rows = jnp.arange(n * w, dtype=jnp.int32).reshape(n, w)
    accepted = jnp.arange(n, dtype=jnp.int32) % w + 1

    def call_pool(i, put, step, key="pool"):
        batch = put(kda_jax.VarlenBatch.from_lengths(ones, bucket))
        state["o"], state[key] = step(state[key], batch, idx, *x)

    def call_verify(i):
        state["o"], state["verify"] = verify1(state["verify"], rows, accepted, *xv)

    host = lambda b: b
    sync_pool = lambda key="pool": jax.block_until_ready(state[key])
    sync_dense = lambda: jax.block_until_ready(state["ht"])
    return {
        ("pool", "host batch"): (functools.partial(call_pool, put=host, step=pool1), sync_pool, 1),
        ("pool", "device_put batch"): (
            functools.partial(call_pool, put=jax.device_put, step=pool1), sync_pool, 1),
        ("pool", "host batch, 8 in one jit"): (
            functools.partial(call_pool, put=host, step=pool8), sync_pool, 8),
        ("pool bf16", "bf16 pool, host batch"): (
            functools.partial(call_pool, put=host, step=pool1, key="pool bf16"),
            functools.partial(sync_pool, "pool bf16"), 1),
        ("verify", f"S={drafts}, [N, {w}] rows"): (
            call_verify, functools.partial(sync_pool, "verify"), 1),
        ("dense", "one step per call"): (lambda i: state.update(ht=dense1(h0, *x)[1]),
                                         sync_dense, 1),
        ("dense", "8 in one jit"): (lambda i: state.update(ht=dense8(h0, *x)[1]), sync_dense, 8),
    }


# The kda_jax row each form's rounds time against fla's.
ROUND_STEP = {"dense": "one step per call", "pool": "host batch", "pool bf16": "bf16 pool, host batch"}


def kda_ms(steps, form, name, iters, repeats) -> tuple[float, float]:
    import jax

    from bench.timing import time_calls

    call, sync, per = steps[(form, name)]
    with jax.transfer_guard_device_to_host("disallow"):
        ms, host_ms = time_calls(call, sync, iters, repeats)
    return ms / per, host_ms / per


def summarize(rounds: list[dict]) -> dict:
    """Per form: the medians of each side's times and of the per-round ratios
    (kda_jax / fla), and the ratios' range."""
    out = {}
    for form in sorted({r["form"] for r in rounds}):
        rows = [r for r in rounds if r["form"] == form]
        ratios = [r["kda_jax_ms"] / r["fla_ms"] for r in rows]
        out[form] = dict(rounds=len(rows),
                         kda_jax_ms=statistics.median(r["kda_jax_ms"] for r in rows),
                         fla_ms=statistics.median(r["fla_ms"] for r in rows),
                         ratio_median=statistics.median(ratios),
                         ratio_min=min(ratios), ratio_max=max(ratios))
    return out


def round_order(r: int) -> tuple[str, str]:
    """Who goes first in round ``r``: kda_jax on even rounds, fla on odd."""
    return ("kda_jax", "fla") if r % 2 == 0 else ("fla", "kda_jax")


def run(a, peers, results):
    """Every row of the benchmark, added to ``results`` as it is measured; fla's through
    ``peers`` (bench.harness)."""

    def fla_rows(n, forms, syncs=True, iters=None):
        job = dict(job="decode", n=n, heads=a.heads, head_dim=a.head_dim, forms=list(forms),
                   drafts=a.drafts, iters=iters or a.iters, repeats=a.repeats, syncs=syncs)
        return list(peers.rows(job))

    for n in a.sizes:
        step = f"decode N={n}"
        steps = kda_steps(n, a.heads, a.head_dim, a.kda_impl, a.drafts)
        peer = {}
        if peers.usable:  # a missing fla: one row (the first size's) says why
            for r in fla_rows(n, FORMS):
                peer[r.get("form")] = r.get("ms")
                results.add(dict(step=step, implementation=f"fla {r.get('form', '')}".strip(),
                                 **r))
        for form, name in steps:
            row = dict(step=step, form=form, implementation=f"kda_jax {a.kda_impl} {name}",
                       steps_per_call=steps[(form, name)][2])
            try:
                row["ms"], row["host_ms"] = kda_ms(steps, form, name, a.iters, a.repeats)
                row["d2h_per_step"] = 0
            except Exception as e:  # noqa: BLE001 - a failed row is recorded, not fatal
                row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
            fla_ms = peer.get(form)
            row["ratio_to_fla"] = row["ms"] / fla_ms if row.get("ms") and fla_ms else None
            results.add(row)
        if n == a.sizes[0] and a.rounds and all(peer.get(f) for f in ROUND_STEP):
            results.add(*rounds_rows(a, n, steps, fla_rows, step))


def rounds_rows(a, n, steps, fla_rows, step) -> list[dict]:
    """The alternating rounds' rows: per form, the medians over the rounds that finished;
    where fla's child fails, its row (which says why) and the rounds before it."""
    rounds, failed = [], []
    for r in range(a.rounds):
        for form in ROUND_STEP:
            times = {}
            for side in round_order(r):
                if side == "kda_jax":
                    times[side] = kda_ms(steps, form, ROUND_STEP[form], a.iters, a.repeats)[0]
                else:
                    row = fla_rows(n, [form], syncs=False)[0]
                    times[side] = row.get("ms")
            if not times["fla"]:
                failed.append(dict(row, step=step, implementation=f"fla {form}, round {r}"))
                break
            rounds.append(dict(round=r, form=form, first=round_order(r)[0],
                               kda_jax_ms=times["kda_jax"], fla_ms=times["fla"]))
            print(f"round {r} {form:6s} kda_jax {times['kda_jax']:.4f} ms  fla "
                  f"{times['fla']:.4f} ms  ratio {times['kda_jax'] / times['fla']:.3f}", flush=True)
        if failed:
            break
    return failed + [dict(step=f"decode N={n}", form=form, implementation=f"rounds: kda_jax "
                 f"{ROUND_STEP[form]} / fla {form}", ms=s["kda_jax_ms"], fla_ms=s["fla_ms"],
                 ratio_to_fla=s["ratio_median"], ratio_min=s["ratio_min"],
                 ratio_max=s["ratio_max"], rounds=s["rounds"],
                 per_round=[r for r in rounds if r["form"] == form])
            for form, s in summarize(rounds).items()]


def print_table(rows):
    print(f"{'step':<14} {'implementation':<52} {'ms/step':>9} {'host ms':>8} {'/ fla':>7}")
    for r in rows:
        ms = f"{r['ms']:.4f}" if r.get("ms") is not None else "-"
        host = f"{r['host_ms']:.3f}" if r.get("host_ms") is not None else "-"
        ratio = f"{r['ratio_to_fla']:.3f}" if r.get("ratio_to_fla") else ""
        if "ratio_min" in r:
            ratio += f" ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
        why = r.get("error") or r.get("unavailable")
        note = f"  ({why})" if why else ""
        print(f"{r.get('step', ''):<14} {r['implementation']:<52} {ms:>9} {host:>8} {ratio:>7}{note}")


def main(argv=None):
    # No abbreviations: --tree reruns this command line less its own options (harness).
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--sizes", default="256,1024", help="comma-separated N")
    p.add_argument("--drafts", type=int, default=3, help="S of the verify rows")
    p.add_argument("--rounds", type=int, default=0,
                   help="alternating rounds with fla at the first size (0: none)")
    add_step_arguments(p)
    add_tree_argument(p)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.sizes = [int(x) for x in a.sizes.split(",")]
    if any(n < 1 for n in a.sizes):
        p.error(f"--sizes: every N must be >= 1, got {a.sizes}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    with Peers(enabled=not a.no_fla) as peers:
        results = Results("bench.decode", argv, a.json, peers, heads=a.heads,
                          head_dim=a.head_dim, dtype="bfloat16", iters=a.iters,
                          repeats=a.repeats)
        run(a, peers, results)
        peers.close()  # its memory, before a tree's process
        for path in a.tree:
            results.add(*tree_rows_of(path, "bench.decode", argv, step="tree"))
    print_table(results.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
