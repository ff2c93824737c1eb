"""Matrix instructions of a compiled kernel and their estimated matrix-core cycles.

Reads the assembly Triton produces per target (no GPU, no JAX, no Triton
import): AMDGCN (``compiled.asm["amdgcn"]``) on HIP targets, PTX
(``compiled.asm["ptx"]``) on sm90 (the SASS would need cuobjdump or nvdisasm,
which ``bench.aot`` does not assume; the PTX's wgmma/mma are what ptxas maps
one to one onto HGMMA/HMMA).

:func:`matrix_profile` returns, for one kernel:

* ``matrix_ops`` ``{opcode: count}``: the static count, each instruction in
  the code once (a loop body once, whatever its trip count). The opcode
  carries its shape and types (``v_mfma_f32_32x32x16_bf16``,
  ``wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16``).
* ``matrix_loops``: the loops of the code that hold matrix instructions, from
  the loop comments LLVM writes into both assemblies ("Loop Header:
  Depth=d", "in Loop: Header=BB0_n"). Each is matched to the kernel source's
  ``for ... in range(...)`` statement that holds the most of its
  instructions (by the ``.loc`` debug lines, inlined call sites included);
  its trip count is evaluated from the launch's constexprs and the kernel
  module's constants when the range's arguments are all such names, else it
  is runtime (``trips: None``, a per-sequence or per-row loop).
* ``matrix_ops_per_program``: the static counts with each op multiplied by
  the known trip counts of the loops around it. Ops in a runtime loop are
  counted once: the count is per iteration of that loop (listed in
  ``matrix_count_basis``).

Proxies, not measurements: a loop that LLVM partially unrolls or Triton
software-pipelines (a peeled prologue/epilogue body outside the loop) is
counted at the source's trip count all the same, so such a loop may be
over-counted by one peeled body; branches are counted as if taken (the
prepare kernel's exact fallback and its anchored products both count).

:func:`matrix_cycles` prices the counts with :data:`COST`: cycles one
matrix instruction keeps its matrix unit busy.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import re

__all__ = ["COST", "family_of", "instruction_cycles", "matrix_cycles", "matrix_profile",
           "parse_matrix_ops", "source_loops"]

# --------------------------------------------------------------------------- #
# Cost table: cycles per instruction issue.
#
# AMD: cycles one wave's instruction occupies its SIMD's matrix core (the ISA
# guides give "passes", 1 pass = 4 cycles). NVIDIA: wgmma, cycles the SM's
# four tensor cores spend on one warpgroup's instruction; mma.sync, cycles one
# SM sub-partition's tensor core spends on one warp's instruction.
# Entries are either from the cited document ("doc") or estimates ("est")
# derived as written next to them; the check
# cycles = FLOPs / (peak FLOP/s / (CUs or SMs x clock) / matrix units) holds
# for every "doc" entry with the vendor's published peaks.
# --------------------------------------------------------------------------- #

# CDNA3 (gfx942, MI300X): AMD "AMD Instinct MI300 Instruction Set Architecture"
# reference guide, the MFMA table of section 7 (passes per instruction). Check
# against MI300X's peaks (304 CUs, 2100 MHz, 4 SIMDs per CU): bf16 1307.4
# TFLOP/s -> 512 FLOP/clk/SIMD, so 32x32x8 bf16 (16384 FLOP) = 32 cycles;
# fp32 matrix 163.4 TFLOP/s -> 64 FLOP/clk/SIMD, so 32x32x2 f32 = 64 cycles;
# tf32 (xf32) 653.7 TFLOP/s -> 256, so 32x32x4 xf32 = 32 cycles.
_CDNA3 = {
    "v_mfma_f32_32x32x2_f32": (64, "doc"),
    "v_mfma_f32_16x16x4_f32": (32, "doc"),
    "v_mfma_f32_32x32x1_2b_f32": (64, "doc"),
    "v_mfma_f32_16x16x1_4b_f32": (32, "doc"),
    "v_mfma_f32_4x4x1_16b_f32": (8, "doc"),
    "v_mfma_f32_32x32x4_xf32": (32, "doc"),
    "v_mfma_f32_16x16x8_xf32": (16, "doc"),
    "v_mfma_f32_32x32x8_f16": (32, "doc"),
    "v_mfma_f32_32x32x8_bf16": (32, "doc"),
    "v_mfma_f32_16x16x16_f16": (16, "doc"),
    "v_mfma_f32_16x16x16_bf16": (16, "doc"),
    "v_mfma_f32_32x32x16_fp8_fp8": (32, "doc"),
    "v_mfma_f32_16x16x32_fp8_fp8": (16, "doc"),
    "v_mfma_i32_32x32x16_i8": (32, "doc"),
    "v_mfma_i32_16x16x32_i8": (16, "doc"),
    "v_mfma_f64_16x16x4_f64": (32, "doc"),
}

# CDNA4 (gfx950, MI355X): AMD "AMD Instinct CDNA4 Instruction Set
# Architecture" reference guide, MFMA table. MI355X's peaks (256 CUs, 2400
# MHz): bf16 2516.6 TFLOP/s -> 1024 FLOP/clk/SIMD, so the double-K 16-bit
# instructions 32x32x16 (32768 FLOP) = 32 cycles and 16x16x32 = 16 cycles;
# fp32 matrix 157.3 TFLOP/s -> 64 FLOP/clk/SIMD: the f32 MFMAs keep CDNA3's
# cycles. XF32 is gone on gfx950 (Triton's tf32 products lower to bf16x3 or
# fp32 there).
_CDNA4 = {
    "v_mfma_f32_32x32x16_bf16": (32, "doc"),
    "v_mfma_f32_32x32x16_f16": (32, "doc"),
    "v_mfma_f32_16x16x32_bf16": (16, "doc"),
    "v_mfma_f32_16x16x32_f16": (16, "doc"),
    "v_mfma_f32_32x32x2_f32": (64, "doc"),
    "v_mfma_f32_16x16x4_f32": (32, "doc"),
    # est: the CDNA3 K = 8 / 16 16-bit forms, assumed to keep CDNA3's cycles
    # on gfx950 (half the rate of the double-K forms above); not verified.
    "v_mfma_f32_32x32x8_f16": (32, "est"),
    "v_mfma_f32_32x32x8_bf16": (32, "est"),
    "v_mfma_f32_16x16x16_f16": (16, "est"),
    "v_mfma_f32_16x16x16_bf16": (16, "est"),
    # est: fp8 from MI355X's 5033 TFLOP/s dense fp8 -> 2048 FLOP/clk/SIMD.
    "v_mfma_f32_32x32x64_f8f6f4": (64, "est"),
    "v_mfma_f32_16x16x128_f8f6f4": (32, "est"),
    "v_mfma_f64_16x16x4_f64": (64, "est"),  # MI355X fp64 matrix 78.6 TFLOP/s: half of CDNA3's
}

# gfx1250 (wave32, WMMA): the gfx1250 ISA's WMMA list names the instructions,
# but no per-instruction cycle count or published peak was at hand: every
# entry is an estimate that assumes CDNA4's per-SIMD rates per data type
# (16-bit 1024 FLOP/clk, fp32 64 FLOP/clk, fp8 2048 FLOP/clk) and 4 SIMDs per
# CU. Treat gfx1250 cycle estimates as relative (op mix), not absolute.
_GFX1250 = {
    "v_wmma_f32_16x16x4_f32": (32, "est"),      # 2048 FLOP / 64
    "v_wmma_f32_16x16x32_bf16": (16, "est"),    # 16384 FLOP / 1024
    "v_wmma_f32_16x16x32_f16": (16, "est"),
    "v_wmma_f32_16x16x64_fp8_fp8": (16, "est"),  # 32768 FLOP / 2048
    "v_wmma_f32_16x16x64_bf8_bf8": (16, "est"),
}

# sm90 (H100/H200 SXM): NVIDIA "H100 Tensor Core GPU Architecture" whitepaper:
# dense fp16/bf16 989.4 TFLOP/s, tf32 494.7, fp8 1978.9 at 1830 MHz boost over
# 132 SMs -> 4096 / 2048 / 8192 FLOP per clock per SM. The shapes are the PTX
# ISA's (wgmma.mma_async: M = 64, K = 16 for f16/bf16, 8 for tf32, 32 for
# fp8; mma.sync m16n8kK). wgmma (a warpgroup drives the SM's 4 tensor cores):
# cycles = 2 M N K / per-SM rate = N / 2 for every dense type ("doc": from the
# whitepaper's peaks). mma.sync runs on one sub-partition's tensor core (a
# quarter of the SM's rate); on Hopper it does not reach the wgmma peak, so
# its cycles here are a lower bound ("est").
_SM90_RATE = {"f16": 4096, "bf16": 4096, "tf32": 2048, "e4m3": 8192, "e5m2": 8192,
              "s8": 8192, "u8": 8192}


def _sm90_cycles(opcode: str):
    m = re.search(r"\.m(\d+)n(\d+)k(\d+)\.", opcode + ".")
    if not m:
        return None
    mm, nn, kk = map(int, m.groups())
    types = [t for t in opcode.split(".") if t in _SM90_RATE]
    if not types:
        return None
    rate = _SM90_RATE[types[-1]]
    if opcode.startswith("wgmma.mma_async"):
        return (2 * mm * nn * kk / rate, "doc")
    if opcode.startswith("mma.sync"):
        return (2 * mm * nn * kk / (rate / 4), "est")
    return None


COST = {"cdna3": _CDNA3, "cdna4": _CDNA4, "gfx1250": _GFX1250, "sm90": _sm90_cycles}
_FAMILY = {"gfx942": "cdna3", "gfx950": "cdna4", "gfx1250": "gfx1250", "sm90": "sm90"}
# Matrix units per CU / SM that a program's waves or warps spread over: 4
# SIMDs per CU (CDNA3/4; assumed for gfx1250), 4 sub-partitions per SM.
_UNITS = 4


def family_of(target: str) -> str:
    """The cost family ("cdna3", "cdna4", "gfx1250", "sm90") of a target name."""
    if target not in _FAMILY:
        raise ValueError(f"target={target!r} has no cost family; known: {sorted(_FAMILY)}")
    return _FAMILY[target]


def instruction_cycles(target: str, opcode: str):
    """(cycles, "doc" | "est") of one ``opcode`` on ``target``, or None if not in COST."""
    table = COST[family_of(target)]
    if callable(table):
        return table(opcode)
    return table.get(opcode)


def matrix_cycles(target: str, ops: dict, num_warps: int) -> dict:
    """Matrix-core cycles of one program, its CU / SM to itself.

    ``ops`` is a per-wave (AMD), per-warp (mma.sync) or per-warpgroup (wgmma)
    ``{opcode: count}``: every wave or warp runs the same code, so the
    program's ``num_warps`` waves share 4 matrix units (CU SIMDs, SM
    sub-partitions; a wgmma warpgroup takes all 4): cycles =
    sum(count x cost) x ceil(num_warps / 4). Returns ``{"cycles": int | None,
    "estimated": [opcodes priced by estimate], "uncosted": [opcodes not in COST]}``
    (``cycles`` None when nothing could be priced but ops exist)."""
    family_of(target)  # an unknown target raises, ops or not
    total, estimated, uncosted = 0.0, [], []
    for op, n in sorted(ops.items()):
        cost = instruction_cycles(target, op)
        if cost is None:
            uncosted.append(op)
            continue
        total += n * cost[0]
        if cost[1] == "est":
            estimated.append(op)
    cycles = None if uncosted and not total else round(total * math.ceil(num_warps / _UNITS))
    return dict(cycles=cycles, estimated=estimated, uncosted=uncosted)


# --------------------------------------------------------------------------- #
# Parsing the assembly.
# --------------------------------------------------------------------------- #

_OPCODE = {
    "hip": re.compile(r"^\s*(v_(?:mfma|smfmac|wmma|swmmac)_[0-9a-z_]+)\b"),
    # A predicated instruction starts with "@%p1 " or "@!%p1 ".
    "cuda": re.compile(r"^\s*(?:@!?%\w+\s+)?((?:wgmma\.mma_async|mma\.sync)(?:\.[0-9a-z_]+)+)"),
}
_COMMENT = {"hip": ";", "cuda": "//"}
_BLOCK = {"hip": re.compile(r"^(?:(\.LBB\d+_\d+):|;\s*%bb\.\d+:)"),
          "cuda": re.compile(r"^(?:(\$L__BB\d+_\d+):|//\s*%bb\.\d+:)")}
_HEADER = re.compile(r"=>\s*This (?:Inner )?Loop Header: Depth=(\d+)")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+) Depth=(\d+)")
_PARENT = re.compile(r"Parent Loop (BB\d+_\d+) Depth=(\d+)")
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)(?:.*?inlined_at\s+(\d+)\s+(\d+)\s+\d+)?")
_FRAME = re.compile(r"([\w.-]+\.py):(\d+):\d+")
_FILE_HIP = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"\s+"([^"]*)"')
_FILE_CUDA = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"')


def parse_matrix_ops(asm: str, backend: str) -> dict:
    """``{opcode: count}`` of the matrix instructions in ``asm`` (static count).

    ``backend`` is "hip" (AMDGCN: v_mfma / v_smfmac / v_wmma / v_swmmac) or
    "cuda" (PTX: wgmma.mma_async / mma.sync; wgmma's fence, commit and wait
    are not matrix work and are not counted)."""
    if backend not in _OPCODE:
        raise ValueError(f"backend={backend!r}: expected 'hip' or 'cuda'")
    ops: dict = {}
    for line in asm.splitlines():
        m = _OPCODE[backend].match(line)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return dict(sorted(ops.items()))


def _files(asm: str, backend: str) -> dict:
    """{file index: path} from the ``.file`` directives."""
    out = {}
    for line in asm.splitlines():
        if backend == "hip":
            m = _FILE_HIP.match(line)
            if m:
                out[int(m.group(1))] = os.path.join(m.group(2), m.group(3))
        else:
            m = _FILE_CUDA.match(line)
            if m:
                out[int(m.group(1))] = m.group(2)
    return out


def _walk(asm: str, backend: str):
    """The instructions of ``asm`` as (matrix opcode or None, innermost loop
    header or None, frames, text), plus {loop header: parent header or None}.
    frames: the (file basename, line) of the instruction's ``.loc`` and of
    the call sites it was inlined at; text: the instruction without its
    comment. AMDGCN stops at the kernel's end (its metadata follows)."""
    files = {i: os.path.basename(p) for i, p in _files(asm, backend).items()}
    # PTX's .loc names one call site (inlined_at), not the chain: the call
    # sites of a location, from the lines where it is the innermost one,
    # complete it (a helper called from two places gets both).
    callers: dict = {}
    for lm in map(_LOC.match, asm.splitlines()):
        if lm and lm.group(4) and int(lm.group(2)) and int(lm.group(5)):
            callers.setdefault((files.get(int(lm.group(1)), "?"), int(lm.group(2))), set()).add(
                (files.get(int(lm.group(4)), "?"), int(lm.group(5))))
    block_re, comment = _BLOCK[backend], _COMMENT[backend]
    parents: dict = {}
    insts = []
    label, loop, chain, frames = None, None, [], ()
    for line in asm.splitlines():
        if line.startswith(".Lfunc_end"):
            break
        m = block_re.match(line)
        if m:
            label = m.group(1).lstrip(".$L_") if m.group(1) else None
            loop, chain = None, []
        stripped = line.strip()
        text = line.split(comment, 1)[1] if comment in line else ""
        if m or stripped.startswith(comment):
            for p in _PARENT.finditer(text):
                chain.append(p.group(1))
            h = _HEADER.search(text)
            if h and label:
                loop = label
            i = _IN_LOOP.search(text)
            if i:
                loop = i.group(1)
            if loop is not None and loop not in parents:
                parents[loop] = chain[-1] if chain else None
            if not m:
                continue
        if not stripped or m:
            continue
        lm = _LOC.match(line)
        if lm:
            fs = []
            if int(lm.group(2)):
                fs.append((files.get(int(lm.group(1)), "?"), int(lm.group(2))))
            if lm.group(4) and int(lm.group(5)):
                fs.append((files.get(int(lm.group(4)), "?"), int(lm.group(5))))
            fs += [(f, int(n)) for f, n in _FRAME.findall(text)[1:]]
            todo = list(fs[1:] or fs)
            while todo and len(fs) < 32:
                for c in sorted(callers.get(todo.pop(0), ())):
                    if c not in fs:
                        fs.append(c)
                        todo.append(c)
            frames = tuple(dict.fromkeys(fs))
            continue
        if stripped.startswith(".") or stripped.endswith(":"):
            continue  # a directive or a label of its own
        op = _OPCODE[backend].match(line)
        insts.append((op.group(1) if op else None, loop, frames,
                      line.split(comment, 1)[0].strip()))
    return insts, parents


