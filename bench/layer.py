"""One KDA layer, kda_jax.nn.KimiDeltaAttention against fla's KimiDeltaAttention:
parity (the same weights and bf16 inputs) and timing, in one run.

    python -m bench.layer [--gates softplus,safe] [--json bench/results/h200-layer.json]
                          [--no-fla] [--smoke]
    python -m bench.layer --skip-timing --fla-first-config   # parity alone, quickly

``--gates``: the layer's gate forms, each a run of its own (rows carry "gates"):
"softplus", fla's default -exp(A_log) * softplus(x + dt_bias), and "safe",
-5 * sigmoid(exp(A_log) * (x + dt_bias)) with fla's safe_gate (bench.layer_fla.GATE_FORMS).

Parity: fla's layer is built (fla's init, bf16, on the GPU) in a child process
(bench.layer_fla; torch and JAX run badly in one process, see bench.fla_peer),
its weights converted with ``kda_jax.nn.from_fla_state_dict`` into ours
(bf16 parameters; A_log and dt_bias float32, the same values). For each case
our layer's outputs and gradients (for the same cotangent) are compared, as
relative RMS errors, with fla's bf16 layer ("vs fla triton") and with fla's
layer in float32 on fla's naive recurrence ("vs fla naive fp32", the
reference); fla's own error against that reference is recorded beside them.
Cases: "dense" [2, 512] and "varlen" (lengths 1, 63, 200, 500, 260) in
training mode (y, dx, every parameter's gradient); "decode": 4 sequences
prefill 100 tokens through the cache, then one token each (the outputs and
the conv and KDA states after each; fla's conv states are compared on the
W - 1 columns ours keeps).

Timing (bench.timing, medians; compilation excluded): the layer's forward and
forward + backward (gradients of the parameters and x) at [1, 8192, 2048],
16 heads, K = V = 128, bf16; one decode step of 256 sequences (ours with a
dense cache and with the cache as a pool updated in place, donated). Both
layers hold the same parameters (fla's init, converted) and take the same
inputs (bench.layer_fla.timing_inputs). The ratio is ours over fla's.

``--smoke`` uses tiny sizes (``--impl xla --no-fla`` runs on a CPU: it checks
the code path; CPU timings are not results). ``--fla-cpu`` is the parity
without a GPU: fla's layer on the CPU (its short-convolution and norm Triton
kernels in Triton's interpreter, its naive float32 KDA path), GVA (4 value
heads on 2) and V = 2 K at tiny sizes, against ours in float32 on the XLA
path; ``--fla-python`` names a Python with torch and fla when this one has
neither (bench/results/cpu-layer-parity.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import Peers, PeerUnavailable, Results
from bench.layer_fla import CASES, CPU, FULL, GATE_FORMS, SMOKE, timing_inputs
from bench.timing import time_calls
from kda_jax.testing import rel_rms

CONV_KEYS = ("conv_q", "conv_k", "conv_v")


def our_layer(config: dict, implementation: str | None):
    from flax import nnx

    from kda_jax.nn import KimiDeltaAttention

    return KimiDeltaAttention(config["hidden"], config["heads"], config["head_dim"],
                              num_v_heads=config.get("v_heads"),
                              expand_v=config.get("expand_v", 1),
                              param_dtype=jnp.dtype(config.get("dtype", "bfloat16")),
                              implementation=implementation,
                              mode=config.get("mode", "chunk"),
                              safe_gate=config.get("safe_gate", False),
                              lower_bound=config.get("lower_bound"), rngs=nnx.Rngs(config["seed"]))


def _split(layer):
    from flax import nnx

    graph, params = nnx.split(layer, nnx.Param)
    return (lambda p: nnx.merge(graph, p)), params


def _fla_cache(cache, layer, tag: str) -> dict[str, np.ndarray]:
    from kda_jax.nn import cache_to_fla

    conv, h = cache_to_fla(cache, layer)
    out = {f"{tag}/recurrent": h}
    out.update({f"{tag}/{k}": c for k, c in zip(CONV_KEYS, conv)})
    return out


def run_ours(layer, name: str, inputs: dict) -> dict[str, np.ndarray]:
    """Our layer on a case's inputs; the results in fla's keys and layouts
    (float32 NumPy), as bench.layer_fla writes fla's."""
    from kda_jax.nn import to_fla_state_dict

    merge, params = _split(layer)
    dtype = layer.param_dtype  # bf16, or float32 against fla's layer on the CPU
    bf16 = lambda a: jnp.asarray(a, dtype)
    if name == "decode":
        @jax.jit
        def step(params, x, cache):
            return merge(params)(x, cache=cache)

        x0 = bf16(inputs["x_prefill"])
        y0, cache = step(params, x0, layer.init_cache(x0.shape[0], dtype=dtype))
        out = {"y_prefill": np.asarray(y0, np.float32), **_fla_cache(cache, layer, "prefill")}
        y1, cache = step(params, bf16(inputs["x_step"]), cache)
        return {**out, "y_step": np.asarray(y1, np.float32), **_fla_cache(cache, layer, "step")}
    bounds = None if "cu_seqlens" not in inputs else np.asarray(inputs["cu_seqlens"])

    @jax.jit
    def train(params, x, dy):
        y, vjp = jax.vjp(lambda p, x: merge(p)(x, cu_seqlens=bounds), params, x)
        return (y, *vjp(dy))

    y, dparams, dx = train(params, bf16(inputs["x"]), bf16(inputs["dy"]))
    out = {"y": np.asarray(y, np.float32), "dx": np.asarray(dx, np.float32)}
    out.update({f"grad/{k}": v for k, v in to_fla_state_dict(dparams, layer).items()})
    return out


