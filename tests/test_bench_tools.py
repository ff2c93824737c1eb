"""bench's shared helpers: the run metadata every row carries, the timing loop,
and the plot rendered from a small results file (CPU)."""

import json

import pytest

from bench import meta, plot, timing


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
