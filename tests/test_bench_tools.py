"""bench's shared helpers: the run metadata every row carries, the timing loop,
and the plot rendered from a small results file (CPU)."""

import json

import pytest

from bench import meta, plot, timing
from kda_jax import testing


def test_run_metadata_names_date_commit_versions_machine_and_command():
    m = meta.run_metadata("bench.forward", ["--shapes", "1,64,2"])
    assert set(m) == {"date", "commit", "dirty", "versions", "machine", "command"}
    assert m["date"].endswith("Z") and m["date"][4] == "-"
    assert m["command"] == "python -m bench.forward --shapes 1,64,2"
    assert {"python", "jax", "jaxlib", "triton", "jax_triton", "torch", "fla"} <= set(m["versions"])
    assert m["versions"]["jax"]  # importable here
    assert {"gpu", "driver", "platform"} == set(m["machine"])
    # This checkout is a git work tree: the commit and the dirty flag are known.
    assert isinstance(m["commit"], str) and len(m["commit"]) >= 7
    assert isinstance(m["dirty"], bool)


def test_fla_versions_from_the_child_replace_the_parents():
    m = meta.run_metadata("bench.serving", [], torch="9.9", fla=None)
    assert m["versions"]["torch"] == "9.9"  # the child's
    assert "fla" in m["versions"]  # None from the child keeps the parent's lookup


def test_git_state_outside_a_repository(monkeypatch, tmp_path):
    monkeypatch.setattr(meta, "REPO", str(tmp_path))
    assert meta.git_state() == {"commit": None, "dirty": None}


def test_stamp_and_write_rows(tmp_path):
    path = tmp_path / "sub" / "x.json"
    meta.write_rows(str(path), meta.stamp([{"ms": 1.0}], {"commit": "abc", "date": "d"}))
    assert json.loads(path.read_text()) == [{"ms": 1.0, "commit": "abc", "date": "d"}]
    meta.write_rows(None, [{"ms": 1.0}])  # no path: nothing written, no error


def test_time_calls_warms_up_then_times_every_call():
    calls, syncs = [], []
    ms, host_ms = timing.time_calls(calls.append, lambda: syncs.append(len(calls)), iters=3,
                                    repeats=2)
    # two warm-up calls and a sync, then each loop of 3 calls ends with a sync
    assert calls == [0, 1, 0, 1, 2, 3, 4, 5] and syncs == [2, 5, 8]
    assert 0 <= host_ms and 0 <= ms


def _row(**kw):
    base = dict(K=128, V=128, dtype="bfloat16", varlen=None, commit="abc123", dirty=False,
                date="2026-01-01T00:00:00Z", machine={"gpu": "GPU", "driver": "1"})
    return {**base, **kw}


@pytest.fixture
def results(tmp_path):
    fwd = [_row(B=1, T=64, H=2, implementation="kda_jax-triton", ms=0.5, ratio_to_fla=0.5),
           _row(B=1, T=64, H=2, implementation="fla", ms=1.0, ratio_to_fla=1.0),
           _row(B=1, T=66, H=2, varlen=[1, 65], implementation="kda_jax-triton", ms=0.4,
                ratio_to_fla=None)]  # no fla time: no bar
    serving = [dict(step="mixed N=2", implementation="kda_jax", ms=0.5, commit="abc123"),
               dict(step="mixed N=2", implementation="fla", ms=None, error="no fla")]
    (tmp_path / "gpu-forward.json").write_text(json.dumps(fwd))
    (tmp_path / "gpu-serving.json").write_text(json.dumps(serving))
    (tmp_path / "tune-forward.json").write_text(json.dumps([{"config": {}}]))
    (tmp_path / "notes.json").write_text("{}")
    return tmp_path


def test_plot_renders_pngs_from_results_json(results, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "png"
    assert plot.main(["--results", str(results), "--out", str(out)]) == 0
    pngs = sorted(p.name for p in out.iterdir())
    assert pngs == ["gpu-forward.png", "gpu-serving.png"]  # tune-* and others skipped
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "gpu-forward.png" in capsys.readouterr().out


def test_plot_refuses_a_directory_without_results(tmp_path):
    with pytest.raises(SystemExit, match="no forward, backward, serving or decode JSON"):
        plot.main(["--results", str(tmp_path)])


def test_plot_refuses_a_file_that_is_not_rows(tmp_path):
    bad = tmp_path / "x-decode.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="non-empty JSON list of rows"):
        plot.render(str(bad))


def test_aot_compare_summary_against_report(tmp_path, capsys):
    """bench.aot_compare: a summary (one spec, all_specs) before, a full report after."""
    from bench import aot_compare

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
    from bench import stalls

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


def test_sass_loops_counts_each_loop_by_its_back_edge():
    from bench import sass_loops

    sass = "\n".join([
        '\t//## File "/x/kernels/chunk_fwd.py", line 10',
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        '\t//## File "/x/kernels/common.py", line 99',
        "        /*0010*/                   SHFL.BFLY PT, R2, R3, 0x1, 0x1f ;",
        "        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        "        /*0030*/                   MUFU.EX2 R4, R5 ;",
        '\t//## File "/x/kernels/chunk_fwd.py", line 12',
        "        /*0040*/               @P0 BRA `(.L_x_0) ;",
        "        /*0050*/              @!P1 BRA `(.L_x_1) ;",
        ".L_x_1:",
        "        /*0060*/                   EXIT ;"])
    instrs, loops = sass_loops.parse(sass)
    assert [ins.op for ins in instrs] == ["MOV", "SHFL", "BAR", "MUFU", "BRA", "BRA", "EXIT"]
    assert loops == [(1, 4)]  # the forward branch to .L_x_1 is no loop
    s = sass_loops.summarize(sass)
    assert s["instructions"] == 7
    assert s["loops"] == [dict(line="chunk_fwd.py:12", count=4, BAR=1, SHFL=1, MUFU=1, HGMMA=0,
                               LDS=0, STS=0, LDG=0, STG=0)]
    assert s["straight"]["count"] == 3
    text = sass_loops.table({".": dict(s, vgprs=40, vgpr_spills=0, occupancy=16)})
    assert "chunk_fwd.py:12" in text and "BAR 1 SHFL 1 MUFU 1" in text


def test_profile_target_runs_a_forward_and_a_gradient():
    from bench import profile_target

    profile_target.main(["1,64,2", "--head-dim", "16", "--calls", "1"])
    profile_target.main(["1,64,2", "--head-dim", "16", "--calls", "1", "--backward"])


def test_gate_precision_rows_on_the_small_grid(tmp_path):
    """bench.gate_precision on the interpreter's grid, XLA path: one row per case and
    implementation, each gradient's relative RMS against the float32 reference, the run's
    metadata stamped on; the float32 case is exact to float32 rounding."""
    from bench import gate_precision
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
