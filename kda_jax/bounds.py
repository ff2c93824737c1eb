"""Host-side sequence bounds and the metadata tables built from them.

Variable-length bounds (``cu_seqlens``) are host data in kda_jax: every table a
kernel needs is a pure function of the bounds and the chunk size, so it is built
here with NumPy at trace time, cached on the bounds' contents, and reaches the
device as one int32 constant. The bucketed (serving) form pads the same tables
to a static :class:`Bucket` instead, so that the buffer can be a runtime
argument whose shape does not change with the bounds. Nothing in this module
touches a device.
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
    "Bucket",
    "bucketed_metadata",
    "check_bucketed_metadata",
    "most_chunks",
    "next_pow2",
    "checkpoint_counts",
    "checkpoint_offsets",
    "checkpoint_slots",
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
        """Builds bounds from per-sequence lengths ``[N]``, N >= 1 (zeros allowed)."""
        _refuse_device_data(lengths, "lengths")
        lens = np.asarray(lengths)
        if lens.ndim != 1:
            raise ValueError(f"lengths must be 1-D [N], got shape {lens.shape}")
        if lens.size == 0:
            raise ValueError(f"lengths is empty: {_NO_SEQUENCE}")
        if not _is_integer_array(lens):
            raise TypeError(
                f"lengths must hold integers, got dtype {lens.dtype}; pass e.g. "
                "np.array([5, 7], dtype=np.int32)"
            )
        if lens.min() < 0:
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


# SeqBounds as a pytree without leaves: a jitted function can take it as an
# ordinary argument, and its contents key the compilation cache. Registered
# here, where it is defined, when JAX is installed; this module itself needs
# only NumPy.
try:
    import jax as _jax
except ImportError:  # pragma: no cover - exercised only without JAX
    pass
else:
    _jax.tree_util.register_static(SeqBounds)


def _is_integer_array(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_


# Why bounds need a sequence, and what to do instead.
_NO_SEQUENCE = ("bounds need at least one sequence; a call with none has nothing to compute, "
                "so skip it (inputs with B = 0 and no cu_seqlens return empty results)")


def _validated_cu(cu_seqlens) -> np.ndarray:
    _refuse_device_data(cu_seqlens, "cu_seqlens")
    cu = np.asarray(cu_seqlens)
    if cu.dtype == object or not _is_integer_array(cu) and cu.size:
        raise TypeError(
            f"cu_seqlens must hold integers, got dtype {cu.dtype}; pass e.g. "
            "np.array([0, 5, 12], dtype=np.int32)"
        )
    if cu.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1], got shape {cu.shape}")
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 entries, got {cu.tolist()}: "
                         f"{_NO_SEQUENCE}")
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
    _refuse_device_data(cu_seqlens, "cu_seqlens")
    if type(cu_seqlens).__name__ == "VarlenBatch":  # e.g. given to the reference
        raise TypeError(
            "a VarlenBatch (the bucketed form) is taken by chunk_kda and "
            "fused_recurrent_kda as cu_seqlens, not by host-bounds helpers; pass the "
            "host bounds it was built from"
        )
    raise TypeError(
        f"cu_seqlens must be a NumPy array, a list/tuple of ints or a "
        f"kda_jax.SeqBounds, got {type(cu_seqlens).__name__}"
    )


def _is_jax_value(x) -> bool:
    # Checked by type name so this module stays importable without JAX.
    return any(
        c.__module__.startswith(("jax", "jaxlib")) for c in type(x).__mro__
    )


def _refuse_device_data(x, name: str):
    """Bounds are host data: a jax.Array or tracer raises TypeError."""
    if _is_jax_value(x):
        raise TypeError(
            f"{name} is a {type(x).__name__} (device data). kda_jax builds its varlen "
            "metadata on the host at trace time, so reading device bounds back "
            "would stall every step. Pass the bounds as host data: a NumPy array, "
            "a list/tuple, or kda_jax.SeqBounds (hashable; usable as a jax.jit "
            "static argument). For bounds that change every step without a "
            "recompile, pass kda_jax.VarlenBatch.build(host_bounds, bucket) as a "
            "jit argument: the bucketed form, whose metadata is a runtime array."
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
    layout, flats, cursor = [], [], 0
    for name, table in tables.items():
        table = np.asarray(table)
        if table.size and (table.min() < np.iinfo(np.int32).min or table.max() > _INT32_MAX):
            raise ValueError(f"table {name!r} has values outside int32")
        layout.append((name, cursor, tuple(int(d) for d in table.shape)))
        flats.append(table.ravel())
        cursor += -(-table.size // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    # One zeroed buffer filled in place: serving builds one per step, and
    # per-block padding and concatenation cost more than the tables.
    buffer = np.zeros((max(cursor, ALIGN_ELEMENTS),), np.int32)
    for (_, offset, _), flat in zip(layout, flats):
        buffer[offset:offset + flat.size] = flat
    buffer.setflags(write=False)
    return PackedTables(buffer=buffer, layout=tuple(layout))


def _varlen_tables(bounds: SeqBounds, chunk_size: int) -> dict[str, np.ndarray]:
    """The kernels' tables, unpadded: the one builder of both metadata forms."""
    return {
        "cu_seqlens": bounds.cu_seqlens,
        "chunk_offsets": chunk_offsets(bounds, chunk_size),
        "chunk_table": chunk_table(bounds, chunk_size),
    }


