"""The diagnostics beside the benchmarks (bench.diagnostics): each runs on what it reads
(a report, an Nsight Compute page) or on the CPU. Outside the default test run:
``python -m pytest -m diagnostics``."""

import json

import pytest

from kda_jax import testing

pytestmark = pytest.mark.diagnostics


def test_aot_compare_summary_against_report(tmp_path, capsys):
    """bench.diagnostics.aot_compare: a summary (one spec, all_specs) before, a full report after."""
    from bench.diagnostics import aot_compare

    def entry(spec, occ, cyc, **kw):
        return dict(spec=spec, num_warps=4, vgprs=200, lds_bytes=16384, occupancy=occ,
                    vgpr_spills=0, scratch=0, est_matrix_cycles=cyc,
                    matrix_ops_per_program={"v_mfma_f32_32x32x2_f32": cyc // 64}, **kw)

    before = {"kernels": {"kda_bwd_wy_kernel": {
        "gfx950": entry("main/c64/default", 2, 8192, all_specs={"min_occupancy": 1}),
        "sm90": entry("main/c64/default", 8, 100)}}}
    after = {"results": [dict(kernel="kda_bwd_wy_kernel", target="gfx950", **entry(s, o, c))
                         for s, o, c in (("main/c64/default", 1, 2048), ("x/c32/all", 3, 1024))]}
    paths = []
    for name, report in (("b.json", before), ("a.json", after)):
        (tmp_path / name).write_text(json.dumps(report))
        paths.append(str(tmp_path / name))
    out = tmp_path / "cmp.json"
    assert aot_compare.main([*paths, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())  # sm90 is not an AMD target
    assert (row["kernel"], row["target"], row["spec"]) == ("kda_bwd_wy_kernel", "gfx950",
                                                           "main/c64/default")
    assert row["ratio"]["est_matrix_cycles"] == 0.25 and row["ratio"]["occupancy"] == 0.5
    assert row["before"]["min_occupancy"] == 1 and row["after"]["min_occupancy"] == 1
    assert "occupancy_fell_at" not in row  # one spec in common: nothing per spec to compare
    assert row["before_source"] == paths[0] and "commit" in row
    assert "8192 -> 2048" in capsys.readouterr().out
    # Two full reports: the specs where the occupancy fell are named.
    fell = aot_compare.load(paths[1])
    for r in fell[("kda_bwd_wy_kernel", "gfx950")].values():
        r["occupancy"] = 0
    (row,) = aot_compare.compare(aot_compare.load(paths[1]), fell, ["gfx950"], "main/c64/default")
    assert row["occupancy_fell_at"] == {"main/c64/default": [1, 0], "x/c32/all": [3, 0]}


def test_stalls_summary_of_an_ncu_source_page(tmp_path, capsys):
    from bench.diagnostics import stalls

    header = ["Address", "Source", stalls.SAMPLES, stalls.EXECUTED, "stall_long_sb",
              "stall_barrier", "stall_long_sb (Not Issued)"]
    body = [["0x0", "  LDG.E R7, desc[UR4][R8.64]", "2", "512", "0", "2", "0"],
            ["0x10", "  STS [R4+0x2c000], R7", "90", "512", "85", "5", "80"],
            ["0x20", "@P1  BRA 0x7f00", "8", "1,024", "8", "0", "8"]]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(",".join(f'"{x}"' for x in row) for row in
                              [["Kernel Name", "k_a", ""], header, *body,
                               ["Kernel Name", "k_b", ""], header, body[0]]) + "\n")
    per = stalls.kernels(str(path))
    assert list(per) == ["k_a", "k_b"] and len(per["k_a"]) == 3 and len(per["k_b"]) == 1
    assert [stalls.opcode(r["Source"]) for r in per["k_a"]] == ["LDG", "STS", "BRA"]
    text = stalls.summary(per["k_a"], top=2)
    assert "100 stall samples" in text and "long_sb 93%" in text and "barrier 7%" in text
    assert "BRA 50%" in text  # executed counts with thousands separators
    top = [line for line in text.splitlines() if line.startswith("  ")]
    assert len(top) == 2 and "STS" in top[0] and "90.0%" in top[0] and "long_sb 85" in top[0]
    stalls.main([str(path), "--top", "1"])
    assert "== k_b" in capsys.readouterr().out


def test_profile_target_runs_a_forward_and_a_gradient():
    from bench.diagnostics import profile_target

    profile_target.main(["1,64,2", "--head-dim", "16", "--calls", "1"])
    profile_target.main(["1,64,2", "--head-dim", "16", "--calls", "1", "--backward"])


def test_gate_precision_rows_on_the_small_grid(tmp_path):
    """bench.diagnostics.gate_precision on the interpreter's grid, XLA path: one row per case and
    implementation, each gradient's relative RMS against the float32 reference, the run's
    metadata stamped on; the float32 case is exact to float32 rounding."""
    from bench.diagnostics import gate_precision
    path = tmp_path / "precision.json"
    gate_precision.main(["--small", "--impls", "xla", "--json", str(path)])
    rows = json.loads(path.read_text())
    assert [r["case"] for r in rows] == ["B1-T70-H1-K16-float32-n1.0-l2False",
                                         "B1-T40-H2-K32-bfloat16-n10.0-l2True"]
    assert {"date", "commit", "command"} <= set(rows[0])
    for name in gate_precision.NAMES:
        assert rows[0][f"d{name}"] < 1e-5
        assert rows[1][f"d{name}"] < testing.GRAD_TOLERANCES["bfloat16"][name]
    with pytest.raises(ValueError):
        gate_precision.main(["--small", "--impls", "triton:backward.no_such_field=1"])


# A stand-in for the fla child's gradients job: zero gradients, or a child that dies.
FAKE_GRADIENTS_CHILD = """
import json, sys
import numpy as np
print(json.dumps({"ready": True, "torch": "t", "fla": "f"}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if job["l2norm"]:
        print("Traceback: CUDA error", flush=True)
        sys.exit(1)
    with np.load(job["inputs"]) as x:
        np.savez(job["out"], **{n: np.zeros_like(x[n]) for n in x.files if n[:2] != "w_"})
    print(json.dumps({"row": {"out": job["out"]}}), flush=True)
    print(json.dumps({"done": True}), flush=True)
"""


def test_gate_precision_takes_fla_from_the_child(tmp_path):
    """bench.diagnostics.gate_precision's "fla" rows: the child's gradients against the same
    float32 reference (zeros: every relative RMS is 1), and a child that dies gives a row
    that says so."""
    import sys

    from bench.diagnostics import gate_precision
    from bench.harness import Peers

    child = tmp_path / "child.py"
    child.write_text(FAKE_GRADIENTS_CHILD)
    grid = ((1, 20, 1, 16, "float32", 1.0, False), (1, 20, 1, 16, "float32", 1.0, True))
    with Peers([sys.executable, str(child)]) as peers:
        rows = gate_precision.run(["fla"], grid, peers=peers)
    assert [r["implementation"] for r in rows] == ["fla", "fla"]
    assert all(rows[0][f"d{n}"] == 1.0 for n in gate_precision.NAMES), rows[0]
    assert "CUDA error" in rows[1]["error"] and "dq" not in rows[1]