def source_loops(path: str) -> list[dict]:
    """The ``for ... in range(...)`` / ``tl.range(...)`` statements of a source
    file (``tl.static_range`` is unrolled by Triton and left out), each as
    {file, line, end, text, args (ast nodes), constexprs (names of the
    enclosing function's constexpr parameters)}, plus the module's integer
    constants under the key "constants" of every entry. The entries are shared
    between calls on an unchanged file: read them, do not modify them."""
    st = os.stat(path)
    return list(_source_loops(path, st.st_mtime_ns, st.st_size))


# Keyed by the file's mtime and size, so an edited file is parsed again: the
# AOT report profiles hundreds of compiles of the same few kernel sources.
@functools.lru_cache(maxsize=32)
def _source_loops(path: str, mtime_ns: int, size: int) -> tuple:
    with open(path) as f:
        tree = ast.parse(f.read())
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            v = node.value
            if isinstance(v, ast.Call) and v.args and getattr(v.func, "attr", None) == "constexpr":
                v = v.args[0]
            if isinstance(v, ast.Constant) and isinstance(v.value, int):
                constants[node.targets[0].id] = v.value
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        cexpr = {a.arg for a in fn.args.args
                 if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)):
                continue
            name = ast.unparse(node.iter.func)
            if name not in ("range", "tl.range"):
                continue
            out.append(dict(file=os.path.basename(path), line=node.lineno, end=node.end_lineno,
                            text=f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}",
                            args=[a for a in node.iter.args[:3]], constexprs=cexpr,
                            constants=constants))
    return tuple(out)


