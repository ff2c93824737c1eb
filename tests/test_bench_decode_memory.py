"""bench.decode_memory's host-side pieces: its option parsing and the layout of
the placement rows' slab (the GPU rows themselves need torch and a GPU)."""

from __future__ import annotations

import inspect

import pytest

from bench import decode_memory


def test_vloop_configs_parse_and_bad_ones_name_the_entry():
    assert decode_memory.parse_vloop("32x4x2,16x2x3") == [(32, 4, 2), (16, 2, 3)]
    assert decode_memory.parse_vloop("") == []
    for bad in ("32x4", "32x4x0", "ax4x2"):
        with pytest.raises(ValueError, match=f"--vloop entry '{bad}' must be BLOCK_VxWARPSxSTAGES"):
            decode_memory.parse_vloop(bad)


@pytest.mark.parametrize("size, gap, base, expected", [
    (100, 0, 0, (200, 0, 100)),        # back to back
    (100, 8, 4, (212, 4, 112)),        # a gap, and the first state 4 bytes in
    (100, -300, 0, (300, 200, 0)),     # the final state 300 bytes before the initial one
    (100, -200, 16, (216, 116, 16)),   # back to back, final first
])
def test_slab_layout_places_both_states_without_overlap(size, gap, base, expected):
    total, at0, at1 = decode_memory.slab_layout(size, gap, base)
    assert (total, at0, at1) == expected
    assert at1 - at0 == size + gap
    assert min(at0, at1) == base and max(at0, at1) + size == total


def test_slab_layout_refuses_overlapping_states():
    with pytest.raises(ValueError, match="the states would overlap: size=100 gap=-50"):
        decode_memory.slab_layout(100, -50)


def test_the_experiment_kernels_take_the_arguments_main_passes():
    persistent, flat, copy_persistent, tiles, vloop = decode_memory._kernels()
    names = lambda k: list(inspect.signature(getattr(k, "fn", k)).parameters)
    assert names(vloop) == ["q", "k", "v", "g", "beta", "h0", "o", "ht", "H", "HV", "K", "V",
                            "BV", "SCALE", "STAGES"]
    assert names(persistent)[:9] == ["q", "k", "v", "g", "beta", "h0", "o", "ht", "n_tiles"]
    assert names(flat) == ["src", "dst", "BLOCK", "STREAM"]
    assert names(copy_persistent) == ["src", "dst", "n_blocks", "BLOCK", "STAGES"]
    assert names(tiles) == ["h0", "ht", "HV", "K", "V", "BV"]