@_cached_per_chunk_size
def packed_metadata(bounds: SeqBounds, chunk_size: int) -> PackedTables:
    """The chunk-parallel kernels' metadata in one aligned int32 buffer.

    Blocks: ``cu_seqlens`` ``[N + 1]``, ``chunk_offsets`` ``[N + 1]`` and
    ``chunk_table`` ``[num_chunks, 2]`` (see :func:`chunk_table`).
    """
    return pack_int32_tables(_varlen_tables(bounds, chunk_size))


# --------------------------------------------------------------------------- #
# The bucketed form: the same tables padded to a static bucket.
# --------------------------------------------------------------------------- #

# chunk_kda's chunk sizes; a bucket's chunk table is built for one of them.
BUCKET_CHUNK_SIZES = (32, 64)


def _positive_int(value, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int; {fix}")
    if value > _INT32_MAX:
        raise ValueError(f"{name}={value} does not fit in int32; {fix}")
    return int(value)


def most_chunks(max_seqs: int, max_tokens: int, chunk_size: int) -> int:
    """The most chunks any bounds of at most ``max_seqs`` sequences and
    ``max_tokens`` tokens can have: each non-empty sequence adds at most one
    partial chunk, so k non-empty sequences need at most
    ``k + (tokens - k) // chunk_size`` chunks, largest at k = min(seqs, tokens)."""
    k = min(max_seqs, max_tokens)
    return k + (max_tokens - k) // chunk_size


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): bucket sizes and kernel tiles."""
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The static shape of a bucketed varlen batch (the serving form).

    Every bounds that fits the bucket gives metadata of the same shape, so a
    jitted step compiles once per bucket, however the bounds change. Frozen
    and hashable: the static part of :class:`kda_jax.VarlenBatch`.

    Attributes:
      max_seqs: sequence slots N_b. ``initial_state``, a pool's rows
        (``PoolRows``) and final states are ``[max_seqs, ...]``; slots
        past the real sequence count are empty sequences.
      max_tokens: token rows T_b: q, k, v, g, beta are ``[1, max_tokens, ...]``;
        rows past the real token count belong to no sequence.
      chunk_size: the chunk size of the chunk table (chunk_kda's ``chunk_size``,
        32 or 64).
      max_chunks: chunk slots (the grid of the chunk-parallel kernel). Default:
        the most any bounds within (max_seqs, max_tokens) can need
        (:func:`most_chunks`), so it never limits; a smaller value is checked
        for each bounds.
      max_len: the longest a sequence may be (None: no limit but max_tokens),
        checked for each bounds: ``Bucket(n, n, max_len=1)`` is a decode
        bucket, whose bounds are refused unless every sequence has at most
        one token.
    """

    max_seqs: int
    max_tokens: int
    chunk_size: int = 64
    max_chunks: int | None = None
    max_len: int | None = None

    def __post_init__(self):
        fix = "pick a bucket with kda_jax.Bucket.fit(cu_seqlens)"
        seqs = _positive_int(self.max_seqs, "max_seqs", fix)
        tokens = _positive_int(self.max_tokens, "max_tokens", fix)
        if isinstance(self.chunk_size, bool) or self.chunk_size not in BUCKET_CHUNK_SIZES:
            raise ValueError(
                f"chunk_size={self.chunk_size!r} must be 32 or 64 (chunk_kda's chunk sizes)"
            )
        most = most_chunks(seqs, tokens, int(self.chunk_size))
        chunks = most if self.max_chunks is None else _positive_int(
            self.max_chunks, "max_chunks", f"or None for the most the bucket can need ({most})")
        if self.max_len is not None:
            object.__setattr__(self, "max_len", _positive_int(
                self.max_len, "max_len", "or None for no limit but max_tokens"))
        # Normalized, so that Bucket(16, 4096) == Bucket(16, 4096, 64, 79).
        for name, value in (("max_seqs", seqs), ("max_tokens", tokens),
                            ("chunk_size", int(self.chunk_size)),
                            ("max_chunks", min(chunks, most))):
            object.__setattr__(self, name, value)

    @classmethod
    def fit(cls, cu_seqlens, *, chunk_size: int = 64, candidates=None, min_seqs: int = 1,
            min_tokens: int = 1) -> "Bucket":
        """A bucket that holds ``cu_seqlens`` (host bounds).

        With ``candidates`` (Buckets, smallest first): the first that holds the
        bounds. Without: powers of two, ``max_seqs = pow2(max(N, min_seqs))``
        and ``max_tokens = pow2(max(T, min_tokens))``, so bounds that change
        every step land in few buckets (one compile each).
        """
        bounds = as_seq_bounds(cu_seqlens)
        if candidates is not None:
            candidates = list(candidates)
            for bucket in candidates:
                if not isinstance(bucket, Bucket):
                    raise TypeError(f"candidates must hold kda_jax.Bucket values, got "
                                    f"{type(bucket).__name__}")
                if bucket.chunk_size == chunk_size and bucket.why_not(bounds) is None:
                    return bucket
            raise ValueError(
                f"no bucket in candidates holds {bounds} (N={bounds.num_seqs}, "
                f"T={bounds.total_tokens}) with chunk_size={chunk_size}; add a larger one"
            )
        fix = "pass a positive int"
        return cls(
            max_seqs=next_pow2(max(bounds.num_seqs, _positive_int(min_seqs, "min_seqs", fix))),
            max_tokens=next_pow2(max(bounds.total_tokens,
                                 _positive_int(min_tokens, "min_tokens", fix))),
            chunk_size=chunk_size,
        )

    def why_not(self, cu_seqlens) -> str | None:
        """Why ``cu_seqlens`` does not fit this bucket (None when it does)."""
        bounds = as_seq_bounds(cu_seqlens)
        chunks = chunk_table(bounds, self.chunk_size).shape[0]
        for what, value, limit in (("sequences", bounds.num_seqs, self.max_seqs),
                                   ("tokens", bounds.total_tokens, self.max_tokens),
                                   (f"chunks of {self.chunk_size}", chunks, self.max_chunks)):
            if value > limit:
                return f"{bounds} has {value} {what}, more than the bucket's {limit}"
        longest = int(bounds.lengths.max(initial=0))
        if self.max_len is not None and longest > self.max_len:
            return (f"{bounds} has a sequence of {longest} tokens, longer than the bucket's "
                    f"max_len={self.max_len}")
        return None

    @property
    def layout(self) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
        """``((name, offset, shape), ...)`` of the metadata buffer (static)."""
        return _bucket_layout(self)[0]

    @property
    def metadata_size(self) -> int:
        """int32 elements of the metadata buffer."""
        return _bucket_layout(self)[1]

    def offset(self, name: str) -> int:
        for entry in self.layout:
            if entry[0] == name:
                return entry[1]
        raise KeyError(f"{name!r} is not in a bucketed buffer; it holds "
                       f"{[e[0] for e in self.layout]}")


