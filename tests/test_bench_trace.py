"""bench.trace_decode's reading of profiler traces (JAX's and torch's formats)
and its per-step busy / idle summary."""

import pytest

from bench import trace_decode


def test_gpu_activities_from_a_jax_trace():
    trace = {"traceEvents": [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "ts": 0.0, "dur": 50.0, "name": "PjitFunction(step)"},
        {"ph": "X", "pid": 7, "ts": 30.0, "dur": 5.0, "name": "fusion"},
        {"ph": "X", "pid": 7, "ts": 10.0, "dur": 15.0, "name": "kda_fused_recurrent_kernel"},
    ]}
    assert trace_decode.gpu_activities(trace) == [
        ("kda_fused_recurrent_kernel", 10.0, 15.0), ("fusion", 30.0, 5.0)]


def test_gpu_activities_from_a_torch_trace():
    trace = [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 9, "name": "aten::zeros"},
             {"ph": "X", "cat": "kernel", "ts": 4, "dur": 3, "name": "fused_recurrent_kda"},
             {"ph": "X", "cat": "gpu_memset", "ts": 1, "dur": 1, "name": "Memset"}]
    assert trace_decode.gpu_activities(trace) == [("Memset", 1.0, 1.0),
                                                  ("fused_recurrent_kda", 4.0, 3.0)]


def test_summary_counts_overlaps_once_and_gaps_as_idle():
    acts = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("a", 20.0, 10.0), ("c", 40.0, 0.0)]
    s = trace_decode.summarize(acts, steps=2)
    # window 0..40, busy 0..15 and 20..30 = 25, idle 15
    assert s["window_us_per_step"] == 20.0
    assert s["busy_us_per_step"] == 12.5
    assert s["idle_us_per_step"] == 7.5
    assert s["activities"]["a"] == {"count": 2, "mean_us": 10.0}
    assert list(s["activities"])[0] == "a"  # the most time first


def test_an_empty_trace_is_named():
    assert trace_decode.summarize([], steps=3) == {"error": "no GPU activity in the trace"}


@pytest.mark.parametrize("form", ["dense", "pool", "varlen"])
def test_kda_jax_trace_runs_on_the_host(form):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU the trace has device activity (the GPU stage reads it)")
    # On a CPU the trace holds host events only: the summary says so.
    out = trace_decode.trace_kda_jax(4, 2, 16, steps=2, chain=2, form=form)
    assert out == {"error": "no GPU activity in the trace"}


def test_varlen_form_is_kda_jax_only():
    with pytest.raises(SystemExit):
        trace_decode.main(["--peer", "fla", "--form", "varlen"])
