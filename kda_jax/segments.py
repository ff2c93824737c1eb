"""Host plans that split sequences: segments within a device, pieces across devices.

The chunk states of a sequence are a chain, ``S_end = E + M @ S_start`` for
any stretch of it (docs/kda.md section 7): ``E`` ``[K, V]`` is the stretch's
end state from a zero start, ``M`` ``[K, K]`` its transition. Both plans here
cut sequences into stretches whose ``(E, M)`` can be computed in parallel and
folded afterwards (:mod:`kda_jax.segmented`, :mod:`kda_jax.context_parallel`).
Everything is NumPy, built at trace time from host bounds and cached on them,
like the tables of :mod:`kda_jax.bounds`; nothing here touches a device.

- :func:`segment_plan`: long sequences cut into segments of whole chunks
  within one device, and the tables of the fold and the output correction.
- :func:`segment_chunks`: the rule that decides whether a call is segmented
  and how long its segments are (the thresholds: :class:`SegmentConfig` in
  :mod:`kda_jax.configs`).
- :func:`context_plan`: the tokens split into contiguous 1/n pieces over n
  devices, per device the pieces of the sequences it holds.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kda_jax.bounds import PackedTables, SeqBounds, chunk_offsets, pack_int32_tables

__all__ = ["SegmentPlan", "segment_plan", "SegmentTables", "segment_tables", "segment_chunks",
           "DevicePieces", "context_plan"]

_CACHE_SIZE = 256


def _frozen(*arrays):
    for a in arrays:
        a.setflags(write=False)


# --------------------------------------------------------------------------- #
# Segments within a device.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Sequences of ``bounds`` cut into ``S`` segments (every token in exactly
    one; empty sequences have none), and the tables of the fold.

    Attributes (int64 NumPy, read-only):
      segments: the segments as sequences of the same packed tokens.
      first: bool ``[S]``: the segment starts its sequence (it runs from the
        sequence's initial state; the others from the identity, see
        :mod:`kda_jax.segmented`).
      seq: ``[S]``: the sequence of each segment.
      fold: ``[L, steps]``: per lane (a sequence of two segments or more), its
        segments in order; ``S`` past its count (the identity).
      final_lane: ``[N]``: the lane of each sequence, -1 if it has < 2 segments.
      final_segment: ``[N]``: the one segment of a one-segment sequence, else -1
        (an empty sequence: -1 in both: its final state is its initial state).
      corr_index: ``[C, R]``: the tokens of the ``C`` segments that are not
        first (rows ``R`` = the longest of them), the token count ``T`` past a
        segment's end.
      corr_start: ``[C]``: the fold position (``lane * steps + step - 1``) of
        the state each of those segments starts from.
      corr_slot: ``[T]``: each token's flat index into ``C * R``, ``C * R`` for
        a token of a first segment (no correction).
    """

    bounds: SeqBounds
    segments: SeqBounds
    first: np.ndarray
    seq: np.ndarray
    fold: np.ndarray
    final_lane: np.ndarray
    final_segment: np.ndarray
    corr_index: np.ndarray
    corr_start: np.ndarray
    corr_slot: np.ndarray

    @property
    def num_segments(self) -> int:
        return self.segments.num_seqs


