"""The bucketed varlen form (serving): bounds as one runtime int32 buffer.

A serving step sees new bounds on every call. With :class:`kda_jax.SeqBounds`
the metadata is a constant of the compiled program, so new bounds retrace and
recompile. A :class:`VarlenBatch` instead carries the same tables
(:func:`kda_jax.bounds.bucketed_metadata`) padded to a static
:class:`kda_jax.Bucket`, as a pytree whose only leaf is that int32 buffer: the
jitted step takes it as an ordinary argument, ``jax.device_put`` of the batch
is the one asynchronous host-to-device transfer, and every bounds of the same
bucket reuses one executable. Nothing is read back from the device.

This module also gives the backends one view of either form
(:func:`kernel_metadata`, :func:`mask_padding`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import pool as state_pool
from kda_jax.bounds import (Bucket, SeqBounds, as_seq_bounds, bucketed_metadata,
                            check_bucketed_metadata, chunk_table, packed_metadata)

__all__ = ["VarlenBatch", "KernelMetadata", "kernel_metadata", "mask_padding", "num_seqs"]


class VarlenBatch:
    """Varlen bounds in the bucketed form: ``metadata`` (the one leaf) + ``bucket`` (static).

    Build it on the host with :meth:`build` (NumPy; no device work), move it
    with ``jax.device_put(batch)`` (one asynchronous transfer of a few
    hundred bytes) or let the jitted step's dispatch copy it (pass the NumPy
    batch itself; cheaper on the host), and pass it as ``cu_seqlens=batch``
    inside a jitted step that takes the batch as an argument. Then:

    * q, k, v, g, beta are ``[1, bucket.max_tokens, ...]``; rows past the real
      token count belong to no sequence: their o is 0 and they touch no state
      (their contents are never read).
    * ``initial_state``, final states and a pool's rows (``PoolRows``) are
      ``[bucket.max_seqs, ...]``; sequence slots
      past the real count are empty sequences (a final state equals its
      initial state, or zeros). With a state pool their indices are ignored
      (treated as -1: nothing read, nothing written), so padding them with -1
      is the convention but not required.

    Constructed from a NumPy buffer, the buffer is checked against the bucket
    (:func:`kda_jax.bounds.check_bucketed_metadata`: every table must be what
    :meth:`build` makes of the bounds it holds; a ValueError names the first
    table that is not). A ``jax.Array`` or tracer is not checked: that would
    need a read-back from the device. The Triton kernels clamp every index
    they take from the buffer, so no buffer makes them read or write outside
    their arrays, but a buffer not made by :meth:`build` gives undefined
    results (the XLA path's: NaN, where it can tell, see
    :mod:`kda_jax.xla`). Pickling and (deep) copying keep the bucket and the
    buffer (a NumPy buffer is checked again on the way back).

    Attributes:
      metadata: int32 ``[bucket.metadata_size]``: NumPy on the host, a
        ``jax.Array`` after ``device_put``, a tracer inside jit.
      bucket: the :class:`kda_jax.Bucket` (static: it keys the jit cache).
    """

    __slots__ = ("metadata", "bucket")

    def __init__(self, metadata, bucket: Bucket):
        if not isinstance(bucket, Bucket):
            raise TypeError(f"bucket must be a kda_jax.Bucket, got {type(bucket).__name__}")
        if not hasattr(metadata, "shape") or not hasattr(metadata, "dtype"):
            raise TypeError(
                f"metadata must be an int32 array, got {type(metadata).__name__}; build the "
                "batch with kda_jax.VarlenBatch.build(cu_seqlens, bucket)"
            )
        if tuple(metadata.shape) != (bucket.metadata_size,) or np.dtype(metadata.dtype) != np.int32:
            raise ValueError(
                f"metadata must be int32 [{bucket.metadata_size}] for {bucket}, got "
                f"{np.dtype(metadata.dtype)} {list(metadata.shape)}; build the batch with "
                "kda_jax.VarlenBatch.build(cu_seqlens, bucket)"
            )
        if isinstance(metadata, np.ndarray):
            check_bucketed_metadata(metadata, bucket)
        object.__setattr__(self, "metadata", metadata)
        object.__setattr__(self, "bucket", bucket)

    @classmethod
    def _built(cls, metadata: np.ndarray, bucket: Bucket) -> "VarlenBatch":
        """A batch of a buffer :func:`bucketed_metadata` has just made (no check)."""
        batch = object.__new__(cls)
        object.__setattr__(batch, "metadata", metadata)
        object.__setattr__(batch, "bucket", bucket)
        return batch

    @classmethod
    def build(cls, cu_seqlens, bucket: Bucket | None = None, *,
              chunk_size: int = 64) -> "VarlenBatch":
        """The batch of host bounds ``cu_seqlens`` (NumPy, list or SeqBounds) in
        ``bucket`` (default: :meth:`Bucket.fit`, powers of two). Host only."""
        bounds = as_seq_bounds(cu_seqlens)
        if bucket is None:
            bucket = Bucket.fit(bounds, chunk_size=chunk_size)
        return cls._built(bucketed_metadata(bounds, bucket).buffer, bucket)

    @classmethod
    def from_lengths(cls, lengths, bucket: Bucket | None = None, *,
                     chunk_size: int = 64) -> "VarlenBatch":
        """:meth:`build` from per-sequence lengths ``[N]`` (zeros allowed).

        Integer lengths seen recently (a decode step's N ones, step after
        step) reuse their built buffer, which is read-only."""
        arr = np.asarray(lengths)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            # Not a list of integers: SeqBounds.from_lengths names the problem.
            return cls.build(SeqBounds.from_lengths(lengths), bucket, chunk_size=chunk_size)
        buffer, bucket = _buffer_of_lengths(tuple(arr.tolist()), bucket, chunk_size)
        return cls._built(buffer, bucket)

    def table(self, name: str) -> jax.Array:
        """The block ``name`` of the metadata (a static slice of the buffer)."""
        off = self.bucket.offset(name)
        shape = dict((e[0], e[2]) for e in self.bucket.layout)[name]
        size = int(np.prod(shape))
        buf = jnp.asarray(self.metadata)
        return jax.lax.slice(buf, (off,), (off + size,)).reshape(shape)

    def host_header(self) -> tuple[int, int, int, int] | None:
        """(sequences, tokens, chunks, chunk size) of the real bounds, read from
        a NumPy buffer; None for a buffer on the device (a read-back)."""
        if not isinstance(self.metadata, np.ndarray):
            return None
        off = self.bucket.offset("header")
        return tuple(int(x) for x in self.metadata[off:off + 4])

    def pad_tokens(self, x, axis: int = 1):
        """``x`` zero-padded along ``axis`` (the token axis: 1 for q, k, v, g
        ``[1, T, ...]`` and beta ``[1, T, HV]``) to ``bucket.max_tokens`` (NumPy
        in, NumPy out; jax in, jax out). With host metadata, x must hold the
        batch's real token count on that axis."""
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"axis={axis} is out of range for x of shape {tuple(x.shape)}")
        t = x.shape[axis]
        if t > self.bucket.max_tokens:
            raise ValueError(f"x has {t} tokens on axis {axis}, more than the bucket's "
                             f"max_tokens={self.bucket.max_tokens}")
        header = self.host_header()
        if header is not None:
            real = header[1]
            if t != real:
                raise ValueError(
                    f"x has {t} tokens on axis {axis} (shape {tuple(x.shape)}), the batch "
                    f"holds {real}; pass the real tokens (x of shape [1, {real}, ...] with "
                    "axis=1)")
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, self.bucket.max_tokens - t)
        return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"VarlenBatch is immutable ({name})")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"VarlenBatch is immutable ({name})")

    def __reduce__(self):
        # Through the constructor: frozen slots refuse the default state
        # restore, and an unpickled NumPy buffer is checked like any other.
        return (VarlenBatch, (self.metadata, self.bucket))

    def __repr__(self):
        return f"VarlenBatch({self.bucket}, metadata={type(self.metadata).__name__})"


