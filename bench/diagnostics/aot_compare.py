"""Before/after of two AOT reports (``python -m bench.aot``) per kernel and target.

    python -m bench.diagnostics.aot_compare BEFORE AFTER [--targets gfx950,gfx1250,gfx942]
        [--spec main/c64/default] [--json bench/results/aot-amd-before-after.json]

BEFORE and AFTER are files written by ``bench.aot --summary`` or ``--json``, or
``REV:PATH`` for a committed one (read with ``git show``), e.g.
``1cee4c3:bench/results/aot-summary.json``. For each kernel and target at the spec: matrix
instructions by opcode per program, estimated matrix-core cycles, VGPRs, LDS, occupancy and
spills, before and after, with after / before ratios; and the least occupancy over every
spec compiled (a summary's ``all_specs``). With two full reports (``--json``), each row also
names the specs where the occupancy fell. Static counts: a proxy, not a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from bench.meta import REPO, run_metadata, stamp, write_rows

FIELDS = ("num_warps", "num_stages", "matrix_ops_per_program", "est_matrix_cycles", "vgprs",
          "agprs", "lds_bytes", "occupancy", "vgpr_spills", "scratch", "min_occupancy")
RATIOS = ("est_matrix_cycles", "vgprs", "lds_bytes", "occupancy", "min_occupancy")


def load(source: str) -> dict:
    """{(kernel, target): {spec: row}} of a summary or full report (a path or REV:PATH).
    A summary gives its one spec's row, with min_occupancy from its all_specs."""
    if os.path.exists(source) or ":" not in source:
        with open(source) as f:
            report = json.load(f)
    else:
        report = json.loads(subprocess.run(["git", "-C", REPO, "show", source], check=True,
                                           capture_output=True, text=True).stdout)
    out: dict = {}
    if "results" in report:  # a full report: every row, the least occupancy added
        for r in report["results"]:
            out.setdefault((r["kernel"], r["target"]), {})[r["spec"]] = r
        for rows in out.values():
            occ = [r["occupancy"] for r in rows.values() if r.get("occupancy") is not None]
            for r in rows.values():
                r["min_occupancy"] = min(occ) if occ else None
        return out
    for kernel, per in report["kernels"].items():
        for target, e in per.items():
            row = {**e, "min_occupancy": e.get("all_specs", {}).get("min_occupancy")}
            out[(kernel, target)] = {e["spec"]: row}
    return out


def compare(before: dict, after: dict, targets, spec: str) -> list[dict]:
    rows = []
    for (kernel, target), specs in after.items():
        if target not in targets or spec not in specs or (kernel, target) not in before:
            continue
        b, a = before[(kernel, target)].get(spec, {}), specs[spec]
        row = {"kernel": kernel, "target": target, "spec": spec,
               "before": {k: b.get(k) for k in FIELDS}, "after": {k: a.get(k) for k in FIELDS}}
        row["ratio"] = {k: round(a[k] / b[k], 3) if a.get(k) is not None and b.get(k) else None
                        for k in RATIOS}
        both = sorted(set(before[(kernel, target)]) & set(specs))
        if len(both) > 1:  # per-spec rows on both sides
            row["occupancy_fell_at"] = {
                s: [before[(kernel, target)][s]["occupancy"], specs[s]["occupancy"]]
                for s in both if (specs[s].get("occupancy") or 0)
                < (before[(kernel, target)][s].get("occupancy") or 0)}
        rows.append(row)
    return rows


def _ops(ops) -> str:
    return " ".join(f"{n}x{op}" for op, n in (ops or {}).items()) or "-"


def table(rows: list[dict]) -> str:
    lines = [("kernel", "target", "cycles", "ratio", "vgprs", "lds", "occ", "min occ (specs)",
              "spills", "matrix ops per program: before -> after")]
    for r in rows:
        b, a = r["before"], r["after"]
        fell = r.get("occupancy_fell_at")
        lines.append((
            r["kernel"].replace("kda_", ""), r["target"],
            f"{b['est_matrix_cycles']} -> {a['est_matrix_cycles']}",
            str(r["ratio"]["est_matrix_cycles"]), f"{b['vgprs']} -> {a['vgprs']}",
            f"{b['lds_bytes']} -> {a['lds_bytes']}", f"{b['occupancy']} -> {a['occupancy']}",
            f"{b['min_occupancy']} -> {a['min_occupancy']}"
            + (f" fell at {', '.join(fell)}" if fell else ""),
            f"{b['vgpr_spills']}/{b['scratch']} -> {a['vgpr_spills']}/{a['scratch']}",
            f"{_ops(b['matrix_ops_per_program'])} -> {_ops(a['matrix_ops_per_program'])}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1]
                     for line in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.diagnostics.aot_compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="AOT summary or report: a path or REV:PATH")
    parser.add_argument("after", help="AOT summary or report: a path or REV:PATH")
    parser.add_argument("--targets", default="gfx950,gfx1250,gfx942")
    parser.add_argument("--spec", default="main/c64/default")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = compare(load(args.before), load(args.after), args.targets.split(","), args.spec)
    if not rows:
        raise SystemExit(f"no kernel/target of {args.targets} at {args.spec} in both reports")
    print(table(rows))
    write_rows(args.json, stamp(rows, {"before_source": args.before,
                                       "after_source": args.after,
                                       **run_metadata("bench.diagnostics.aot_compare", argv)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
