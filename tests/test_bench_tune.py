"""bench.tune.grid, the tuners' loop: a failing config is a record, not the end."""

import json

from bench.tune.grid import run_grid, write_records
from kda_jax import configs


def test_run_grid_records_each_change_and_failures(tmp_path, capsys):
    def measure(cfg):
        if cfg.prepare["16bit"].warps == 8:
            raise RuntimeError("out of resources")
        return 1.5 * cfg.prepare["16bit"].block_k, {"o_rel_rms": 1e-3}

    changes = [{}, {"prepare.16bit.block_k": 16}, {"prepare.16bit.warps": 8}]
    records = run_grid(configs.FORWARD["default"], changes, measure, (1, 64, 2, 128, 128))
    assert [r["change"] for r in records] == changes
    assert [r["ms"] for r in records] == [96.0, 24.0, None]
    assert records[1]["config"]["prepare"]["16bit"]["block_k"] == 16
    assert "out of resources" in records[2]["error"]
    assert "out of resources" in capsys.readouterr().err

    path = tmp_path / "grid.json"
    write_records(str(path), "bench.tune.tune_forward", ["--grid", "prepare"], records)
    saved = json.loads(path.read_text())
    assert [r["change"] for r in saved] == changes
    assert saved[1]["config"]["prepare"]["16bit"]["block_k"] == 16
    assert {r["command"] for r in saved} == {"python -m bench.tune.tune_forward --grid prepare"}
    assert all(r["versions"]["jax"] and "commit" in r and "date" in r for r in saved)