def _cut(length: int, chunk_size: int, per_segment: int) -> list[int]:
    """Lengths of the segments of one sequence: ``chunks // per_segment``
    pieces of whole chunks, as equal as whole chunks allow (the last takes
    the partial chunk): each at least ``per_segment`` chunks and under twice
    that. A sequence of fewer than ``2 * per_segment`` chunks stays whole."""
    chunks = -(-length // chunk_size)
    pieces = chunks // per_segment
    if pieces < 2:
        return [length] if length else []
    base, extra = divmod(chunks, pieces)
    sizes = [(base + (i < extra)) * chunk_size for i in range(pieces)]
    sizes[-1] = length - sum(sizes[:-1])
    return sizes


@functools.lru_cache(maxsize=_CACHE_SIZE)
def segment_plan(bounds: SeqBounds, chunk_size: int, per_segment: int) -> SegmentPlan:
    """Cuts every sequence of at least ``2 * per_segment`` chunks (of
    ``chunk_size`` tokens) into near-equal segments of whole chunks, each at
    least ``per_segment`` chunks and under twice that. A plan with no
    sequence cut is valid (a single pass, no fold)."""
    if per_segment < 1:
        raise ValueError(f"per_segment={per_segment} must be >= 1 (chunks per segment)")
    lengths = bounds.lengths
    n, t = bounds.num_seqs, bounds.total_tokens
    seg_lengths, seq, first = [], [], []
    for i, length in enumerate(lengths.tolist()):
        sizes = _cut(int(length), chunk_size, per_segment)
        seg_lengths += sizes
        seq += [i] * len(sizes)
        first += [True] + [False] * (len(sizes) - 1) if sizes else []
    segments = SeqBounds.from_lengths(np.asarray(seg_lengths, np.int64))
    seq = np.asarray(seq, np.int64)
    first = np.asarray(first, bool)
    s = seq.size
    counts = np.bincount(seq, minlength=n) if s else np.zeros(n, np.int64)

    multi = np.flatnonzero(counts >= 2)
    steps = int(counts.max()) if s else 0
    fold = np.full((multi.size, max(steps, 1)), s, np.int64)
    final_lane = np.full(n, -1, np.int64)
    final_segment = np.full(n, -1, np.int64)
    seg_start = np.concatenate([[0], np.cumsum(counts)])  # first segment of each sequence
    lane_of_seq = np.full(n, -1, np.int64)
    for lane, i in enumerate(multi.tolist()):
        fold[lane, : counts[i]] = np.arange(seg_start[i], seg_start[i + 1])
        lane_of_seq[i] = lane
    final_lane[multi] = np.arange(multi.size)
    single = np.flatnonzero(counts == 1)
    final_segment[single] = seg_start[single]

    # The segments that start from a folded state: their tokens, in slots.
    later = np.flatnonzero(~first)
    cu = segments.cu_seqlens
    rows = int(np.max(np.diff(cu)[later])) if later.size else 1
    corr_index = np.full((later.size, rows), t, np.int64)
    corr_slot = np.full(t, later.size * rows, np.int64)
    corr_start = np.zeros(later.size, np.int64)
    fold_steps = fold.shape[1]
    for c, sgm in enumerate(later.tolist()):
        lo, hi = int(cu[sgm]), int(cu[sgm + 1])
        corr_index[c, : hi - lo] = np.arange(lo, hi)
        corr_slot[lo:hi] = c * rows + np.arange(hi - lo)
        i = seq[sgm]
        corr_start[c] = lane_of_seq[i] * fold_steps + (sgm - seg_start[i]) - 1
    _frozen(first, seq, fold, final_lane, final_segment, corr_index, corr_start, corr_slot)
    return SegmentPlan(bounds=bounds, segments=segments, first=first, seq=seq, fold=fold,
                       final_lane=final_lane, final_segment=final_segment,
                       corr_index=corr_index, corr_start=corr_start, corr_slot=corr_slot)


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentTables:
    """A plan's tables for the Triton state chain (kda_jax/kernels/segments.py).

    Attributes:
      plan: the :class:`SegmentPlan`.
      packed: one int32 buffer (:class:`kda_jax.bounds.PackedTables`):
        ``cu_seqlens`` and ``chunk_offsets`` of the segments (their chunks are
        the rows the unsegmented call numbers, in the same order) and
        ``chains`` ``[C, 3]``: per sequence with segments (a chain of one
        segment or more), (its first segment, its segment count, the
        sequence).
      num_chains: C.
      first_segment, last_segment: int64 ``[N]``: each sequence's first and
        last segment, -1 for an empty sequence.
    """

    plan: SegmentPlan
    packed: PackedTables
    num_chains: int
    first_segment: np.ndarray
    last_segment: np.ndarray


@functools.lru_cache(maxsize=_CACHE_SIZE)
def segment_tables(plan: SegmentPlan, chunk_size: int) -> SegmentTables:
    """The :class:`SegmentTables` of ``plan`` (segments of whole
    ``chunk_size`` chunks)."""
    n = plan.bounds.num_seqs
    counts = np.bincount(plan.seq, minlength=n) if plan.seq.size else np.zeros(n, np.int64)
    seg0 = np.concatenate([[0], np.cumsum(counts)])[:-1]  # each sequence's first segment
    has = counts > 0
    chains = np.stack([seg0[has], counts[has], np.flatnonzero(has)], axis=1)
    offsets = chunk_offsets(plan.segments, chunk_size)
    whole = chunk_offsets(plan.bounds, chunk_size)
    if not np.array_equal(offsets[seg0[has]], whole[:-1][has]) or offsets[-1] != whole[-1]:
        raise AssertionError("segments must cut sequences at whole chunks")  # by construction
    packed = pack_int32_tables({"cu_seqlens": plan.segments.cu_seqlens,
                                "chunk_offsets": offsets, "chains": chains})
    first_segment = np.where(has, seg0, -1)
    last_segment = np.where(has, seg0 + counts - 1, -1)
    _frozen(first_segment, last_segment)
    return SegmentTables(plan=plan, packed=packed, num_chains=int(has.sum()),
                         first_segment=first_segment, last_segment=last_segment)


def segment_chunks(bounds: SeqBounds, chunk_size: int, *, hv: int, programs_per_seq_head: int,
                   min_programs: int, target_programs: int, min_segment_chunks: int,
                   min_segments: int = 2, forced_segment_chunks: int | None = None,
                   segment_programs_per_seq_head: int | None = None) -> int | None:
    """The rule: the segment length in chunks (:func:`segment_plan`'s
    ``per_segment``), or None for no segments.

    A call is under-filled when its state pass has fewer than ``min_programs``
    programs (non-empty sequences x ``hv`` x ``programs_per_seq_head``, the V
    blocks of the state kernel). Then sequences are cut into at most
    ``wanted = max(1, floor(target_programs / (hv x per head)))`` segments
    in all (per head: ``segment_programs_per_seq_head``, the V blocks of the
    pass over segments), so that the cut sequences give at most
    ``target_programs`` programs (a sequence too short to cut stays one
    segment beside them): at least ``floor(total chunks / (wanted + 1)) + 1``
    chunks per segment (the shortest length that makes no more), but never
    fewer than ``min_segment_chunks`` (each segment adds a fold step and a
    [K, K] transition). None unless some sequence then makes
    ``min_segments`` segments or more (a sequence cut in two runs its map and
    its state pass over half its chunks each: no shorter than one pass).
    ``segment_programs_per_seq_head``: the segmented pass's programs per
    segment and head, when its V blocks differ from the one pass's (None:
    ``programs_per_seq_head``). ``forced_segment_chunks`` skips the
    thresholds (tests, tuning).
    """
    if bounds.num_seqs == 0 or bounds.total_tokens == 0:
        return None
    counts = -(-bounds.lengths // chunk_size)
    if forced_segment_chunks is not None:
        per = int(forced_segment_chunks)
    else:
        programs = int(np.count_nonzero(counts)) * hv * programs_per_seq_head
        if programs >= min_programs:
            return None
        per_head = (programs_per_seq_head if segment_programs_per_seq_head is None
                    else segment_programs_per_seq_head)
        wanted = max(1, target_programs // (hv * per_head))
        per = max(min_segment_chunks, int(counts.sum()) // (wanted + 1) + 1)
    needed = 2 if forced_segment_chunks is not None else max(min_segments, 2)
    return per if int(counts.max()) // per >= needed else None


# --------------------------------------------------------------------------- #
# Pieces across devices (context parallelism).
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, eq=False)
class DevicePieces:
    """What one device of a context-parallel call holds: its tokens are, for
    each of the ``B`` rows (lanes), the contiguous range ``[d L, (d + 1) L)``
    of that row (``L`` tokens per device), flattened row-major; a piece is a
    sequence's part inside one lane's range.

    Attributes (int64 / bool NumPy, read-only):
      bounds: the pieces as sequences of the device's ``B * L`` tokens.
      seq: ``[P]``: each piece's global sequence.
      starts: bool ``[P]``: the piece begins its sequence (it runs from the
        sequence's initial state).
      entering: bool ``[P]``: the piece continues a sequence from the
        previous device (it runs from the identity: its state depends on the
        state handed over).
      leaving: ``[B]``: per lane, the piece whose sequence goes on to the
        next device, or -1.
      final_piece: ``[N]``: the piece holding the sequence's last token when
        that is on this device; -1 otherwise.
      owns: bool ``[N]``: this device returns the sequence's final state (it
        holds its last token; an empty sequence belongs to the device whose
        range holds its position, the last device for the end).
      lane: ``[N]``: the lane (row) of each sequence.
    """

    bounds: SeqBounds
    seq: np.ndarray
    starts: np.ndarray
    entering: np.ndarray
    leaving: np.ndarray
    final_piece: np.ndarray
    owns: np.ndarray
    lane: np.ndarray


@functools.lru_cache(maxsize=_CACHE_SIZE)
def context_plan(bounds: SeqBounds, rows: int, devices: int) -> tuple[DevicePieces, ...]:
    """Per device, its pieces of ``bounds`` (over ``rows * T`` global tokens,
    ``T = devices * L``; a sequence must lie within one row). Raises
    ValueError when the tokens do not split evenly or a sequence crosses a row."""
    total = bounds.total_tokens
    if rows < 1 or devices < 1 or total % (rows * devices):
        raise ValueError(
            f"{total} tokens do not split into {rows} rows of {devices} equal pieces")
    row_len = total // rows
    per = row_len // devices
    cu = bounds.cu_seqlens.astype(np.int64)
    n = bounds.num_seqs
    lo_all, hi_all = cu[:-1], cu[1:]
    lane = np.minimum(lo_all // max(row_len, 1), rows - 1) if n else np.zeros(0, np.int64)
    crossing = (hi_all > lo_all) & ((hi_all - 1) // max(row_len, 1) != lane)
    if np.any(crossing):
        i = int(np.flatnonzero(crossing)[0])
        raise ValueError(
            f"sequence {i} spans tokens [{lo_all[i]}, {hi_all[i]}), across the end of a batch "
            f"row of {row_len} tokens; with B > 1 each row is its own sequence")
    # Owner of each sequence: the device of its last token (of its position
    # when empty; the end of a row belongs to its last device).
    where = np.where(hi_all > lo_all, hi_all - 1, lo_all) - lane * row_len
    owner = np.minimum(where // max(per, 1), devices - 1) if n else where
    plans = []
    for d in range(devices):
        lengths, seq, starts, entering = [], [], [], []
        leaving = np.full(rows, -1, np.int64)
        final_piece = np.full(n, -1, np.int64)
        for r in range(rows):
            lo, hi = r * row_len + d * per, r * row_len + (d + 1) * per
            inside = np.flatnonzero((hi_all > lo) & (lo_all < hi) & (hi_all > lo_all))
            for i in inside.tolist():
                a, b = max(int(lo_all[i]), lo), min(int(hi_all[i]), hi)
                p = len(seq)
                lengths.append(b - a)
                seq.append(i)
                starts.append(a == lo_all[i])
                entering.append(a > lo_all[i])
                if hi_all[i] > hi:
                    leaving[r] = p
                if b == hi_all[i]:
                    final_piece[i] = p
        # Empty sequences sit between pieces; they own no token, so they add
        # no piece: their final state is their initial state.
        piece_bounds = SeqBounds.from_lengths(np.asarray(lengths, np.int64))
        arrays = (np.asarray(seq, np.int64), np.asarray(starts, bool),
                  np.asarray(entering, bool), leaving, final_piece, owner == d,
                  lane.astype(np.int64))
        _frozen(*arrays)
        plans.append(DevicePieces(piece_bounds, *arrays))
    return tuple(plans)