@functools.lru_cache(maxsize=128)
def _buffer_of_lengths(lengths: tuple, bucket: Bucket | None, chunk_size: int):
    """(read-only metadata buffer, bucket) of VarlenBatch.from_lengths: the host
    build costs tens of microseconds per step, the lookup a few."""
    batch = VarlenBatch.build(SeqBounds.from_lengths(np.array(lengths, np.int64)), bucket,
                              chunk_size=chunk_size)
    batch.metadata.setflags(write=False)
    return batch.metadata, batch.bucket


def _flatten(batch):
    return (batch.metadata,), batch.bucket


def _unflatten(bucket, leaves):
    # No checks: jax rebuilds pytrees with placeholders (object(), None, tracers).
    batch = object.__new__(VarlenBatch)
    object.__setattr__(batch, "metadata", leaves[0])
    object.__setattr__(batch, "bucket", bucket)
    return batch


jax.tree_util.register_pytree_node(VarlenBatch, _flatten, _unflatten)


# --------------------------------------------------------------------------- #
# One view of either form for the backends.
# --------------------------------------------------------------------------- #


def num_seqs(varlen: SeqBounds | VarlenBatch) -> int:
    """Sequence slots: N for host bounds, the bucket's max_seqs for a batch."""
    return varlen.bucket.max_seqs if isinstance(varlen, VarlenBatch) else varlen.num_seqs


