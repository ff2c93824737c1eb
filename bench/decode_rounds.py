"""The decode step against fla's in alternating rounds, one ratio per round.

    python -m bench.decode_rounds [--n 256] [--rounds 8] [--forms dense,pool] [--json PATH]

bench.serving times kda_jax's steps, then fla's in a child process: two
processes one after the other, and a GPU whose clocks and temperature drift
between them moves a step of ~0.27 ms by a few per cent (seen on the H200:
fla's decode kernel 264 us in one process, 271 in another). Here the fla child
stays alive and the two take turns: each round times kda_jax's step and
fla's (the order swapped every round), each the median of --repeats loops of
--iters calls (bench.serving.wall_ms). A drift then falls on both sides of a
round alike; the result is the median of the per-round ratios, with their
range.

Forms (bench.serving's decode rows, the same inputs): "dense", N one-token
sequences [N, 1] with a float32 initial and final state (fla's public
fused_recurrent_kda), and "pool", the serving decode (packed tokens, device
bounds, a pool updated in place; ours with the batch moved by jax.device_put,
fla's through ssm_state_indices). GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

FORMS = ("dense", "pool")


def kda_name(form: str, n: int) -> str:
    """bench.serving.kda_decode_steps' row of ``form``."""
    return f"dense B={n}" if form == "dense" else "bucketed + pool"


def fla_name(form: str, n: int) -> str:
    """bench.serving.fla_decode_steps' row of ``form``."""
    return (f"fla fused_recurrent dense B={n}" if form == "dense"
            else "fla fused_recurrent, pool in place (ssm_state_indices)")


def round_order(r: int) -> tuple[str, str]:
    """Who goes first in round ``r``: kda_jax on even rounds, fla on odd."""
    return ("kda_jax", "fla") if r % 2 == 0 else ("fla", "kda_jax")


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


def child(spec: dict) -> int:
    """fla's side: reads a form per stdin line, answers one JSON line with its time."""
    import torch

    from bench.serving import fla_decode_steps, wall_ms

    n = spec["n"]
    steps = fla_decode_steps(n, spec["heads"], spec["head_dim"])
    print(json.dumps({"ready": True, "torch": torch.__version__,
                      "fla": getattr(__import__("fla"), "__version__", "?")}), flush=True)
    for line in sys.stdin:
        form = line.strip()
        if not form:
            break
        ms, host_ms = wall_ms(steps[fla_name(form, n)], torch.cuda.synchronize, spec["iters"],
                              spec["repeats"])
        print(json.dumps({"ms": ms, "host_ms": host_ms}), flush=True)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--forms", default="dense,pool")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        return child(json.loads(a.child))
    forms = a.forms.split(",")
    for form in forms:
        if form not in FORMS:
            raise SystemExit(f"--forms: {form!r} must be one of {FORMS}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts

    import jax

    from bench.serving import kda_decode_steps, wall_ms
    from bench.timing import versions

    spec = dict(n=a.n, heads=a.heads, head_dim=a.head_dim, iters=a.iters, repeats=a.repeats)
    proc = subprocess.Popen([sys.executable, "-m", "bench.decode_rounds", "--child",
                             json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    hello = json.loads(proc.stdout.readline() or '{"ready": false}')
    if not hello.get("ready"):
        raise SystemExit(f"the fla child did not start (exit {proc.wait()})")

    def fla_ms(form):
        proc.stdin.write(form + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())["ms"]

    steps = kda_decode_steps(a.n, a.heads, a.head_dim)

    def kda_ms(form):
        call, sync, _ = steps[kda_name(form, a.n)]
        with jax.transfer_guard_device_to_host("disallow"):
            return wall_ms(call, sync, a.iters, a.repeats)[0]

    rounds = []
    try:
        for r in range(a.rounds):
            for form in forms:
                times = {}
                for side in round_order(r):
                    times[side] = kda_ms(form) if side == "kda_jax" else fla_ms(form)
                rounds.append(dict(round=r, form=form, first=round_order(r)[0],
                                   kda_jax_ms=times["kda_jax"], fla_ms=times["fla"]))
                print(f"round {r} {form:6s} kda_jax {times['kda_jax']:.4f} ms  fla "
                      f"{times['fla']:.4f} ms  ratio {times['kda_jax'] / times['fla']:.3f}",
                      flush=True)
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait()
    summary = summarize(rounds)
    for form, s in summary.items():
        print(f"{form}: kda_jax {s['kda_jax_ms']:.4f} ms, fla {s['fla_ms']:.4f} ms, ratio "
              f"{s['ratio_median']:.3f} (rounds {s['ratio_min']:.3f}-{s['ratio_max']:.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(summary=summary, rounds=rounds, n=a.n, heads=a.heads,
                           head_dim=a.head_dim, iters=a.iters, repeats=a.repeats,
                           versions=dict(versions(), torch=hello.get("torch"),
                                         fla=hello.get("fla")),
                           command="python -m bench.decode_rounds " + " ".join(
                               argv if argv is not None else sys.argv[1:])), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
