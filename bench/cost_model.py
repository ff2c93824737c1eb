"""Estimated duration of each kernel at a problem shape, from its compiled sm90 code, on
the CPU: what a design costs before the GPU times it.

    python -m bench.cost_model [--shape 1,8192,32] [--spec main/c64/all] [--tree DIR ...]
        [--variant CHANGES ...] [--kernels ...] [--measured PATH] [--fit REV ...] [--overlap X]
        [--untaken TREE=FILE:LINE ...] [--json PATH]

Each kernel is compiled as `python -m bench.aot` compiles it (main spec: bf16, K = V =
128, chunk 64; Triton's bundled ptxas; the SASS with source lines from nvdisasm). ``--spec
main/c64/all`` compiles the layer's form instead: the gate, L2 norm and beta sigmoid in
the kernels, whose backward then takes the intermediates sm90's config gives that form
(16-bit at chunk 64, fla's form; `BackwardConfig.gate_fp32_max_k`) (that spec also carries an
initial and a final state, a V-first state and negative eigenvalues). Then:

1. **Instructions per warp at the shape.** Every loop of the SASS (a backward branch) is
   named by the source line of its `for`; its trip count comes from that line's
   `range(...)` evaluated with the launch's constexprs and the shape's runtime values
   (chunks per sequence, tokens per sequence). Nested loops multiply. Each instruction is
   put in a unit class: tensor core, fp32, fp64, special function, integer and predicate,
   shuffle, shared memory, global memory, barrier, other.
2. **Occupancy and waves.** Programs per SM from the registers, shared memory and threads
   (sm90: 64K registers, 227 KiB, 2048 threads, 32 programs); the grid from the
   constexprs and the shape, in waves over 132 SMs.
3. **Time per wave.** Per SM scheduler (four per SM): the issue time of the warps it
   holds (one instruction a cycle, and each unit's occupancy: a tensor-core instruction
   holds its unit for its multiply-adds over the unit's rate; fp64, integer, shuffle and
   shared-memory ops two cycles, special functions eight), the largest of them; against
   that, one warp's own time (:func:`warp_cycles`: a scoreboard over the SASS's
   register operands, each result ready after its unit's latency, HGMMAs queued on the
   tensor core until a WARPGROUP.DEPBAR, cp.async groups until a DEPBAR): its arithmetic
   chain as it is (the scoreboard with ALU latencies everywhere, :data:`ALU_ONLY`), plus
   what memory, the tensor core, shuffles and barriers add to it times the overlap. A
   wave takes the larger of the two.
4. **Memory.** Global bytes from the load and store instructions' widths (32 lanes each),
   against the L2's bandwidth (re-read tiles mostly hit it); and the arrays the kernel
   reads and writes (kda_jax.kernels.signatures, each array once, at the shape) against
   HBM's (:func:`dram_bytes`). The kernel takes the larger of compute and memory, plus a
   launch's fixed cost.

The constants are sm90's published rates and typical latencies (:data:`SM90`); the
overlap of latencies is the one fitted number (:func:`fit`). ``--measured`` takes the
Nsight Compute durations of ``bench/results/h100-kernel-times.json`` and prints each
kernel's error; ``--fit REV`` fits to those trees only (the others are predictions).
``--tree`` compiles another source tree (``git archive REV kda_jax``; ``kda_jax kernels``
for a revision with the kernels outside the package) beside the working tree, kernel by
kernel: the comparison names what moved the estimate (:func:`comparison`: the launch's
occupancy, waves, bound and registers, and each unit's count that changed).
``--variant PATH=VALUE[+backward.PATH=VALUE...]`` models the working tree with those
values of its sm90 ForwardConfig / BackwardConfig changed (paths as
kda_jax.configs.replace takes them, as bench.sweep's ``triton:PATH=VALUE`` rows time
them): a config change's estimate before its timing.
Untaken code: a tree whose kernels branch on the data (before 05e146c) runs only some of
its code on a given input; ``--untaken TREE=FILE:LINE`` names a `for` line (that loop runs
no trip) or a function's `def` line (its inlined code and loops count nothing).
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import math
import os
import re
import subprocess
import sys

from bench.sass_loops import _COMPILE, CHECKOUT, Instr, _short, parse
from bench.sweep import config_changes

# sm90 (H100 SXM): issue cost per warp instruction on its sub-partition's unit, in cycles,
# and latency of its result, in cycles. Tensor-core instructions cost their multiply-adds
# over the sub-partition's rate (see _tensor_cycles). dram_gbs: HBM3's 3.35 TB/s less what
# a streaming kernel does not reach (about 90 %); l2_gbs: the L2's, re-read tiles.
SM90 = dict(
    sms=132, clock_ghz=1.755, l2_gbs=7000.0, dram_gbs=3000.0, launch_us=3.0,
    regs_per_sm=65536, smem_per_sm=227 * 1024, threads_per_sm=2048, programs_per_sm=32,
    issue=dict(tensor=0.0, fp32=1.0, fp64=2.0, sfu=8.0, int=2.0, shuffle=2.0, smem=2.0,
               gmem=2.0, barrier=1.0, other=1.0),
    latency=dict(tensor=24.0, fp32=4.0, fp64=8.0, sfu=18.0, int=4.0, shuffle=24.0, smem=30.0,
                 gmem=200.0, barrier=24.0, other=4.0),
)

# The same machine with the long latencies (memory, tensor core, shuffles, barriers)
# cut to an ALU's: one warp's time through its arithmetic dependences alone.
ALU_ONLY = dict(SM90, latency=dict(SM90["latency"], tensor=4.0, shuffle=4.0, smem=4.0,
                                    gmem=4.0, barrier=0.0))

_CLASSES = (
    ("tensor", r"^(HGMMA|HMMA|IMMA|WARPGROUP)"),
    ("fp64", r"^D(ADD|MUL|FMA|SETP|MNMX)"),
    ("sfu", r"^MUFU"),
    ("fp32", r"^(FADD|FMUL|FFMA|FMNMX|FSET|FSEL|FCHK|FSWZADD|F2F|F2I|I2F|FRND|HADD2|HMUL2|HFMA2"
             r"|F2FP)"),
    ("shuffle", r"^SHFL"),
    ("smem", r"^(LDS|STS|LDSM|STSM|ATOMS)"),
    ("gmem", r"^(LDG|STG|LDGSTS|RED|ATOMG|UBLKCP|UTMALDG|UTMASTG|LD|ST)$|^(LDG|STG|LD|ST)\b"),
    ("barrier", r"^(BAR|WARPSYNC|DEPBAR|MEMBAR|ARRIVES|SYNCS)"),
    ("int", r"^(IMAD|IADD|LOP|ISETP|SEL|SHF|PRMT|IABS|IMNMX|LEA|FLO|POPC|BREV|P2R|R2P|PLOP"
            r"|VIADD|VIMNMX|BMSK|SGXT|UIMAD|UIADD|ULOP|UISETP|USEL|USHF|UPRMT|ULEA|UMOV|IDP)"),
)


def unit(opcode: str) -> str:
    for name, pattern in _CLASSES:
        if re.match(pattern, opcode):
            return name
    return "other"


def _tensor_cycles(op: str, rest: str) -> float:
    """Cycles one warp's tensor-core instruction holds its sub-partition's unit: a
    warpgroup HGMMA.MxNxK spreads M x N x K multiply-adds over four sub-partitions at 512
    (16-bit) or 256 (tf32) a cycle each; an HMMA.16816 is 2048 at 512."""
    m = re.match(r"\.(\d+)x(\d+)x(\d+)", rest)
    if op == "HGMMA" and m:
        macs = int(m.group(1)) * int(m.group(2)) * int(m.group(3)) / 4
        return macs / (256.0 if "TF32" in rest else 512.0)
    m = re.match(r"\.(\d+)(\d)(\d+)", rest)
    if op == "HMMA":
        return 4.0
    return 0.0


_FOR = re.compile(r"^\s*for\s+\w+\s+in\s+(?:tl\.)?(range|static_range)\((.*)\)\s*:")
# A halving loop (`h = EXPR` before it, `h //= 2` in it): floor(log2(EXPR)) + 1 trips.
_WHILE = re.compile(r"^\s*while\s+(\w+)\s*>\s*0\s*:")
_SOURCES: dict[str, list[str]] = {}


def _source(path: str) -> list[str]:
    if path not in _SOURCES:
        try:
            _SOURCES[path] = open(path).read().splitlines()
        except OSError:
            _SOURCES[path] = []
    return _SOURCES[path]


def loop_lines(instrs: list[Instr], loops: list[tuple[int, int]],
               strict: bool = True) -> list[str | None]:
    """Each loop's `for` line ("file:line"): among the source lines of its body, the `for`
    line with the most instructions, inner loops' lines excluded (ptxas moves the back
    edge's own line around; the induction variable's update keeps the `for` line).
    ``strict``: a loop with no `for` line is an error; else its line is None (a loop the
    compiler made, such as AMDGCN's waterfall loops)."""
    order = sorted(range(len(loops)), key=lambda i: loops[i][1] - loops[i][0])
    claimed, out = {}, [None] * len(loops)
    for i in order:
        first, last = loops[i]
        inner = {claimed[j] for j in claimed
                 if loops[j][0] >= first and loops[j][1] <= last}
        seen = collections.Counter()
        # The body first; else the loop's set-up and exit around it (a body of
        # reductions alone may carry no instruction of its `for` line).
        window = instrs[first:last + 1]
        around = instrs[max(first - 24, 0):first] + instrs[last + 1:last + 9]
        for ins in window + (around if not _has_for(window, inner) else []):
            path, line = ins.where.rsplit(":", 1) if ":" in ins.where else ("", "0")
            src = _source(path)
            n = int(line)
            if (ins.where not in inner and 0 < n <= len(src)
                    and (_FOR.match(src[n - 1]) or _WHILE.match(src[n - 1]))):
                seen[ins.where] += 1
        if not seen:
            if strict:
                raise ValueError(f"the loop ending at {instrs[last].where} holds no `for` "
                                 "line")
            continue
        out[i] = claimed[i] = seen.most_common(1)[0][0]
    return out


def _is_loop_line(where: str) -> bool:
    path, line = where.rsplit(":", 1) if ":" in where else ("", "0")
    src, n = _source(path), int(line)
    return 0 < n <= len(src) and bool(_FOR.match(src[n - 1]) or _WHILE.match(src[n - 1]))


def _has_for(instrs: list[Instr], inner: set) -> bool:
    return any(ins.where not in inner and _is_loop_line(ins.where) for ins in instrs)


def trip_count(where: str, env: dict) -> tuple[int, str]:
    """(trips, the `range` text) of the `for` at ``where`` ("file:line"), its arguments
    evaluated in ``env`` (constexprs and the shape's runtime values) and the file's
    module-level constants."""
    path, line = where.rsplit(":", 1)
    lines = _source(path)
    # Module constants of the kernels' package (imported names like BS), the file's own
    # first.
    folder = os.path.dirname(path)
    shared = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.endswith(".py"):
            shared.update(_module_constants(_source(os.path.join(folder, name))))
    env = {**shared, **_module_constants(lines), **env}
    m = _FOR.match(lines[int(line) - 1])
    if m is None:  # a halving `while`
        name = _WHILE.match(lines[int(line) - 1]).group(1)
        for n in range(int(line) - 2, max(int(line) - 10, 0) - 1, -1):
            a = re.match(rf"^\s*{name}\s*=\s*(.+?)\s*(#.*)?$", lines[n])
            if a:
                start = int(eval(a.group(1), {"__builtins__": {}}, env))
                return start.bit_length(), f"while {name} > 0 (from {a.group(1)}, halving)"
        raise ValueError(f"{where}: no `{name} = ...` above the while loop")
    text = m.group(2)
    args = [a for a in _split_args(text) if "=" not in a or "==" in a]
    try:
        values = [eval(compile(ast.parse(a, mode="eval"), where, "eval"),
                       {"__builtins__": {}, "min": min, "max": max}, env) for a in args]
    except NameError as e:
        raise ValueError(f"{where}: range({text}) needs {e.name} (add it to the shape's "
                         "runtime values)") from None
    return len(range(*[int(v) for v in values])), f"range({text})"


def _module_constants(lines: list[str]) -> dict:
    """The source file's module-level ``NAME = tl.constexpr(INT)`` and ``NAME = INT``."""
    out = {}
    for line in lines:
        m = re.match(r"^([A-Z_][A-Z0-9_]*)\s*=\s*(?:tl\.constexpr\()?(-?\d+)\)?\s*(#.*)?$", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def _split_args(text: str) -> list[str]:
    depth, cur, out = 0, "", []
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def dynamic_counts(instrs: list[Instr], loops: list[tuple[int, int]], env: dict,
                   untaken: set[str] = frozenset()) -> tuple[collections.Counter, list[dict]]:
    """Per unit class, the instructions one warp issues (tensor-core ones in cycles of its
    unit as "tensor_cycles", global ones in bytes as "gmem_bytes"), with each loop's body
    counted trips times (nested loops multiply); and the loops' table."""
    weight = [0.0 if _in_untaken_function(ins.where, untaken) else 1.0 for ins in instrs]
    table = []
    for (first, last), where in zip(loops, loop_lines(instrs, loops)):
        # A loop of untaken code (its `for` in an untaken function, or named itself).
        skip = where in untaken or _in_untaken_function(where, untaken)
        trips, text = (0, "untaken") if skip else trip_count(where, env)
        # The body runs `trips` times; the code before the loop's first check once (Triton
        # rotates its loops: the body ends with the back edge).
        for n in range(first, last + 1):
            weight[n] *= trips
        table.append(dict(where=_short(where), range=text, trips=trips, size=last - first + 1))
    counts = collections.Counter()
    for w, ins in zip(weight, instrs):
        if not w:
            continue
        cls = unit(ins.op)
        counts[cls] += w
        if cls == "tensor":
            counts["tensor_cycles"] += w * _tensor_cycles(ins.op, ins.rest)
        elif cls == "gmem":
            counts["gmem_bytes"] += w * 32 * _width(ins.rest)
    return counts, table


def _function_span(where: str) -> tuple[str, int, int] | None:
    """(file, first, last line) of the function whose `def` is at ``where``, else None."""
    path, line = where.rsplit(":", 1)
    src, n = _source(path), int(line)
    if not (0 < n <= len(src) and src[n - 1].lstrip().startswith("def ")):
        return None
    end = n
    while end < len(src) and not re.match(r"^(@|def |class |[A-Za-z_])", src[end]):
        end += 1
    return path, n, end


def _in_untaken_function(where: str, untaken) -> bool:
    if ":" not in where:
        return False
    path, line = where.rsplit(":", 1)
    for item in untaken:
        span = _function_span(item)
        if span and span[0] == path and span[1] <= int(line) <= span[2]:
            return True
    return False


def _width(rest: str) -> int:
    m = re.match(r"(?:\.\w+)*?\.(128|64|U16|S16|U8|S8)\b", rest)
    return {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}.get(
        m.group(1) if m else "", 4)


# --------------------------------------------------------------------------- #
# One warp's cycles: a scoreboard over the SASS's register dependences.
# --------------------------------------------------------------------------- #

_NO_DEST = re.compile(r"^(ST|STG|STS|STL|RED|BAR|BRA|EXIT|RET|CALL|WARPSYNC|DEPBAR|LDGDEPBAR|"
                      r"WARPGROUP|MEMBAR|NOP|ARRIVES|SYNCS|BSSY|BSYNC|YIELD|LDGSTS|UBLKCP|ERRBAR|"
                      r"CCTL|FENCE)")
_REG = re.compile(r"\b(U?R)(\d+)(?:\.64)?\b")
_PRED = re.compile(r"\b(U?P)([0-6])\b")


def _dest_width(op: str, full: str) -> int:
    m = re.match(r"HGMMA\.64x(\d+)x\d+\.F32", op + full)
    if m:
        return int(m.group(1)) // 2
    if ".128" in full:
        return 4
    if ".64" in full.split(" ")[0] or op in ("DADD", "DMUL", "DFMA", "DMNMX") or "WIDE" in full:
        return 2
    return 1


def _operands(ins: Instr) -> tuple[list[str], list[str]]:
    """(registers written, registers read) of an instruction, approximately: the first
    register operand is the destination unless the opcode writes none; a ``.64`` pair or
    a vector load's registers and an HGMMA's accumulator tile are expanded."""
    text = ins.rest.split(";")[0]
    full = ins.op + text
    regs = [(k, int(n), bool(dot)) for k, n, dot in
            re.findall(r"\b(U?R)(\d+)(\.64)?\b", text)]
    preds = [f"{k}{n}" for k, n in _PRED.findall(text)]
    writes, reads = [], []
    setp = re.match(r"^(I|F|D|U|H)?(SETP|SETP)", ins.op) or "SETP" in ins.op
    if setp and preds:
        writes.append(preds[0])
        preds = preds[1:]
    start = 0
    if regs and not _NO_DEST.match(ins.op) and not setp:
        kind, n, _ = regs[0]
        writes += [f"{kind}{n + i}" for i in range(_dest_width(ins.op, full))]
        start = 1
    for kind, n, pair in regs[start:]:
        width = 2 if pair else 1
        if ins.op == "HGMMA" and kind == "R" and n == (regs[0][1] if regs else -1):
            width = _dest_width(ins.op, full)
        reads += [f"{kind}{n + i}" for i in range(width)]
    reads += preds
    return writes, reads


def warp_cycles(instrs: list[Instr], hw: dict = SM90) -> float:
    """Cycles one warp takes through ``instrs`` in order, alone on its scheduler: each
    instruction issues when its operands are ready and its unit is free (one a cycle),
    its result ready after its unit's latency; HGMMAs run back to back on the tensor
    core and a WARPGROUP.DEPBAR waits for them; LDGSTS groups (LDGDEPBAR) complete after
    the global latency, DEPBAR.LE SB0, N waits for all but the newest N."""
    ready: dict[str, float] = {}
    unit_free = collections.defaultdict(float)
    t = 0.0
    tensor_done = 0.0
    groups, open_group = [], 0.0
    lat, issue = hw["latency"], hw["issue"]
    for ins in instrs:
        cls = unit(ins.op)
        writes, reads = _operands(ins)
        start = max([t, unit_free[cls]] + [ready.get(r, 0.0) for r in reads])
        if ins.op == "WARPGROUP" and "DEPBAR" in ins.rest:
            start = max(start, tensor_done)
        elif ins.op == "DEPBAR":
            m = re.search(r"SB0,\s*0x([0-9a-f]+)", ins.rest)
            keep = int(m.group(1), 16) if m else 0
            if len(groups) > keep:
                start = max([start] + groups[:len(groups) - keep])
                groups = groups[len(groups) - keep:]
        elif ins.op == "BAR":
            start += lat["barrier"]
        t = start + 1.0
        if cls == "tensor" and ins.op == "HGMMA":
            tensor_done = max(tensor_done, start) + _tensor_cycles(ins.op, ins.rest)
            done = tensor_done + lat["tensor"]
            tensor_done = done
        else:
            unit_free[cls] = start + issue[cls]
            done = start + (lat["gmem"] if ins.op.startswith("LDG") and cls == "gmem"
                            else lat[cls])
        if ins.op == "LDGSTS":
            open_group = max(open_group, start + lat["gmem"])
        elif ins.op == "LDGDEPBAR":
            groups.append(open_group)
            open_group = 0.0
        for r in writes:
            ready[r] = done
    return t


def _loops_of(instrs, taken, loops, trips):
    """The loops (and their trips) re-indexed into ``taken``, a subsequence of
    ``instrs``; loops left empty are dropped."""
    index, k = {}, 0
    kept = set(map(id, taken))
    for n, ins in enumerate(instrs):
        if id(ins) in kept:
            index[n] = k
            k += 1
    out, out_trips = [], []
    for (first, last), t in zip(loops, trips):
        inside = [index[n] for n in range(first, last + 1) if n in index]
        if inside:
            out.append((inside[0], inside[-1]))
            out_trips.append(t)
    return out, out_trips


def region_cycles(instrs: list[Instr], loops: list[tuple[int, int]], trips: list[int],
                  hw: dict = SM90) -> float:
    """One warp's cycles through the kernel: each loop body (its own instructions, inner
    loops apart) simulated once and counted as often as it runs, and the straight-line
    rest once."""
    owner = [-1] * len(instrs)
    for i in sorted(range(len(loops)), key=lambda i: -(loops[i][1] - loops[i][0])):
        first, last = loops[i]
        for n in range(first, last + 1):
            owner[n] = i
    runs = []
    for i, (first, last) in enumerate(loops):
        count = trips[i]
        for j, (f2, l2) in enumerate(loops):
            if j != i and f2 <= first and last <= l2 and (f2, l2) != (first, last):
                count *= trips[j]
        runs.append(count)
    total = warp_cycles([ins for n, ins in enumerate(instrs) if owner[n] == -1], hw)
    for i in range(len(loops)):
        if runs[i]:
            body = [ins for n, ins in enumerate(instrs) if owner[n] == i]
            total += runs[i] * warp_cycles(body, hw)
    return total


# --------------------------------------------------------------------------- #
# Grids and runtime values at a shape (main spec: K = V = 128, chunk 64, one sequence
# per row).
# --------------------------------------------------------------------------- #

def shape_values(b: int, t: int, h: int, bt: int = 64) -> dict:
    chunks = -(-t // bt)
    return dict(n_chunks=chunks, count=chunks, n_tokens=b * t, start=b * t, eos=t, bos=0,
                n_seqs=b, chunk_rows=b * chunks, heads=h, n_rows=min(bt, t),
                BR=64)  # store_zero_rows' row block: its loop runs past the last sequence only


def grid(kernel: str, c: dict, v: dict) -> int:
    """Programs of ``kernel``'s launch (constexprs ``c``) at the shape values ``v``."""
    hv, rows, seqs = v["heads"], v["chunk_rows"], v["n_seqs"]
    blocks = lambda n, b: -(-n // b)
    if kernel in ("kda_fwd_prepare_kernel", "kda_bwd_recompute", "kda_bwd_wy_kernel",
                  "kda_bwd_grads_kernel"):
        return rows * hv
    if kernel in ("kda_fwd_state_output_kernel", "kda_bwd_state_kernel",
                  "kda_bwd_dstate_kernel"):
        return seqs * hv * blocks(c["V"], c["BV"])
    if kernel in ("kda_bwd_inter_kernel", "kda_bwd_intra_kernel"):
        return rows * hv * blocks(c["K"], c["BK"])
    raise ValueError(f"no grid rule for {kernel}")


# Elements of each kernel argument at the shape (t tokens, h = HV heads, n sequences, nt
# chunks; K, V, BT, NK from the constexprs), and bytes per element as bench's inputs have
# them (bf16 q, k, v and cotangents, float32 g and beta, 16-bit intermediates).
_ARRAY_ELEMENTS = {
    **dict.fromkeys(("q", "k", "g", "w", "qg", "kt", "gc", "dq", "dk", "dg", "dw", "dq_p",
                     "dk_p", "dg_p", "dk_w", "dg_w"), lambda d: d["t"] * d["h"] * d["K"]),
    **dict.fromkeys(("v", "u", "vn", "dvn", "do", "o", "dv"),
                    lambda d: d["t"] * d["h"] * d["V"]),
    **dict.fromkeys(("aqk", "x", "dl", "daqk"), lambda d: d["t"] * d["h"] * d["BT"]),
    **dict.fromkeys(("beta", "dbeta"), lambda d: d["t"] * d["h"]),
    "dbeta_k": lambda d: d["t"] * d["h"] * d["NK"],
    "gl": lambda d: d["nt"] * d["h"] * d["K"],
    **dict.fromkeys(("h", "dh", "hc"), lambda d: d["nt"] * d["h"] * d["K"] * d["V"]),
    **dict.fromkeys(("h0", "ht", "dht", "dh0"), lambda d: d["n"] * d["h"] * d["K"] * d["V"]),
}
_TWO_BYTES = {"q", "k", "v", "do", "o", "w", "u", "qg", "kt", "aqk", "vn", "dvn"}


_ELEMENT_BYTES = dict(bf16=2, fp16=2, fp32=4, fp64=8, i32=4, i64=8)


def dram_bytes(kernel: str, c: dict, v: dict, pointers: dict | None = None) -> int:
    """Bytes of the arrays ``kernel`` reads and writes, each once, at the shape values
    ``v`` (constexprs ``c``): the traffic HBM cannot avoid, whatever the L2 keeps. The
    arguments are the working tree's kda_jax.kernels.signatures (the kernels of older
    trees take the same arrays); the prepare writes x and gc only as the backward's
    recompute (STORE_X), the state kernel its checkpoints only when asked.
    ``pointers``: the compiled signature's element type per array ("bf16", "fp32");
    without it (or for an array it lacks) bench's dtypes, 16-bit intermediates."""
    from kda_jax.kernels.signatures import SIGNATURES

    sig = SIGNATURES["kda_fwd_prepare_kernel" if kernel == "kda_bwd_recompute" else kernel]
    d = dict(t=v["n_tokens"], h=v["heads"], n=v["n_seqs"], nt=v["chunk_rows"],
             K=c.get("K", 128), V=c.get("V", 128), BT=c.get("BT", 64),
             NK=-(-c.get("K", 128) // c.get("BK", c.get("K", 128))))
    skip = set()
    if kernel in ("kda_fwd_prepare_kernel", "kda_bwd_recompute") and not c.get("STORE_X"):
        skip |= {"x", "gc"}
    if not c.get("CHECKPOINT_CHUNKS"):
        skip.add("hc")
    total = 0
    for name, _ in sig.args:
        if name in _ARRAY_ELEMENTS and name not in skip:
            size = _ELEMENT_BYTES.get((pointers or {}).get(name, ""))
            total += _ARRAY_ELEMENTS[name](d) * (size or (2 if name in _TWO_BYTES else 4))
    return total


FORWARD = ("kda_fwd_prepare_kernel", "kda_fwd_state_output_kernel")
# bench.aot's specs at the shapes' head dims (K = V = 128, chunk 64): the main case, and
# the layer's form.
SPECS = ("main/c64/default", "main/c64/all")
BACKWARD = ("kda_bwd_recompute", "kda_bwd_state_kernel", "kda_bwd_dstate_kernel",
            "kda_bwd_inter_kernel", "kda_bwd_wy_kernel", "kda_bwd_intra_kernel",
            "kda_bwd_grads_kernel")


# --------------------------------------------------------------------------- #
# The model.
# --------------------------------------------------------------------------- #

def occupancy(regs: int, smem: int, threads: int, hw: dict = SM90) -> int:
    """Programs per SM: registers (allocated per warp in 256s), shared memory, threads."""
    warps = threads // 32
    regs_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = hw["regs_per_sm"] // (regs_warp * warps)
    by_smem = hw["smem_per_sm"] // smem if smem else hw["programs_per_sm"]
    return max(0, min(by_regs, by_smem, hw["threads_per_sm"] // threads, hw["programs_per_sm"]))


def estimate(counts: collections.Counter, *, programs: int, warps: int, regs: int, smem: int,
             overlap: float, hw: dict = SM90) -> dict:
    """Estimated microseconds of one launch, and what set it."""
    occ = occupancy(regs, smem, warps * 32, hw)
    waves = math.ceil(programs / (hw["sms"] * occ)) if occ else float("inf")
    classes = [c for c in hw["issue"]]
    dispatch = sum(counts[c] for c in classes)
    pipes = {c: counts[c] * hw["issue"][c] for c in classes if c != "tensor"}
    pipes["tensor"] = counts["tensor_cycles"]
    # The warps of one wave on one scheduler share its issue slot and units.
    per_sched = occ * warps / 4
    issue = per_sched * max(dispatch, *pipes.values())
    # One warp's own time (its dependences' latencies), shortened by the other warps
    # only as far as they fill its stalls: the overlap.
    alu = counts.get("warp_cycles_alu", 0.0)
    chain = alu + (counts["warp_cycles"] - alu) * overlap
    wave = max(issue, chain)
    compute_us = waves * wave / (hw["clock_ghz"] * 1e3)
    memory_us = max(counts["gmem_bytes"] * warps * programs / (hw["l2_gbs"] * 1e3),
                    counts["dram_bytes"] / (hw["dram_gbs"] * 1e3))
    us = max(compute_us, memory_us) + hw["launch_us"]
    bound = ("memory" if memory_us > compute_us else "issue" if issue >= chain else "latency")
    return dict(us=us, occupancy=occ, waves=waves, issue_cycles=issue, chain_cycles=chain,
                memory_us=memory_us, bound=bound)


def fit(rows: list[dict]) -> float:
    """The overlap (a warp's latencies hidden by its own independent instructions and by
    the other warps) that minimises the squared log error over ``rows`` (each with
    "counts", launch fields and "measured_us"); a 1-D search."""
    best = None
    for k in range(1, 400):
        overlap = 0.01 * k
        err = sum(math.log(estimate(r["counts"], overlap=overlap, **r["launch"])["us"]
                           / r["measured_us"]) ** 2 for r in rows)
        if best is None or err < best[0]:
            best = (err, overlap)
    return best[1]


# --------------------------------------------------------------------------- #
# Compiling the kernels of a tree.
# --------------------------------------------------------------------------- #

# Applied in the child before it compiles: the target's configs with a variant's fields changed
# (KDA_COST_CHANGES, "PATH=VALUE+backward.PATH=VALUE"; values as bench.sweep reads them).
_CHANGES = r"""
from kda_jax import configs
from bench.sweep import config_changes
fields = config_changes(os.environ["KDA_COST_CHANGES"])
for owner, tables in (("forward", (configs.FORWARD, configs.FORWARD_C32)),
                      ("backward", (configs.BACKWARD, configs.BACKWARD_C32))):
    for table in tables:
        for path, value in fields[owner].items():
            table[target] = configs.replace(table[target], path, value)
"""


def compile_kernel(tree: str, kernel: str, spec: str, out: str, reuse: bool = False,
                   changes: str = "", target: str = "sm90") -> dict:
    """Compiles ``kernel`` of the tree for ``target`` in a child process (its own kda_jax);
    returns the launch fields and the code: "sass" on sm90, "asm" (AMDGCN) on AMD.
    ``reuse``: an earlier compile's files at ``out``. ``changes``: the target's config
    fields to change first (``--variant``). None where that config does not launch
    the kernel (the per-chunk gradient kernels or their fused form)."""
    key, suffix = ("sass", ".sass") if target == "sm90" else ("asm", ".s")
    if reuse and os.path.exists(out + suffix) and os.path.exists(out + ".json"):
        row = json.load(open(out + ".json"))
        row[key] = open(out + suffix).read()
        return row
    # A cache of its own per tree: a cached binary of equal source would carry another
    # tree's file names and line numbers.
    # The tree first (its kda_jax), then this checkout (bench.aot for a tree without
    # kda_jax.aot, bench.sweep for a variant's values).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), CHECKOUT]),
               TRITON_CACHE_DIR=out.rsplit("-", 1)[0] + ".triton-cache",
               KDA_COST_CHANGES=changes)
    env.pop("TRITON_INTERPRET", None)  # a compile for the target, never the interpreter's
    env.pop("KDA_JAX_INTERPRET", None)
    code = _COMPILE
    if changes:
        code = code.replace("# (config changes)\n", _CHANGES)
    subprocess.run([sys.executable, "-c", code, kernel, spec, out, target], env=env,
                   check=True, cwd=os.path.abspath(tree), stdout=subprocess.DEVNULL)
    row = json.load(open(out + ".json"))
    if row.get("applies") is False:
        return None
    if not os.path.exists(out + suffix):
        raise RuntimeError(f"{tree}: {kernel} did not compile for {target}: {row.get('error')}")
    row[key] = open(out + suffix).read()
    return row


def model_kernel(tree: str, kernel: str, shape: tuple, out: str,
                 untaken: set[str] = frozenset(), reuse: bool = False,
                 changes: str = "", spec: str = "main/c64/default") -> dict:
    row = compile_kernel(tree, kernel, spec, out, reuse, changes)
    if row is None:
        return None
    instrs, loops = parse(row["sass"])
    c = row["constexprs"] or {}
    values = shape_values(*shape, bt=c.get("BT", 64))
    env = {**c, **values}
    counts, table = dynamic_counts(instrs, loops, env, untaken)
    taken = [ins for ins in instrs if not _in_untaken_function(ins.where, untaken)]
    kept_loops, kept_trips = _loops_of(instrs, taken, loops, [r["trips"] for r in table])
    counts["warp_cycles"] = region_cycles(taken, kept_loops, kept_trips)
    counts["warp_cycles_alu"] = region_cycles(taken, kept_loops, kept_trips, ALU_ONLY)
    counts["dram_bytes"] = dram_bytes(kernel, c, values, row.get("pointers"))
    launch = dict(programs=grid(kernel, c, values), warps=row["num_warps"],
                  regs=row["vgprs"], smem=row["lds_bytes"] or 0)
    return dict(kernel=kernel, tree=tree + (f":{changes}" if changes else ""), counts=counts,
                loops=table, launch=launch,
                spills=row["vgpr_spills"], instructions=len(instrs))


def report(rows: list[dict], overlap: float) -> str:
    lines = [f"overlap {overlap:.2f}"]
    names = [os.path.basename(r["tree"].rstrip("/")) or "." for r in rows]
    width = max([18] + [len(n) for n in names])
    head = (f"{'kernel':28s} {'tree':{width}s} {'est us':>8s} {'meas us':>8s} {'ratio':>6s} "
            f"{'bound':8s} {'occ':>3s} {'waves':>5s}  per warp: instr  tensor  fp32  sfu  "
            f"int  shfl  smem  bar")
    lines.append(head)
    for r, name in zip(rows, names):
        e = estimate(r["counts"], overlap=overlap, **r["launch"])
        r["estimate"] = e
        m = r.get("measured_us")
        n = r["counts"]
        total = sum(n[k] for k in SM90["issue"])
        lines.append(
            f"{r['kernel'][:28]:28s} {name:{width}s} "
            f"{e['us']:8.1f} {m if m is not None else float('nan'):8.1f} "
            f"{(e['us'] / m) if m else float('nan'):6.2f} {e['bound']:8s} {e['occupancy']:3d} "
            f"{e['waves']:5d}  {total:9.0f} {n['tensor']:6.0f} {n['fp32']:6.0f} "
            f"{n['sfu']:5.0f} {n['int']:5.0f} {n['shuffle']:5.0f} {n['smem']:5.0f} "
            f"{n['barrier']:4.0f}")
    return "\n".join(lines)


# What a comparison names when it moved: the launch, then one warp's instructions by unit,
# its time, and the bytes against HBM.
_MOVES = (("occupancy", "estimate"), ("waves", "estimate"), ("bound", "estimate"),
          ("regs", "launch"), ("programs", "launch"), ("warps", "launch"),
          ("spills", None), ("tensor_cycles", "counts"), ("fp32", "counts"), ("fp64", "counts"),
          ("sfu", "counts"), ("int", "counts"), ("shuffle", "counts"), ("smem", "counts"),
          ("gmem_bytes", "counts"), ("barrier", "counts"), ("warp_cycles", "counts"),
          ("dram_bytes", "counts"))


def moved(base: dict, other: dict, at_least: float = 0.05) -> list[str]:
    """What differs between two rows of one kernel (each estimated, as ``report`` leaves
    them): every launch or estimate field that changed, and each count that moved by
    ``at_least`` relative or more, largest move first."""
    exact, counted = [], []
    for name, where in _MOVES:
        a, b = ((r[where] if where else r).get(name) for r in (base, other))
        if where == "counts":
            a, b = float(a or 0), float(b or 0)
            if max(a, b) and abs(b - a) >= at_least * max(a, b):
                ratio = b / a if a else float("inf")
                counted.append((abs(math.log(ratio)) if a and b else float("inf"),
                                f"{name} {a:.4g} -> {b:.4g} ({ratio:.2f}x)"))
        elif a != b:
            exact.append(f"{name} {a} -> {b}")
    return exact + [text for _, text in sorted(counted, key=lambda c: -c[0])]


def comparison(rows: list[dict]) -> str:
    """Per kernel modelled more than once, each later row against the first: its estimate
    as a ratio, and what moved it (:func:`moved`). Rows must have been through ``report``."""
    first, lines = {}, []
    for r in rows:
        base = first.setdefault(r["kernel"], r)
        if base is r:
            continue
        ratio = r["estimate"]["us"] / base["estimate"]["us"]
        lines.append(f"{r['kernel']}: {r['tree']} against {base['tree']}: "
                     f"{base['estimate']['us']:.1f} -> {r['estimate']['us']:.1f} us "
                     f"({ratio:.2f}x); " + ("; ".join(moved(base, r)) or "nothing moved"))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,8192,32", help="B,T,H (K = V = 128, chunk 64)")
    p.add_argument("--tree", action="append", default=[],
                   help="another source tree (git archive REV kda_jax [kernels]) to model")
    p.add_argument("--variant", action="append", default=[],
                   help="PATH=VALUE[+backward.PATH=VALUE]: the working tree with these sm90 "
                        "config fields changed (repeatable)")
    p.add_argument("--spec", default="main/c64/default", choices=SPECS,
                   help="the bench.aot spec to compile (K = V = 128, chunk 64): "
                        "main/c64/all is the layer's form (in-kernel gate, L2 norm and beta "
                        "sigmoid; the backward's intermediates float32)")
    p.add_argument("--kernels", default=",".join(FORWARD + BACKWARD))
    p.add_argument("--measured", help="per-kernel durations to compare with and fit "
                   "(bench/results/h100-kernel-times.json)")
    p.add_argument("--overlap", type=float, help="instead of fitting it to --measured")
    p.add_argument("--fit", action="append", default=[],
                   help="fit the overlap to this tree's measured rows only (repeatable; "
                        "default: every measured row); the others are predictions")
    p.add_argument("--untaken", action="append", default=[],
                   help="TREE=FILE:LINE: a loop of that tree that the input never runs")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--reuse", action="store_true",
                   help="take the compiles already in --out (same trees, same order)")
    p.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cost_model"))
    args = p.parse_args(argv)
    for changes in args.variant:  # a bad field fails here, not in a child
        if config_changes(changes)["segment"]:
            raise SystemExit(f"--variant {changes!r}: segment fields do not change these kernels")
    shape = tuple(int(x) for x in args.shape.split(","))
    os.makedirs(args.out, exist_ok=True)
    untaken = collections.defaultdict(set)
    for item in args.untaken:
        tree, where = item.split("=", 1)
        untaken[os.path.normpath(tree)].add(where)
    measured = {}
    if args.measured:
        # bench/results/h100-kernel-times.json: {"kernels": {REV: {kernel: us}}}, a tree
        # ".variants/REV" (or any path ending in REV) takes REV's row.
        by_rev = json.load(open(args.measured))["kernels"]
        for tree in args.tree:
            rev = os.path.basename(os.path.normpath(tree))
            if rev in by_rev:
                measured[os.path.normpath(tree)] = by_rev[rev]
    rows = []
    entries = [(t, "") for t in ["."] + args.tree] + [(".", v) for v in args.variant]
    for tree, changes in entries:
        name = os.path.normpath(tree)
        label = name + (f":{changes}" if changes else "")
        for kernel in args.kernels.split(","):
            spec = "" if args.spec == SPECS[0] else "@" + args.spec.replace("/", "_")
            out = os.path.join(args.out, re.sub(r"[^\w.=+-]", "_", label) + spec + f"-{kernel}")
            src = os.path.abspath(tree)
            # (The SASS names the sources by their path in the package.)
            skip = {w if w.startswith("/") else os.path.join(src, "kda_jax", "kernels", w)
                    for w in untaken.get(name, ())}
            r = model_kernel(tree, kernel, shape, out, skip, args.reuse, changes, args.spec)
            if r is None:
                print(f"{kernel} does not run under {label}", file=sys.stderr)
                continue
            r["measured_us"] = None if changes else measured.get(name, {}).get(kernel)
            rows.append(r)
            print(f"compiled {kernel} ({label})", file=sys.stderr)
    overlap = args.overlap
    if overlap is None:
        fitted = {os.path.normpath(t) for t in args.fit} if args.fit else None
        known = [r for r in rows if r["measured_us"]
                 and (fitted is None or os.path.normpath(r["tree"]) in fitted)]
        overlap = fit(known) if known else 1.0
    print(report(rows, overlap))
    compared = comparison(rows)
    if compared:
        print("\nwhat moved:\n" + compared)
    if args.json:
        json.dump(dict(shape=shape, overlap=overlap, hw=SM90, rows=[
            {k: (dict(v) if isinstance(v, collections.Counter) else v)
             for k, v in r.items()} for r in rows]), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
