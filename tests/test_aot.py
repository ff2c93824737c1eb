"""Ahead-of-time compile (bench.aot): no GPU needed."""

import pytest

pytest.importorskip("triton")

from bench import aot  # noqa: E402

SPEC = {s.name: s for s in aot.SPECS}["main/c32/default"]
KERNEL = "kda_fwd_state_output_kernel"
TARGETS = ("gfx950", "sm90")


@pytest.fixture(scope="module")
def rows():
    # aot.run compiles in fresh processes: this suite sets TRITON_INTERPRET=1,
    # under which Triton hands out interpreter kernels that cannot compile.
    return {r["target"]: r for r in aot.run(TARGETS, (SPEC,), (KERNEL,), jobs=2)}


@pytest.mark.parametrize("target", TARGETS)
def test_compile_reports_resources_without_spills(rows, target):
    row = rows[target]
    assert row["error"] is None, row["error"]
    assert row["ok"]
    assert (row["kernel"], row["spec"]) == (KERNEL, SPEC.name)
    assert row["num_warps"] > 0 and row["num_stages"] > 0
    fields = ["vgprs", "vgpr_spills", "scratch", "lds_bytes", "occupancy"]
    if target.startswith("gfx"):
        fields += ["sgprs", "sgpr_spills"]
    for name in fields:
        assert isinstance(row[name], int), (name, row[name])
    assert row["vgprs"] > 0
    assert row["occupancy"] >= 1
    assert row["vgpr_spills"] == 0
    assert row["scratch"] == 0


@pytest.mark.parametrize("target", TARGETS)
def test_compile_reports_matrix_ops(rows, target):
    # The state kernel's products are tl.dot: MFMA on gfx950, wgmma on sm90.
    row = rows[target]
    assert row["matrix_error"] is None, row["matrix_error"]
    ops = row["matrix_ops"]
    assert ops and all(n > 0 for n in ops.values()), ops
    # sm90 at chunk 32 mixes wgmma and mma.sync (tiles below wgmma's M = 64).
    prefix = ("v_mfma_",) if target == "gfx950" else ("wgmma.mma_async", "mma.sync")
    assert all(op.startswith(prefix) for op in ops), ops
    # Its chunk loop's trip count is runtime: counts stay per iteration.
    assert row["matrix_ops_per_program"] == ops
    assert any("n_chunks" in b for b in row["matrix_count_basis"]), row["matrix_count_basis"]
    assert row["est_matrix_cycles"] > 0 and not row["matrix_ops_uncosted"]
    if target == "sm90" and row["sass_matrix_ops"] is not None:
        assert all(op.startswith(("HGMMA.", "HMMA.")) for op in row["sass_matrix_ops"])


def test_one_spec_compiles_the_bf16_state_pool():
    # The pool kernels' rounding store (kda_jax/kernels/state_io._rounded) compiles at
    # one existing spec: no extra rows. main/c32/all keeps the float32 forms.
    by_name = {s.name: s for s in aot.SPECS}
    assert [s.name for s in aot.SPECS if s.state != "fp32"] == ["main/c64/all/bf16-pool"]
    assert len(aot.SPECS) == (len(aot.SHAPES) * len(aot.CHUNKS) * len(aot.FLAG_SETS)
                              + len(aot.EXTRA_SPECS))
    indexed = lambda kernel, name: aot._launch_for(kernel, "sm90", by_name[name])[
        0].constexprs["INDEXED_STATE"]
    for kernel in aot.POOL_KERNELS:
        assert indexed(kernel, "main/c64/all/bf16-pool"), kernel
    assert not indexed("kda_fwd_state_output_kernel", "main/c32/all")
    assert indexed("kda_fused_recurrent_kernel", "main/c32/all")  # a float32 pool


# --------------------------------------------------------------------------- #
# The matrix-op parser, loop trip counts and costs (bench.aot_isa), on small
# hand-written assembly in the form LLVM prints.
# --------------------------------------------------------------------------- #

from bench import aot_isa  # noqa: E402

# A kernel source with one constexpr loop and one runtime loop.
_SRC = '''\
import triton.language as tl
NB = tl.constexpr(3)


def kern(x, n_rows, K: tl.constexpr, BK: tl.constexpr):
    for ks in range(0, K, BK):
        a = 1
        b = 2
    for j in range(0, n_rows):
        c = 3
    for i in tl.static_range(0, NB):
        d = 4
    for i in range(NB - 1):
        e = 5
'''

