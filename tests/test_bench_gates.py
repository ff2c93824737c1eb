"""The benchmarks' gate regimes (bench.inputs.make_gated, options) and the peers'
child side that runs without torch: the regimes' ranges, that the layer regime's raw
inputs become the init regime's through kda_jax.transforms, the sweeps' --gates on the
CPU (XLA path), and the child's row classification (CPU; no torch, no GPU)."""

import io
import json
import sys

import numpy as np
import pytest

from bench import backward, fla_peer, forward
from bench.inputs import GATES, LOWER_BOUND, init_dt_bias, make_gated, options, safe_gate
from kda_jax import transforms
from kda_jax.testing import rel_rms


def test_strong_gate_lies_in_its_bounds_and_averages_minus_two_and_a_half():
    x = make_gated(2, 512, 8, 64, 64, "strong", seed=3)
    g = x["g"]
    assert g.dtype == np.float32 and g.shape == (2, 512, 8, 64)
    assert g.min() >= LOWER_BOUND and g.max() < 0
    assert abs(g.mean() + 2.5) < 0.05
    assert "A_log" not in x  # precomputed: the kernels see g alone


def test_init_and_softplus_gates_are_a_layers_at_initialisation():
    """init: -5 sigmoid(x + dt_bias) with dt_bias = softplus^-1(logU(1e-3, 1e-1)): a mean of
    about -0.16 and about half of the (64-token chunk, channel) pairs decaying less than e^-5;
    softplus: -exp(A_log) softplus(x + dt_bias), exp(A_log) in [1, 16]: a mean of about -0.33,
    steeper on some heads, unbounded below."""
    init = make_gated(1, 4096, 16, 64, 8, "init", seed=3)["g"]
    assert init.min() >= LOWER_BOUND and init.max() < 0
    assert -0.2 < init.mean() < -0.12
    chunk = init.reshape(1, 64, 64, 16, 64).sum(axis=2)
    assert 0.35 < np.mean(chunk > -5) < 0.6
    soft = make_gated(1, 4096, 16, 64, 8, "softplus", seed=3)["g"]
    assert soft.max() < 0 and soft.min() < LOWER_BOUND
    assert -0.5 < soft.mean() < -0.2
    dt = np.log1p(np.exp(init_dt_bias(np.random.default_rng(0), 64, 128)))  # softplus
    assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001


def test_mild_gate_is_flas_benchmark_gate():
    g = make_gated(2, 512, 8, 64, 64, "mild", seed=3)["g"]
    assert g.max() < 0 and g.min() > -1
    assert abs(g.mean() + 0.0504) < 0.002  # E[logsigmoid(N(0, 1))] / 16


def test_precomputed_regimes_pass_normalised_keys_and_beta_in_unit_interval():
    for gates in ("init", "softplus", "mild", "strong"):
        x = make_gated(1, 64, 2, 16, 8, gates)
        for n in ("q", "k"):
            np.testing.assert_allclose(np.linalg.norm(x[n], axis=-1), 1, atol=1e-5)
        assert 0 < x["beta"].min() and x["beta"].max() < 1
        assert x["v"].shape == (1, 64, 2, 8) and x["beta"].shape == (1, 64, 2)


def test_layer_raw_inputs_become_the_init_regimes_through_kda_jax_transforms():
    layer, init = (make_gated(1, 96, 4, 32, 16, gates, seed=7) for gates in ("layer", "init"))
    assert layer["A_log"].shape == (4,) and layer["dt_bias"].shape == (4, 32)
    np.testing.assert_array_equal(layer["A_log"], 0)
    flags = options("layer", "kda_jax")
    q, k, g, beta = transforms.prepare_inputs(
        layer["q"], layer["k"], layer["g"], layer["beta"], A_log=layer["A_log"],
        dt_bias=layer["dt_bias"].reshape(-1), allow_neg_eigval=False,
        **{n: flags[n] for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                 "lower_bound", "use_beta_sigmoid_in_kernel")})
    np.testing.assert_allclose(np.asarray(g), init["g"], atol=2e-6)
    np.testing.assert_allclose(np.asarray(q), init["q"], atol=1e-6)
    np.testing.assert_allclose(np.asarray(k), init["k"], atol=1e-6)
    np.testing.assert_allclose(np.asarray(beta), init["beta"], atol=1e-6)
    np.testing.assert_array_equal(layer["v"], init["v"])


def test_safe_gate_saturates_without_overflow():
    x = np.array([-1e30, -50.0, 0.0, 50.0, 1e30], np.float32).reshape(1, 1, 1, 5)
    with np.errstate(all="raise"):
        g = safe_gate(x, np.array([np.log(16.0)], np.float32), np.zeros((1, 5), np.float32))
    np.testing.assert_allclose(g.ravel(), [0, 0, -2.5, -5, -5], atol=1e-6)


def test_inputs_are_the_same_for_every_caller_and_seeded():
    a, b = make_gated(1, 32, 2, 8, 8, "layer"), make_gated(1, 32, 2, 8, 8, "layer")
    assert all(np.array_equal(a[n], b[n]) for n in a)
    c = make_gated(1, 32, 2, 8, 8, "layer", seed=1)
    assert not np.array_equal(a["q"], c["q"])
    with pytest.raises(ValueError, match="strong"):
        make_gated(1, 8, 1, 8, 8, "safe")


