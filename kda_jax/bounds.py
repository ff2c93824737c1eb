"""Host-side sequence bounds and the metadata tables built from them.

Variable-length bounds (``cu_seqlens``) are host data in kda_jax: every table a
kernel needs is a pure function of the bounds and the chunk size, so it is built
here with NumPy at trace time, cached on the bounds' contents, and reaches the
device as one int32 constant. Nothing in this module touches a device.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Sequence

import numpy as np

__all__ = [
    "SeqBounds",
    "PackedTables",
    "LaneSchedule",
    "as_seq_bounds",
    "chunk_table",
    "chunk_offsets",
    "pack_int32_tables",
    "packed_metadata",
    "lane_schedule",
]

_INT32_MAX = int(np.iinfo(np.int32).max)
# Triton specializes kernels on 16-byte pointer alignment; every block of a
# packed buffer starts on a multiple of 4 int32 elements.
ALIGN_ELEMENTS = 4
_CACHE_SIZE = 1024


class SeqBounds:
    """Cumulative sequence bounds ``cu_seqlens`` held on the host.

    A frozen, hashable value keyed on the bounds' contents: two ``SeqBounds``
    built from equal arrays are equal and hash alike, so a ``SeqBounds`` can be a
    ``jax.jit`` static argument (or a plain argument: it is a pytree with no
    leaves), and a jitted function retraces only when the bounds change.

    Args:
      cu_seqlens: 1-D integers ``[N + 1]`` with ``cu_seqlens[0] == 0``,
        non-decreasing, and ``cu_seqlens[-1]`` (the token count) within int32.
        Sequence ``i`` spans tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``; equal
        neighbours describe an empty sequence.
    """

    __slots__ = ("_cu", "_key", "_hash")

    def __init__(self, cu_seqlens: np.ndarray | Sequence[int]):
        if isinstance(cu_seqlens, SeqBounds):
            cu = cu_seqlens._cu
        else:
            cu = _validated_cu(cu_seqlens)
        object.__setattr__(self, "_cu", cu)
        object.__setattr__(self, "_key", cu.tobytes())
        object.__setattr__(self, "_hash", hash(self._key))

    @classmethod
    def from_lengths(cls, lengths: np.ndarray | Sequence[int]) -> "SeqBounds":
        """Builds bounds from per-sequence lengths ``[N]`` (zeros allowed)."""
        lens = np.asarray(lengths)
        if lens.ndim != 1 or not _is_integer_array(lens):
            raise ValueError(
                f"lengths must be a 1-D integer array, got shape {lens.shape} "
                f"dtype {lens.dtype}"
            )
        if lens.size and lens.min() < 0:
            raise ValueError(f"lengths must be >= 0, got {lens.tolist()}")
        return cls(np.concatenate([[0], np.cumsum(lens.astype(np.int64))]))

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"SeqBounds is immutable ({name})")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"SeqBounds is immutable ({name})")

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Read-only int64 ``[N + 1]`` bounds (a view that cannot be made writable)."""
        return self._cu.view()

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[N]`` sequence lengths."""
        return np.diff(self._cu)

    @property
    def num_seqs(self) -> int:
        return int(self._cu.shape[0] - 1)

    @property
    def total_tokens(self) -> int:
        return int(self._cu[-1])

    def __eq__(self, other):
        if not isinstance(other, SeqBounds):
            return NotImplemented
        return self._key == other._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        cu = self._cu
        shown = cu.tolist() if cu.size <= 12 else cu[:6].tolist() + ["..."] + cu[-3:].tolist()
        return f"SeqBounds(cu_seqlens={shown}, num_seqs={self.num_seqs})"

    def __reduce__(self):
        return (SeqBounds, (self._cu.copy(),))


def _is_integer_array(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_


def _validated_cu(cu_seqlens) -> np.ndarray:
    cu = np.asarray(cu_seqlens)
    if cu.dtype == object or not _is_integer_array(cu) and cu.size:
        raise TypeError(
            f"cu_seqlens must hold integers, got dtype {cu.dtype}; pass e.g. "
            "np.array([0, 5, 12], dtype=np.int32)"
        )
    if cu.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1], got shape {cu.shape}")
    if cu.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens must hold N + 1 >= 2 entries (at least one sequence), "
            f"got {cu.tolist()}"
        )
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got cu_seqlens={_short(cu)}")
    steps = np.diff(cu)
    if steps.size and steps.min() < 0:
        bad = int(np.argmin(steps))
        raise ValueError(
            "cu_seqlens must be non-decreasing, got "
            f"cu_seqlens[{bad}]={int(cu[bad])} > cu_seqlens[{bad + 1}]={int(cu[bad + 1])}"
        )
    if cu[-1] > _INT32_MAX:
        raise ValueError(
            f"cu_seqlens[-1]={int(cu[-1])} does not fit in int32; split the batch"
        )
    cu.setflags(write=False)
    return cu


def _short(a: np.ndarray) -> str:
    return str(a.tolist()) if a.size <= 12 else f"{a[:6].tolist()}...{a[-3:].tolist()}"


def as_seq_bounds(cu_seqlens) -> SeqBounds:
    """Converts host bounds (NumPy array, list/tuple, SeqBounds) to SeqBounds.

    A ``jax.Array`` or tracer is refused: turning it into host data would need a
    device-to-host read, which kda_jax never does.
    """
    if isinstance(cu_seqlens, SeqBounds):
        return cu_seqlens
    if isinstance(cu_seqlens, (np.ndarray, list, tuple)):
        return SeqBounds(cu_seqlens)
    kind = type(cu_seqlens).__name__
    if _is_jax_value(cu_seqlens):
        raise TypeError(
            f"cu_seqlens is a {kind} (device data). kda_jax builds its varlen "
            "metadata on the host at trace time, so reading device bounds back "
            "would stall every step. Pass the bounds as host data: a NumPy array, "
            "a list/tuple, or kda_jax.SeqBounds (hashable; usable as a jax.jit "
            "static argument)."
        )
    raise TypeError(
        f"cu_seqlens must be a NumPy array, a list/tuple of ints or a "
        f"kda_jax.SeqBounds, got {kind}"
    )


def _is_jax_value(x) -> bool:
    # Checked by type name so this module stays importable without JAX.
    return any(
        c.__module__.startswith(("jax", "jaxlib")) for c in type(x).__mro__
    )


# --------------------------------------------------------------------------- #
# Tables for chunk-parallel kernels.
# --------------------------------------------------------------------------- #


def _check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    return int(chunk_size)


def _cached_per_chunk_size(fn):
    """lru_cache on (bounds, chunk_size) that checks chunk_size before the lookup
    (a bare lru_cache would answer ``True`` or ``16.0`` from the entry of 1 or 16)."""
    cached = functools.lru_cache(maxsize=_CACHE_SIZE)(fn)

    @functools.wraps(fn)
    def wrapper(bounds: SeqBounds, chunk_size: int):
        return cached(bounds, _check_chunk_size(chunk_size))

    wrapper.cache_info, wrapper.cache_clear = cached.cache_info, cached.cache_clear
    return wrapper


def _chunks_per_seq(bounds: SeqBounds, chunk_size: int) -> np.ndarray:
    return -(-bounds.lengths // chunk_size)


@_cached_per_chunk_size
def chunk_table(bounds: SeqBounds, chunk_size: int) -> np.ndarray:
    """int32 ``[num_chunks, 2]``: (sequence id, chunk index within the sequence).

    Numbered by each sequence's position in ``cu_seqlens``, so empty sequences
    (which own no chunk) never shift the chunks of later sequences.
    """
    chunk_size = _check_chunk_size(chunk_size)
    counts = _chunks_per_seq(bounds, chunk_size)
    seq_ids = np.repeat(np.arange(bounds.num_seqs, dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    within = np.arange(seq_ids.size, dtype=np.int64) - np.repeat(starts, counts)
    table = np.stack([seq_ids, within], axis=1).astype(np.int32)
    table.setflags(write=False)
    return table


@_cached_per_chunk_size
def chunk_offsets(bounds: SeqBounds, chunk_size: int) -> np.ndarray:
    """int32 ``[N + 1]``: index of each sequence's first chunk (exclusive cumsum)."""
    chunk_size = _check_chunk_size(chunk_size)
    counts = _chunks_per_seq(bounds, chunk_size)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    offsets.setflags(write=False)
    return offsets


