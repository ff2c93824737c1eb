"""examples/serve_loop.py runs briefly on the CPU (XLA path), checks its first
steps against the reference and compiles once per bucket."""

from __future__ import annotations

import re




def test_serve_loop_runs_and_compiles_once_per_bucket(capsys, example):
    rc = example("serve_loop").main(["--implementation", "xla", "--steps", "6", "--check", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(re.findall(r"^check step \d+: .* o rel_rms", out, re.M)) == 3, out
    assert "FAIL" not in out
    assert re.search(r"compiles: 2 \(\{'chunk_kda': 1, 'fused_recurrent_kda': 1\}\)", out), out
    assert re.search(r"steps: 6: [\d.]+ steps/s", out), out
