"""The sweep driver shared by bench.forward and bench.backward: the command
line for the rows, and one loop that times kda_jax's implementations and reads
fla's times (measured in a child process, bench.fla_peer), printing a table and
writing one JSON row per (shape, implementation), each with the run's metadata
(bench.meta)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys

import numpy as np

from bench import meta as run_meta
from bench.fla_peer import FlaPeer, FlaUnavailable
from bench.inputs import make
from kda_jax.testing import DENSE_SWEEP


def add_arguments(p):
    """The options every sweep takes."""
    p.add_argument("--impls", default="triton,fla,xla",
                   help="measured in this order, each over every row")
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
# "triton:FIELD=VALUE[+...]" (e.g. triton:prepare_stages=1) runs it with those
# fields of this device's ForwardConfig changed ("backward.FIELD=VALUE" and
# "segment.FIELD=VALUE": of its BackwardConfig and SegmentConfig).
SEGMENT_VARIANTS = ("triton-noseg", "triton-seq")


def implementation(impl: str, segment_chunks: int | None = None):
    """(kda_jax implementation name, context manager to trace it under)."""
    from kda_jax import configs

    if impl.startswith("triton@"):
        return "triton", _arch_configs(impl.split("@", 1)[1])
    if impl.startswith("triton:"):
        return "triton", _changed_configs(impl.split(":", 1)[1])
    if impl == "triton-noseg":
        return "triton", configs.override_segments(configs.SegmentConfig())
    if impl == "triton-seq":
        rule = dataclasses.replace(configs.segment_config(), min_programs=2**31 - 1,
                                   backward_min_programs=2**31 - 1,
                                   segment_chunks=segment_chunks)
        return "triton", configs.override_segments(rule)
    return impl, contextlib.nullcontext()


def _arch_configs(arch: str):
    from kda_jax import configs

    return _under(configs.forward_config(arch), configs.backward_config(arch),
                  configs.segment_config())


def _changed_configs(changes: str):
    """A context manager tracing under the device's forward, backward and
    segment configs with ``changes`` ("FIELD=VALUE+backward.FIELD=VALUE+
    segment.FIELD=VALUE"; a value is an integer, True, False, None or a name
    such as a precision). The configs are built here, so a bad change raises
    before anything runs."""
    from kda_jax import configs

    current = dict(forward=configs.forward_config(), backward=configs.backward_config(),
                   segment=configs.segment_config())
    fields = {owner: {} for owner in current}
    for change in changes.split("+"):
        name, _, text = change.partition("=")
        owner, _, field = name.rpartition(".")
        owner = owner or "forward"
        config = current.get(owner)
        if config is None or not text or field not in {f.name for f in dataclasses.fields(config)}:
            raise ValueError(f"{change!r}: not FIELD=VALUE for a field of ForwardConfig (or "
                             "backward.FIELD=VALUE of BackwardConfig, segment.FIELD=VALUE of "
                             "SegmentConfig)")
        if field in fields[owner]:
            raise ValueError(f"{change!r}: {name} is set twice in {changes!r}")
        fields[owner][field] = _value_of(text)
    changed = {owner: dataclasses.replace(current[owner], **fields[owner]) for owner in current}
    return _under(changed["forward"], changed["backward"], changed["segment"])


def _value_of(text: str):
    if text in _CONSTANTS:
        return _CONSTANTS[text]
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text


_CONSTANTS = {"True": True, "False": False, "None": None}


@contextlib.contextmanager
def _under(forward, backward, segment):
    from kda_jax import configs

    with configs.override(forward), configs.override_backward(backward), \
            configs.override_segments(segment):
        yield


def rows_of(args) -> list[tuple]:
    """(B, T, H, cu_seqlens or None) per row: --varlen, --shapes or the dense sweep."""
    if args.varlen:
        lens = [int(x) for x in args.varlen.split(",")]
        return [(1, sum(lens), args.heads, np.cumsum([0] + lens))]
    sweep = DENSE_SWEEP if not args.shapes else [
        tuple(int(x) for x in row.split(",")) for row in args.shapes.split(";")]
    return [(b, t, h, None) for b, t, h in sweep]


def fla_stream(rows, kd, vd, mode="forward"):
    """Yields (row index, ms) of fla's chunk_kda for ``rows`` as each is timed
    ("forward" or "backward": forward + autograd backward), then (None, the
    child's versions); measured in a child process (bench.fla_peer). A child that
    fails or dies ends the stream with a message on stderr; rows timed stand."""
    spec = [[b, t, h, kd, vd, None if cu is None else [int(x) for x in cu]] for b, t, h, cu in rows]
    try:
        with FlaPeer() as fla:
            for msg in fla.run({"job": "sweep", "mode": mode, "rows": spec}):
                if "error" in msg:
                    print(f"  fla failed: {msg['error']}", file=sys.stderr)
                else:
                    yield msg["row"]["index"], msg["row"]["ms"]
            yield None, fla.versions
    except FlaUnavailable as e:
        print(f"  fla failed: {e}", file=sys.stderr)


def _line(b, t, h, times, impls, roof):
    """One table row: the times, triton / fla and the roofline fraction."""
    fla, tri = times.get("fla"), times.get("triton")
    ratio = tri / fla if tri and fla else float("nan")
    line = f"{b:>2} {t:>6} {h:>3} " + " ".join(
        f"{times[i]:>10.3f}" if times.get(i) else f"{'-':>10}" for i in impls) + f"  {ratio:>10.3f}"
    if roof:
        line += f"  {100 * roof[0] / tri:>8.1f}" if tri else f"  {'-':>8}"
    return line


def run(args, argv, *, module: str, runner, mode: str, extra=None, roofline=None):
    """Times every row: ``runner(impl, arrays, cu)`` gives a timing closure for
    a kda_jax implementation; ``extra(b, t, h)`` adds fields to each record;
    ``roofline(b, t, h, kd, vd)`` -> (ms, bytes, flops) adds the roofline
    columns. Each implementation goes over every row in ``args.impls`` order
    (fla's in a child process), so "triton,fla,xla" leaves the XLA path's slow
    compiles for last; ``args.json`` is rewritten after every row, so a run cut
    short keeps what it measured.
    Prints the table; returns each row's {implementation: ms or None}."""
    impls = args.impls.split(",")
    kd = vd = args.head_dim
    rows = rows_of(args)
    fla_versions = {}
    base = run_meta.run_metadata(module, argv)
    times = [dict.fromkeys(impls) for _ in rows]
    roofs = [roofline(b, t, h, kd, vd) if roofline else None for b, t, h, _ in rows]

    def save():
        if not args.json:
            return
        meta = dict(base, versions={**base["versions"], **fla_versions})
        records = []
        for (b, t, h, cu), row_times, roof in zip(rows, times, roofs):
            fields = dict(extra(b, t, h)) if extra else {}
            fla = row_times.get("fla")
            for impl in impls:
                ms = row_times[impl]
                if roof:
                    fields.update(roofline_ms=roof[0], model_bytes=roof[1], model_flops=roof[2],
                                  roofline_fraction=(roof[0] / ms) if ms else None)
                records.append(dict(
                    B=b, T=t, H=h, K=kd, V=vd, dtype="bfloat16",
                    varlen=None if cu is None else [int(x) for x in np.diff(cu)],
                    implementation="fla" if impl == "fla" else f"kda_jax-{impl}", ms=ms,
                    ratio_to_fla=(ms / fla) if (ms and fla) else None, **fields))
        run_meta.write_rows(args.json, run_meta.stamp(records, meta))

    header = (f"{'B':>2} {'T':>6} {'H':>3} " + " ".join(f"{i:>10}" for i in impls)
              + "  triton/fla" + ("  roofline%" if roofline else ""))
    print(header, flush=True)
    for impl in impls:  # a bad variant name fails here, before anything is timed
        implementation(impl, getattr(args, "segment_chunks", None))
    for impl in impls:  # one implementation over every row, in --impls order
        if impl == "fla":
            print("fla (child process):", flush=True)
            for row, value in fla_stream(rows, kd, vd, mode=mode):
                if row is None:
                    fla_versions.update(value)
                else:
                    times[row]["fla"] = value
                    b, t, h, _ = rows[row]
                    print(_line(b, t, h, times[row], impls, roofs[row]), flush=True)
                save()
            continue
        print(f"{impl}:", flush=True)
        for row, (b, t, h, cu) in enumerate(rows):
            try:
                name, traced_under = implementation(impl, getattr(args, "segment_chunks", None))
                with traced_under:  # the first call traces and compiles
                    times[row][impl] = runner(name, make(b, t, h, kd, vd), cu)()
            except Exception as e:  # noqa: BLE001 - record and go on to the next peer
                print(f"  {impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            print(_line(b, t, h, times[row], impls, roofs[row]), flush=True)
            save()
    return times