def _error(a, b, key):
    if any(f"/{c}" in key for c in CONV_KEYS):  # ours keeps fla's last W - 1 columns
        a, b = a[..., 1:], b[..., 1:]
    return rel_rms(a, b)


def compare(name: str, ours: dict, triton: dict | None, naive: dict | None) -> list[dict]:
    """Rows of relative RMS errors for every quantity of a case."""
    rows = []
    for key in ours:
        row = {"case": name, "quantity": key}
        if triton is not None:
            row["vs_fla_triton"] = _error(ours[key], triton[key], key)
        if naive is not None:
            row["vs_fla_naive_fp32"] = _error(ours[key], naive[key], key)
        if triton is not None and naive is not None:
            row["fla_triton_vs_naive_fp32"] = _error(triton[key], naive[key], key)
        rows.append(row)
    return rows


def _progress(what: str):
    """A line on stderr as each stage ends (fla's autotuning and our compiles take minutes)."""
    print(f"[bench.layer] {what}", file=sys.stderr, flush=True)


def parity(fla: Peers, config: dict, cases: dict, implementation) -> list[dict]:
    from kda_jax.nn import from_fla_state_dict

    directory = tempfile.mkdtemp(prefix="kda-layer-")
    try:
        files = {}
        for msg in fla.run({"job": "parity", "config": config, "cases": cases,
                            "dir": directory}):
            if "error" in msg:
                raise PeerUnavailable(f"fla's parity job failed: {msg['error']}\n{fla.tail()}")
            files[(msg["row"]["case"], msg["row"]["variant"])] = msg["row"]["file"]
            _progress(f"fla's layer: {msg['row']['case']} ({msg['row']['variant']}) done")
        layer = our_layer(config, implementation)
        from_fla_state_dict(dict(np.load(os.path.join(directory, "weights.npz"))), layer)
        rows = []
        for name in cases:
            inputs = dict(np.load(os.path.join(directory, f"{name}-inputs.npz")))
            load = lambda v: dict(np.load(files[(name, v)])) if (name, v) in files else None
            rows += compare(name, run_ours(layer, name, inputs), load("triton"), load("naive"))
            _progress(f"ours: {name} done")
        return rows
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def our_timings(config: dict, implementation, tokens: int, decode_seqs: int, iters: int,
                repeats: int, weights: dict | None = None) -> dict[str, float]:
    """ms per call of our layer (with fla's ``weights`` where given): forward, forward +
    backward, and a decode step (dense cache; pool cache donated and updated in place)."""
    from kda_jax.nn import from_fla_state_dict

    layer = our_layer(config, implementation)
    if weights is not None:
        from_fla_state_dict(weights, layer)
    merge, params = _split(layer)
    x, dy, x_step = (jnp.asarray(a, jnp.bfloat16)
                     for a in timing_inputs(config["hidden"], tokens, decode_seqs, config["seed"]))
    forward = jax.jit(lambda p, x: merge(p)(x))

    @jax.jit
    def forward_backward(p, x, dy):
        _, vjp = jax.vjp(lambda p, x: merge(p)(x), p, x)
        return vjp(dy)

    decode = jax.jit(lambda p, x, c: merge(p)(x, cache=c), donate_argnums=2)
    state = {}

    def timed(call):
        def run(_):
            state["out"] = call()
        return time_calls(run, lambda: jax.block_until_ready(state["out"]), iters, repeats)[0]

    def step(form):
        def call():
            y, state[form] = decode(params, x_step, state[form])
            return y, state[form]
        return call

    cache = lambda: layer.init_cache(decode_seqs, dtype=jnp.bfloat16)
    state["dense"] = cache()
    state["pool"] = cache().at(jnp.arange(decode_seqs, dtype=jnp.int32))
    calls = {"forward": lambda: forward(params, x),
             "forward+backward": lambda: forward_backward(params, x, dy),
             "decode step": step("dense"), "decode step, pool": step("pool")}
    rows = {}
    for what, call in calls.items():  # each row printed as it lands
        rows[what] = timed(call)
        _progress(f"ours: {what} {rows[what]:.3f} ms")
    return rows


