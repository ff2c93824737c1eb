"""A small serving engine over one bfloat16 state pool: prefills with prefix
checkpoints, one-token decodes and speculative verifies in every step.

    python examples/serve_loop.py                                  # default backend (Triton on a GPU)
    python examples/serve_loop.py --implementation xla --steps 8   # CPU: small shapes, seconds

Requests arrive, prefill their prompt, then either decode one token per step
or verify ``--drafts`` S draft tokens per step (1 + S tokens), and finish.
Each step is one jitted function of two calls on the same pool:

* the mixed call packs new prefills and the plain decodes into one
  :class:`kda_jax.VarlenBatch` of a fixed :class:`kda_jax.Bucket`
  (``chunk_kda_pool``; ``fused_recurrent_kda_pool`` when only decodes run, a
  second bucket): each prefill writes its prompt's state every ``chunk_size``
  tokens into prefix-cache rows (``PoolRows.checkpoint_indices``) and its
  final state into its own row;
* the verify call (``fused_recurrent_kda_pool``, ``[Nv, 1 + S]`` tokens)
  starts each speculative request from the row of its last accepted token
  (``num_accepted_tokens``) and writes the state after every token to its own
  row (``ssm_state_indices [Nv, 1 + S]``); the acceptance counts for the next
  step are drawn at random here, where a model would compare the drafts.

Padded slots carry index -1 and touch nothing. The pool is donated, so each
step updates it in place; the bounds, indices and counts are runtime
arguments, so each bucket's step compiles once. Prints the compile time,
steps/s, tokens/s and the compile count; ``--check N`` compares the first N
steps with the float32 reference (reading the pool back, outside the timed
loop). Exit code 1 when a check fails or a step compiled more than once.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
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
    p.add_argument("--max-seqs", type=int, help="sequences per call (the buckets); default 16 / 6")
    p.add_argument("--max-prompt", type=int, help="longest prompt; default 1300 / 80")
    p.add_argument("--drafts", type=int, default=3, help="S, draft tokens per verify")
    p.add_argument("--checkpoint-every", type=int, choices=(32, 64),
                   help="prefix checkpoints every n tokens (the chunk size); default 64 / 32")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="q, k, v dtype; default bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--check", type=int, default=0, help="check the first N steps")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    gpu = jax.default_backend() != "cpu"
    # Defaults only where the option was left out: an explicit 0 is an error below.
    defaults = dict(heads=(32, 2), head_dim=(128, 32), max_seqs=(16, 6), max_prompt=(1300, 80),
                    dtype=("bfloat16", "float32"), checkpoint_every=(64, 32))
    for name, (on_gpu, on_cpu) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, on_gpu if gpu else on_cpu)
    a.implementation = None if a.implementation == "none" else a.implementation
    for name in ("steps", "heads", "head_dim", "max_seqs", "max_prompt"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.drafts < 0:
        p.error(f"--drafts={a.drafts} must be >= 0")
    if not 0 <= a.check <= a.steps:
        p.error(f"--check={a.check} must lie in [0, --steps={a.steps}]: it checks the first N "
                "steps")
    if a.seed < 0:
        p.error(f"--seed={a.seed} must be >= 0 (a NumPy seed)")
    return a


@dataclasses.dataclass
class Request:
    rows: list          # its state rows: one, or 1 + S for a speculative request
    prefix: list        # its prompt's checkpoint rows (a prefix cache's entries)
    accepted: int = 0   # tokens accepted in its last verify (0: not prefilled yet)


@dataclasses.dataclass
class Plan:
    """One step's calls, padded to their buckets (host NumPy)."""
    lens: list
    idx: np.ndarray          # int32 [Nb]: each mixed sequence's row
    has: np.ndarray          # bool [Nb]: False for a prefill (starts from zeros)
    prefix: np.ndarray       # int32 [Nb, J]: checkpoint rows, -1 for none
    verify_rows: np.ndarray  # int32 [Nv, 1 + S]
    accepted: np.ndarray     # int32 [Nv]


