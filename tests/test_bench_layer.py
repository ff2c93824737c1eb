"""bench.layer's code paths on the CPU (XLA path, tiny shapes, no torch): our
timings through main(), and the parity pipeline (weights and inputs through
files, our layer's results in fla's keys and layouts, the comparison) with a
stand-in for fla's child that serves our own layer's results."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("flax.nnx")

from bench import layer as bench_layer  # noqa: E402
from bench.layer_fla import (CASES, GATE_FORMS, SMOKE, LayerCache,  # noqa: E402
                             case_inputs, timing_inputs)
from kda_jax.nn import to_fla_state_dict  # noqa: E402

CONFIG = dict(SMOKE, mode="fused_recurrent")  # the quick form of the XLA path


def test_layer_bench_times_our_side(tmp_path):
    out = tmp_path / "layer.json"
    assert bench_layer.main(["--smoke", "--no-fla", "--impl", "xla", "--mode", "fused_recurrent",
                             "--iters", "1", "--repeats", "1", "--tokens", "8",
                             "--decode-seqs", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["what"] for r in rows] == ["forward", "forward+backward", "decode step",
                                        "decode step, pool"]
    assert all(r["ms"] > 0 and r["ratio_to_fla"] is None and r["kind"] == "timing"
               for r in rows)
    assert rows[0]["command"].startswith("python -m bench.layer --smoke")


def test_layer_bench_gate_forms_and_fla_weights(tmp_path):
    """--gates softplus,safe: one run per form, rows tagged; our layer takes fla's weights
    (here its own, converted) for the timing."""
    out = tmp_path / "layer.json"
    assert bench_layer.main(["--smoke", "--no-fla", "--impl", "xla", "--mode", "fused_recurrent",
                             "--gates", "safe,softplus", "--iters", "1", "--repeats", "1",
                             "--tokens", "8", "--decode-seqs", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["gates"] for r in rows] == ["safe"] * 4 + ["softplus"] * 4
    safe = dict(CONFIG, **GATE_FORMS["safe"])
    layer = bench_layer.our_layer(safe, "xla")
    assert layer.lower_bound == -5.0 and float(abs(layer.A_log[...]).max()) == 0  # fla's init
    weights = to_fla_state_dict(bench_layer.our_layer(dict(safe, seed=3), "xla"))
    ms = bench_layer.our_timings(safe, "xla", 8, 2, 1, 1, weights)
    assert set(ms) == {"forward", "forward+backward", "decode step", "decode step, pool"}
    with pytest.raises(SystemExit):
        bench_layer.main(["--smoke", "--no-fla", "--gates", "mild"])


class OwnResults:
    """Serves the parity job as fla's child does, with our layer (another seed)
    in place of fla's: the parent must then find zero error everywhere."""

    def __init__(self):
        self.layer = bench_layer.our_layer(dict(CONFIG, seed=5), "xla")

    def tail(self):
        return ""

    def run(self, job):
        d = job["dir"]
        np.savez(os.path.join(d, "weights.npz"), **to_fla_state_dict(self.layer))
        for name, case in job["cases"].items():
            inputs = case_inputs(name, case, job["config"]["hidden"], 0)
            np.savez(os.path.join(d, f"{name}-inputs.npz"), **inputs)
            path = os.path.join(d, f"{name}-triton.npz")
            np.savez(path, **bench_layer.run_ours(self.layer, name, inputs))
            yield {"row": {"case": name, "variant": "triton", "file": path}}


def test_parity_pipeline_on_our_own_results():
    cases = {k: CASES["smoke"][k] for k in ("varlen", "decode")}  # "dense": the same code
    rows = bench_layer.parity(OwnResults(), CONFIG, cases, "xla")
    got = {(r["case"], r["quantity"]) for r in rows}
    assert {("varlen", "dx"), ("varlen", "grad/A_log"), ("varlen", "grad/q_conv1d.weight"),
            ("decode", "y_step"), ("decode", "step/conv_v"), ("decode", "prefill/recurrent")} <= got
    bad = [(r["case"], r["quantity"], r["vs_fla_triton"]) for r in rows if r["vs_fla_triton"]]
    assert not bad, bad


def test_timing_inputs_are_shared_and_seeded():
    x, dy, step = timing_inputs(16, 8, 3, seed=0)
    assert x.shape == dy.shape == (1, 8, 16) and step.shape == (3, 1, 16)
    assert np.array_equal(x, timing_inputs(16, 8, 3, seed=0)[0]) and not np.array_equal(x, dy)


def test_fla_cache_stand_in():
    cache = LayerCache()
    cache.update(recurrent_state="h", conv_state=("q", "k", "v"), layer_idx=0, offset=3)
    cache.update(recurrent_state="h2", layer_idx=0)
    assert len(cache) == 1 and cache[0] == {"recurrent_state": "h2", "conv_state": ("q", "k", "v")}