@dataclasses.dataclass(frozen=True, eq=False)
class PackedTables:
    """Several int32 tables in one buffer, each block 16-byte aligned.

    Attributes:
      buffer: read-only int32 ``[size]``, size a multiple of 4.
      layout: ``((name, offset, shape), ...)`` in elements of ``buffer``.
    """

    buffer: np.ndarray
    layout: tuple[tuple[str, int, tuple[int, ...]], ...]

    def offset(self, name: str) -> int:
        return self._entry(name)[1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def view(self, name: str) -> np.ndarray:
        """The table ``name`` as a read-only view of the host buffer."""
        _, off, shape = self._entry(name)
        return self.buffer[off : off + int(np.prod(shape, dtype=np.int64))].reshape(shape)

    def _entry(self, name):
        for entry in self.layout:
            if entry[0] == name:
                return entry
        raise KeyError(f"{name!r} is not in this buffer; it holds {[e[0] for e in self.layout]}")


def pack_int32_tables(tables: dict[str, np.ndarray]) -> PackedTables:
    """Packs int tables into one int32 buffer with 16-byte aligned blocks."""
    layout, pieces, cursor = [], [], 0
    for name, table in tables.items():
        table = np.asarray(table)
        if table.size and (table.min() < np.iinfo(np.int32).min or table.max() > _INT32_MAX):
            raise ValueError(f"table {name!r} has values outside int32")
        flat = table.astype(np.int32).ravel()
        padded = -(-flat.size // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        layout.append((name, cursor, tuple(int(d) for d in table.shape)))
        pieces.append(np.pad(flat, (0, padded - flat.size)))
        cursor += padded
    buffer = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
    if buffer.size == 0:
        buffer = np.zeros((ALIGN_ELEMENTS,), np.int32)
    buffer = buffer.astype(np.int32)
    buffer.setflags(write=False)
    return PackedTables(buffer=buffer, layout=tuple(layout))


@_cached_per_chunk_size
def packed_metadata(bounds: SeqBounds, chunk_size: int) -> PackedTables:
    """The chunk-parallel kernels' metadata in one aligned int32 buffer.

    Blocks: ``cu_seqlens`` ``[N + 1]``, ``chunk_offsets`` ``[N + 1]`` and
    ``chunk_table`` ``[num_chunks, 2]`` (see :func:`chunk_table`).
    """
    return pack_int32_tables(
        {
            "cu_seqlens": bounds.cu_seqlens,
            "chunk_offsets": chunk_offsets(bounds, chunk_size),
            "chunk_table": chunk_table(bounds, chunk_size),
        }
    )


# --------------------------------------------------------------------------- #
# Lane schedule for the XLA path.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, eq=False)
class LaneSchedule:
    """Sequences packed into parallel lanes of chunk slots, for a scan over steps.

    The XLA path runs the sequential state pass as one ``lax.scan`` of
    ``num_steps`` steps over ``num_lanes`` lanes. Each lane holds whole
    sequences back to back (the state resets at a sequence's first chunk), so
    the traced program depends on (steps, lanes, chunk size, tokens) only, never
    on the number of sequences. ``num_steps`` is the longest sequence's chunk
    count, the fewest steps possible; lanes are filled worst-fit decreasing.

    Tables (all in ``tables``, one aligned int32 buffer):
      ``token_index`` ``[S, L, C]``: token at each slot row, or ``T`` (padding).
      ``slot_of_token`` ``[T]``: flat index into ``S * L * C`` of each token.
      ``first`` ``[S, L]``: 1 where the slot holds a sequence's first chunk.
      ``seq_of_slot`` ``[S, L]``: that sequence's id where ``first``, else N.
      ``last_slot`` ``[N]``: flat index ``s * L + l`` of each sequence's last
        chunk, or ``S * L`` for an empty sequence.
      ``seq_ending`` ``[S, L]``: the sequence whose last chunk is at the slot,
        else N.
    """

    num_steps: int
    num_lanes: int
    chunk_size: int
    num_seqs: int
    total_tokens: int
    tables: PackedTables


@_cached_per_chunk_size
def lane_schedule(bounds: SeqBounds, chunk_size: int) -> LaneSchedule:
    chunk_size = _check_chunk_size(chunk_size)
    n, t = bounds.num_seqs, bounds.total_tokens
    counts = _chunks_per_seq(bounds, chunk_size)
    steps = max(int(counts.max()), 1)

    # Worst-fit decreasing: the least-filled lane takes the next longest
    # sequence when it fits, else a new lane opens. O(N log L).
    order = sorted((i for i in range(n) if counts[i] > 0), key=lambda i: -counts[i])
    lane_of = np.full(n, -1, np.int64)
    step0 = np.zeros(n, np.int64)
    heap: list[tuple[int, int]] = []
    for i in order:
        if heap and heap[0][0] + counts[i] <= steps:
            fill, lane = heapq.heappop(heap)
        else:
            fill, lane = 0, len(heap)
        lane_of[i], step0[i] = lane, fill
        heapq.heappush(heap, (fill + int(counts[i]), lane))
    lanes = max(len(heap), 1)

    table = chunk_table(bounds, chunk_size).astype(np.int64)
    c_seq, c_idx = table[:, 0], table[:, 1]
    c_step = step0[c_seq] + c_idx
    c_lane = lane_of[c_seq]
    c_flat = c_step * lanes + c_lane

    rows = np.arange(chunk_size, dtype=np.int64)
    starts = bounds.cu_seqlens[c_seq] + c_idx * chunk_size
    tok = starts[:, None] + rows[None, :]
    valid = tok < bounds.cu_seqlens[c_seq + 1][:, None]
    token_index = np.full((steps * lanes, chunk_size), t, np.int64)
    token_index[c_flat] = np.where(valid, tok, t)

    slot_of_token = np.zeros(t, np.int64)
    flat_rows = c_flat[:, None] * chunk_size + rows[None, :]
    slot_of_token[tok[valid]] = flat_rows[valid]

    first = np.zeros(steps * lanes, np.int64)
    seq_of_slot = np.full(steps * lanes, n, np.int64)
    is_first = c_idx == 0
    first[c_flat[is_first]] = 1
    seq_of_slot[c_flat[is_first]] = c_seq[is_first]

    last_slot = np.full(n, steps * lanes, np.int64)
    is_last = c_idx == counts[c_seq] - 1
    last_slot[c_seq[is_last]] = c_flat[is_last]
    seq_ending = np.full(steps * lanes, n, np.int64)
    seq_ending[c_flat[is_last]] = c_seq[is_last]

    packed = pack_int32_tables(
        {
            "token_index": token_index.reshape(steps, lanes, chunk_size),
            "slot_of_token": slot_of_token,
            "first": first.reshape(steps, lanes),
            "seq_of_slot": seq_of_slot.reshape(steps, lanes),
            "last_slot": last_slot,
            "seq_ending": seq_ending.reshape(steps, lanes),
        }
    )
    return LaneSchedule(
        num_steps=steps,
        num_lanes=lanes,
        chunk_size=chunk_size,
        num_seqs=n,
        total_tokens=t,
        tables=packed,
    )