def fla_timings(fla: Peers, config: dict, tokens: int, decode_seqs: int, iters: int,
                repeats: int):
    """fla's layer timed in the child: ({what: row}, its weights or None, ok)."""
    rows, ok = {}, True
    directory = tempfile.mkdtemp(prefix="kda-layer-")
    try:
        for msg in fla.run({"job": "timing", "config": config, "tokens": tokens, "dir": directory,
                            "decode_seqs": decode_seqs, "iters": iters, "repeats": repeats}):
            if "row" in msg:
                rows[msg["row"]["what"]] = msg["row"]
                _progress(f"fla: {msg['row']['what']} {msg['row'].get('ms')} ms")
            else:
                print(f"fla timing: {msg}", file=sys.stderr)
                ok = False
        path = os.path.join(directory, "weights.npz")
        return rows, (dict(np.load(path)) if os.path.exists(path) else None), ok
    except PeerUnavailable as e:
        print(f"fla timing failed: {e}", file=sys.stderr)
        return rows, None, False
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def timing_rows(ours: dict, fla_rows: dict) -> list[dict]:
    rows = []
    for what, ms in ours.items():
        base = what.split(",")[0]
        fla_ms = fla_rows.get(base, {}).get("ms")
        rows.append({"what": what, "implementation": "kda_jax.nn", "ms": ms,
                     "fla_ms": fla_ms, "ratio_to_fla": None if not fla_ms else ms / fla_ms})
    for what, row in fla_rows.items():
        rows.append({"what": what, "implementation": "fla", **{k: v for k, v in row.items()
                                                               if k != "what"}})
    return rows


