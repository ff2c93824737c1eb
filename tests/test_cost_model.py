"""bench.cost_model's pieces on hand-written SASS (no compile, no GPU): loops and their
`for` lines, trip counts from the launch's constexprs, the scoreboard of one warp, and
occupancy."""

from __future__ import annotations

import collections
import json

import pytest

from bench import cost_model as cm


def _sass(path, body_lines):
    """SASS text whose instructions carry ``path``'s line numbers: (line, text, label)."""
    out = []
    for line, text, label in body_lines:
        if label:
            out.append(f"{label}:")
        out.append(f'\t//## File "{path}", line {line}')
        out.append(f"        /*{len(out):04x}*/                   {text} ;")
    return "\n".join(out)


@pytest.fixture
def kernel_source(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("\n".join([
        "BB = tl.constexpr(16)",              # 1
        "def k(K: tl.constexpr, BK: tl.constexpr):",  # 2
        "    for ks in range(0, K, BK):",     # 3
        "        x = x + 1",                  # 4
        "        for j in range(0, BB - 1):",  # 5
        "            y = y * 2",              # 6
        "    h = BT // 2",                    # 7
        "    while h > 0:",                   # 8
        "        h //= 2",                    # 9
    ]) + "\n")
    return str(src)


def test_loops_trips_and_counts(kernel_source):
    sass = _sass(kernel_source, [
        (2, "MOV R0, RZ", None),
        (3, "IADD3 R1, R1, 0x1, RZ", ".L_x_0"),
        (4, "FADD R2, R2, 1", None),
        (6, "FMUL R3, R3, 2", ".L_x_1"),
        (5, "ISETP.NE.AND P0, PT, R4, RZ, PT", None),
        (5, "@P0 BRA `(.L_x_1)", None),
        (3, "ISETP.NE.AND P1, PT, R1, R5, PT", None),
        (3, "@P1 BRA `(.L_x_0)", None),
        (8, "SHF.R.S32.HI R6, RZ, 0x1, R6", ".L_x_2"),
        (8, "@P2 BRA `(.L_x_2)", None),
        (9, "EXIT", None),
        (9, "BRA `(.L_x_3)", ".L_x_3"),  # padding after the exit (a branch to itself)
    ])
    instrs, loops = cm.parse(sass)
    assert len(loops) == 3
    lines = cm.loop_lines(instrs, loops)
    assert [w.rsplit(":", 1)[1] for w in lines] == ["5", "3", "8"]
    env = dict(K=128, BK=32, BT=64)
    assert cm.trip_count(lines[0], env)[0] == 15  # BB, a module constant
    assert cm.trip_count(lines[1], env)[0] == 4
    assert cm.trip_count(lines[2], env)[0] == 6  # 32, 16, 8, 4, 2, 1
    counts, table = cm.dynamic_counts(instrs, loops, env)
    # The inner body (3 instructions) runs 4 x 15 times; the outer's own 4 run 4 times.
    assert counts["fp32"] == 4 + 4 * 15  # FADD per outer trip, FMUL per inner trip
    assert [r["trips"] for r in table] == [15, 4, 6]
    with pytest.raises(ValueError, match="needs BK"):
        cm.trip_count(lines[1], dict(K=128))
    # An untaken loop contributes nothing.
    counts, _ = cm.dynamic_counts(instrs, loops, env, untaken={lines[0]})
    assert counts["fp32"] == 4


def test_scoreboard_dependences():
    chain = [cm.Instr("FFMA", "?", f" R{i + 1}, R{i}, R{i}, R{i}") for i in range(10)]
    free = [cm.Instr("FFMA", "?", f" R{i + 20}, R1, R1, R1") for i in range(10)]
    dependent, independent = cm.warp_cycles(chain), cm.warp_cycles(free)
    assert dependent >= 9 * cm.SM90["latency"]["fp32"]
    assert independent <= 12
    # HGMMAs queue on the tensor core; the DEPBAR waits for them.
    mma = [cm.Instr("WARPGROUP", "?", ".ARRIVE"),
           cm.Instr("HGMMA", "?", ".64x64x16.F32.BF16 R24, gdesc[UR4], R24"),
           cm.Instr("HGMMA", "?", ".64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"),
           cm.Instr("WARPGROUP", "?", ".DEPBAR.LE gsb0, 0x0"),
           cm.Instr("FADD", "?", " R60, R24, R25")]
    assert cm.warp_cycles(mma) >= 2 * 32  # two 64x64x16 at 512 MACs a cycle each


def test_occupancy_and_estimate():
    assert cm.occupancy(regs=255, smem=0, threads=128) == 2
    assert cm.occupancy(regs=128, smem=0, threads=256) == 2
    assert cm.occupancy(regs=64, smem=120 * 1024, threads=128) == 1
    counts = collections.Counter(fp32=1000, warp_cycles=8000.0)
    one = cm.estimate(counts, programs=132, warps=4, regs=255, smem=0, overlap=1.0)
    two = cm.estimate(counts, programs=4 * 132, warps=4, regs=255, smem=0, overlap=1.0)
    assert one["waves"] == 1 and two["waves"] == 2 and two["us"] > one["us"]
    assert one["bound"] == "latency"


def test_variant_changes_the_sm90_configs(monkeypatch):
    """--variant: the child's prelude changes the named fields of its target's
    entries (sm90 here), forward and backward, at both chunk sizes, and nothing
    else."""
    import os

    from kda_jax import configs

    saved = {id(t): dict(t) for t in (configs.FORWARD, configs.FORWARD_C32, configs.BACKWARD,
                                      configs.BACKWARD_C32)}
    before_fwd, before_bwd = configs.FORWARD["sm90"], configs.BACKWARD_C32["sm90"]
    monkeypatch.setenv("KDA_COST_CHANGES", "prepare.*.block_k=32+backward.intra.bf16.dot=tf32")
    try:
        exec(cm._CHANGES, {"os": os, "target": "sm90"})
        assert configs.FORWARD["sm90"] == configs.replace(before_fwd, "prepare.*.block_k", 32)
        assert configs.BACKWARD_C32["sm90"] == configs.replace(before_bwd, "intra.bf16.dot",
                                                               "tf32")
        assert configs.FORWARD["gfx950"] is saved[id(configs.FORWARD)]["gfx950"]
    finally:
        for table in (configs.FORWARD, configs.FORWARD_C32, configs.BACKWARD,
                      configs.BACKWARD_C32):
            table.update(saved[id(table)])


def test_dram_bytes_counts_each_array_once():
    """The inter kernel at (1, 8192, 32): q, k (bf16), gc, g (float32), h, dh (float32
    per chunk), vn, dvn, do (bf16) read, dq, dk, dg, dw (float32) written; the prepare
    writes x and gc only as the recompute."""
    v = cm.shape_values(1, 8192, 32)
    c = dict(K=128, V=128, BT=64, BK=32)
    tk = 8192 * 32 * 128
    state = 128 * 32 * 128 * 128
    want = 2 * tk * 2 + 2 * tk * 4 + 2 * state * 4 + 3 * tk * 2 + 4 * tk * 4
    assert cm.dram_bytes("kda_bwd_inter_kernel", c, v) == want
    fwd = cm.dram_bytes("kda_fwd_prepare_kernel", c, v)
    extra = 8192 * 32 * 64 * 4 + tk * 4  # x, gc
    assert cm.dram_bytes("kda_bwd_recompute", dict(c, STORE_X=True), v) == fwd + extra
    # The compiled signature's types win: float32 intermediates (the layer's backward)
    # double vn and dvn, and a bf16 g halves it.
    typed = cm.dram_bytes("kda_bwd_inter_kernel", c, v, dict(vn="fp32", dvn="fp32", g="bf16"))
    assert typed == want + 2 * tk * 2 - tk * 2
    counts = collections.Counter(gmem_bytes=0, dram_bytes=3e9)
    e = cm.estimate(counts, programs=132, warps=4, regs=64, smem=0, overlap=1.0)
    assert e["bound"] == "memory"
    assert e["memory_us"] == pytest.approx(3e9 / (cm.SM90["dram_gbs"] * 1e3))


def test_comparison_names_what_moved_a_config_change(tmp_path, capsys):
    """The comparison mode end to end on the CPU: the reverse state pass compiled for sm90
    as shipped and with 32-wide V blocks (--variant), estimated at (1, 8192, 32), and what
    moved between them named: half the programs, twice the tensor-core work per warp, more
    registers."""
    out = tmp_path / "rows.json"
    cm.main(["--kernels", "kda_bwd_dstate_kernel", "--variant",
             "backward.dstate.16bit.block_v=32", "--overlap", "2.75", "--out",
             str(tmp_path / "compiled"), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tree"] for r in rows] == [".", ".:backward.dstate.16bit.block_v=32"]
    base, wide = rows
    assert wide["launch"]["programs"] * 2 == base["launch"]["programs"]
    assert wide["counts"]["tensor_cycles"] == 2 * base["counts"]["tensor_cycles"]
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("kda_bwd_dstate_kernel: "))
    programs = base["launch"]["programs"]
    assert f"programs {programs} -> {programs // 2}" in line and "tensor_cycles" in line
    assert f"regs {base['launch']['regs']} -> {wide['launch']['regs']}" in line
