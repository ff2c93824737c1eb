"""Instructions per loop of one compiled kernel, from its sm90 SASS, on the CPU: what one
iteration of each loop issues per warp (its barriers, shuffles, exponentials and tensor-core
instructions among them), and the straight-line rest.

    python -m bench.sass_loops KERNEL [--spec main/c64/default] [--tree DIR ...]

KERNEL is one of bench.aot's kernels (kda_fwd_prepare_kernel, kda_bwd_recompute, ...),
compiled as `python -m bench.aot` compiles it (Triton's bundled ptxas; nvdisasm -g for
the source lines). Each --tree (a source tree made with `git archive REV kda_jax`, and
`kernels` too for a revision with the kernels outside the package) is compiled the same
way and shown beside the working tree's, so a change's cost per iteration is visible
before it is timed. A loop is a backward branch; it is named by the source line of that
branch, and its trip count is the reader's (K / BK for a K-slice loop).
Counts, not times: where a kernel is latency-bound (one or two programs per SM), the
instructions and barriers of its loops are its critical path (docs/tuning.md, "The
prepare's instructions").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys

# Opcodes shown per loop, besides the total.
SHOWN = ("BAR", "SHFL", "MUFU", "HGMMA", "LDS", "STS", "LDG", "STG")

# The checkout holding this bench package.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child process that compiles one kernel of a source tree (its own kda_jax) for one
# target: argv KERNEL SPEC OUT [TARGET] (default sm90). It writes OUT.sass (sm90: nvdisasm
# of the cubin, with source lines) or OUT.s (AMDGCN), and OUT.json: the compile report's
# fields, the launch's constexprs and the pointer arguments' element types ("bf16",
# "fp32", ...), which the cost models count bytes by. "# (config changes)" is where a
# caller inserts code that edits the config tables (``target``'s entries) first.
_COMPILE = r"""
import json, os, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
try:
    from kda_jax import aot  # a source tree from before the compile report left the package
except ImportError:
    from bench import aot
kernel, spec_name, out = sys.argv[1:4]
target = sys.argv[4] if len(sys.argv) > 4 else "sm90"
# (config changes)
captured = {}
compile_ = triton.compile
def keep(*a, **k):
    captured["c"] = compile_(*a, **k)
    return captured["c"]
triton.compile = keep
# A spec by its name, or by the name less a pool suffix ("main/c64/all" for
# "main/c64/all/bf16-pool", whose pool changes no chunked kernel).
spec = next(s for s in aot.SPECS if s.name == spec_name or s.name.startswith(spec_name + "/"))
# A kernel the target's config does not launch at this spec (bench.aot.applies:
# the per-chunk gradient kernels or their fused form) compiles nothing.
applies = getattr(aot, "applies", None)
if applies is not None and not applies(kernel, target, spec):
    json.dump({"applies": False}, open(out + ".json", "w"))
    sys.exit(0)
row = aot.compile_one(kernel, target, spec)
c = captured.get("c")
if c is not None and target == "sm90":
    open(out + ".cubin", "wb").write(c.asm["cubin"])
    from triton.backends.nvidia import compiler
    tool = os.path.join(os.path.dirname(compiler.__file__), "bin", "nvdisasm")
    sass = subprocess.run([tool, "-c", "-g", out + ".cubin"], capture_output=True, text=True)
    open(out + ".sass", "w").write(sass.stdout)
elif c is not None:
    open(out + ".s", "w").write(c.asm["amdgcn"])
sig = getattr(getattr(c, "src", None), "signature", None) or {}
row["pointers"] = {n: t[1:] for n, t in sig.items() if isinstance(t, str) and t.startswith("*")}
json.dump({k: row.get(k) for k in ("vgprs", "vgpr_spills", "lds_bytes", "occupancy", "error",
                                   "constexprs", "num_warps", "num_stages", "pointers")},
          open(out + ".json", "w"))
