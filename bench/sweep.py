"""The sweep driver shared by bench.forward and bench.backward: the command
line for the rows, the implementation names (kda_jax's, config variants, "tree:PATH"),
and one loop that times kda_jax's implementations and reads the peers' times (fla and
cuDNN in the run's PyTorch child, bench.harness.Peers), printing a table and writing one
JSON row per (gate regime, shape, implementation) through bench.harness.Results."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import sys
import tempfile

import numpy as np

from bench.harness import (TREE, Peers, PeerUnavailable, Results, check_tree, tree_commit,
                           tree_rows as run_tree, why_unavailable)
from bench.inputs import GATES, make_gated, options
from kda_jax.testing import DENSE_SWEEP, rel_rms

PEERS = ("fla", "cudnn")  # timed in the PyTorch child; every other name is kda_jax's


def add_arguments(p):
    """The options every sweep takes."""
    p.add_argument("--impls", default="triton,fla,cudnn,xla",
                   help="measured in this order, each over every row: kda_jax's "
                        "implementations and variants, and the peers fla and cudnn")
    p.add_argument("--gates", default="init",
                   help="comma-separated gate regimes (bench.inputs.GATES): init, softplus, "
                        "layer, mild, strong")
    p.add_argument("--varlen", default=None, help="comma-separated lengths: one B=1 call")
    p.add_argument("--heads", type=int, default=32, help="H for --varlen")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shapes", default=None,
                   help="'B,T,H;B,T,H': these rows instead of the dense sweep")
    p.add_argument("--segment-chunks", type=int, default=None,
                   help="chunks per segment for triton-seq (default: the rule's choice)")
    p.add_argument("--json", default=None)


# Implementations besides kda_jax's own names: the Triton path with the
# segmented schedule off (today's single pass) or on for every row (the rule's
# segment length unless --segment-chunks); "triton" follows the rule of
# kda_jax.configs.SegmentConfig for the device. "triton@ARCH" (e.g.
# triton@gfx950) runs the Triton path with another arch's forward and backward
# configs (tiles, warps, product precisions) on this device: a relative figure
# for that config's numerics and cost here, not that arch's time.
# "triton:PATH=VALUE[+...]" (e.g. triton:prepare.16bit.stages=1) runs it with
# those values of this device's ForwardConfig changed (a path through its
# kernels, variants, "*" for all, and fields: kda_jax.configs.replace;
# "backward.PATH=VALUE" and "segment.PATH=VALUE": of its BackwardConfig and
# SegmentConfig).
SEGMENT_VARIANTS = ("triton-noseg", "triton-seq")

# "tree:PATH" times the Triton path of another kda_jax source tree (bench.harness.TREE;
# `kda_jax kernels` for a revision with the kernels outside the package) in the same run:
# the same benchmark module in a child process. It keeps a replaced kernel design
# comparable with its successor in one run.


def implementation(impl: str, segment_chunks: int | None = None):
    """(kda_jax implementation name, context manager to trace it under)."""
    from kda_jax import configs

    if impl.startswith(TREE):
        check_tree(impl[len(TREE):])
        return impl, contextlib.nullcontext()
    if impl.startswith("triton@"):
        return "triton", _arch_configs(impl.split("@", 1)[1])
    if impl.startswith("triton:"):
        return "triton", _changed_configs(impl.split(":", 1)[1])
    if impl == "triton-noseg":
        return "triton", configs.override(configs.SegmentConfig())
    if impl == "triton-seq":
        cfg = configs.segment_config()
        always = lambda rule: dataclasses.replace(rule, min_programs=2**31 - 1)
        rule = dataclasses.replace(cfg, forward=always(cfg.forward),
                                   backward=always(cfg.backward), segment_chunks=segment_chunks)
        return "triton", configs.override(rule)
    return impl, contextlib.nullcontext()


def _arch_configs(arch: str):
    from kda_jax import configs

    return _under(configs.forward_config(arch), configs.backward_config(arch),
                  configs.segment_config())


def config_changes(changes: str) -> dict:
    """``changes`` ("PATH=VALUE+backward.PATH=VALUE+segment.PATH=VALUE"; a
    path as :func:`kda_jax.configs.replace` takes it, a value an integer,
    True, False, None or a name such as a precision) as {"forward": {path:
    value}, "backward": {...}, "segment": {...}}."""
    fields = {owner: {} for owner in _OWNERS}
    for change in changes.split("+"):
        name, _, text = change.partition("=")
        owner, _, path = name.partition(".")
        if owner not in _OWNERS:
            owner, path = "forward", name
        if not text or not path:
            raise ValueError(f"{change!r}: not PATH=VALUE for a value of ForwardConfig (or "
                             "backward.PATH=VALUE of BackwardConfig, segment.PATH=VALUE of "
                             "SegmentConfig), e.g. prepare.16bit.warps=4")
        if path in fields[owner]:
            raise ValueError(f"{change!r}: {name} is set twice in {changes!r}")
        fields[owner][path] = _value_of(text)
    _check_paths(fields)
    return fields


def _check_paths(fields: dict):
    """Each change applied to the "default" arch's configs: a path or value
    that no config takes raises here, naming it."""
    from kda_jax import configs

    base = dict(forward=configs.FORWARD["default"], backward=configs.BACKWARD["default"],
                segment=configs.SEGMENTS["default"])
    for owner, paths in fields.items():
        for path, value in paths.items():
            try:
                configs.replace(base[owner], path, value)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{owner} config: {e}") from None


_OWNERS = ("forward", "backward", "segment")


def _changed_configs(changes: str):
    """A context manager tracing under the device's forward, backward and
    segment configs with ``changes`` (:func:`config_changes`). The configs are
    built here, so a bad change raises before anything runs."""
    from kda_jax import configs

    changed = dict(forward=configs.forward_config(), backward=configs.backward_config(),
                   segment=configs.segment_config())
    for owner, paths in config_changes(changes).items():
        for path, value in paths.items():
            try:
                changed[owner] = configs.replace(changed[owner], path, value)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{owner} config: {e}") from None
    return _under(changed["forward"], changed["backward"], changed["segment"])


def _value_of(text: str):
    if text in _CONSTANTS:
        return _CONSTANTS[text]
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text


_CONSTANTS = {"True": True, "False": False, "None": None}


@contextlib.contextmanager
def _under(forward, backward, segment):
    from kda_jax import configs

    with configs.override(forward, backward, segment):
        yield


def rows_of(args) -> list[tuple]:
    """(B, T, H, cu_seqlens or None) per row: --varlen, --shapes or the dense sweep."""
    if args.varlen:
        lens = [int(x) for x in args.varlen.split(",")]
        return [(1, sum(lens), args.heads, np.cumsum([0] + lens))]
    sweep = DENSE_SWEEP if not args.shapes else [
        tuple(int(x) for x in row.split(",")) for row in args.shapes.split(";")]
    return [(b, t, h, None) for b, t, h in sweep]


def gates_of(args) -> list[str]:
    gates = (getattr(args, "gates", None) or "init").split(",")
    bad = [g for g in gates if g not in GATES]
    if bad or len(set(gates)) < len(gates):
        raise ValueError(f"--gates {args.gates!r}: distinct names among {', '.join(GATES)}")
    return gates


def kda_jax_inputs(inputs: dict, gates: str):
    """((q, k, v, g, beta), params, flags) for kda_jax.chunk_kda: bf16 q, k, v, float32 g,
    beta; params {A_log [H], dt_bias [H * K]} (layer) or {}; flags the regime's options.
    ``inputs``: make_gated's dict, or a (q, k, v, g, beta) tuple (bench.inputs.make)."""
    import jax.numpy as jnp

    names = ("q", "k", "v", "g", "beta")
    inputs = inputs if isinstance(inputs, dict) else dict(zip(names, inputs))
    arrays = tuple(jnp.asarray(inputs[n], jnp.bfloat16 if n in ("q", "k", "v") else jnp.float32)
                   for n in names)
    params = {n: jnp.asarray(inputs[n].reshape(-1), jnp.float32)
              for n in ("A_log", "dt_bias") if n in inputs}
    return arrays, params, options(gates, "kda_jax")


