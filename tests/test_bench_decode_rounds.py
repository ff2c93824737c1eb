"""bench.decode_rounds and bench.decode_donation on a CPU: their bookkeeping, and
the step names decode_rounds asks bench.serving for (a mismatch would show only
in a GPU call)."""

from __future__ import annotations

import pytest

from bench import decode_rounds as rounds


def test_the_order_alternates_and_ratios_are_per_round():
    assert rounds.round_order(0) == ("kda_jax", "fla")
    assert rounds.round_order(1) == ("fla", "kda_jax")
    got = rounds.summarize([
        dict(round=0, form="dense", kda_jax_ms=1.0, fla_ms=2.0),
        dict(round=1, form="dense", kda_jax_ms=3.0, fla_ms=2.0),
        dict(round=2, form="dense", kda_jax_ms=2.0, fla_ms=2.0),
        dict(round=0, form="pool", kda_jax_ms=1.0, fla_ms=1.0),
    ])
    assert got["dense"] == dict(rounds=3, kda_jax_ms=2.0, fla_ms=2.0, ratio_median=1.0,
                                ratio_min=0.5, ratio_max=1.5)
    assert got["pool"]["ratio_median"] == 1.0 and got["pool"]["rounds"] == 1


@pytest.mark.parametrize("form", rounds.FORMS)
def test_kda_jax_steps_have_the_names_asked_for(form):
    from bench.serving import kda_decode_steps

    steps = kda_decode_steps(4, 2, 16, impl="xla")
    call, sync, per = steps[rounds.kda_name(form, 4)]
    assert per == 1
    call(0)
    sync()


def test_an_unknown_form_is_refused():
    with pytest.raises(SystemExit, match="'paged' must be one of"):
        rounds.main(["--forms", "dense,paged"])


def test_every_decode_step_of_bench_serving_runs():
    # XLA on the CPU, tiny shapes: the calls and syncs bench.serving times.
    from bench.serving import kda_decode_steps

    steps = kda_decode_steps(4, 2, 16, impl="xla")
    assert {per for _, _, per in steps.values()} == {1, 8}
    for call, sync, _ in steps.values():
        call(0)
        sync()


def test_decode_donation_runs_its_three_forms(tmp_path):
    # XLA on the CPU, tiny shapes: bench.decode_donation's calls and JSON.
    import json

    from bench import decode_donation

    out = tmp_path / "donation.json"
    decode_donation.main(["--n", "4", "--heads", "2", "--head-dim", "16", "--rounds", "1",
                          "--iters", "2", "--repeats", "1", "--impl", "xla", "--json", str(out)])
    got = json.loads(out.read_text())
    assert set(got["medians_ms"]) == set(decode_donation.FORMS)
    assert all(ms > 0 for ms in got["medians_ms"].values())
