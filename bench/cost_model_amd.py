"""Estimated duration of each kernel at a problem shape on gfx950 and gfx1250, from its
compiled AMDGCN, on the CPU: the sm90 model's method (:mod:`bench.cost_model`) on AMD's
code, with no ground truth to fit.

    python -m bench.cost_model_amd [--target gfx950] [--shape 1,8192,32]
        [--spec main/c64/default] [--tree DIR ...] [--variant CHANGES ...] [--kernels ...]

Each kernel is compiled as `python -m bench.aot` compiles it for the target. Then:

1. **Instructions per wave at the shape.** The AMDGCN's loops (a branch back to an earlier
   label) are named by their `for` line through the ``.loc`` debug lines and their trip
   counts evaluated at the shape, as on sm90 (:func:`bench.cost_model.loop_lines`,
   :func:`~bench.cost_model.trip_count`). Each instruction goes to a unit class
   (:func:`unit`): matrix, VALU, transcendental, scalar, LDS, vector memory, scalar
   memory, barrier, wait, branch.
2. **Occupancy and waves.** Waves per SIMD as LLVM reports it (``; Occupancy``), over a
   program's waves spread on the CU's four SIMDs; the grid in waves over the part's CUs.
3. **Time per wave.** Per SIMD: the issue cycles of the waves it holds (each unit's cycles
   per wave instruction, :data:`TARGETS`), the matrix core's cycles apart
   (:func:`bench.aot_isa.instruction_cycles`), the larger of them; against that, one
   wave's own time: its issue cycles plus, at each ``s_waitcnt``, the latency it waits
   for (vector memory, LDS / scalar memory), at each ``s_barrier`` a barrier's, each
   ``s_nop N`` N + 1 cycles, the waits times sm90's fitted overlap (the one assumption
   the two models share). A wave takes the larger.
4. **Memory.** The arrays of the kernel's signature at the shape, each once, against HBM
   (:func:`bench.cost_model.dram_bytes`); the kernel takes the larger of compute and
   memory, plus a launch's fixed cost.

The constants and where they come from are in :data:`TARGETS` and docs/rocm.md ("The cost
model on AMD"). With no AMD hardware to time, the estimates rank designs against each
other on one target; their absolute values are unchecked.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys

from bench import aot_isa
from bench import cost_model as cm
from bench.sass_loops import Instr

# Per target: CUs and clock of the part, HBM bandwidth (90 % of the peak), lanes per wave
# and per SIMD's VALU, and the latencies a wave waits for at an s_waitcnt. gfx950:
# MI355X (256 CUs, 2.4 GHz, 8 TB/s HBM3E; CDNA4 ISA guide: a 16-lane VALU, so a wave64
# instruction takes 4 cycles, transcendentals a quarter rate). gfx1250: no part's
# figures were at hand; it is modelled as gfx950's CU count, clock and bandwidth with a
# 32-lane VALU and wave32 (gfx12's), so its estimates rank designs only.
TARGETS = {
    "gfx950": dict(cus=256, clock_ghz=2.4, dram_gbs=7200.0, lanes=64, simd_lanes=16,
                   launch_us=4.0, wait=dict(vmem=600.0, lgkm=64.0, barrier=32.0)),
    "gfx1250": dict(cus=256, clock_ghz=2.4, dram_gbs=7200.0, lanes=32, simd_lanes=32,
                    launch_us=4.0, wait=dict(vmem=600.0, lgkm=64.0, barrier=32.0)),
}
# Issue cycles of one wave instruction per unit class, in VALU passes (lanes / SIMD lanes)
# for the vector classes, cycles for the scalar ones.
PASSES = dict(valu=1.0, trans=4.0, lds=1.0, vmem=1.0)
SCALAR = dict(salu=1.0, smem=1.0, barrier=1.0, wait=1.0, branch=1.0, other=1.0)
CLASSES = tuple(PASSES) + tuple(SCALAR) + ("matrix",)

_TRANS = re.compile(r"^v_(exp|log|rcp|rsq|sqrt|sin|cos)_")


def unit(op: str) -> str:
    """The unit class of an AMDGCN mnemonic."""
    if re.match(r"^v_(mfma|smfmac|wmma|swmmac)_", op):
        return "matrix"
    if _TRANS.match(op):
        return "trans"
    if op.startswith("v_"):
        return "valu"
    if op.startswith("ds_"):
        return "lds"
    if op.startswith(("global_", "buffer_", "flat_", "scratch_")):
        return "vmem"
    if op.startswith(("s_load", "s_buffer_load", "s_store")):
        return "smem"
    if op.startswith("s_barrier"):
        return "barrier"
    if op.startswith(("s_waitcnt", "s_wait_", "s_nop", "s_sleep")):
        return "wait"
    if op.startswith(("s_cbranch", "s_branch", "s_setpc", "s_endpgm")):
        return "branch"
    if op.startswith("s_"):
        return "salu"
    return "other"


def parse(asm: str) -> tuple[list[Instr], list[tuple[int, int]]]:
    """The kernel's instructions (mnemonic, "file:line" of the innermost ``.loc``, operands)
    and its loops as (first, last) instruction indices, from the loop comments LLVM writes
    on each block, as bench.aot_isa walks them: a loop spans the blocks of it and of the
    loops inside it (LLVM lays a loop's blocks out together)."""
    paths = {os.path.basename(p): p for p in aot_isa._files(asm, "hip").values()}
    insts, parents = aot_isa._walk(asm, "hip")
    instrs = []
    for _, _, frames, text in insts:
        op, _, rest = text.partition(" ")
        where = f"{paths.get(frames[0][0], frames[0][0])}:{frames[0][1]}" if frames else ""
        instrs.append(Instr(op, where, rest.strip()))
    spans = {}
    for n, (_, h, _, _) in enumerate(insts):
        seen = set()
        while h is not None and h not in seen:
            seen.add(h)
            first, last = spans.get(h, (n, n))
            spans[h] = (min(first, n), max(last, n))
            h = parents.get(h)
    return instrs, sorted(spans.values())


def _wait_cycles(ins: Instr, hw: dict) -> float:
    """What a wave waits at this instruction, as a lone wave would (before the overlap)."""
    w = hw["wait"]
    if ins.op.startswith("s_waitcnt") or ins.op.startswith("s_wait_"):
        text = ins.op + " " + ins.rest
        cycles = 0.0
        if "vmcnt" in text or "loadcnt" in text or "storecnt" in text:
            cycles = max(cycles, w["vmem"])
        if "lgkmcnt" in text or "dscnt" in text or "kmcnt" in text:
            cycles = max(cycles, w["lgkm"])
        return cycles
    if ins.op.startswith("s_nop"):
        m = re.match(r"(0x[0-9a-f]+|\d+)", ins.rest)
        return int(m.group(1), 0) + 1 if m else 1
    if ins.op.startswith("s_barrier"):
        return w["barrier"]
    return 0.0


def counts_at(instrs, loops, env, target: str, hw: dict, untaken=frozenset()):
    """Per unit class, one wave's instructions at the shape (matrix ones also in cycles of
    its matrix core, "matrix_cycles"), its issue cycles ("issue_cycles") and its waits
    ("wait_cycles"); and the loops' table."""
    weight = [1.0] * len(instrs)
    table = []
    for (first, last), where in zip(loops, cm.loop_lines(instrs, loops, strict=False)):
        if where is None:  # a loop the compiler made (a waterfall loop): taken once
            trips, text = 1, "no for line: once"
        elif where in untaken:
            trips, text = 0, "untaken"
        else:
            trips, text = cm.trip_count(where, env)
        for n in range(first, last + 1):
            weight[n] *= trips
        table.append(dict(where=cm._short(where or "?"), range=text, trips=trips,
                          size=last - first + 1))
    passes = hw["lanes"] / hw["simd_lanes"]
    counts = collections.Counter()
    for w, ins in zip(weight, instrs):
        if not w:
            continue
        cls = unit(ins.op)
        counts[cls] += w
        if cls == "matrix":
            cycles = (aot_isa.instruction_cycles(target, ins.op) or (0,))[0]
            counts["matrix_cycles"] += w * cycles
        counts["issue_cycles"] += w * (PASSES[cls] * passes if cls in PASSES
                                       else SCALAR.get(cls, 0.0))
        counts["wait_cycles"] += w * _wait_cycles(ins, hw)
    return counts, table


def estimate(counts, *, programs: int, warps: int, occupancy: int, overlap: float,
             hw: dict) -> dict:
    """Estimated microseconds of one launch on the target, and what set it."""
    # Programs per CU: its four SIMDs' waves over a program's waves (at least one).
    per_cu = min(max(4 * (occupancy or 1) // warps, 1), 32)
    waves = math.ceil(programs / (hw["cus"] * per_cu))
    resident = per_cu * warps / 4  # waves per SIMD
    issue = resident * max(counts["issue_cycles"], counts["matrix_cycles"])
    chain = counts["issue_cycles"] + counts["matrix_cycles"] + counts["wait_cycles"] * overlap
    wave = max(issue, chain)
    compute_us = waves * wave / (hw["clock_ghz"] * 1e3)
    memory_us = counts["dram_bytes"] / (hw["dram_gbs"] * 1e3)
    us = max(compute_us, memory_us) + hw["launch_us"]
    bound = "memory" if memory_us > compute_us else "issue" if issue >= chain else "latency"
    return dict(us=us, programs_per_cu=per_cu, waves=waves, issue_cycles=issue,
                chain_cycles=chain, memory_us=memory_us, bound=bound)


def model_kernel(tree: str, kernel: str, target: str, shape: tuple, out: str, *,
                 spec: str = cm.SPECS[0], reuse: bool = False, changes: str = "") -> dict:
    hw = TARGETS[target]
    row = cm.compile_kernel(tree, kernel, spec, out, reuse, changes, target=target)
    instrs, loops = parse(row["asm"])
    c = row["constexprs"] or {}
    values = cm.shape_values(*shape, bt=c.get("BT", 64))
    counts, table = counts_at(instrs, loops, {**c, **values}, target, hw)
    counts["dram_bytes"] = cm.dram_bytes(kernel, c, values, row.get("pointers"))
    launch = dict(programs=cm.grid(kernel, c, values), warps=row["num_warps"],
                  occupancy=row["occupancy"] or 1)
    return dict(kernel=kernel, target=target, tree=tree + (f":{changes}" if changes else ""),
                counts=counts, loops=table, launch=launch, spills=row["vgpr_spills"],
                vgprs=row["vgprs"], instructions=len(instrs))


def report(rows: list[dict], overlap: float) -> str:
    lines = [f"overlap {overlap:.2f} (sm90's)"]
    names = [os.path.basename(r["tree"].rstrip("/")) or "." for r in rows]
    width = max([18] + [len(n) for n in names])
    lines.append(f"{'kernel':28s} {'tree':{width}s} {'target':7s} {'est us':>8s} {'bound':8s} "
                 f"{'occ':>3s} {'waves':>5s}  per wave: instr  matrix(cyc)  valu  trans  "
                 f"salu  lds  vmem  bar  wait(cyc)")
    for r, name in zip(rows, names):
        e = estimate(r["counts"], overlap=overlap, hw=TARGETS[r["target"]], **r["launch"])
        r["estimate"] = e
        n = r["counts"]
        total = sum(n[k] for k in CLASSES)
        lines.append(
            f"{r['kernel'][:28]:28s} {name:{width}s} {r['target']:7s} {e['us']:8.1f} "
            f"{e['bound']:8s} {r['launch']['occupancy']:3d} {e['waves']:5d}  {total:9.0f} "
            f"{n['matrix_cycles']:11.0f} {n['valu']:6.0f} {n['trans']:5.0f} {n['salu']:5.0f} "
            f"{n['lds']:4.0f} {n['vmem']:5.0f} {n['barrier']:4.0f} {n['wait_cycles']:9.0f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", choices=sorted(TARGETS),
                   help="gfx950 and / or gfx1250 (default: both)")
    p.add_argument("--shape", default="1,8192,32", help="B,T,H (K = V = 128, chunk 64)")
    p.add_argument("--spec", default=cm.SPECS[0], choices=cm.SPECS)
    p.add_argument("--tree", action="append", default=[],
                   help="another source tree (git archive REV kda_jax) to model")
    p.add_argument("--variant", action="append", default=[],
                   help="PATH=VALUE[+backward.PATH=VALUE]: the working tree with the "
                        "target's config fields changed (repeatable)")
    p.add_argument("--kernels", default=",".join(cm.FORWARD + cm.BACKWARD))
    p.add_argument("--overlap", type=float, default=2.75,
                   help="waits' overlap (default: sm90's fitted value)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                 "cost_model_amd"))
    args = p.parse_args(argv)
    for changes in args.variant:
        if cm.config_changes(changes)["segment"]:
            raise SystemExit(f"--variant {changes!r}: segment fields do not change these kernels")
    shape = tuple(int(x) for x in args.shape.split(","))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for target in args.target or sorted(TARGETS):
        for tree, changes in [(t, "") for t in ["."] + args.tree] + [(".", v) for v in
                                                                     args.variant]:
            label = os.path.normpath(tree) + (f":{changes}" if changes else "")
            for kernel in args.kernels.split(","):
                out = os.path.join(args.out, re.sub(r"[^\w.=+-]", "_", label) + "@" + target
                                   + "@" + args.spec.replace("/", "_") + f"-{kernel}")
                rows.append(model_kernel(tree, kernel, target, shape, out, spec=args.spec,
                                         reuse=args.reuse, changes=changes))
                print(f"compiled {kernel} ({label}, {target})", file=sys.stderr)
    print(report(rows, args.overlap))
    if args.json:
        json.dump(dict(shape=shape, overlap=args.overlap, targets=TARGETS, rows=[
            {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in r.items()}
            for r in rows]), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