def test_each_librarys_flags_per_regime():
    for library in ("kda_jax", "cudnn"):
        for gates in ("init", "softplus", "mild", "strong"):
            assert options(gates, library) == {}
    assert options("mild", "fla") == options("softplus", "fla") == {}
    assert options("init", "fla") == options("strong", "fla") == {"safe_gate": True}
    assert options("layer", "kda_jax") == dict(
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
        lower_bound=-5.0)
    assert options("layer", "fla") == dict(options("layer", "kda_jax"), safe_gate=True)
    assert options("layer", "cudnn") == dict(
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        gate_lower_bound=-5.0)
    with pytest.raises(ValueError, match="torch"):
        options("mild", "torch")
    assert GATES == ("init", "softplus", "layer", "mild", "strong")


def test_forward_sweep_at_every_regime_on_the_xla_path(tmp_path):
    out = tmp_path / "f.json"
    forward.main(["--impls", "xla", "--gates", ",".join(GATES), "--shapes", "1,40,2",
                  "--head-dim", "16", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["gates"], r["implementation"]) for r in rows] == [
        (g, "kda_jax-xla") for g in GATES]
    assert all(r["ms"] > 0 and "gpu" in r["machine"] and "commit" in r for r in rows)
    assert rows[0]["command"].startswith("python -m bench.forward --impls xla --gates")


def test_layer_and_init_regimes_compute_the_same_outputs():
    """kda_jax's in-kernel gate, norms and sigmoid on the raw inputs against the
    precomputed regime (bf16 rounding apart)."""
    o = {gates: forward.jax_runner("xla", make_gated(1, 80, 2, 16, 16, gates), None,
                                   gates).output() for gates in ("init", "layer")}
    assert o["init"].shape == (1, 80, 2, 16)
    assert rel_rms(o["layer"], o["init"]) < 2e-2


def test_backward_runner_takes_the_gate_parameters():
    timer = backward.jax_runner("xla", make_gated(1, 24, 2, 8, 8, "layer"), None, "layer")
    assert timer() > 0
    mild = make_gated(1, 24, 2, 8, 8, "mild")
    tuple_inputs = tuple(mild[n] for n in ("q", "k", "v", "g", "beta"))
    assert backward.jax_runner("xla", tuple_inputs, None)() > 0  # bench.tune's call


# --------------------------------------------------------------------------- #
# The child's side, without torch.
# --------------------------------------------------------------------------- #


class GraphNotSupported(Exception):
    pass


GraphNotSupported.__name__ = "cudnnGraphNotSupportedError"


def test_failures_read_as_refused_or_error():
    refused = fla_peer.failure(NotImplementedError(
        "KdaHopperCudaEngine: the kernel takes log-space g directly; safe_gate/a_log/dt_bias "
        "are unsupported"))
    assert refused == {"refused": "NotImplementedError: KdaHopperCudaEngine: the kernel takes "
                                  "log-space g directly; safe_gate/a_log/dt_bias are unsupported"}
    assert "refused" in fla_peer.failure(GraphNotSupported("no engine for this graph"))
    assert fla_peer.failure(RuntimeError("CUDA error: out of memory")) == {
        "error": "RuntimeError: CUDA error: out of memory"}


def test_sweep_job_rows_unavailable_refused_and_timed(monkeypatch):
    rows = [[1, 64, 2, 16, 16, None, "safe"], [1, 64, 2, 16, 16, [0, 1, 64], "layer"],
            [1, 64, 2, 16, 16, None]]  # no regime: mild
    monkeypatch.setitem(fla_peer.CALLS, "cudnn", (None, "no_such_module_for_cudnn"))
    got = list(fla_peer.sweep_job({"job": "sweep", "library": "cudnn", "rows": rows}))
    assert [r["index"] for r in got] == [0, 1, 2]
    assert all(r["ms"] is None and "no_such_module_for_cudnn" in r["unavailable"] for r in got)

    seen = []

    def peer_row(library, backward, b, t, h, kd, vd, cu, gates, reference, iters, repeats):
        seen.append((library, backward, cu, gates, reference))
        if gates == "layer":
            raise NotImplementedError("KdaHopperCudaEngine: use_qk_l2norm is unsupported")
        return {"ms": 1.5, "host_ms": 0.2}

    monkeypatch.setitem(fla_peer.CALLS, "fla", (None, "json"))  # importable here
    monkeypatch.setattr(fla_peer, "peer_row", peer_row)
    got = list(fla_peer.sweep_job({"job": "sweep", "library": "fla", "mode": "backward",
                                   "rows": rows, "references": ["a.npy", None, None]}))
    assert got == [{"index": 0, "ms": 1.5, "host_ms": 0.2},
                   {"index": 1, "ms": None, "refused": "NotImplementedError: "
                    "KdaHopperCudaEngine: use_qk_l2norm is unsupported"},
                   {"index": 2, "ms": 1.5, "host_ms": 0.2}]
    assert seen == [("fla", True, None, "safe", "a.npy"), ("fla", True, [0, 1, 64], "layer", None),
                    ("fla", True, None, "mild", None)]


def test_child_says_ready_with_every_version(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"job": "x"}) + "\n"))
    fla_peer.serve({"x": lambda job: iter([{"ok": 1}])}, "2.11", "0.6.0",
                   cudnn_frontend="1.32.0")
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == [{"ready": True, "torch": "2.11", "fla": "0.6.0", "cudnn_frontend": "1.32.0"},
                     {"row": {"ok": 1}}, {"done": True}]