class Scheduler:
    """Which requests run at each step (pure host bookkeeping): some finish,
    new ones prefill while rows and the token budget last, the plain ones
    decode, the speculative ones verify."""

    def __init__(self, rng, *, max_seqs, max_prompt, drafts, slots, every):
        self.rng, self.max_seqs, self.max_prompt, self.s = rng, max_seqs, max_prompt, drafts
        self.every = every
        self.j = -(-max_prompt // every)  # checkpoints of the longest prompt
        self.max_tokens = 3 * max_prompt + max_seqs
        self.free = list(range(slots))
        self.running: dict[int, Request] = {}
        self.next_id = 0

    def _take(self, n):
        rows, self.free = self.free[:n], self.free[n:]
        return rows

    def step(self) -> Plan:
        for rid, req in list(self.running.items()):
            if self.rng.random() < 0.1:
                self.free += req.rows + req.prefix
                del self.running[rid]
        spec = [r for r in self.running.values() if len(r.rows) > 1][: self.max_seqs]
        plain = [r for r in self.running.values() if len(r.rows) == 1][: self.max_seqs - 1]
        lens, idx, has, prefix = [1] * len(plain), [r.rows[0] for r in plain], \
            [True] * len(plain), [[-1] * self.j for _ in plain]
        budget = self.max_tokens - len(lens)
        for _ in range(int(self.rng.integers(1, 4))):
            n = min(int(self.rng.integers(1, self.max_prompt + 1)), budget)
            speculative = self.rng.random() < 0.5
            need = (1 + self.s if speculative else 1) + -(-n // self.every)
            if len(lens) == self.max_seqs or n < 1 or len(self.free) < need:
                break
            req = Request(self._take(1 + self.s if speculative else 1),
                          self._take(-(-n // self.every)))
            self.running[self.next_id] = req
            self.next_id += 1
            # A speculative request's prefill fills its last column, as if a
            # verify had accepted every token: its first verify reads it.
            lens.append(n), idx.append(req.rows[-1]), has.append(False)
            prefix.append(req.prefix + [-1] * (self.j - len(req.prefix)))
            req.accepted = len(req.rows)
            budget -= n
        plan = self.plan(lens or [0], idx, has, prefix, [r.rows for r in spec],
                         [r.accepted for r in spec])
        for req in spec:
            req.accepted = int(self.rng.integers(1, 2 + self.s))  # the model's verdict
        return plan

    def plan(self, lens, idx, has, prefix, verify_rows, accepted) -> Plan:
        """A Plan padded to the buckets (max_seqs slots, index -1, count 1)."""
        nb, w = self.max_seqs, 1 + self.s
        pad = lambda x, fill, dt: np.array(list(x) + [fill] * (nb - len(x)), dt)
        return Plan(list(lens), pad(idx, -1, np.int32), pad(has, False, bool),
                    np.array(list(prefix) + [[-1] * self.j] * (nb - len(prefix)),
                             np.int32).reshape(nb, self.j),
                    np.array(list(verify_rows) + [[-1] * w] * (nb - len(verify_rows)),
                             np.int32).reshape(nb, w),
                    pad(accepted, 1, np.int32))


def main(argv=None) -> int:
    a = parse_args(argv)
    rng = np.random.default_rng(a.seed)
    d, h, w = a.head_dim, a.heads, 1 + a.drafts
    every = a.checkpoint_every
    slots = 2 * a.max_seqs * (w + -(-a.max_prompt // every))
    sched = Scheduler(rng, max_seqs=a.max_seqs, max_prompt=a.max_prompt, drafts=a.drafts,
                      slots=slots, every=every)
    # One bucket for every step with prefills, one for decode-only steps.
    mixed = kda_jax.Bucket(a.max_seqs, 1 << (sched.max_tokens - 1).bit_length(), chunk_size=every)
    decode = kda_jax.Bucket(a.max_seqs, a.max_seqs, max_len=1)
    traces = {mixed: 0, decode: 0}

    def make_step(bucket):
        def step(pool, plan, inputs, verify_inputs, batch):
            traces[bucket] += 1
            rows = kda_jax.PoolRows(plan["idx"], has_initial_state=plan["has"])
            kw = dict(cu_seqlens=batch, implementation=a.implementation)
            if bucket is mixed:
                o, pool = kda_jax.chunk_kda_pool(
                    *inputs, pool, rows._replace(checkpoint_indices=plan["prefix"]),
                    chunk_size=every, checkpoint_every=every, **kw)
            else:
                o, pool = kda_jax.fused_recurrent_kda_pool(*inputs, pool, rows, **kw)
            ov, pool = kda_jax.fused_recurrent_kda_pool(
                *verify_inputs, pool, kda_jax.PoolRows(plan["verify_rows"],
                                                       num_accepted_tokens=plan["accepted"]),
                implementation=a.implementation)
            return o, ov, pool
        return jax.jit(step, donate_argnums=0)

    steps = {bucket: make_step(bucket) for bucket in traces}
    # Inputs on the device once (a model's layers would produce them there);
    # a step uses the first max_tokens rows, the verify the first Nv * (1 + S).
    x = testing.make_inputs(a.seed, T=mixed.max_tokens, H=h, K=d, V=d, dtype=DTYPES[a.dtype])
    inputs = [jax.device_put(arr) for arr in x.args()]
    xv = testing.make_inputs(a.seed + 1, B=a.max_seqs, T=w, H=h, K=d, V=d,
                             dtype=DTYPES[a.dtype], with_state=False)
    verify_inputs = [jax.device_put(arr) for arr in xv.args()]
    pool = jax.device_put(np.zeros((slots, h, d, d), jnp.bfloat16)).copy()
    print(f"kda_jax {kda_jax.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"implementation {a.implementation or 'default'}")
    print(f"H={h} K=V={d} {a.dtype}; bfloat16 pool of {slots} rows; {a.drafts} drafts; "
          f"buckets: mixed {mixed}, decode-only {decode}")

    def args_of(plan: Plan, bucket):
        device = {k: jax.device_put(v) for k, v in dataclasses.asdict(plan).items() if k != "lens"}
        batch = jax.device_put(kda_jax.VarlenBatch.from_lengths(plan.lens, bucket))
        return device, [arr[:, : bucket.max_tokens] for arr in inputs], verify_inputs, batch

    # Compile both executables first on all-padding plans (every index -1:
    # nothing is read or written), and read each one's buffer aliasing: the
    # pool (argument 0) must come back in its own buffer (output 2).
    t0 = time.perf_counter()
    ok = True
    for bucket, step in steps.items():
        idle = sched.plan([0], [-1], [False], [], [], [])
        hlo = step.lower(pool, *args_of(idle, bucket)).compile().as_text()
        in_place = re.search(r"input_output_alias=\{[^\n]*\{2\}: \(0, \{\}", hlo) is not None
        print(f"{'mixed' if bucket is mixed else 'decode-only'} step: pool updated in place: "
              f"{'yes' if in_place else 'NO'}")
        ok &= in_place
        *_, pool = step(pool, *args_of(idle, bucket))
    jax.block_until_ready(pool)
    print(f"compile: {time.perf_counter() - t0:.2f} s for {len(steps)} buckets")

    tokens = 0
    t0 = time.perf_counter()
    for i in range(a.steps):
        plan = sched.step()
        # A prefill runs in the mixed bucket, however short: it has checkpoints.
        bucket = mixed if max(plan.lens) > 1 or (plan.prefix >= 0).any() else decode
        before = np.asarray(pool.astype(jnp.float32)) if i < a.check else None
        o, ov, pool = steps[bucket](pool, *args_of(plan, bucket))
        if before is not None:
            ok &= check_step(x, xv, plan, every, before, o, ov, pool, i)
        tokens += sum(plan.lens) + w * int((plan.verify_rows[:, 0] >= 0).sum())
    jax.block_until_ready(pool)
    elapsed = time.perf_counter() - t0
    compiles = sum(traces.values())
    note = f" (includes {a.check} checked steps)" if a.check else ""
    print(f"steps: {a.steps}: {a.steps / elapsed:.1f} steps/s, {tokens / elapsed:.0f} "
          f"tokens/s{note}")
    print(f"compiles: {compiles} (mixed {traces[mixed]}, decode-only {traces[decode]}); "
          "one per bucket expected")
    ok &= all(c <= 1 for c in traces.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _states_after(args, cu, h0, n, t):
    """The float64 reference's state of sequence n after its first t tokens."""
    sl = slice(int(cu[n]), int(cu[n]) + t)
    return kda_jax.naive_recurrent_kda(*(x[:, sl] for x in args), initial_state=h0[n:n + 1],
                                       output_final_state=True)[1][0]


def check_step(x, xv, plan: Plan, every, before, o, ov, pool, i) -> bool:
    """One step against the float32 reference: o of the real tokens (0 past
    them), each written row (final states, checkpoints, every verify token's
    state), the verify's outputs."""
    pool = np.asarray(pool.astype(jnp.float32))
    n, t = len(plan.lens), sum(plan.lens)
    cu = np.cumsum([0] + plan.lens)
    real = [arr[:, :t].astype(np.float32) for arr in x.args()]
    rows = plan.idx[:n]
    h0 = np.where(plan.has[:n, None, None, None], before[rows], 0.0).astype(np.float32)
    ro, rs = kda_jax.naive_recurrent_kda(*real, cu_seqlens=cu, initial_state=h0,
                                         output_final_state=True)
    o = np.asarray(o.astype(jnp.float32))
    got, want = list(pool[rows]), list(np.asarray(rs))
    for s in range(n):
        for j in np.flatnonzero(plan.prefix[s] >= 0):  # the state before each interval
            got.append(pool[plan.prefix[s, j]])
            want.append(_states_after(real, cu, h0, s, j * every))
    errs = [("o", testing.rel_rms(o[:, :t], ro))]
    live = np.flatnonzero(plan.verify_rows[:, 0] >= 0)
    if live.size:
        vrows = plan.verify_rows[live]
        vh0 = before[vrows[np.arange(live.size), plan.accepted[live] - 1]]
        wv = vrows.shape[1]
        vreal = [arr[live].reshape((1, -1) + arr.shape[2:]).astype(np.float32)
                 for arr in xv.args()]
        vcu = np.arange(live.size + 1) * wv
        rov = kda_jax.naive_recurrent_kda(*vreal, cu_seqlens=vcu, initial_state=vh0)[0]
        for s in range(live.size):
            for c in range(wv):
                got.append(pool[vrows[s, c]])
                want.append(_states_after(vreal, vcu, vh0, s, c + 1))
        ov = np.asarray(ov.astype(jnp.float32))[live].reshape(rov.shape)
        errs.append(("verify o", testing.rel_rms(ov, rov)))
    errs.append(("states", testing.rel_rms(np.stack(got), np.stack(want))))
    tol = testing.TOLERANCES["bfloat16"]["rel_rms"]  # the pool rounds every state to bf16
    good = all(e <= tol for _, e in errs) and not np.any(o[:, t:])
    print(f"check step {i}: lengths {plan.lens}, {live.size} verifies, {len(got)} rows: "
          + ", ".join(f"{k} rel_rms {e:.1e}" for k, e in errs) + ("" if good else "  FAIL"))
    return good


if __name__ == "__main__":
    sys.exit(main())
