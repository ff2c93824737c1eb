"""bench.sweep, the forward and backward sweeps' driver: implementations in
--impls order, fla's rows streamed from a child, the JSON rewritten after every row (a sweep cut by
a time limit keeps what it measured)."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from bench import harness, sweep


def _args(tmp_path, impls="triton,fla", gates="mild"):
    return argparse.Namespace(impls=impls, varlen=None, heads=2, head_dim=16, gates=gates,
                              shapes="1,64,2;2,32,2", json=str(tmp_path / "sweep.json"))


def _fake_peers(rows_of_peer):
    """A stand-in for sweep.peer_stream: rows_of_peer(library, cases, mode) yields its rows."""
    calls = []

    def stream(child, cases, kd, vd, mode="forward", library="fla", references=None):
        calls.append((library, mode, references))
        child.versions.update({"torch": "t-child", library: f"{library}-child"})
        yield from rows_of_peer(library, cases, mode)

    return stream, calls


def test_peer_rows_arrive_one_by_one_and_a_cut_run_keeps_them(tmp_path, monkeypatch, capsys):
    def cut_after_one_row(library, cases, mode):
        assert mode == "forward" and len(cases) == 2
        yield 0, {"ms": 2.0, "host_ms": 0.1}
        # the child is killed here: row 1 never comes

    stream, _ = _fake_peers(cut_after_one_row)
    monkeypatch.setattr(sweep, "peer_stream", stream)
    times = sweep.run(_args(tmp_path), ["--shapes", "1,64,2;2,32,2"], module="bench.forward",
                      runner=lambda impl, inputs, cu, gates: (lambda: 1.5), mode="forward")
    assert times == [{"triton": 1.5, "fla": 2.0}, {"triton": 1.5, "fla": None}]
    records = json.loads((tmp_path / "sweep.json").read_text())
    by = {(r["B"], r["implementation"]): r for r in records}
    assert by[(1, "kda_jax-triton")]["ratio_to_fla"] == 0.75
    assert by[(2, "kda_jax-triton")]["ms"] == 1.5 and by[(2, "kda_jax-triton")]["ratio_to_fla"] is None
    assert by[(2, "fla")]["ms"] is None and by[(1, "fla")]["host_ms"] == 0.1
    assert all(r["gates"] == "mild" for r in records)
    assert records[0]["versions"]["fla"] == "fla-child"
    assert records[0]["command"] == "python -m bench.forward --shapes 1,64,2;2,32,2"
    assert "0.750" in capsys.readouterr().out


def test_implementations_run_in_impls_order_over_every_gate_regime(tmp_path, monkeypatch):
    calls = []

    def peer_rows(library, cases, mode):
        calls.append(library)
        yield from ((i, {"ms": 2.0}) for i in range(len(cases)))

    def runner(impl, inputs, cu, gates):
        calls.append((impl, gates))
        assert ("A_log" in inputs) == (gates == "layer")
        return lambda: 1.0

    stream, _ = _fake_peers(peer_rows)
    monkeypatch.setattr(sweep, "peer_stream", stream)
    sweep.run(_args(tmp_path, "triton,fla,cudnn,xla", gates="strong,layer"), [],
              module="bench.forward", runner=runner, mode="forward")
    # the XLA path's slow compiles come last: a run cut there keeps the peers' rows;
    # four cases: two regimes by two shapes
    regimes = ["strong", "strong", "layer", "layer"]
    assert calls == ([("triton", g) for g in regimes] + ["fla", "cudnn"]
                     + [("xla", g) for g in regimes])
    records = json.loads((tmp_path / "sweep.json").read_text())
    assert len(records) == 4 * 4
    assert {(r["gates"], r["implementation"]) for r in records} == {
        (g, i) for g in ("strong", "layer")
        for i in ("kda_jax-triton", "fla", "cudnn", "kda_jax-xla")}
    tri = [r for r in records if r["implementation"] == "kda_jax-triton"]
    assert all(r["ratio_to_fla"] == 0.5 and r["ratio_to_cudnn"] == 0.5 for r in tri)


def test_refused_and_unavailable_peer_rows_are_records(tmp_path, monkeypatch, capsys):
    def peer_rows(library, cases, mode):
        for i, (gates, *_) in enumerate(cases):
            if library == "fla":
                yield i, {"ms": 2.0}
            elif gates == "layer":
                yield i, {"ms": None, "refused": "NotImplementedError: KdaHopperCudaEngine: "
                                                 "safe_gate/a_log/dt_bias are unsupported"}
            else:
                yield i, {"ms": 1.0}

    stream, _ = _fake_peers(peer_rows)
    monkeypatch.setattr(sweep, "peer_stream", stream)
    sweep.run(_args(tmp_path, "triton,fla,cudnn", gates="mild,layer"), [],
              module="bench.backward", runner=lambda *a: (lambda: 4.0), mode="backward")
    records = json.loads((tmp_path / "sweep.json").read_text())
    refused = [r for r in records if "refused" in r]
    assert {(r["gates"], r["implementation"]) for r in refused} == {("layer", "cudnn")}
    assert all(r["ms"] is None and "unsupported" in r["refused"] for r in refused)
    tri = {(r["gates"], r["B"]): r for r in records if r["implementation"] == "kda_jax-triton"}
    assert tri[("mild", 1)]["ratio_to_cudnn"] == 4.0 and tri[("layer", 1)]["ratio_to_cudnn"] is None
    assert "refused" in capsys.readouterr().out


def test_a_failing_implementation_is_a_record(tmp_path, monkeypatch, capsys):
    def runner(impl, inputs, cu, gates):
        def time_it():
            raise RuntimeError("out of resources")
        return time_it

    times = sweep.run(_args(tmp_path, impls="triton"), [], module="bench.backward",
                      runner=runner, mode="backward")
    assert times == [{"triton": None}, {"triton": None}]
    assert "out of resources" in capsys.readouterr().err
    records = json.loads((tmp_path / "sweep.json").read_text())
    assert all("out of resources" in r["error"] for r in records)


def test_forward_outputs_are_compared_with_the_triton_path(tmp_path, monkeypatch):
    seen = {}

    def peer_rows(library, cases, mode):
        for i in range(len(cases)):
            yield i, {"ms": 2.0, "o_rel_rms_to_triton": 1e-3}

    def stream(child, cases, kd, vd, mode="forward", library="fla", references=None):
        seen["references"] = [np.load(p) for p in references]
        yield from peer_rows(library, cases, mode)

    def runner(impl, inputs, cu, gates):
        timer = lambda: 1.0
        o = np.ones((2, 3), np.float32)
        timer.output = lambda: o * (1.0 if impl == "triton" else 1.01)
        return timer

    monkeypatch.setattr(sweep, "peer_stream", stream)
    sweep.run(_args(tmp_path, "triton,fla,xla"), [], module="bench.forward", runner=runner,
              mode="forward")
    assert [r.tolist() for r in seen["references"]] == [[[1.0] * 3] * 2] * 2
    records = json.loads((tmp_path / "sweep.json").read_text())
    by = {r["implementation"]: r for r in records if r["B"] == 1}
    assert by["kda_jax-xla"]["o_rel_rms_to_triton"] == pytest.approx(0.01, rel=1e-4)
    assert by["fla"]["o_rel_rms_to_triton"] == 1e-3
    assert "o_rel_rms_to_triton" not in by["kda_jax-triton"]


def test_peer_stream_builds_the_job_and_reads_the_child(monkeypatch, capsys):
    class Peer:
        def __init__(self):
            self.versions = {"torch": "t", "fla": "f", "cudnn_frontend": None}

        def run(self, job):
            assert job["job"] == "sweep" and job["mode"] == "backward"
            assert job["library"] == "cudnn" and job["references"] is None
            assert job["rows"] == [[1, 64, 2, 16, 16, None, "safe"],
                                   [1, 64, 2, 16, 16, [0, 1, 64], "layer"]]
            yield from self.messages

        def close(self):
            pass

    Peer.messages = [{"row": {"index": 0, "ms": 1.25}},
                     {"row": {"index": 1, "ms": None, "refused": "NotImplementedError: no"}}]
    monkeypatch.setattr(harness, "FlaPeer", lambda argv=None: Peer())
    cases = [("safe", 1, 64, 2, None), ("layer", 1, 64, 2, np.array([0, 1, 64]))]
    child = harness.Peers()
    got = list(sweep.peer_stream(child, cases, 16, 16, "backward", "cudnn"))
    assert got == [(0, {"index": 0, "ms": 1.25}),
                   (1, {"index": 1, "ms": None, "refused": "NotImplementedError: no"})]
    assert child.versions == {"torch": "t", "fla": "f"}

    def dies(self, job):
        yield {"row": {"index": 0, "ms": 2.0}}
        raise harness.PeerUnavailable("the fla child died: OutOfMemoryError: CUDA")

    monkeypatch.setattr(Peer, "run", dies)
    got = list(sweep.peer_stream(child, cases, 16, 16, "backward", "cudnn"))
    assert got[0] == (0, {"index": 0, "ms": 2.0})
    assert got[1][0] == 1 and got[1][1]["ms"] is None and "OutOfMemoryError" in got[1][1]["error"]
    assert child.child is None  # started again by the next peer
    assert "OutOfMemoryError: CUDA" in capsys.readouterr().err

    def no_child(argv=None):
        raise harness.PeerUnavailable("the fla child did not start: No module named 'torch'")

    monkeypatch.setattr(harness, "FlaPeer", no_child)
    got = list(sweep.peer_stream(harness.Peers(), cases, 16, 16, "forward", "fla"))
    assert [i for i, _ in got] == [0, 1]
    assert all(r["ms"] is None and "torch" in r["unavailable"] for _, r in got)


def test_rows_carry_the_run_metadata(tmp_path, monkeypatch):
    stream, _ = _fake_peers(lambda library, cases, mode: ((i, {"ms": 2.0})
                                                          for i in range(len(cases))))
    monkeypatch.setattr(sweep, "peer_stream", stream)
    sweep.run(_args(tmp_path), ["--shapes", "1,64,2;2,32,2"], module="bench.forward",
              runner=lambda impl, inputs, cu, gates: (lambda: 1.0), mode="forward")
    records = json.loads((tmp_path / "sweep.json").read_text())
    for r in records:
        assert r["versions"]["torch"] == "t-child" and r["versions"]["fla"] == "fla-child"
        assert r["date"] and "commit" in r and "dirty" in r and "gpu" in r["machine"]


def test_bad_gate_regimes_fail_before_anything_runs(tmp_path):
    for bad in ("safe", "mild,mild", "mild,"):
        with pytest.raises(ValueError, match="--gates"):
            sweep.run(_args(tmp_path, gates=bad), [], module="bench.forward",
                      runner=lambda *a: pytest.fail("ran"), mode="forward")


def test_arch_variant_traces_under_that_archs_configs():
    from kda_jax import configs

    name, under = sweep.implementation("triton@gfx1250")
    assert name == "triton"
    with under:
        assert configs.forward_config() == configs.forward_config("gfx1250")
        assert configs.backward_config() == configs.backward_config("gfx1250")
    assert configs.forward_config() == configs.forward_config(configs.current_arch())


def test_field_variant_changes_only_those_fields():
    from kda_jax import configs

    forward, backward = configs.forward_config(), configs.backward_config()
    segment = configs.segment_config()
    name, under = sweep.implementation(
        "triton:prepare.16bit.stages=2+prepare.*.dot=tf32+backward.wy.*.warps=2+"
        "segment.segment_chunks=8")
    assert name == "triton"
    with under:
        assert configs.forward_config() == configs.replace(
            forward, {"prepare.16bit.stages": 2, "prepare.*.dot": "tf32"})
        assert configs.backward_config() == configs.replace(backward, "wy.*.warps", 2)
        assert configs.segment_config() == dataclasses.replace(segment, segment_chunks=8)
    assert configs.forward_config() == forward and configs.segment_config() == segment
    assert configs.backward_config() == backward
    with sweep.implementation("triton:segment.xla=True+segment.segment_chunks=None+"
                              "segment.forward.min_programs=-0")[1]:
        assert configs.segment_config() == configs.replace(
            segment, {"xla": True, "segment_chunks": None, "forward.min_programs": 0})
    # Every bad name raises when the variant is named, before anything runs.
    for bad, message in (("not_a_field=1", "has no field 'not_a_field'"),
                         ("prepare.16bit.stages", "not PATH=VALUE"),
                         ("wy.bf16.warps=2", "has no field 'wy'"),
                         ("sideways.wy_warps=2", "has no field 'sideways'"),
                         ("", "''"), ("prepare.16bit.stages=1++prepare.16bit.warps=4", "''"),
                         ("prepare.16bit.stages=2+prepare.16bit.stages=3", "set twice"),
                         ("prepare.16bit.stages=9", "stages=9 must be one of"),
                         ("prepare.fp64.stages=1", "no variant 'fp64'"),
                         ("prepare.16bit.stages=--1", "stages='--1' must be an int"),
                         ("segment.xla=yes", "xla='yes'")):
        with pytest.raises(ValueError, match=message):
            sweep.implementation(f"triton:{bad}")


def test_a_bad_variant_fails_before_any_row_is_timed(tmp_path):
    timed = []
    with pytest.raises(ValueError, match="stages=9"):
        sweep.run(_args(tmp_path, "triton,triton:prepare.16bit.stages=9"), [],
                  module="bench.forward",
                  mode="forward",
                  runner=lambda impl, inputs, cu, gates: timed.append(impl) or (lambda: 1.0))
    assert timed == []


def _tree(tmp_path, name, broken=False):
    """A copy of this checkout's kda_jax (kernels included) under tmp_path/name."""
    import pathlib
    import shutil

    import kda_jax

    root = tmp_path / name
    shutil.copytree(pathlib.Path(kda_jax.__file__).parent, root / "kda_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if broken:
        (root / "kda_jax" / "__init__.py").write_text("raise ImportError('the tree was taken')\n")
    return root


def test_a_tree_is_timed_in_a_child_with_its_own_kda_jax(tmp_path):
    """tree:PATH runs the benchmark module in a child whose kda_jax is PATH's:
    a working copy gives times (and the commit its directory names), a tree
    whose kda_jax fails to import gives error rows, not this process's times."""
    good, bad = _tree(tmp_path, "0123abc"), _tree(tmp_path, "broken", broken=True)
    args = argparse.Namespace(impls=f"tree:{good},tree:{bad}", varlen=None, heads=2, head_dim=16,
                              gates="strong", shapes="1,40,1", json=str(tmp_path / "t.json"))
    times = sweep.run(args, [], module="bench.forward", mode="forward",
                      runner=lambda *a: pytest.fail("a tree is never timed in this process"))
    assert [t[f"tree:{good}"] > 0 for t in times] == [True]
    assert [t[f"tree:{bad}"] for t in times] == [None]
    records = json.load(open(args.json))
    by_impl = {}
    for r in records:
        by_impl.setdefault(r["implementation"], []).append(r)
    assert [(r["gates"], r["T"]) for r in by_impl[f"kda_jax-tree:{good}"]] == [("strong", 40)]
    assert {r["tree_commit"] for r in by_impl[f"kda_jax-tree:{good}"]} == {"0123abc"}
    assert all("the tree was taken" in r["error"] for r in by_impl[f"kda_jax-tree:{bad}"])


def test_a_missing_tree_fails_before_any_row_is_timed(tmp_path):
    with pytest.raises(ValueError, match="holds no kda_jax"):
        sweep.implementation(f"tree:{tmp_path}")