def peer_stream(peers, cases, kd, vd, mode="forward", library="fla", references=None):
    """Yields (case index, row) of a peer for ``cases`` [(gates, B, T, H, cu)] as each is
    timed (row: {"ms", ...} as bench.fla_peer's sweep job gives it). A child that does not
    start or dies leaves the rows it did not give as {"ms": None, "unavailable" / "error"}."""
    spec = [[b, t, h, kd, vd, None if cu is None else [int(x) for x in cu], gates]
            for gates, b, t, h, cu in cases]
    done = set()
    try:
        for msg in peers.run({"job": "sweep", "library": library, "mode": mode, "rows": spec,
                              "references": references}):
            if "row" in msg:
                done.add(msg["row"]["index"])
                yield msg["row"]["index"], msg["row"]
            else:
                print(f"  {library} failed: {msg.get('error', msg)}", file=sys.stderr)
    except PeerUnavailable as e:
        print(f"  {library} failed: {e}", file=sys.stderr)
        why = why_unavailable(e, started=bool(done))
        yield from ((i, {"ms": None, **why}) for i in range(len(cases)) if i not in done)


def _cell(result):
    if result.get("ms"):
        return f"{result['ms']:>10.3f}"
    return f"{'refused' if 'refused' in result else '-':>10}"


