"""A dense decode step's time by what happens to its state buffers.

    python -m bench.decode_donation [--n 256] [--rounds 6] [--json PATH]

N one-token sequences (H = 32, K = V = 128, bf16 q/k/v), fused_recurrent_kda
with a float32 initial and final state, three ways of calling the jitted step:
  keep:    step(h0) with a fixed h0; the last result held while the next runs
           (bench.serving's dense row);
  drop:    the same, the last result released before the next call (as fla's
           bench drops its final state);
  donated: h = step(h) with h donated, the state carried from step to step.
The donated form is not in place: the kernel writes a new buffer and XLA
copies it into the donated one (a state pool, ``state_cache``, is the
in-place form). Rounds alternate the three (bench.serving.wall_ms: the median of
--repeats loops of --iters calls); medians per form. GPU only for
results (``--impl xla`` runs it anywhere, as the CPU test does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

FORMS = ("keep", "drop", "donated")


def decode_calls(n: int, h: int, d: int, impl: str = "triton") -> tuple[dict, dict]:
    """({form: call(i)}, state): the three ways of calling one dense decode step."""
    import jax
    import jax.numpy as jnp

    import kda_jax
    from bench.inputs import make

    x = [jnp.asarray(y, jnp.bfloat16 if i < 3 else jnp.float32).reshape((n, 1) + y.shape[2:])
         for i, y in enumerate(make(1, n, h, d, d, seed=1))]

    def step(h0, *x):
        return kda_jax.fused_recurrent_kda(*x, initial_state=h0, output_final_state=True,
                                           implementation=impl)[1]

    plain, donated = jax.jit(step), jax.jit(step, donate_argnums=0)
    h0 = jnp.zeros((n, h, d, d), jnp.float32)
    state = {"h": jnp.zeros((n, h, d, d), jnp.float32)}

    def keep(i):
        state["ht"] = plain(h0, *x)

    def drop(i):
        state.pop("ht", None)
        state["ht"] = plain(h0, *x)

    def carried(i):
        state["h"] = donated(state["h"], *x)

    return {"keep": keep, "drop": drop, "donated": carried}, state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--impl", default="triton", choices=("triton", "xla"))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts
    import jax

    from bench.serving import wall_ms
    from bench.timing import versions

    calls, state = decode_calls(a.n, a.heads, a.head_dim, a.impl)
    sync = lambda: jax.block_until_ready(list(state.values()))  # noqa: E731
    times = {form: [] for form in FORMS}
    for r in range(a.rounds):
        for form in FORMS:
            times[form].append(wall_ms(calls[form], sync, a.iters, a.repeats)[0])
        print(f"round {r} " + "  ".join(f"{f} {times[f][-1]:.4f} ms" for f in FORMS), flush=True)
    medians = {form: statistics.median(t) for form, t in times.items()}
    print("median " + "  ".join(f"{f} {m:.4f} ms" for f, m in medians.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(medians_ms=medians, rounds_ms=times, n=a.n, heads=a.heads,
                           head_dim=a.head_dim, impl=a.impl, iters=a.iters, repeats=a.repeats,
                           versions=versions(),
                           command="python -m bench.decode_donation " + " ".join(
                               argv if argv is not None else sys.argv[1:])), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
