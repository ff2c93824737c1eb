"""examples/serve_loop.py runs briefly on the CPU (XLA path), checks its first
steps against the reference and compiles once per bucket."""

from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    path = os.path.join(ROOT, "examples", "serve_loop.py")
    spec = importlib.util.spec_from_file_location("serve_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_loop_runs_and_compiles_once_per_bucket(capsys):
    rc = _example().main(["--implementation", "xla", "--steps", "6", "--check", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(re.findall(r"^check step \d+: .* o rel_rms", out, re.M)) == 3, out
    assert "FAIL" not in out
    assert re.search(r"compiles: 2 \(\{'chunk_kda': 1, 'fused_recurrent_kda': 1\}\)", out), out
    assert re.search(r"steps: 6: [\d.]+ steps/s", out), out