def _line(case, results, impls, roof):
    """One table row: the times, triton / each peer and the roofline fraction."""
    gates, b, t, h, _ = case
    tri = results["triton"].get("ms") if "triton" in results else None
    line = f"{gates:>8} {b:>2} {t:>6} {h:>3} " + " ".join(_cell(results[i]) for i in impls)
    for peer in (p for p in PEERS if p in impls and "triton" in impls):
        ms = results[peer].get("ms")
        line += f"  {tri / ms:>10.3f}" if tri and ms else f"  {'-':>10}"
    if roof:
        line += f"  {100 * roof[0] / tri:>8.1f}" if tri else f"  {'-':>8}"
    return line


def run(args, argv, *, module: str, runner, mode: str, extra=None, roofline=None):
    """Times every (gate regime, row): ``runner(impl, inputs, cu, gates)`` gives a timing
    closure for a kda_jax implementation (inputs: bench.inputs.make_gated's arrays; a
    closure with an ``output()`` attribute gives o, which the forward compares across
    implementations); ``extra(b, t, h)`` adds fields to each record; ``roofline(b, t, h,
    kd, vd)`` -> (ms, bytes, flops) adds the roofline columns. Each implementation goes over
    every case in ``args.impls`` order (the peers in one child process), so
    "triton,fla,cudnn,xla" leaves the XLA path's slow compiles for last; ``args.json`` is
    rewritten after every case, so a run cut short keeps what it measured.
    Prints the table; returns each case's {implementation: ms or None}."""
    impls = args.impls.split(",")
    kd = vd = args.head_dim
    cases = [(gates, *row) for gates in gates_of(args) for row in rows_of(args)]
    results = [{impl: {"ms": None} for impl in impls} for _ in cases]
    roofs = [roofline(b, t, h, kd, vd) if roofline else None for _, b, t, h, _ in cases]
    peers, scratch = Peers(), tempfile.mkdtemp(prefix="kda-bench-o-")
    record = Results(module, argv, args.json, peers)
    references = [None] * len(cases)  # the triton path's o per case (.npy), forward only

    def save():
        if not args.json:
            return
        records = []
        for (gates, b, t, h, cu), row, roof in zip(cases, results, roofs):
            fields = dict(extra(b, t, h)) if extra else {}
            for impl in impls:
                ms = row[impl]["ms"]
                if roof:
                    fields.update(roofline_ms=roof[0], model_bytes=roof[1], model_flops=roof[2],
                                  roofline_fraction=(roof[0] / ms) if ms else None)
                ratios = {f"ratio_to_{p}": (ms / row[p]["ms"]) if (ms and row.get(p, {}).get("ms"))
                          else None for p in PEERS if p in impls}
                records.append(dict(
                    B=b, T=t, H=h, K=kd, V=vd, dtype="bfloat16", gates=gates,
                    varlen=None if cu is None else [int(x) for x in np.diff(cu)],
                    implementation=impl if impl in PEERS else f"kda_jax-{impl}",
                    **row[impl], **ratios, **fields))
        record.replace(records)

    header = (f"{'gates':>8} {'B':>2} {'T':>6} {'H':>3} " + " ".join(f"{i:>10}" for i in impls)
              + "".join(f"  {'triton/' + p:>10}" for p in PEERS if p in impls and "triton" in impls)
              + ("  roofline%" if roofline else ""))
    print(header, flush=True)
    for impl in impls:  # a bad variant name fails here, before anything is timed
        if impl not in PEERS:
            implementation(impl, getattr(args, "segment_chunks", None))
    try:
        for impl in impls:  # one implementation over every case, in --impls order
            if impl in PEERS:
                print(f"{impl} (child process):", flush=True)
                refs = references if any(references) else None
                for i, row in peer_stream(peers, cases, kd, vd, mode, impl, refs):
                    results[i][impl] = {k: v for k, v in row.items() if k != "index"}
                    print(_line(cases[i], results[i], impls, roofs[i]), flush=True)
                    save()
                continue
            print(f"{impl}:", flush=True)
            if impl.startswith(TREE):
                for i, row in enumerate(tree_rows(impl[len(TREE):], module, args, cases)):
                    results[i][impl] = row
                    print(_line(cases[i], results[i], impls, roofs[i]), flush=True)
                save()
                continue
            for i, (gates, b, t, h, cu) in enumerate(cases):
                try:
                    name, traced_under = implementation(impl, getattr(args, "segment_chunks", None))
                    with traced_under:  # the first call traces and compiles
                        timer = runner(name, make_gated(b, t, h, kd, vd, gates), cu, gates)
                        results[i][impl]["ms"] = timer()
                        _agreement(impl, i, timer, references, results, scratch, len(impls))
                except Exception as e:  # noqa: BLE001 - record and go on to the next peer
                    results[i][impl]["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"  {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                print(_line(cases[i], results[i], impls, roofs[i]), flush=True)
                save()
    finally:
        peers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return [{impl: row[impl]["ms"] for impl in impls} for row in results]


def tree_rows(path: str, module: str, args, cases) -> list[dict]:
    """The rows of ``cases`` timed by another source tree's Triton path (bench.harness.
    tree_rows): the same rows and gate regimes. Each row {"ms", "tree_commit"}, or
    {"ms": None, "error"} where the child gave none."""
    argv = ["--impls", "triton", "--gates", ",".join(gates_of(args)),
            "--head-dim", str(args.head_dim)]
    if args.varlen:
        argv += ["--varlen", args.varlen, "--heads", str(args.heads)]
    elif args.shapes:
        argv += ["--shapes", args.shapes]
    records, stderr, _ = run_tree(path, module, argv)
    timed = {(r["gates"], r["B"], r["T"], r["H"]): r for r in records}
    commit = tree_commit(path)
    rows = []
    for gates, b, t, h, _ in cases:
        r = timed.get((gates, b, t, h))
        if r is not None and r.get("ms"):
            rows.append({"ms": r["ms"], "tree_commit": commit})
        else:
            why = (r or {}).get("error") or stderr or "no row"
            rows.append({"ms": None, "error": why, "tree_commit": commit})
    return rows


def _agreement(impl, i, timer, references, results, scratch, n_impls):
    """The forward's o: the shipped path's (``triton``) is kept as the case's reference
    (.npy, read by the peers' child too); another implementation's records its relative
    RMS difference from it."""
    output = getattr(timer, "output", None)
    if output is None or n_impls < 2 or (impl != "triton" and references[i] is None):
        return
    o = output()
    if impl == "triton":
        references[i] = os.path.join(scratch, f"o-{i}.npy")
        np.save(references[i], o)
    else:
        results[i][impl]["o_rel_rms_to_triton"] = rel_rms(o, np.load(references[i]))