_HIP = """\
\t.file\t1 "{dir}" "src.py"
kern:
\t.loc\t1 5 0 prologue_end          ; src.py:5:0
\tv_mfma_f32_32x32x16_bf16 v[0:15], v[16:19], v[20:23], 0
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
\t.loc\t1 7 5                           ; src.py:7:5
\tv_mfma_f32_32x32x2_f32 v[0:15], v16, v17, v[0:15]
\tv_mfma_f32_32x32x2_f32 v[0:15], v16, v17, v[0:15]
; %bb.2:                                ;   in Loop: Header=BB0_1 Depth=1
\t.loc\t1 8 5                           ; src.py:8:5
\ts_add_i32 s0, s0, 32
\ts_cbranch_scc1 .LBB0_1
.LBB0_3:                                ; =>This Inner Loop Header: Depth=1
\t.loc\t1 10 5                          ; src.py:10:5
\tv_mfma_f32_16x16x4_f32 v[0:3], v4, v5, v[0:3]
\ts_cbranch_scc1 .LBB0_3
; %bb.4:
\t.loc\t1 14 5                          ; src.py:14:5
\tv_mfma_f32_32x32x16_bf16 v[0:15], v[16:19], v[20:23], v[0:15]
\ts_endpgm
"""

_PTX = """\
\t.loc\t1 5 0                           // src.py:5:0
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {{%r1}}, %rd1, %rd2, p, 1, 1, 0, 1;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
\t.loc\t1 7 5                           // src.py:7:5
\t@%p1 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{%f1}}, {{%r1}}, {{%r2}}, {{%f1}};
\twgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {{%r1}}, %rd1, %rd2, p, 1, 1;
\twgmma.commit_group.sync.aligned;
\t@%p2 bra \t$L__BB0_1;
// %bb.2:
\twgmma.wait_group.sync.aligned \t0;
\tret;
\t.file\t1 "{dir}/src.py"
"""


@pytest.fixture()
def src(tmp_path):
    (tmp_path / "src.py").write_text(_SRC)
    return str(tmp_path)


def test_parse_matrix_ops_hip_and_ptx(src):
    hip = aot_isa.parse_matrix_ops(_HIP.format(dir=src), "hip")
    assert hip == {"v_mfma_f32_16x16x4_f32": 1, "v_mfma_f32_32x32x16_bf16": 2,
                   "v_mfma_f32_32x32x2_f32": 2}
    ptx = aot_isa.parse_matrix_ops(_PTX.format(dir=src), "cuda")
    # fence / commit / wait are not matrix work; a predicated mma counts.
    assert ptx == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": 1,
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16": 1,
                   "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32": 1}
    with pytest.raises(ValueError, match="backend"):
        aot_isa.parse_matrix_ops("", "rocm")


def test_source_loops_trip_counts(src):
    loops = {lp["line"]: lp for lp in aot_isa.source_loops(src + "/src.py")}
    assert sorted(loops) == [6, 9, 13]  # static_range is unrolled by Triton: not a loop
    consts = {"K": 100, "BK": 32}
    assert aot_isa._trips(loops[6], consts) == 4  # ceil(100 / 32), as scf.for runs
    assert aot_isa._trips(loops[9], consts) is None  # n_rows: runtime
    assert aot_isa._trips(loops[13], consts) == 2  # module constant NB - 1
    assert aot_isa._trips(loops[6], {"K": 100}) is None  # BK unknown