def _eval(node, names: dict):
    """An int from an expression of ints and known names (+ - * //), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        v = names.get(node.id)
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _eval(node.operand, names)
        return None if v is None else -v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, names), _eval(node.right, names)
        if a is None or b is None:
            return None
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
               ast.FloorDiv: lambda: a // b if b else None}
        f = ops.get(type(node.op))
        return f() if f else None
    return None


def _trips(loop: dict, constexprs: dict):
    """The trip count of a source loop at these constexprs, or None (runtime).

    A name counts only as a constexpr parameter of the loop's own function or
    a module constant; a helper's constexpr parameter takes the launch's value
    of the same name (the kernels pass constexprs through under their names)."""
    names = dict(loop["constants"])
    names.update({k: v for k, v in constexprs.items() if k in loop["constexprs"]})
    vals = [_eval(a, names) for a in loop["args"]]
    if any(v is None for v in vals) or not vals:
        return None
    if len(vals) == 1:
        vals = [0] + vals
    step = vals[2] if len(vals) == 3 else 1
    return len(range(vals[0], vals[1], step)) if step else None


def _match(frames_list, loops):
    """The source loop holding the most of these instructions' frames (ties:
    the one matched through the innermost frames, then the shortest)."""
    located = [fs for fs in frames_list if fs]
    if not located:
        return None
    best, best_key = None, None
    for lp in loops:
        hit, depth = 0, 0
        for fs in located:
            for d, (f, n) in enumerate(fs):
                if f == lp["file"] and lp["line"] <= n <= lp["end"]:
                    hit, depth = hit + 1, depth + d
                    break
        if not hit:
            continue
        key = (-hit, depth / hit, lp["end"] - lp["line"])
        if best_key is None or key < best_key:
            best, best_key = lp, key
    if best is None or -best_key[0] < 0.5 * len(located):
        return None
    return best


def matrix_profile(asm: str, backend: str, constexprs: dict, sources=None) -> dict:
    """The matrix instructions of one compiled kernel (see the module docstring).

    ``asm``: AMDGCN or PTX text; ``backend``: "hip" or "cuda"; ``constexprs``:
    the launch's constexprs; ``sources``: {basename: path} of the kernel
    sources (default: the ``.file`` paths in ``asm`` that exist)."""
    ops = parse_matrix_ops(asm, backend)
    insts, parents = _walk(asm, backend)
    if sources is None:
        sources = {os.path.basename(p): p for p in _files(asm, backend).values()
                   if p.endswith(".py") and os.path.isfile(p)}
    loops = [lp for p in sources.values() for lp in source_loops(p)]

    def ancestors(h):
        out = []
        while h is not None and h not in out:
            out.append(h)
            h = parents.get(h)
        return out

    members: dict = {}  # loop header -> frames of every instruction in it (nested too)
    direct: dict = {}   # loop header -> {opcode: count} directly in it
    for op, loop, frames, _ in insts:
        for h in ancestors(loop):
            members.setdefault(h, []).append(frames)
        if op is not None and loop is not None:
            d = direct.setdefault(loop, {})
            d[op] = d.get(op, 0) + 1
    holding = {a for h in direct for a in ancestors(h)}
    matched = {h: _match(members.get(h, []), loops) for h in holding}
    trips = {}
    for h in holding:
        lp = matched[h]
        parent_lp = matched.get(parents.get(h)) if parents.get(h) else None
        # One source loop for two nested code loops: which runs how often is unknown.
        trips[h] = None if lp is None or lp is parent_lp else _trips(lp, constexprs)

    per_program = dict(ops)
    basis = set()
    for h, d in direct.items():
        factor = 1
        for a in ancestors(h):
            if trips[a] is None:
                lp = matched[a]
                basis.add(f"{lp['file']}:{lp['line']} {lp['text']}" if lp else
                          f"unmatched loop {a}")
            else:
                factor *= trips[a]
        for op, n in d.items():
            per_program[op] += n * (factor - 1)
    order = {h: i for i, h in enumerate(parents)}  # as the loops appear in the code
    rows = []
    for h in sorted(holding, key=order.get):
        lp = matched[h]
        rows.append(dict(
            loop=f"{lp['file']}:{lp['line']} {lp['text']}" if lp else None,
            depth=len(ancestors(h)), trips=trips[h],
            matrix_ops=dict(sorted(direct.get(h, {}).items()))))
    return dict(matrix_ops=ops, matrix_loops=rows,
                matrix_ops_per_program=dict(sorted(per_program.items())),
                matrix_count_basis=sorted(basis))