def print_tables(parity_rows, timing, shapes):
    if parity_rows:
        print("\nparity, relative RMS: ours vs fla's layer | ours vs fla's naive float32 "
              "path | fla's layer vs its naive path")
        for r in parity_rows:
            cols = [f"{r[k]:.2e}" if k in r else "-" for k in
                    ("vs_fla_triton", "vs_fla_naive_fp32", "fla_triton_vs_naive_fp32")]
            print(f"  {r['case']:7s} {r['quantity']:28s} " + "  ".join(cols))
    if not timing:
        return
    print(f"\ntiming ({shapes}): ms")
    for r in timing:
        ratio = "" if r.get("ratio_to_fla") is None else f"  ratio {r['ratio_to_fla']:.2f}"
        ms = "error" if r.get("ms") is None else f"{r['ms']:.3f}"
        print(f"  {r['implementation']:10s} {r['what']:20s} {ms}{ratio}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--impl", default="triton", choices=("triton", "xla"))
    p.add_argument("--no-fla", action="store_true", help="our timings only (no parity)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--tokens", type=int, default=None, help="default 8192 (smoke 64)")
    p.add_argument("--decode-seqs", type=int, default=None, help="default 256 (smoke 4)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fla-cpu", action="store_true",
                   help="parity only, against fla's layer on the CPU (its Triton kernels in "
                        "the interpreter, its naive float32 path); ours in float32, XLA")
    p.add_argument("--fla-python", default=sys.executable,
                   help="the Python that runs fla's child (one with torch and fla)")
    p.add_argument("--fla-first-config", action="store_true",
                   help="fla's autotuned kernels take their first config (for --skip-timing: "
                        "parity does not depend on the tuning, which takes minutes per shape)")
    p.add_argument("--mode", default="chunk", choices=("chunk", "fused_recurrent"),
                   help="our layer's mode (fused_recurrent: a quick check of the code "
                        "path on a CPU; its Triton form has no backward)")
    p.add_argument("--gates", default="softplus",
                   help=f"comma-separated gate forms among {', '.join(GATE_FORMS)}")
    args = p.parse_args(argv)
    forms = args.gates.split(",")
    if not forms or any(f not in GATE_FORMS for f in forms) or len(set(forms)) < len(forms):
        p.error(f"--gates {args.gates!r}: distinct names among {', '.join(GATE_FORMS)}")
    config = dict(SMOKE if args.smoke else FULL, mode=args.mode)
    cases = CASES["smoke" if args.smoke else "full"]
    child = [args.fla_python, "-m", "bench.layer_fla"]
    if args.fla_cpu:
        config, cases = dict(CPU, dtype="float32", mode=args.mode), CASES["smoke"]
        args.impl, args.skip_timing, args.no_fla = "xla", True, False
        child.append("--cpu")
    elif args.fla_first_config:
        if not args.skip_timing:
            p.error("--fla-first-config would time fla untuned: use it with --skip-timing")
        child.append("--first-config")
    tokens = args.tokens or (64 if args.smoke else 8192)
    decode_seqs = args.decode_seqs or (4 if args.smoke else 256)
    fla = Peers(child, enabled=not args.no_fla)
    if fla.enabled:
        try:
            fla.start()
        except PeerUnavailable as e:
            print(f"fla unavailable, our side only: {e}", file=sys.stderr)
    results = Results("bench.layer", argv, args.json, fla)
    shapes = (f"[1, {tokens}, {config['hidden']}], {config['heads']} heads, K = V = "
              f"{config['head_dim']}; decode {decode_seqs} sequences; bf16")
    rc = 0
    try:
        for form in forms:
            cfg = dict(config, **GATE_FORMS[form])
            parity_rows, timing = [], []
            if fla.usable and not args.skip_parity:
                try:
                    parity_rows = parity(fla, cfg, cases, args.impl)
                except PeerUnavailable as e:
                    print(f"parity failed: {e}", file=sys.stderr)
                    rc = 1
            if not args.skip_timing:
                fla_rows, weights = {}, None
                if fla.usable:
                    fla_rows, weights, ok = fla_timings(fla, cfg, tokens, decode_seqs,
                                                        args.iters, args.repeats)
                    rc = rc or int(not ok)
                ours = our_timings(cfg, args.impl, tokens, decode_seqs, args.iters,
                                   args.repeats, weights)
                timing = timing_rows(ours, fla_rows)
            print(f"\n== gates: {form}")
            print_tables(parity_rows, timing, shapes)
            results.add(*[{"kind": "parity", "gates": form, **r} for r in parity_rows],
                        *[{"kind": "timing", "gates": form, "shape": shapes, **r}
                          for r in timing])
    finally:
        fla.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
