"""The varlen metadata loads shared by every kernel, clamped.

A bucketed batch's metadata buffer is runtime data that the host cannot check
without a read-back, so nothing read from it may steer a load or a store out
of an array, whatever int32 values it holds. These helpers clamp each index
they return (a few scalar ops per program, none in the token or chunk loops):

* a sequence id from the chunk table to [0, n_bounds), n_bounds being the
  (bos, eos) pairs that cu_seqlens holds (its length - 1);
* bos and eos to 0 <= bos <= eos <= n_tokens (the token rows of the arrays);
* a chunk index within a sequence to [0, cdiv(eos - bos, BT)], so that its
  first row stays within n_tokens + BT (no int32 overflow);
* a sequence's first row of the per-chunk arrays (chunk_offsets) so that its
  chunks fall in [0, n_chunk_rows), and its chunk count to n_chunk_rows.

For metadata built by kda_jax.bounds every clamp is the identity.
"""

import triton
import triton.language as tl


@triton.jit
def seq_span(meta, off_cu, i_n, n_tokens):
    """(bos, eos) of sequence i_n (an index into cu_seqlens at ``off_cu`` whose
    i_n + 1 exists), clamped to 0 <= bos <= eos <= n_tokens."""
    bos = tl.load(meta + off_cu + i_n)
    eos = tl.load(meta + off_cu + i_n + 1)
    bos = tl.minimum(tl.maximum(bos, 0), n_tokens)
    eos = tl.minimum(tl.maximum(eos, bos), n_tokens)
    return bos, eos


@triton.jit
def chunk_span(meta, off_cu, off_ct, i_c, n_bounds, n_tokens, BT: tl.constexpr):
    """(t0, eos) of chunk-table row i_c: its first token row and its
    sequence's end. The chunk's rows are [t0, min(t0 + BT, eos)); none when
    t0 >= eos (a padded row, or a chunk index past its sequence)."""
    i_n = tl.load(meta + off_ct + 2 * i_c)
    i_j = tl.load(meta + off_ct + 2 * i_c + 1)
    i_n = tl.minimum(tl.maximum(i_n, 0), n_bounds - 1)
    bos, eos = seq_span(meta, off_cu, i_n, n_tokens)
    i_j = tl.minimum(tl.maximum(i_j, 0), tl.cdiv(eos - bos, BT))
    return bos + i_j * BT, eos


@triton.jit
def seq_chunks(meta, off_co, i_n, bos, eos, n_chunk_rows, BT: tl.constexpr):
    """(c0, n_chunks) of sequence i_n spanning [bos, eos): its chunks are rows
    c0 .. c0 + n_chunks - 1 of the per-chunk arrays ([n_chunk_rows, ...]),
    clamped into them; past n_chunk_rows a sequence's last chunks are left out."""
    c0 = tl.load(meta + off_co + i_n)
    n_chunks = tl.minimum(tl.cdiv(eos - bos, BT), n_chunk_rows)
    c0 = tl.minimum(tl.maximum(c0, 0), n_chunk_rows - n_chunks)
    return c0, n_chunks
