"""bench.sweep, the forward and backward sweeps' driver: implementations in
--impls order, fla's rows streamed from a child, the JSON rewritten after every row (a sweep cut by
a time limit keeps what it measured)."""

import argparse
import io
import json

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
    assert records[0]["fla"] == "0.0-test"
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
    class Child:
        def __init__(self, argv, **kw):
            assert argv[1:3] == ["-m", "bench.fla_peer"] and argv[-1] == "backward"
            # stderr must not be a pipe nobody reads: a chatty child would stall.
            assert kw["stderr"] is sweep.subprocess.STDOUT
            # jax-triton empties TRITON_CACHE_DIR at import; torch's Triton needs a real one.
            assert "TRITON_CACHE_DIR" not in kw["env"] and kw["env"]["KEEP"] == "1"
            self.stdout = io.StringIO(self.text)

        def wait(self):
            return self.rc

    Child.text, Child.rc = ('{"row": 0, "ms": 1.25}\nnoise\n{"row": 1, "ms": 3.5}\n'
                            '{"torch": "t", "fla": "f"}\n'), 0
    monkeypatch.setattr(sweep.subprocess, "Popen", Child)
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.setenv("KEEP", "1")
    got = list(sweep.fla_stream([(1, 64, 2, None), (1, 64, 2, None)], 16, 16, "backward"))
    assert got == [(0, 1.25), (1, 3.5), (None, {"torch": "t", "fla": "f"})]

    Child.text, Child.rc = '{"row": 0, "ms": 2.0}\nTraceback\nOutOfMemoryError: CUDA\n', 1
    got = list(sweep.fla_stream([(1, 64, 2, None)] * 2, 16, 16, "backward"))
    assert got == [(0, 2.0)]
    assert "OutOfMemoryError: CUDA" in capsys.readouterr().err