def _bucket_shapes(bucket: Bucket) -> dict[str, tuple[int, ...]]:
    n = bucket.max_seqs
    return {
        # (num_seqs, total_tokens, num_chunks, chunk_size) of the real bounds.
        "header": (4,),
        # N_b + 2 entries: slot N_b is an always-empty sentinel sequence at
        # the real token count, which padded chunk-table rows point at.
        "cu_seqlens": (n + 2,),
        "chunk_offsets": (n + 2,),
        "chunk_table": (bucket.max_chunks, 2),
    }


@functools.lru_cache(maxsize=256)
def _bucket_layout(bucket: Bucket):
    layout, cursor = [], 0
    for name, shape in _bucket_shapes(bucket).items():
        layout.append((name, cursor, shape))
        cursor += -(-int(np.prod(shape)) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    return tuple(layout), cursor


def bucketed_metadata(cu_seqlens, bucket: Bucket) -> PackedTables:
    """The tables of :func:`packed_metadata`, padded to ``bucket``: one aligned
    int32 buffer whose shape depends on the bucket only.

    Blocks (in this order):
      ``header`` ``[4]``: (N, T, number of chunks, chunk size) of the real bounds.
      ``cu_seqlens`` ``[N_b + 2]``: the bounds, then T repeated: slots
        N..N_b - 1 are empty sequences, and slot N_b is an always-empty
        sentinel (also when N == N_b).
      ``chunk_offsets`` ``[N_b + 2]``: the offsets, then the chunk count repeated.
      ``chunk_table`` ``[max_chunks, 2]``: the (sequence, chunk) rows, then
        (N_b, 0): chunk 0 of the sentinel, which has no rows, so a kernel
        program given a padded chunk loads and stores nothing.
    Token rows T..T_b - 1 belong to no sequence.
    """
    if not isinstance(bucket, Bucket):
        raise TypeError(f"bucket must be a kda_jax.Bucket, got {type(bucket).__name__}")
    bounds = as_seq_bounds(cu_seqlens)
    reason = bucket.why_not(bounds)
    if reason is not None:
        raise ValueError(f"{reason}; pick a larger bucket (kda_jax.Bucket.fit(cu_seqlens))")
    n, t, nb = bounds.num_seqs, bounds.total_tokens, bucket.max_seqs
    tables = _varlen_tables(bounds, bucket.chunk_size)
    nc = tables["chunk_table"].shape[0]
    cu = np.full(nb + 2, t, np.int64)
    cu[: n + 1] = tables["cu_seqlens"]
    co = np.full(nb + 2, nc, np.int64)
    co[: n + 1] = tables["chunk_offsets"]
    ct = np.empty((bucket.max_chunks, 2), np.int64)
    ct[:nc] = tables["chunk_table"]
    ct[nc:] = (nb, 0)
    packed = pack_int32_tables({
        "header": np.array([n, t, nc, bucket.chunk_size]),
        "cu_seqlens": cu,
        "chunk_offsets": co,
        "chunk_table": ct,
    })
    if packed.layout != bucket.layout:  # the layout is static: it must not depend on data
        raise RuntimeError(f"bucketed metadata layout {packed.layout} != {bucket.layout}")
    return packed


def check_bucketed_metadata(buffer: np.ndarray, bucket: Bucket) -> SeqBounds:
    """Checks a host buffer against ``bucket``: it must be exactly what
    :func:`bucketed_metadata` builds from the bounds it holds. Returns those
    bounds; raises ValueError naming the first table that is wrong.

    The kernels index token rows, chunk rows and sequence slots with these
    tables, so every table is checked, not only the shape: the header against
    the bucket, ``cu_seqlens`` as bounds, then the whole buffer against the one
    rebuilt from those bounds (chunk_offsets, chunk_table, the padding).

    Args:
      buffer: int32 NumPy ``[bucket.metadata_size]`` (shape and dtype checked
        by the caller).
      bucket: the :class:`Bucket` the buffer claims to be built for.
    """
    fix = "build the batch with kda_jax.VarlenBatch.build(cu_seqlens, bucket)"
    layout = {name: (off, shape) for name, off, shape in bucket.layout}
    view = lambda name: buffer[layout[name][0]:layout[name][0] + int(np.prod(layout[name][1]))]
    n, t, nc, cs = (int(x) for x in view("header"))
    for what, value, low, high in (("header[0] (sequences)", n, 1, bucket.max_seqs),
                                   ("header[1] (tokens)", t, 0, bucket.max_tokens),
                                   ("header[2] (chunks)", nc, 0, bucket.max_chunks),
                                   ("header[3] (chunk size)", cs, bucket.chunk_size,
                                    bucket.chunk_size)):
        if not low <= value <= high:
            raise ValueError(f"metadata table 'header': {what}={value} is outside [{low}, "
                             f"{high}] of {bucket}; {fix}")
    cu = view("cu_seqlens")
    try:
        bounds = SeqBounds(cu[: n + 1])
    except ValueError as e:
        raise ValueError(f"metadata table 'cu_seqlens' (its first {n + 1} entries) is not "
                         f"valid bounds: {e}; {fix}") from None
    if bounds.total_tokens != t:
        raise ValueError(f"metadata table 'cu_seqlens' ends at cu_seqlens[{n}]="
                         f"{bounds.total_tokens}, but header[1] (tokens) is {t}; {fix}")
    try:
        expected = bucketed_metadata(bounds, bucket).buffer
    except ValueError as e:
        raise ValueError(f"metadata table 'cu_seqlens' holds {bounds}, which does not fit "
                         f"{bucket}: {e}") from None
    if np.array_equal(buffer, expected):
        return bounds
    covered = np.zeros(buffer.shape, bool)
    for name, (off, shape) in layout.items():
        size = int(np.prod(shape))
        covered[off:off + size] = True
        bad = np.flatnonzero(buffer[off:off + size] != expected[off:off + size])
        if bad.size:
            i = np.unravel_index(int(bad[0]), shape)
            at = ", ".join(str(int(x)) for x in i)
            raise ValueError(
                f"metadata table {name!r} differs from what {bounds} gives in {bucket}: "
                f"{name}[{at}]={int(buffer[off + bad[0]])}, expected "
                f"{int(expected[off + bad[0]])} ({bad.size} entries differ); {fix}")
    pad = int(np.flatnonzero((buffer != expected) & ~covered)[0])
    raise ValueError(f"metadata padding between tables must be 0, got buffer[{pad}]="
                     f"{int(buffer[pad])}; {fix}")


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


# --------------------------------------------------------------------------- #
# Prefill checkpoints: the state before every ``every``-token interval.
# --------------------------------------------------------------------------- #


def checkpoint_counts(lengths: np.ndarray, every: int) -> np.ndarray:
    """int64 ``[N]``: checkpoints per sequence of ``lengths``, ``ceil(len / every)``
    (the states before tokens 0, every, 2 every, ...; none for an empty sequence)."""
    return -(-np.asarray(lengths, np.int64) // int(every))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def checkpoint_offsets(bounds: SeqBounds, every: int) -> np.ndarray:
    """int32 ``[N + 1]``: index of each sequence's first checkpoint in the
    ``[C, ...]`` output (exclusive cumsum of :func:`checkpoint_counts`)."""
    offsets = np.concatenate([[0], np.cumsum(checkpoint_counts(bounds.lengths, every))])
    if offsets[-1] > _INT32_MAX:
        raise ValueError(f"{int(offsets[-1])} checkpoints do not fit in int32; split the batch")
    offsets = offsets.astype(np.int32)
    offsets.setflags(write=False)
    return offsets


@functools.lru_cache(maxsize=_CACHE_SIZE)
def checkpoint_slots(bounds: SeqBounds, chunk_size: int, every: int) -> PackedTables:
    """Where the checkpoints sit in :func:`lane_schedule`'s slots (the XLA
    path's state is the scan's state at a slot's start), one int32 buffer:

      ``slot`` ``[C]``: the flat slot ``s * L + l`` of checkpoint c (in the
        order of :func:`checkpoint_offsets`).
      ``seq`` ``[S * L]``: the sequence whose checkpoint is the state at the
        slot's start, else -1; ``col`` ``[S * L]``: which of its checkpoints
        (j: the state after j * every tokens), else -1.

    ``every`` must be a multiple of ``chunk_size`` (a checkpoint at a chunk's start).
    """
    chunk_size = _check_chunk_size(chunk_size)
    schedule = lane_schedule(bounds, chunk_size)
    cu = bounds.cu_seqlens
    first = schedule.tables.view("token_index")[..., 0].reshape(-1).astype(np.int64)
    live = first < bounds.total_tokens  # a slot with a chunk (padding reads token T)
    seq = np.searchsorted(cu, first, side="right") - 1  # the last start at or before it
    pos = first - cu[np.minimum(seq, bounds.num_seqs)]
    at = live & (pos % every == 0)
    seq = np.where(at, seq, -1)
    col = np.where(at, pos // every, -1)
    slot = np.empty(int(checkpoint_offsets(bounds, every)[-1]), np.int64)
    slot[checkpoint_offsets(bounds, every)[seq[at]] + col[at]] = np.flatnonzero(at)
    return pack_int32_tables({"slot": slot, "seq": seq, "col": col})
