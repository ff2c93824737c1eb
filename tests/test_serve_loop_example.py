"""examples/serve_loop.py, the engine loop, runs briefly on the CPU (XLA path):
its first steps match the reference (prefills with checkpoints, decodes and
verifies on a bfloat16 pool), each bucket's step compiles once, and each
step's executable aliases the pool to its output (an in-place update)."""

from __future__ import annotations

import re


def test_engine_loop_checks_compiles_once_and_updates_in_place(capsys, example):
    rc = example("serve_loop").main(["--implementation", "xla", "--steps", "4", "--check", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    checks = re.findall(r"^check step \d+: .* (\d+) verifies, (\d+) rows: o rel_rms", out, re.M)
    assert len(checks) == 3, out
    assert any(int(v) > 0 for v, _ in checks), out  # a verify batch was checked
    assert "FAIL" not in out
    assert out.count("pool updated in place: yes") == 2, out
    assert "compiles: 2 (mixed 1, decode-only 1)" in out, out
    assert re.search(r"steps: 4: [\d.]+ steps/s", out), out


def test_engine_loop_refuses_bad_arguments_naming_them(capsys, example):
    """An explicit 0 is not the default, --check cannot exceed --steps or be
    negative, and a negative seed is refused before NumPy sees it."""
    import pytest

    parse = example("serve_loop").parse_args
    for argv, named in ((["--heads", "0"], "--heads=0"), (["--head-dim", "0"], "--head-dim=0"),
                        (["--max-seqs", "0"], "--max-seqs=0"),
                        (["--max-prompt", "0"], "--max-prompt=0"),
                        (["--steps", "2", "--check", "3"], "--check=3 must lie in [0, --steps=2]"),
                        (["--check", "-1"], "--check=-1"), (["--seed", "-1"], "--seed=-1"),
                        (["--drafts", "-1"], "--drafts=-1")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert named in capsys.readouterr().err, argv
    assert parse([]).heads == 2 and parse(["--heads", "3"]).heads == 3  # the CPU default
