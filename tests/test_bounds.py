"""Host bounds (SeqBounds) and the metadata tables built from them (NumPy only)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_jax import SeqBounds
from kda_jax.bounds import (
    ALIGN_ELEMENTS,
    as_seq_bounds,
    chunk_offsets,
    chunk_table,
    lane_schedule,
    pack_int32_tables,
    packed_metadata,
)

# Lengths with many zeros (empty sequences), ones, and a few long sequences.
LENGTH = st.one_of(st.just(0), st.just(0), st.integers(1, 3), st.integers(0, 300))
LENGTHS = st.lists(LENGTH, min_size=1, max_size=24)
CHUNK = st.sampled_from([16, 32, 64])
PROPERTY = settings(max_examples=150, deadline=None)


# --------------------------------------------------------------------------- #
# SeqBounds validation.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (np.array([[0, 2], [2, 4]]), ValueError, r"cu_seqlens must be 1-D.*\(2, 2\)"),
        (np.array([0.0, 2.0, 4.0]), TypeError, r"cu_seqlens must hold integers.*float64"),
        ([0, 2.5, 4], TypeError, r"cu_seqlens must hold integers.*float"),
        (np.array([False, True]), TypeError, r"cu_seqlens must hold integers.*bool"),
        ([0, "3"], TypeError, r"cu_seqlens must hold integers"),
        (np.array([1, 2, 4]), ValueError, r"cu_seqlens\[0\] must be 0.*\[1, 2, 4\]"),
        (np.array([0, 5, 3, 7]), ValueError,
         r"cu_seqlens must be non-decreasing.*cu_seqlens\[1\]=5 > cu_seqlens\[2\]=3"),
        (np.array([0, 2**31], np.int64), ValueError, r"cu_seqlens\[-1\]=2147483648.*int32"),
        (np.array([0], np.int32), ValueError, r"cu_seqlens must hold N \+ 1 >= 2.*\[0\]"),
        ([], ValueError, r"cu_seqlens must hold N \+ 1 >= 2"),
        (np.array(0), ValueError, r"cu_seqlens must be 1-D"),
    ],
    ids=["2d", "float", "float-list", "bool", "str", "nonzero-start", "decreasing",
         "over-int32", "one-entry", "empty", "0d"],
)
def test_invalid_bounds(bad, error, match):
    with pytest.raises(error, match=match):
        SeqBounds(bad)


def test_largest_int32_total_is_accepted():
    b = SeqBounds(np.array([0, 2**31 - 1], np.int64))
    assert b.total_tokens == 2**31 - 1


def test_from_lengths():
    b = SeqBounds.from_lengths([0, 3, 0, 5])
    assert b == SeqBounds([0, 0, 3, 3, 8])
    assert b.num_seqs == 4 and b.total_tokens == 8
    np.testing.assert_array_equal(b.lengths, [0, 3, 0, 5])
    assert b.cu_seqlens.dtype == np.int64
    assert SeqBounds.from_lengths(np.array([7], np.int32)) == SeqBounds([0, 7])
    with pytest.raises(ValueError, match=r"lengths must be >= 0.*-1"):
        SeqBounds.from_lengths([3, -1])
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype float64"):
        SeqBounds.from_lengths([1.5, 2.0])
    with pytest.raises(ValueError, match=r"lengths must be 1-D \[N\], got shape \(1, 2\)"):
        SeqBounds.from_lengths([[1, 2]])
    with pytest.raises(ValueError, match=r"lengths is empty: bounds need at least one sequence"):
        SeqBounds.from_lengths([])
    with pytest.raises(ValueError, match=r"N \+ 1 >= 2 entries, got \[0\].*skip it"):
        SeqBounds([0])


def test_device_bounds_are_refused_by_every_constructor():
    """SeqBounds(...), from_lengths and as_seq_bounds take host data only."""
    import jax.numpy as jnp

    from kda_jax.bounds import as_seq_bounds
    for make, name in ((SeqBounds, "cu_seqlens"), (SeqBounds.from_lengths, "lengths"),
                       (as_seq_bounds, "cu_seqlens")):
        with pytest.raises(TypeError, match=rf"{name} is a .*\(device data\).*host data"):
            make(jnp.asarray([0, 3, 5]))


@given(LENGTHS)
@settings(max_examples=50, deadline=None)
def test_from_lengths_round_trip(lengths):
    b = SeqBounds.from_lengths(lengths)
    np.testing.assert_array_equal(b.lengths, lengths)
    assert b == SeqBounds(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


# --------------------------------------------------------------------------- #
# Equality, hashing, immutability, pickling.
# --------------------------------------------------------------------------- #


def test_equality_and_hash_on_contents():
    a = np.array([0, 3, 3, 10], np.int32)
    b = np.array([0, 3, 3, 10], np.int64)  # a different object and dtype, equal contents
    assert a is not b
    x, y = SeqBounds(a), SeqBounds(b)
    assert x == y and hash(x) == hash(y)
    assert SeqBounds([0, 3, 3, 10]) == x and hash(SeqBounds((0, 3, 3, 10))) == hash(x)
    assert SeqBounds(x) == x
    assert x != SeqBounds([0, 3, 4, 10])
    assert x != SeqBounds([0, 3, 10])  # a prefix is not equal
    assert x != [0, 3, 3, 10]  # not equal to the raw data
    assert len({x, y, SeqBounds([0, 3, 3, 10]), SeqBounds([0, 1])}) == 2
    assert {x: "cached"}[y] == "cached"


def test_immutable():
    src = np.array([0, 2, 5])
    b = SeqBounds(src)
    with pytest.raises(AttributeError):
        b.foo = 1
    with pytest.raises(AttributeError):
        b._cu = np.array([0, 9])
    with pytest.raises((AttributeError, TypeError)):
        del b._cu
    with pytest.raises(ValueError):
        b.cu_seqlens[1] = 4  # read-only view
    src[1] = 4  # the caller's array is copied, not aliased
    np.testing.assert_array_equal(b.cu_seqlens, [0, 2, 5])
    assert b == SeqBounds([0, 2, 5]) and hash(b) == hash(SeqBounds([0, 2, 5]))


def test_pickle_and_copy():
    b = SeqBounds([0, 0, 4, 9])
    for c in (pickle.loads(pickle.dumps(b)), copy.copy(b), copy.deepcopy(b)):
        assert c == b and hash(c) == hash(b)
        assert not c.cu_seqlens.flags.writeable
        np.testing.assert_array_equal(c.cu_seqlens, [0, 0, 4, 9])


def test_as_seq_bounds_and_repr():
    b = SeqBounds([0, 4])
    assert as_seq_bounds(b) is b
    assert as_seq_bounds([0, 4]) == b and as_seq_bounds((0, 4)) == b
    assert as_seq_bounds(np.array([0, 4])) == b
    with pytest.raises(TypeError, match=r"cu_seqlens must be a NumPy array.*str"):
        as_seq_bounds("0,4")
    assert "num_seqs=1" in repr(b)
    long = SeqBounds.from_lengths(np.arange(40))
    assert "..." in repr(long) and str(long.total_tokens) in repr(long)


# --------------------------------------------------------------------------- #
# Chunk table and offsets.
# --------------------------------------------------------------------------- #


def _reference_table(lengths, c):
    counts = -(-np.asarray(lengths, np.int64) // c)
    seq = np.repeat(np.arange(len(lengths)), counts)
    within = np.concatenate([np.arange(n) for n in counts]) if counts.sum() else np.zeros(0)
    return np.stack([seq, within], axis=1).astype(np.int32).reshape(-1, 2), counts


def test_spec_example():
    table = chunk_table(SeqBounds.from_lengths([0, 1, 0, 65]), 64)
    np.testing.assert_array_equal(table, [[1, 0], [3, 0], [3, 1]])
    np.testing.assert_array_equal(chunk_offsets(SeqBounds.from_lengths([0, 1, 0, 65]), 64),
                                  [0, 0, 1, 1, 3])


@given(LENGTHS, CHUNK)
@PROPERTY
def test_chunk_table_and_offsets(lengths, c):
    bounds = SeqBounds.from_lengths(lengths)
    table = chunk_table(bounds, c)
    expected, counts = _reference_table(lengths, c)
    assert table.dtype == np.int32 and table.shape == expected.shape
    np.testing.assert_array_equal(table, expected)
    assert not table.flags.writeable
    offsets = chunk_offsets(bounds, c)
    assert offsets.dtype == np.int32
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))


@pytest.mark.parametrize("fn", [chunk_table, chunk_offsets, packed_metadata, lane_schedule])
def test_chunk_size_checked(fn):
    b = SeqBounds([0, 5, 7])
    fn(b, 16), fn(b, 1)  # cached entries that True == 1 and 16.0 == 16 would hit
    for bad in (0, -16, True, 16.0, "16"):
        with pytest.raises(ValueError, match="chunk_size"):
            fn(b, bad)


# --------------------------------------------------------------------------- #
# Packed metadata.
# --------------------------------------------------------------------------- #


@given(LENGTHS, CHUNK)
@PROPERTY
def test_packed_metadata(lengths, c):
    bounds = SeqBounds.from_lengths(lengths)
    packed = packed_metadata(bounds, c)
    assert packed.buffer.dtype == np.int32 and packed.buffer.ndim == 1
    assert packed.buffer.size % ALIGN_ELEMENTS == 0
    assert not packed.buffer.flags.writeable
    assert [e[0] for e in packed.layout] == ["cu_seqlens", "chunk_offsets", "chunk_table"]
    ends = []
    for name, offset, shape in packed.layout:
        assert offset % ALIGN_ELEMENTS == 0  # 16-byte aligned blocks
        assert offset * 4 % 16 == 0
        ends.append(offset + int(np.prod(shape)))
    # Blocks do not overlap.
    starts = [e[1] for e in packed.layout]
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:]))
    assert ends[-1] <= packed.buffer.size
    expected = {
        "cu_seqlens": bounds.cu_seqlens.astype(np.int32),
        "chunk_offsets": chunk_offsets(bounds, c),
        "chunk_table": _reference_table(lengths, c)[0],
    }
    for name, table in expected.items():
        view = packed.view(name)
        assert view.dtype == np.int32 and view.shape == table.shape
        np.testing.assert_array_equal(view, table)
        assert not view.flags.writeable
        assert packed.shape(name) == table.shape


def test_packed_metadata_is_cached_on_contents():
    a = SeqBounds(np.array([0, 0, 70, 71]))
    b = SeqBounds(np.array([0, 0, 70, 71], np.int32))
    assert a is not b
    assert packed_metadata(a, 64) is packed_metadata(b, 64)
    assert packed_metadata(a, 64) is not packed_metadata(a, 32)
    assert lane_schedule(a, 64) is lane_schedule(b, 64)
    with pytest.raises(ValueError):
        packed_metadata(a, 64).buffer[0] = 1
    with pytest.raises(KeyError, match="nope"):
        packed_metadata(a, 64).view("nope")


def test_pack_int32_tables():
    p = pack_int32_tables({"a": np.arange(3), "b": np.ones((2, 3)), "c": np.zeros(0)})
    assert [(n, o) for n, o, _ in p.layout] == [("a", 0), ("b", 4), ("c", 12)]
    np.testing.assert_array_equal(p.view("b"), np.ones((2, 3), np.int32))
    assert p.view("c").shape == (0,)
    assert pack_int32_tables({}).buffer.size == ALIGN_ELEMENTS
    with pytest.raises(ValueError, match="'big'.*int32"):
        pack_int32_tables({"big": np.array([2**31])})


# --------------------------------------------------------------------------- #
# Lane schedule of the XLA path.
# --------------------------------------------------------------------------- #


def _check_schedule(lengths, c):
    bounds = SeqBounds.from_lengths(lengths)
    sched = lane_schedule(bounds, c)
    lengths = np.asarray(lengths, np.int64)
    n, t = len(lengths), int(lengths.sum())
    cu = bounds.cu_seqlens
    counts = -(-lengths // c)
    tabs = sched.tables
    for _, offset, _ in tabs.layout:
        assert offset % ALIGN_ELEMENTS == 0
    ti = tabs.view("token_index")
    steps, lanes = sched.num_steps, sched.num_lanes
    assert ti.shape == (steps, lanes, c) and ti.dtype == np.int32
    assert (sched.num_seqs, sched.total_tokens, sched.chunk_size) == (n, t, c)
    assert steps == max(int(counts.max()), 1)  # the fewest steps possible
    assert 1 <= lanes <= max(int((counts > 0).sum()), 1)

    # Every token exactly once; the rest is padding (= T).
    flat = ti.reshape(-1).astype(np.int64)
    valid = flat < t
    assert np.all(flat[~valid] == t)
    np.testing.assert_array_equal(np.bincount(flat[valid], minlength=t), np.ones(t))
    sot = tabs.view("slot_of_token")
    assert sot.shape == (t,)
    np.testing.assert_array_equal(flat[sot], np.arange(t))

    # Each slot holds one chunk of one sequence, rows in order from row 0.
    nslots = steps * lanes
    slot_seq = np.full(nslots, -1)
    slot_chunk = np.full(nslots, -1)
    for slot, row in enumerate(ti.reshape(nslots, c).astype(np.int64)):
        toks = row[row < t]
        if toks.size == 0:
            continue
        seq = int(np.searchsorted(cu, toks[0], side="right") - 1)
        start = toks[0] - cu[seq]
        assert start % c == 0
        chunk = int(start // c)
        rows = min(c, int(lengths[seq]) - chunk * c)
        np.testing.assert_array_equal(row[:rows], cu[seq] + chunk * c + np.arange(rows))
        assert np.all(row[rows:] == t)
        slot_seq[slot], slot_chunk[slot] = seq, chunk

    # A sequence's chunks fill consecutive steps of one lane, in order, and the
    # sequences of a lane do not overlap (each slot has one owner, checked above).
    step_of, lane_of = np.divmod(np.arange(nslots), lanes)
    for seq in range(n):
        mine = np.flatnonzero(slot_seq == seq)
        assert mine.size == counts[seq]
        if mine.size == 0:
            continue
        assert np.unique(lane_of[mine]).size == 1
        order = np.argsort(slot_chunk[mine])
        np.testing.assert_array_equal(slot_chunk[mine][order], np.arange(counts[seq]))
        np.testing.assert_array_equal(np.diff(step_of[mine][order]), 1)
    for lane in range(lanes):
        owners = slot_seq[lane_of == lane]
        owners = owners[owners >= 0]
        if owners.size == 0:
            continue
        # Contiguous runs: once a lane moves on from a sequence it never returns.
        runs = owners[np.r_[True, owners[1:] != owners[:-1]]]
        assert np.unique(runs).size == runs.size

    first = tabs.view("first").reshape(-1)
    seq_of_slot = tabs.view("seq_of_slot").reshape(-1)
    seq_ending = tabs.view("seq_ending").reshape(-1)
    last_slot = tabs.view("last_slot")
    assert tabs.view("first").shape == (steps, lanes) == tabs.view("seq_ending").shape
    is_first = slot_chunk == 0
    np.testing.assert_array_equal(first, is_first.astype(np.int32))
    np.testing.assert_array_equal(seq_of_slot, np.where(is_first, slot_seq, n))
    is_last = (slot_seq >= 0) & (slot_chunk == counts[np.maximum(slot_seq, 0)] - 1)
    np.testing.assert_array_equal(seq_ending, np.where(is_last, slot_seq, n))
    assert last_slot.shape == (n,)
    for seq in range(n):
        if counts[seq] == 0:
            assert last_slot[seq] == nslots
        else:
            assert slot_seq[last_slot[seq]] == seq
            assert slot_chunk[last_slot[seq]] == counts[seq] - 1
    return sched


@given(LENGTHS, st.sampled_from([1, 16, 32, 64]))
@PROPERTY
def test_lane_schedule_invariants(lengths, c):
    _check_schedule(lengths, c)


@pytest.mark.parametrize(
    "lengths,c,lanes",
    [
        ((0, 1, 0, 65), 64, 2),  # 2 steps: the 2-chunk sequence fills lane 0
        ((130, 1, 1, 0, 60), 64, 2),  # 3 steps: three 1-chunk sequences share lane 1
        ((0, 0, 0), 64, 1),  # no tokens: one padding slot
        ((5,) * 8, 1, 8),  # decode-like: equal lengths, one lane each
    ],
)
def test_lane_schedule_examples(lengths, c, lanes):
    sched = _check_schedule(lengths, c)
    assert sched.num_lanes == lanes