"""


@dataclasses.dataclass
class Instr:
    """One SASS instruction: its opcode, its source line ("file:line", the file's path as
    the compile saw it) and the rest of its text (modifiers and operands)."""

    op: str
    where: str
    rest: str


def parse(sass: str) -> tuple[list[Instr], list[tuple[int, int]]]:
    """(instructions, loops as (first, last) indices into them, one per backward branch;
    a branch to itself after the EXIT pads the code and is not a loop)."""
    labels, instrs, where = {}, [], "?"
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.search(r'## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)", line)
        if m:
            instrs.append(Instr(m.group(1), where, m.group(2)))
    loops = []
    for n, ins in enumerate(instrs):
        target = re.search(r"\((\.L_x_\d+)\)", ins.rest) if ins.op == "BRA" else None
        if target and labels.get(target.group(1), n + 1) < n:
            loops.append((labels[target.group(1)], n))
    return instrs, loops


def _short(where: str) -> str:
    """"file:line" with the file's base name."""
    path, _, line = where.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def summarize(sass: str) -> dict:
    """Per loop (by its back edge's source line) and for the straight-line rest: the
    instruction count and the SHOWN opcodes' counts, per warp and iteration."""
    instrs, loops = parse(sass)
    inner = set()
    out = {"instructions": len(instrs), "loops": []}
    for first, last in loops:
        ops = collections.Counter(ins.op for ins in instrs[first:last + 1])
        out["loops"].append(dict(line=_short(instrs[last].where), count=last - first + 1,
                                 **{k: ops[k] for k in SHOWN}))
        inner.update(range(first, last + 1))
    rest = collections.Counter(ins.op for n, ins in enumerate(instrs) if n not in inner)
    out["straight"] = dict(count=sum(rest.values()), **{k: rest[k] for k in SHOWN})
    return out


def compile_tree(tree: str, kernel: str, spec: str, out: str) -> dict:
    """Compiles ``kernel`` of the source tree at ``tree`` in a child process (so its
    kda_jax is the one imported); returns summarize()'s dict plus the compile's registers,
    spills and occupancy."""
    # A cache of its own per tree: a cached binary of equal source would carry another
    # tree's file names and line numbers.
    # The tree first (its kda_jax), then this checkout (bench.aot for a tree whose
    # kda_jax has no aot module: the checkout's compile report compiles its kernels).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), CHECKOUT]),
               TRITON_CACHE_DIR=out + ".cache")
    subprocess.run([sys.executable, "-c", _COMPILE, kernel, spec, out], env=env, check=True,
                   cwd=os.path.abspath(tree), stdout=subprocess.DEVNULL)
    row = json.load(open(out + ".json"))
    if row.get("error") and not os.path.exists(out + ".sass"):
        raise RuntimeError(f"{tree}: {kernel} did not compile: {row['error']}")
    return {**row, **summarize(open(out + ".sass").read())}


def table(results: dict[str, dict]) -> str:
    """Side-by-side lines, one per tree and loop."""
    lines = []
    for name, r in results.items():
        lines.append(f"{name}: {r['instructions']} instructions, {r['vgprs']} registers, "
                     f"{r['vgpr_spills']} bytes spilled, occupancy {r['occupancy']} warps")
        for loop in r["loops"] + [dict(line="(straight-line)", **r["straight"])]:
            shown = " ".join(f"{k} {loop[k]}" for k in SHOWN if loop[k])
            lines.append(f"  {loop['line']:24s} {loop['count']:6d}  {shown}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel")
    p.add_argument("--spec", default="main/c64/default")
    p.add_argument("--tree", action="append", default=[],
                   help="another source tree to compile beside the working tree")
    p.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "sass_loops"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for i, tree in enumerate(["."] + args.tree):
        results[tree] = compile_tree(tree, args.kernel, args.spec,
                                     os.path.join(args.out, f"{args.kernel}-{i}"))
    print(table(results))


if __name__ == "__main__":
    main()
