"""PNG charts of the results JSON: ratio to fla per shape, and step times.

    python -m bench.plot [--results bench/results] [--out DIR]

For every forward or backward file in --results (h100-forward.json,
forward-varlen.json; not tune-*): each
implementation's time over fla's for each gate regime and shape (bars; 1.0 is
parity, below is faster), one bar per implementation (kda_jax's, cuDNN) with an
fla time in the same run. For serving and
decode files: ms per step of each row, grouped by step.
Each chart is written beside its JSON (or into --out) as ``<name>.png``, and its
title names the commit and date of the rows.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

KINDS = ("forward", "backward", "serving", "decode")


def kind_of(path: str) -> str | None:
    parts = os.path.basename(path)[: -len(".json")].split("-")
    if parts[0] == "tune":
        return None
    return next((k for k in KINDS if k in parts), None)


def shape_label(row: dict) -> str:
    gates = f"{row['gates']}: " if row.get("gates") else ""
    if row.get("varlen"):
        return f"{gates}varlen {len(row['varlen'])} seqs\nT={row['T']} H={row['H']}"
    return f"{gates}{row['B']},{row['T']},{row['H']}"


def provenance(rows: list[dict]) -> str:
    """'commit X, date' (or the set of them) of the rows, for a chart's title."""
    commits = sorted({r.get("commit") or "not recorded" for r in rows})
    dates = sorted({str(r.get("date", ""))[:10] for r in rows})
    gpu = sorted({str((r.get("machine") or {}).get("gpu")) for r in rows})
    return f"{', '.join(gpu)}; commit {', '.join(commits)}; {', '.join(dates)}"


def ratio_chart(rows, title, path):
    """Bars of ratio_to_fla per shape, one group per shape, one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["implementation"] != "fla" and r.get("ms")]
    rows = [r for r in timed if r.get("ratio_to_fla")]
    value, ylabel = "ratio_to_fla", "time / fla's time (lower is faster)"
    if not rows:  # no fla time in the run: kda_jax's own times
        rows, value, ylabel = timed, "ms", "ms (no fla time in this run)"
    shapes = list(dict.fromkeys(shape_label(r) for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(shapes) + 2), 4.2))
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        by = {shape_label(r): r[value] for r in rows if r["implementation"] == impl}
        xs = [i + j * width for i, s in enumerate(shapes) if s in by]
        ys = [by[s] for s in shapes if s in by]
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    if value == "ratio_to_fla":
        if rows and max(r[value] for r in rows) > 3:
            ax.set_yscale("log")  # the XLA path's bars would flatten the Triton ones
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(shapes))], shapes,
                  fontsize=8)
    ax.set_xlabel("B, T, H (K = V = 128, bf16)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{provenance(rows)}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_chart(rows, title, path):
    """Horizontal bars of ms per step, grouped by step, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ms") is not None]
    steps = list(dict.fromkeys(r["step"] for r in rows))
    rows.sort(key=lambda r: steps.index(r["step"]))  # stable: each step's rows together
    labels = [f"{r['step']}: {r['implementation']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.4))
    colors = [f"C{steps.index(r['step']) % 10}" for r in rows]
    bars = ax.barh(range(len(rows)), [r["ms"] for r in rows], color=colors)
    ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (wall clock)")
    ax.set_title(f"{title}\n{provenance(rows)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(path: str, out_dir: str | None = None) -> str | None:
    """Renders the chart of one results file; returns the PNG's path (None: not a
    results file this module charts)."""
    kind = kind_of(path)
    if kind is None:
        return None
    with open(path) as f:
        rows = json.load(f)
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty JSON list of rows")
    # Rows of a benchmark name an implementation (forward, backward) or a step
    # (serving, decode); other files (tuning records) are not charted.
    rows = [r for r in rows if ("implementation" if kind in ("forward", "backward") else "step") in r]
    if not rows:
        return None
    png = os.path.join(out_dir or os.path.dirname(path),
                       os.path.basename(path)[: -len(".json")] + ".png")
    if kind in ("forward", "backward"):
        what = "forward" if kind == "forward" else "forward + backward"
        ratio_chart(rows, f"chunk_kda {what}: kda_jax / fla", png)
    else:
        step_chart(rows, f"{kind} steps", png)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--out", default=None, help="directory of the PNGs (default: beside each JSON)")
    a = p.parse_args(argv)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    done = [png for path in sorted(glob.glob(os.path.join(a.results, "*.json")))
            if (png := render(path, a.out))]
    if not done:
        raise SystemExit(f"--results {a.results}: no forward, backward, serving or decode JSON there")
    for png in done:
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
