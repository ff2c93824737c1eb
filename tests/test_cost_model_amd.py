"""bench.cost_model_amd on hand-written AMDGCN: loops from LLVM's loop comments, trip counts
from the `for` lines, unit classes, and the estimate's bounds (no compile, no GPU)."""

import collections
import textwrap

import pytest

from bench import cost_model_amd as amd


def _source(tmp_path):
    src = tmp_path / "k.py"
    src.write_text(textwrap.dedent("""\
        def kernel(K: tl.constexpr, BK: tl.constexpr):
            x = 0
            for ks in range(0, K, BK):
                for j in range(0, 3):
                    x += 1
            return x
        """))
    return src


def _asm(src):
    return textwrap.dedent(f"""\
        \t.file\t1 "{src.parent}" "{src.name}"
        ; %bb.0:
        \t.loc\t1 2 5
        \ts_load_dwordx2 s[0:1], s[0:1], 0x0
        \ts_waitcnt lgkmcnt(0)
        .LBB0_1:                                ; =>This Loop Header: Depth=1
        \t.loc\t1 3 5
        \tv_add_u32_e32 v1, 16, v1
        \tglobal_load_dwordx4 v[2:5], v[6:7], off
        .LBB0_2:                                ;   Parent Loop BB0_1 Depth=1
                                                ; =>  This Inner Loop Header: Depth=2
        \t.loc\t1 4 9
        \tv_exp_f32_e32 v8, v8
        \tv_mfma_f32_32x32x16_bf16 a[0:15], v[2:5], v[2:5], a[0:15]
        \ts_cbranch_scc1 .LBB0_2
        ; %bb.3:                                ;   in Loop: Header=BB0_1 Depth=1
        \t.loc\t1 3 5
        \ts_waitcnt vmcnt(0)
        \tds_read_b128 v[10:13], v0
        \ts_barrier
        \ts_cbranch_scc1 .LBB0_1
        ; %bb.4:
        \t.loc\t1 6 5
        \ts_endpgm
        .Lfunc_end0:
        \t.size\tkernel, .Lfunc_end0-kernel
        \t.amdgpu_metadata
        ---
        amdhsa.kernels:
          - .args:
              - .offset:         0
        \t.end_amdgpu_metadata
        """)


def test_loops_from_llvm_comments_and_trip_counts(tmp_path):
    instrs, loops = amd.parse(_asm(_source(tmp_path)))
    assert [i.op for i in instrs][:3] == ["s_load_dwordx2", "s_waitcnt", "v_add_u32_e32"]
    assert instrs[-1].op == "s_endpgm"  # nothing of the metadata after the kernel's end
    # The outer loop holds the inner one: (first, last) spans nest.
    (o_first, o_last), (i_first, i_last) = sorted(loops, key=lambda s: s[0] - s[1])
    assert o_first < i_first <= i_last < o_last
    counts, table = amd.counts_at(instrs, loops, dict(K=128, BK=32), "gfx950",
                                  amd.TARGETS["gfx950"])
    assert sorted(r["trips"] for r in table) == [3, 4]
    # The inner body runs 4 * 3 times, the outer body's own instructions 4 times.
    assert counts["trans"] == 12 and counts["matrix"] == 12
    assert counts["vmem"] == 4 and counts["lds"] == 4 and counts["barrier"] == 4
    assert counts["matrix_cycles"] == 12 * 32  # CDNA4's 32x32x16 bf16: 32 cycles
    # Issue: wave64 on 16 lanes is 4 passes; a transcendental 4 times a VALU op's.
    assert counts["issue_cycles"] >= 12 * 16 + 4 * 4
    # Waits: the loop's vmcnt and barrier 4 times, the entry's lgkmcnt once.
    w = amd.TARGETS["gfx950"]["wait"]
    assert counts["wait_cycles"] == 4 * (w["vmem"] + w["barrier"]) + w["lgkm"]


@pytest.mark.parametrize("op, cls", [
    ("v_mfma_f32_16x16x32_bf16", "matrix"), ("v_wmma_f32_16x16x32_bf16", "matrix"),
    ("v_exp_f32_e32", "trans"), ("v_rsq_f32_e32", "trans"), ("v_pk_fma_f32", "valu"),
    ("ds_write_b64", "lds"), ("buffer_load_dword", "vmem"), ("global_store_dwordx4", "vmem"),
    ("s_load_dwordx4", "smem"), ("s_barrier", "barrier"), ("s_waitcnt", "wait"),
    ("s_cbranch_execz", "branch"), ("s_and_b64", "salu")])
def test_unit_classes(op, cls):
    assert amd.unit(op) == cls


def test_estimate_bounds():
    """A kernel whose waits dominate is latency-bound; one with many resident waves and no
    waits is issue-bound; enough bytes make it memory-bound."""
    hw = amd.TARGETS["gfx950"]
    c = collections.Counter(issue_cycles=1000, matrix_cycles=0, wait_cycles=10000,
                            dram_bytes=0)
    e = amd.estimate(c, programs=256, warps=4, occupancy=1, overlap=2.75, hw=hw)
    assert e["bound"] == "latency" and e["waves"] == 1
    c["wait_cycles"] = 0
    e = amd.estimate(c, programs=256 * 8, warps=4, occupancy=8, overlap=2.75, hw=hw)
    assert e["bound"] == "issue" and e["programs_per_cu"] == 8 and e["waves"] == 1
    # A program of two waves takes two SIMDs: twice the programs per CU of four waves'.
    e = amd.estimate(c, programs=256 * 16, warps=2, occupancy=8, overlap=2.75, hw=hw)
    assert e["programs_per_cu"] == 16 and e["waves"] == 1
    c["dram_bytes"] = 1e12
    e = amd.estimate(c, programs=256, warps=4, occupancy=8, overlap=2.75, hw=hw)
    assert e["bound"] == "memory"
