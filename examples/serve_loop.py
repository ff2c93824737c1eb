"""A serving loop over a paged state pool, with the bucketed varlen form.

    python examples/serve_loop.py                                  # default backend (Triton on a GPU)
    python examples/serve_loop.py --implementation xla --steps 8   # CPU: small shapes, seconds

Requests arrive, prefill their prompt, decode one token per step and finish;
every step packs the running requests' decodes (one token each) and a few new
prefills into one varlen call, so the bounds change on every step. Each step's
bounds go into a :class:`kda_jax.VarlenBatch` padded to one fixed
:class:`kda_jax.Bucket`: the jitted step takes it as an ordinary argument (one
``jax.device_put`` of a small int32 buffer), so it compiles once, not once
per step. Steps with prefills run ``chunk_kda``; decode-only steps run
``fused_recurrent_kda``: two executables for the whole run. The state pool
(float32 ``[slots, HV, K, V]``) is donated, so it is updated in place.

Prints the compile time, steps/s, tokens/s and the compile count;
``--check N`` compares the first N steps with the float32 reference (reading
the pool back, outside the timed loop). Exit code 1 when a check fails or a
step compiled more than once.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax
from kda_jax import testing

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--implementation", default="none", choices=("none", "xla", "triton"))
    p.add_argument("--heads", type=int, help="H = HV; default 32 on a GPU, 2 on a CPU")
    p.add_argument("--head-dim", type=int, help="K = V; default 128 on a GPU, 32 on a CPU")
    p.add_argument("--max-seqs", type=int, help="sequences per step (the bucket); default 16 / 8")
    p.add_argument("--max-prompt", type=int, help="longest prompt; default 1300 / 40")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="q, k, v dtype; default bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--check", type=int, default=0, help="check the first N steps")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    gpu = jax.default_backend() != "cpu"
    a.heads = a.heads or (32 if gpu else 2)
    a.head_dim = a.head_dim or (128 if gpu else 32)
    a.max_seqs = a.max_seqs or (16 if gpu else 8)
    a.max_prompt = a.max_prompt or (1300 if gpu else 40)
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    a.implementation = None if a.implementation == "none" else a.implementation
    if min(a.steps, a.heads, a.head_dim, a.max_seqs, a.max_prompt) < 1:
        p.error("--steps, --heads, --head-dim, --max-seqs and --max-prompt must be >= 1")
    return a


class Scheduler:
    """Which requests run at each step: prefills of new requests (at most
    three, while slots and the token budget last) and one-token decodes of
    the running ones. Pure host bookkeeping (NumPy)."""

    def __init__(self, rng, *, max_seqs, max_prompt, slots):
        self.rng, self.max_seqs, self.max_prompt = rng, max_seqs, max_prompt
        self.max_tokens = 3 * max_prompt + max_seqs
        self.free = list(range(slots))
        self.running: dict[int, int] = {}  # request -> pool slot
        self.next_id = 0

    def step(self):
        """(lengths, slot per sequence, has_initial_state per sequence)."""
        for req in list(self.running):  # some requests finish
            if self.rng.random() < 0.1:
                self.free.append(self.running.pop(req))
        decodes = list(self.running.items())[: self.max_seqs - 1]
        lens, slots, has = [1] * len(decodes), [s for _, s in decodes], [True] * len(decodes)
        budget = self.max_tokens - len(lens)
        for _ in range(int(self.rng.integers(0, 4)) if len(lens) else 1):
            if not self.free or len(lens) == self.max_seqs or budget < 1:
                break
            n = int(self.rng.integers(1, self.max_prompt + 1))
            n = min(n, budget)
            slot = self.free.pop()
            self.running[self.next_id] = slot
            self.next_id += 1
            lens.append(n), slots.append(slot), has.append(False)
            budget -= n
        order = self.rng.permutation(len(lens))  # prefills and decodes interleaved
        return ([lens[i] for i in order], [slots[i] for i in order], [has[i] for i in order])


def main(argv=None) -> int:
    a = parse_args(argv)
    rng = np.random.default_rng(a.seed)
    d, h = a.head_dim, a.heads
    sched = Scheduler(rng, max_seqs=a.max_seqs, max_prompt=a.max_prompt, slots=4 * a.max_seqs)
    # One bucket for every mixed step, one for every decode-only step.
    mixed = kda_jax.Bucket(a.max_seqs, 1 << (sched.max_tokens - 1).bit_length())
    decode = kda_jax.Bucket(a.max_seqs, a.max_seqs)
    traces = {"chunk_kda": 0, "fused_recurrent_kda": 0}

    def make_step(fn):
        def step(pool, idx, has, q, k, v, g, beta, batch):
            traces[fn.__name__] += 1
            return fn(q, k, v, g, beta, cu_seqlens=batch, state_cache=pool, state_indices=idx,
                      has_initial_state=has, implementation=a.implementation)
        return jax.jit(step, donate_argnums=0)

    steps = {mixed: make_step(kda_jax.chunk_kda), decode: make_step(kda_jax.fused_recurrent_kda)}
    # Inputs for the largest bucket, on the device once (a model's layer would
    # produce them there); each step uses the first max_tokens rows.
    x = testing.make_inputs(a.seed, T=mixed.max_tokens, H=h, K=d, V=d, dtype=DTYPES[a.dtype])
    inputs = [jax.device_put(arr) for arr in x.args()]
    pool = jax.device_put(np.zeros((4 * a.max_seqs, h, d, d), np.float32)).copy()
    print(f"kda_jax {kda_jax.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"implementation {a.implementation or 'default'}")
    print(f"H={h} K=V={d} {a.dtype}; pool {pool.shape[0]} slots; buckets: mixed {mixed}, "
          f"decode-only {decode}")

    # Compile both executables first, with an all-padding batch (one empty
    # sequence, every index -1: nothing is read or written).
    t0 = time.perf_counter()
    for bucket, step in steps.items():
        empty = jax.device_put(kda_jax.VarlenBatch.from_lengths([0], bucket))
        pad = np.full(bucket.max_seqs, -1, np.int32)
        _, pool = step(pool, pad, np.zeros(bucket.max_seqs, bool),
                       *(arr[:, : bucket.max_tokens] for arr in inputs), empty)
    jax.block_until_ready(pool)
    print(f"compile: {time.perf_counter() - t0:.2f} s for {len(steps)} buckets")

    ok, tokens = True, 0
    t0 = time.perf_counter()
    for i in range(a.steps):
        lens, slots, has = sched.step()
        bucket = mixed if max(lens) > 1 else decode
        nb, n = bucket.max_seqs, len(lens)
        idx = np.full(nb, -1, np.int32)
        idx[:n] = slots
        has_b = np.zeros(nb, bool)
        has_b[:n] = has
        batch = jax.device_put(kda_jax.VarlenBatch.from_lengths(lens, bucket))
        args = [arr[:, : bucket.max_tokens] for arr in inputs]
        before = np.asarray(pool) if i < a.check else None
        o, pool = steps[bucket](pool, idx, has_b, *args, batch)
        if before is not None:
            ok &= check_step(x, lens, slots, has, before, o, pool, a.dtype, i)
        tokens += sum(lens)
    jax.block_until_ready(pool)
    elapsed = time.perf_counter() - t0
    compiles = sum(traces.values())
    note = f" (includes {a.check} checked steps)" if a.check else ""
    print(f"steps: {a.steps}: {a.steps / elapsed:.1f} steps/s, {tokens / elapsed:.0f} "
          f"tokens/s{note}")
    print(f"compiles: {compiles} ({traces}); one per bucket expected")
    ok &= all(c <= 1 for c in traces.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def check_step(x, lens, slots, has, before, o, pool, dtype, i) -> bool:
    """One step against the float32 reference: o of the real tokens, the
    written pool rows; o past the real tokens must be 0."""
    t = sum(lens)
    real = [arr[:, :t].astype(np.float32) for arr in x.args()]
    h0 = np.where(np.array(has)[:, None, None, None], before[slots], 0.0).astype(np.float32)
    ro, rs = kda_jax.naive_recurrent_kda(*real, cu_seqlens=np.cumsum([0] + lens),
                                         initial_state=h0, output_final_state=True)
    o = np.asarray(o.astype(jnp.float32))
    tol = testing.TOLERANCES[dtype]
    errs = [(name, testing.rel_rms(got, ref)) for name, got, ref in
            (("o", o[:, :t], ro), ("state", np.asarray(pool)[slots], rs))]
    good = all(e <= tol["rel_rms"] for _, e in errs) and not np.any(o[:, t:])
    print(f"check step {i}: lengths {lens}: " + ", ".join(f"{k} rel_rms {e:.1e}" for k, e in errs)
          + ("" if good else "  FAIL"))
    return good


if __name__ == "__main__":
    sys.exit(main())