def test_matrix_profile_scales_known_loops(src):
    prof = aot_isa.matrix_profile(_HIP.format(dir=src), "hip", {"K": 128, "BK": 32})
    assert prof["matrix_ops"]["v_mfma_f32_32x32x2_f32"] == 2
    # The K loop (4 trips) scales; the n_rows loop stays per iteration.
    assert prof["matrix_ops_per_program"] == {"v_mfma_f32_16x16x4_f32": 1,
                                              "v_mfma_f32_32x32x16_bf16": 2,
                                              "v_mfma_f32_32x32x2_f32": 8}
    assert prof["matrix_count_basis"] == ["src.py:9 for j in range(0, n_rows)"]
    assert [(r["loop"], r["trips"]) for r in prof["matrix_loops"]] == [
        ("src.py:6 for ks in range(0, K, BK)", 4), ("src.py:9 for j in range(0, n_rows)", None)]
    ptx = aot_isa.matrix_profile(_PTX.format(dir=src), "cuda", {"K": 64, "BK": 32})
    assert ptx["matrix_ops_per_program"][
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32"] == 2


def test_matrix_cycles():
    # CDNA4 / CDNA3: 32x32x16 bf16 = 8 passes (32 cycles); 32x32x2 f32 = 16 passes.
    c = aot_isa.matrix_cycles("gfx950", {"v_mfma_f32_32x32x16_bf16": 3,
                                         "v_mfma_f32_32x32x2_f32": 2}, num_warps=4)
    assert c == dict(cycles=3 * 32 + 2 * 64, estimated=[], uncosted=[])
    # 8 waves: two per SIMD, their matrix work in series.
    assert aot_isa.matrix_cycles("gfx942", {"v_mfma_f32_32x32x2_f32": 1}, 8)["cycles"] == 128
    # wgmma m64nNk16 bf16: N / 2 cycles; tf32 k8 the same.
    c = aot_isa.matrix_cycles("sm90", {"wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16": 2,
                                       "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32": 1},
                              num_warps=4)
    assert c["cycles"] == 2 * 16 + 32 and not c["estimated"]
    c = aot_isa.matrix_cycles("gfx1250", {"v_wmma_f32_16x16x32_bf16": 1, "v_foo": 2}, 4)
    assert c == dict(cycles=16, estimated=["v_wmma_f32_16x16x32_bf16"], uncosted=["v_foo"])
    assert aot_isa.matrix_cycles("gfx950", {"v_foo": 1}, 4)["cycles"] is None
    with pytest.raises(ValueError, match="target='gfx90a'"):
        aot_isa.matrix_cycles("gfx90a", {}, 4)


def _row(kernel, target, spec, **kw):
    row = dict(kernel=kernel, target=target, spec=spec, ok=True, num_warps=4, num_stages=1,
               vgprs=100, vgpr_spills=0, scratch=0, lds_bytes=1024, occupancy=2,
               matrix_ops={"v_mfma_f32_32x32x2_f32": 4}, matrix_ops_per_program=None,
               matrix_count_basis=[], est_matrix_cycles=256, sources_sha256="x")
    row.update(kw)
    return row


def test_summary_keeps_main_spec_and_aggregates():
    rows = [_row("k", "gfx950", "fp32/c64/default", vgprs=200, occupancy=1),
            _row("k", "gfx950", aot.SUMMARY_SPEC),
            _row("k", "gfx950", "large/c64/all", ok=False, vgpr_spills=3, lds_bytes=4096),
            _row("k", "sm90", "fp32/c64/default")]
    s = aot.summary(rows, "3.9.0")
    e = s["kernels"]["k"]["gfx950"]
    assert e["spec"] == aot.SUMMARY_SPEC and e["vgprs"] == 100
    assert "matrix_ops_per_program" not in e  # None fields are left out
    assert e["all_specs"] == dict(compiles=3, failed=1, spilled=1, max_vgprs=200,
                                  max_lds_bytes=4096, min_occupancy=1)
    # Without the main spec, the first one compiled stands in, named.
    assert s["kernels"]["k"]["sm90"]["spec"] == "fp32/c64/default"
    assert "sources_sha256" not in str(s)
    text = aot.summary_table(s)
    assert "4xv_mfma_f32_32x32x2_f32" in text and "gfx950" in text


def test_committed_summary_lists_every_kernel_and_target():
    import json
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "bench" / "results" / "aot-summary.json"
    s = json.loads(path.read_text())
    # A kernel has an entry per target where some spec launches it (the
    # backward's state passes run apart or in one launch, as each target's
    # config says), at the main spec where that one does.
    for kernel in aot.ALL_KERNELS:
        per = s["kernels"].get(kernel, {})
        for target in aot.TARGETS:
            specs = [sp for sp in aot.SPECS if aot.applies(kernel, target, sp)]
            if not specs:
                assert target not in per, (kernel, target)
                continue
            e = per[target]
            names = [sp.name for sp in specs]
            main = aot.SUMMARY_SPEC if aot.SUMMARY_SPEC in names else names[0]
            assert e["spec"] == main, (kernel, target)
            assert e["all_specs"]["compiles"] == len(specs), (kernel, target)
            assert e["all_specs"]["failed"] == 0 and e["all_specs"]["spilled"] == 0
    assert set(s["kernels"]) <= set(aot.ALL_KERNELS)


def test_ptx_call_chain_completed_from_other_lines(src):
    # Each .loc of PTX names one call site: the loop's product sits in a
    # helper (line 20) called at line 21, itself called at line 7 in the K
    # loop, which only another .loc line says.
    ptx = """\
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
\t.loc\t1 21 3, function_name $L__info_string1, inlined_at 1 7 5 // src.py:21:3
\tmov.b32 \t%r1, %r2;
\t.loc\t1 20 5, function_name $L__info_string0, inlined_at 1 21 3 // src.py:20:5
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%r1}}, %rd1, %rd2, p, 1, 1, 0, 1;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%r1}}, %rd1, %rd2, p, 1, 1, 0, 1;
\t@%p2 bra \t$L__BB0_1;
\tret;
\t.file\t1 "{dir}/src.py"
"""
    prof = aot_isa.matrix_profile(ptx.format(dir=src), "cuda", {"K": 128, "BK": 32})
    assert prof["matrix_loops"][0]["loop"] == "src.py:6 for ks in range(0, K, BK)"
    assert prof["matrix_ops_per_program"] == {
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": 8}


def test_spilled_counts_only_memory_the_code_touches():
    # ptxas keeps an 8-byte frame for a declared, unused local depot: no
    # traffic, so no spill; a frame the PTX loads or stores is one, as is any
    # HIP private segment.
    assert not aot.spilled(dict(target="sm90", vgpr_spills=0, scratch=8, local_ops=0))
    assert aot.spilled(dict(target="sm90", vgpr_spills=0, scratch=8, local_ops=2))
    assert aot.spilled(dict(target="sm90", vgpr_spills=16, scratch=16, local_ops=4))
    assert aot.spilled(dict(target="gfx950", vgpr_spills=0, scratch=4))
    assert not aot.spilled(dict(target="gfx942", vgpr_spills=0, scratch=0))
