"""kda_jax in one screen: a varlen batch through ``chunk_kda`` under ``jax.jit``.

    python -m kda_jax.demo             # small mixed batch; seconds on a CPU
    python -m kda_jax.demo --serving   # 12 one-token decodes + 3 prefills, H=32, K=V=128

The bounds are host data (:class:`kda_jax.SeqBounds`), a static argument of the
jitted step: its metadata is built once on the host at trace time, equal bounds
reuse the compiled program, and a step reads nothing back from the device. The
result is checked against the float32 token-by-token reference; the exit code is
1 when an error exceeds ``kda_jax.testing.TOLERANCES`` for the dtype.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

import kda_jax
from kda_jax import testing
from kda_jax.reference import naive_recurrent_kda

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
DEFAULT_LENGTHS = (0, 1, 37, 130, 1, 64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kda_jax.demo", description=__doc__.split("\n")[0])
    p.add_argument("--serving", action="store_true",
                   help="the serving step: 12 one-token sequences + 1100, 1300, 900 tokens; H=32, K=V=128")
    p.add_argument("--lengths", help="comma-separated sequence lengths (0 allowed), e.g. 0,1,37,130")
    p.add_argument("--heads", type=int, help="heads H (q/k and v); default 4, or 32 with --serving")
    p.add_argument("--head-dim", type=int, help="K = V; default 64, or 128 with --serving")
    p.add_argument("--dtype", default="bfloat16", type=lambda s: ALIASES.get(s, s), choices=sorted(DTYPES),
                   help="dtype of q, k, v (default bfloat16; g, beta and states are float32)")
    p.add_argument("--chunk-size", type=int, default=64, choices=(32, 64))
    p.add_argument("--implementation", default="none", choices=("none", "xla", "triton"),
                   help="backend; none picks the best available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed calls (median is shown)")
    a = p.parse_args(argv)
    if a.lengths is not None:
        try:
            a.lengths = tuple(int(x) for x in a.lengths.replace(" ", "").split(",") if x)
        except ValueError:
            p.error(f"--lengths must be comma-separated integers, got {a.lengths!r}")
        if not a.lengths or min(a.lengths) < 0:
            p.error("--lengths needs at least one length, all >= 0")
    else:
        a.lengths = testing.SERVING_LENGTHS if a.serving else DEFAULT_LENGTHS
    a.heads = a.heads or (32 if a.serving else 4)
    a.head_dim = a.head_dim or (128 if a.serving else 64)
    if a.repeats < 1 or a.heads < 1 or a.head_dim < 1:
        p.error("--repeats, --heads and --head-dim must be >= 1")
    a.implementation = None if a.implementation == "none" else a.implementation
    return a


def audit_jaxpr(closed) -> tuple[list[str], list[str], int]:
    """Callback primitives, jax.Array constants and Triton launches anywhere in a ClosedJaxpr."""
    callbacks, device_consts, triton = [], [], []

    def visit(cj):
        device_consts.extend(f"{c.dtype}{list(c.shape)}" for c in cj.consts if isinstance(c, jax.Array))
        for eqn in cj.jaxpr.eqns:
            if "callback" in eqn.primitive.name:
                callbacks.append(eqn.primitive.name)
            if eqn.primitive.name == "triton_kernel_call":
                triton.append(eqn)
            for v in eqn.invars:
                if isinstance(v, jex.Literal) and isinstance(v.val, jax.Array):
                    device_consts.append(f"literal {v.val.dtype}{list(v.val.shape)}")
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jex.ClosedJaxpr):
                        visit(sub)
                    elif isinstance(sub, jex.Jaxpr):
                        visit(jex.ClosedJaxpr(sub, ()))

    visit(closed)
    return callbacks, device_consts, len(triton)


def main(argv=None) -> int:
    a = parse_args(argv)
    dtype_name, H, D = a.dtype, a.heads, a.head_dim
    bounds = kda_jax.SeqBounds.from_lengths(a.lengths)
    N, T = bounds.num_seqs, bounds.total_tokens
    device = jax.devices()[0]
    print(f"kda_jax {kda_jax.__version__}, jax {jax.__version__}")
    print(f"JAX backend     : {jax.default_backend()} ({device.device_kind}, {device})")
    shown = list(a.lengths) if N <= 16 else list(a.lengths[:8]) + ["..."]
    print(f"sequences       : N={N}, lengths {shown}, T={T} tokens, chunk_size={a.chunk_size}")
    print(f"shapes          : q, k, v [1, {T}, {H}, {D}] {dtype_name}; "
          f"g [1, {T}, {H}, {D}] f32; beta [1, {T}, {H}] f32; initial_state [{N}, {H}, {D}, {D}] f32")

    x = testing.make_inputs(a.seed, T=T, H=H, K=D, V=D, N=N, dtype=DTYPES[dtype_name])
    args = jax.device_put((x.q, x.k, x.v, x.g, x.beta, x.initial_state))

    traces = 0

    @functools.partial(jax.jit, static_argnames="bounds")
    def step(q, k, v, g, beta, h0, bounds):
        nonlocal traces
        traces += 1
        return kda_jax.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 cu_seqlens=bounds, chunk_size=a.chunk_size,
                                 implementation=a.implementation)

    # Every call of the step, compile included, runs with device-to-host reads refused.
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            t0 = time.perf_counter()
            jax.block_until_ready(step(*args, bounds=bounds))
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(a.repeats):
                same = kda_jax.SeqBounds.from_lengths(a.lengths)  # equal contents, new object
                t0 = time.perf_counter()
                o, final = jax.block_until_ready(step(*args, bounds=same))
                times.append(time.perf_counter() - t0)
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    n_traces = traces
    callbacks, device_consts, launches = audit_jaxpr(step.trace(*args, bounds=bounds).jaxpr)
    interpret = os.environ.get("KDA_JAX_INTERPRET") == "1"  # Triton's interpreter, via host callbacks
    if launches:
        used = f"triton ({launches} Triton kernel launches)"
    elif interpret and callbacks:
        used = f"triton in Triton's interpreter on the host ({len(callbacks)} host callbacks)"
    else:
        used = "xla (XLA ops only, no Triton launch)"
    print(f"implementation  : requested {a.implementation!r}; the jitted program runs {used}")

    o_ref, final_ref = naive_recurrent_kda(*args[:5], initial_state=args[5],
                                           output_final_state=True, cu_seqlens=bounds)
    tol = testing.TOLERANCES[dtype_name]
    ok = True
    print(f"errors vs float32 reference (tolerance rel_rms {tol['rel_rms']:.0e}, max_abs {tol['max_abs']:.0e}):")
    for name, got, ref in (("o", o, o_ref), ("final_state", final, final_ref)):
        got, ref = np.asarray(got.astype(jnp.float32)), np.asarray(ref)
        r, m = testing.rel_rms(got, ref), testing.max_abs(got, ref)
        good = bool(np.all(np.isfinite(got))) and r <= tol["rel_rms"] and m <= tol["max_abs"]
        ok &= good
        print(f"  {name:<12}{str(list(got.shape)):<20} rel_rms {r:.2e}  max_abs {m:.2e}  "
              f"{'ok' if good else 'FAIL'}")

    print(f"first call      : {compile_s * 1e3:.1f} ms (trace + host metadata + compile + run)")
    print(f"steady state    : {statistics.median(times) * 1e3:.3f} ms median of {a.repeats} calls "
          f"(block_until_ready)")
    print(f"jit traces      : {n_traces} for {1 + a.repeats} calls with equal SeqBounds"
          + (" (cache hits)" if n_traces == 1 else " (UNEXPECTED retraces)"))
    guard_note = (" (on CPU device memory is host memory: this guard cannot trigger there)"
                  if device.platform == "cpu" else "")
    structural = not callbacks and not device_consts
    print(f"device-to-host  : none; every call ran under transfer_guard_device_to_host('disallow')"
          f"{guard_note}")
    verdict = "passed" if structural else "not applicable" if interpret else "FAILED"
    print(f"structural check: {verdict}: the jitted step's jaxpr has {len(callbacks)} callback "
          f"primitives and {len(device_consts)} jax.Array constants"
          + (f" {callbacks + device_consts}" if not structural else "")
          + (" (KDA_JAX_INTERPRET=1 runs the kernels on the host)" if interpret and not structural else ""))
    ok &= (structural or interpret) and n_traces == 1
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
