"""Ahead-of-time compile (kda_jax.aot): no GPU needed."""

import pytest

pytest.importorskip("triton")

from kda_jax import aot  # noqa: E402

SPEC = {s.name: s for s in aot.SPECS}["main/c32/default"]
KERNEL = "kda_fwd_state_output_kernel"
TARGETS = ("gfx950", "sm90")


@pytest.fixture(scope="module")
def rows():
    # aot.run compiles in fresh processes: this suite sets TRITON_INTERPRET=1,
    # under which Triton hands out interpreter kernels that cannot compile.
    return {r["target"]: r for r in aot.run(TARGETS, (SPEC,), (KERNEL,), jobs=2)}


@pytest.mark.parametrize("target", TARGETS)
def test_compile_reports_resources_without_spills(rows, target):
    row = rows[target]
    assert row["error"] is None, row["error"]
    assert row["ok"]
    assert (row["kernel"], row["spec"]) == (KERNEL, SPEC.name)
    assert row["num_warps"] > 0 and row["num_stages"] > 0
    fields = ["vgprs", "vgpr_spills", "scratch", "lds_bytes", "occupancy"]
    if target.startswith("gfx"):
        fields += ["sgprs", "sgpr_spills"]
    for name in fields:
        assert isinstance(row[name], int), (name, row[name])
    assert row["vgprs"] > 0
    assert row["occupancy"] >= 1
    assert row["vgpr_spills"] == 0
    assert row["scratch"] == 0
