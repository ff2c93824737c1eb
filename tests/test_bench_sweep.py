"""bench.sweep, the forward and backward sweeps' driver: implementations in
--impls order, fla's rows streamed from a child, the JSON rewritten after every row (a sweep cut by
a time limit keeps what it measured)."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from bench import sweep


def _args(tmp_path, impls="triton,fla"):
    return argparse.Namespace(impls=impls, varlen=None, heads=2, head_dim=16,
                              shapes="1,64,2;2,32,2", json=str(tmp_path / "sweep.json"))


def test_fla_rows_arrive_one_by_one_and_a_cut_run_keeps_them(tmp_path, monkeypatch, capsys):
    def cut_after_one_row(rows, kd, vd, mode):
        assert mode == "forward" and kd == vd == 16 and len(rows) == 2
        yield 0, 2.0
        yield None, {"fla": "0.0-test"}
        # the child is killed here: row 1 never comes

    monkeypatch.setattr(sweep, "fla_stream", cut_after_one_row)
    times = sweep.run(_args(tmp_path), ["--shapes", "1,64,2;2,32,2"], module="bench.forward",
                      runner=lambda impl, arrays, cu: (lambda: 1.5), mode="forward")
    assert times == [{"triton": 1.5, "fla": 2.0}, {"triton": 1.5, "fla": None}]
    records = json.loads((tmp_path / "sweep.json").read_text())
    by = {(r["B"], r["implementation"]): r for r in records}
    assert by[(1, "kda_jax-triton")]["ratio_to_fla"] == 0.75
    assert by[(2, "kda_jax-triton")]["ms"] == 1.5 and by[(2, "kda_jax-triton")]["ratio_to_fla"] is None
    assert by[(2, "fla")]["ms"] is None
    assert records[0]["versions"]["fla"] == "0.0-test"
    assert records[0]["command"] == "python -m bench.forward --shapes 1,64,2;2,32,2"
    assert "0.750" in capsys.readouterr().out


def test_implementations_run_in_impls_order(tmp_path, monkeypatch):
    calls = []

    def fla_rows(rows, kd, vd, mode):
        calls.append("fla")
        yield from ((i, 2.0) for i in range(len(rows)))

    def runner(impl, arrays, cu):
        calls.append(impl)
        return lambda: 1.0

    monkeypatch.setattr(sweep, "fla_stream", fla_rows)
    sweep.run(_args(tmp_path, "triton,fla,xla"), [], module="bench.forward", runner=runner,
              mode="forward")
    # the XLA path's slow compiles come last: a run cut there keeps fla's rows
    assert calls == ["triton", "triton", "fla", "xla", "xla"]


def test_a_failing_implementation_is_a_record(tmp_path, monkeypatch, capsys):
    def runner(impl, arrays, cu):
        def time_it():
            raise RuntimeError("out of resources")
        return time_it

    times = sweep.run(_args(tmp_path, impls="triton"), [], module="bench.backward",
                      runner=runner, mode="backward")
    assert times == [{"triton": None}, {"triton": None}]
    assert "out of resources" in capsys.readouterr().err


def test_fla_stream_reads_the_child_line_by_line(monkeypatch, capsys):
    class Peer:
        def __init__(self):
            self.versions = {"torch": "t", "fla": "f"}

        def run(self, job):
            assert job["job"] == "sweep" and job["mode"] == "backward"
            assert job["rows"] == [[1, 64, 2, 16, 16, None], [1, 64, 2, 16, 16, [0, 1, 64]]]
            yield from self.messages

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    Peer.messages = [{"row": {"index": 0, "ms": 1.25}}, {"row": {"index": 1, "ms": 3.5}}]
    monkeypatch.setattr(sweep, "FlaPeer", Peer)
    rows = [(1, 64, 2, None), (1, 64, 2, np.array([0, 1, 64]))]
    got = list(sweep.fla_stream(rows, 16, 16, "backward"))
    assert got == [(0, 1.25), (1, 3.5), (None, {"torch": "t", "fla": "f"})]

    def dies(self, job):
        yield {"row": {"index": 0, "ms": 2.0}}
        raise sweep.FlaUnavailable("the fla child died: OutOfMemoryError: CUDA")

    monkeypatch.setattr(Peer, "run", dies)
    assert list(sweep.fla_stream(rows, 16, 16, "backward")) == [(0, 2.0)]
    assert "OutOfMemoryError: CUDA" in capsys.readouterr().err


def test_rows_carry_the_run_metadata(tmp_path, monkeypatch):
    def fla_rows(rows, kd, vd, mode):
        yield from ((i, 2.0) for i in range(len(rows)))
        yield None, {"torch": "t-child", "fla": "f-child"}

    monkeypatch.setattr(sweep, "fla_stream", fla_rows)
    sweep.run(_args(tmp_path), ["--shapes", "1,64,2;2,32,2"], module="bench.forward",
              runner=lambda impl, arrays, cu: (lambda: 1.0), mode="forward")
    records = json.loads((tmp_path / "sweep.json").read_text())
    for r in records:
        assert r["versions"]["torch"] == "t-child" and r["versions"]["fla"] == "f-child"
        assert r["date"] and "commit" in r and "dirty" in r and "gpu" in r["machine"]


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
        "triton:prepare_stages=2+prepare_dot=tf32+backward.wy_warps=2+segment.segment_chunks=8")
    assert name == "triton"
    with under:
        assert configs.forward_config() == dataclasses.replace(
            forward, prepare_stages=2, prepare_dot="tf32")
        assert configs.backward_config() == dataclasses.replace(backward, wy_warps=2)
        assert configs.segment_config() == dataclasses.replace(segment, segment_chunks=8)
    assert configs.forward_config() == forward and configs.segment_config() == segment
    assert configs.backward_config() == backward
    with sweep.implementation("triton:segment.xla=True+segment.segment_chunks=None+"
                              "segment.min_programs=-0")[1]:
        assert configs.segment_config() == dataclasses.replace(
            segment, xla=True, segment_chunks=None, min_programs=0)
    # Every bad name raises when the variant is named, before anything runs.
    for bad, message in (("not_a_field=1", "not_a_field=1"), ("prepare_stages", "prepare_stages"),
                         ("wy_warps=2", "wy_warps=2"), ("sideways.wy_warps=2", "sideways"),
                         ("", "''"), ("prepare_stages=1++prepare_warps=4", "''"),
                         ("prepare_stages=2+prepare_stages=3", "set twice"),
                         ("prepare_stages=9", "prepare_stages=9"),
                         ("prepare_stages=--1", "prepare_stages='--1'"),
                         ("segment.xla=yes", "xla='yes'")):
        with pytest.raises(ValueError, match=message):
            sweep.implementation(f"triton:{bad}")


def test_a_bad_variant_fails_before_any_row_is_timed(tmp_path):
    timed = []
    with pytest.raises(ValueError, match="prepare_stages=9"):
        sweep.run(_args(tmp_path, "triton,triton:prepare_stages=9"), [], module="bench.forward",
                  mode="forward",
                  runner=lambda impl, arrays, cu: timed.append(impl) or (lambda: 1.0))
    assert timed == []