@dataclasses.dataclass(frozen=True, eq=False)
class KernelMetadata:
    """What a Triton launch needs from either form.

    buffer: the int32 metadata on the device (the program's one constant for
      host bounds; the runtime argument for a batch).
    off_cu, off_co, off_ct: offsets of cu_seqlens, chunk_offsets, chunk_table.
    num_seqs: sequence slots. seq_programs: grid rows of the per-sequence
      kernels: num_seqs, plus one for a batch, whose program writes o = 0 on
      the token rows past the real end.
    chunk_programs: grid rows of the chunk-parallel kernel (chunk slots).
    bucketed: whether the buffer is a batch's.
    uniform_len: host bounds whose sequences all have this one length (a dense
      batch, or a decode step of one token each): a kernel can then place
      sequence n at n * uniform_len without loading its bounds. None otherwise
      (a batch's bounds are device data).
    """

    buffer: jax.Array
    off_cu: int
    off_co: int
    off_ct: int
    num_seqs: int
    seq_programs: int
    chunk_programs: int
    bucketed: bool
    uniform_len: int | None = None

    @property
    def num_bounds(self) -> int:
        """(bos, eos) pairs in cu_seqlens (its length - 1, a batch's sentinel
        included): the kernels clamp a sequence id from the chunk table below it."""
        return self.seq_programs


def kernel_metadata(varlen: SeqBounds | VarlenBatch, chunk_size: int) -> KernelMetadata:
    """The metadata of ``varlen`` for kernels with chunks of ``chunk_size``
    (a batch must have been built for that chunk size; the API checks)."""
    if isinstance(varlen, VarlenBatch):
        b = varlen.bucket
        return KernelMetadata(
            buffer=jnp.asarray(varlen.metadata), off_cu=b.offset("cu_seqlens"),
            off_co=b.offset("chunk_offsets"), off_ct=b.offset("chunk_table"),
            num_seqs=b.max_seqs, seq_programs=b.max_seqs + 1, chunk_programs=b.max_chunks,
            bucketed=True,
        )
    packed = packed_metadata(varlen, chunk_size)
    lengths = varlen.lengths
    return KernelMetadata(
        buffer=jnp.asarray(packed.buffer),  # the one int32 constant of the program
        off_cu=packed.offset("cu_seqlens"), off_co=packed.offset("chunk_offsets"),
        off_ct=packed.offset("chunk_table"), num_seqs=varlen.num_seqs,
        seq_programs=varlen.num_seqs, chunk_programs=chunk_table(varlen, chunk_size).shape[0],
        bucketed=False,
        uniform_len=int(lengths[0]) if len(lengths) and np.all(lengths == lengths[0]) else None,
    )


def mask_padding(pool: state_pool.StatePool | None, varlen) -> state_pool.StatePool | None:
    """For a batch: the pool with the padded sequence slots' indices set to -1
    (no read, no write), from the real count in the metadata's header (on the
    device: no read-back). Host bounds have no padded slots."""
    if pool is None or not isinstance(varlen, VarlenBatch):
        return pool
    real = varlen.table("header")[0]
    slot = jnp.arange(varlen.bucket.max_seqs, dtype=jnp.int32)

    def live(idx):  # [N] or a verify's [N, W]
        if idx is None:
            return None
        inside = (slot < real).reshape((-1,) + (1,) * (idx.ndim - 1))
        return jnp.where(inside, idx, -1).astype(jnp.int32)

    return pool._replace(indices=live(pool.indices), write_indices=live(pool.write_indices))
