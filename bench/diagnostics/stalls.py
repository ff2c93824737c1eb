"""Summarises Nsight Compute's per-instruction source page (`ncu --import R --page source
--csv --print-source sass`): per kernel, the executed instructions by opcode, the stall
reasons, and the instructions with the most stall samples with their main reasons.

    python -m bench.diagnostics.stalls profile-sass.csv [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path: str) -> dict[str, list[dict]]:
    """{kernel name: [one dict per SASS instruction, by column name]}."""
    out, name, header = {}, None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                name, header = row[1], None
                out[name] = []
            elif row and row[0] == "Address":
                header = row
            elif name and header and len(row) == len(header):
                out[name].append(dict(zip(header, row)))
    return out


def _int(x: str) -> int:
    return int(x.replace(",", "")) if x and x.replace(",", "").isdigit() else 0


def opcode(sass: str) -> str:
    words = sass.split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words[0].split(".")[0] if words else ""


def summary(rows: list[dict], top: int = 20) -> str:
    stalls = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "(" not in c]
    samples = sum(_int(r[SAMPLES]) for r in rows) or 1
    lines = [f"{len(rows)} instructions, {samples} stall samples"]
    reasons = collections.Counter({c[6:]: sum(_int(r[c]) for r in rows) for c in stalls})
    lines.append("stalls: " + ", ".join(f"{k} {100 * v / samples:.0f}%"
                                        for k, v in reasons.most_common(6) if v))
    ops = collections.Counter()
    for r in rows:
        ops[opcode(r["Source"])] += _int(r[EXECUTED])
    executed = sum(ops.values()) or 1
    lines.append("executed: " + ", ".join(f"{k} {100 * v / executed:.0f}%"
                                          for k, v in ops.most_common(8)))
    ranked = sorted(range(len(rows)), key=lambda i: -_int(rows[i][SAMPLES]))[:top]
    for i in sorted(ranked):
        r = rows[i]
        why = sorted(((_int(r[c]), c[6:]) for c in stalls if _int(r[c])), reverse=True)[:2]
        lines.append(f"  {i:5d} {100 * _int(r[SAMPLES]) / samples:5.1f}%  "
                     f"{r['Source'].strip()[:60]:60s} {', '.join(f'{w} {n}' for n, w in why)}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    for name, rows in kernels(args.csv).items():
        print(f"== {name}\n{summary(rows, args.top)}")


if __name__ == "__main__":
    main()
