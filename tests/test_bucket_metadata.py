"""The bucketed varlen form on the host: Bucket, bucketed_metadata, VarlenBatch.

The padded tables must keep every kernel program harmless (padded chunk rows
point at an always-empty sentinel sequence), the layout must depend on the
bucket alone, and the bucket must hold every bounds it claims to.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import Bucket, SeqBounds, VarlenBatch
from kda_jax.bounds import (bucketed_metadata, chunk_offsets, chunk_table, most_chunks,
                            packed_metadata)


def _views(packed):
    return {name: packed.view(name) for name, _, _ in packed.layout}


@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("lens", [[5, 0, 1, 70], [0, 0, 0], [1], [64, 64, 1, 0, 129]])
def test_tables_are_the_static_ones_padded(lens, chunk):
    bounds = SeqBounds.from_lengths(lens)
    bucket = Bucket(max_seqs=8, max_tokens=512, chunk_size=chunk)
    t = _views(bucketed_metadata(bounds, bucket))
    n, total, nb = len(lens), bounds.total_tokens, 8
    nc = chunk_table(bounds, chunk).shape[0]
    assert t["header"].tolist() == [n, total, nc, chunk]
    # The prefix is exactly what the static form holds.
    static = _views(packed_metadata(bounds, chunk))
    np.testing.assert_array_equal(t["cu_seqlens"][: n + 1], static["cu_seqlens"])
    np.testing.assert_array_equal(t["chunk_offsets"][: n + 1], static["chunk_offsets"])
    np.testing.assert_array_equal(t["chunk_table"][:nc], static["chunk_table"])
    # Padding: empty sequences at T, the sentinel N_b empty, padded chunk rows at it.
    assert t["cu_seqlens"].shape == (nb + 2,)
    assert (t["cu_seqlens"][n:] == total).all()
    assert (t["chunk_offsets"][n:] == nc).all()
    assert (t["chunk_table"][nc:] == [nb, 0]).all()
    assert t["chunk_table"].shape == (most_chunks(nb, 512, chunk), 2)


def test_sentinel_is_empty_when_the_bucket_is_full():
    """N == max_seqs and T == max_tokens: no padded sequence or token, and the
    padded chunk rows (the bucket's chunk capacity exceeds this bounds' chunks)
    still point at an empty sequence."""
    bucket = Bucket(max_seqs=3, max_tokens=130)
    t = _views(bucketed_metadata([0, 1, 2, 130], bucket))
    cu = t["cu_seqlens"]
    assert cu.tolist() == [0, 1, 2, 130, 130]
    assert cu[4] == cu[3]  # sequence 3 (the sentinel) is empty
    assert (t["chunk_table"][4:] == [3, 0]).all()  # 4 real chunks; capacity 5


def test_layout_depends_on_the_bucket_only():
    bucket = Bucket(max_seqs=16, max_tokens=4096)
    rng = np.random.default_rng(0)
    layouts = set()
    for _ in range(20):
        n = int(rng.integers(1, 17))
        lens = rng.multinomial(int(rng.integers(0, 4097)), np.ones(n) / n)
        packed = bucketed_metadata(SeqBounds.from_lengths(lens), bucket)
        layouts.add(packed.layout)
        assert packed.buffer.shape == (bucket.metadata_size,)
        assert packed.buffer.dtype == np.int32
    assert layouts == {bucket.layout}
    for _, offset, _ in bucket.layout:
        assert offset % 4 == 0  # 16-byte aligned blocks


@pytest.mark.parametrize("chunk", [32, 64])
def test_most_chunks_is_a_tight_bound(chunk):
    for seqs, tokens in itertools.product([1, 2, 5, 16], [1, 7, 64, 65, 300]):
        bound = most_chunks(seqs, tokens, chunk)
        # Reached: k - 1 one-token sequences and one long one.
        k = min(seqs, tokens)
        worst = SeqBounds.from_lengths([1] * (k - 1) + [tokens - (k - 1)])
        assert chunk_table(worst, chunk).shape[0] == bound
        rng = np.random.default_rng(seqs * 1000 + tokens)
        for _ in range(30):
            n = int(rng.integers(1, seqs + 1))
            lens = rng.multinomial(int(rng.integers(0, tokens + 1)), np.ones(n) / n)
            assert chunk_table(SeqBounds.from_lengths(lens), chunk).shape[0] <= bound


def test_bucket_is_normalized_and_hashable():
    a = Bucket(16, 4096)
    b = Bucket(max_seqs=np.int64(16), max_tokens=4096, chunk_size=64, max_chunks=79)
    assert a == b and hash(a) == hash(b) and a.max_chunks == 79
    assert Bucket(16, 4096, max_chunks=10_000).max_chunks == 79  # capped at what can occur
    assert Bucket(16, 4096, chunk_size=32) != a


def test_fit_powers_of_two_and_candidates():
    assert Bucket.fit([0, 1, 1, 1100, 2400]) == Bucket(4, 4096)
    assert Bucket.fit([0, 3], min_seqs=8, min_tokens=64) == Bucket(8, 64)
    assert Bucket.fit([0, 3], chunk_size=32).chunk_size == 32
    small, large = Bucket(4, 256), Bucket(32, 8192)
    assert Bucket.fit([0, 10, 20], candidates=[small, large]) == small
    assert Bucket.fit([0, 300], candidates=[small, large]) == large
    with pytest.raises(ValueError, match=r"no bucket in candidates holds .*N=1, T=9000"):
        Bucket.fit([0, 9000], candidates=[small, large])
    with pytest.raises(TypeError, match=r"candidates must hold kda_jax.Bucket values"):
        Bucket.fit([0, 3], candidates=[(4, 256)])


BUCKET_ERRORS = [
    (dict(max_seqs=0, max_tokens=64), r"max_seqs=0 must be a positive int"),
    (dict(max_seqs=4, max_tokens=-1), r"max_tokens=-1 must be a positive int"),
    (dict(max_seqs=True, max_tokens=64), r"max_seqs=True must be a positive int"),
    (dict(max_seqs=4, max_tokens=2**31), r"max_tokens=2147483648 does not fit in int32"),
    (dict(max_seqs=4, max_tokens=64, chunk_size=16), r"chunk_size=16 must be 32 or 64"),
    (dict(max_seqs=4, max_tokens=64, max_chunks=0), r"max_chunks=0 must be a positive int"),
]


@pytest.mark.parametrize("kw,match", BUCKET_ERRORS)
def test_bad_bucket(kw, match):
    with pytest.raises(ValueError, match=match):
        Bucket(**kw)


@pytest.mark.parametrize("cu,match", [
    ([0, 1, 2, 3, 4, 5], r"has 5 sequences, more than the bucket's 4"),
    ([0, 100, 300], r"has 300 tokens, more than the bucket's 256"),
])
def test_bounds_outside_the_bucket(cu, match):
    with pytest.raises(ValueError, match=match + r".*pick a larger bucket"):
        VarlenBatch.build(cu, Bucket(4, 256))


def test_a_smaller_chunk_capacity_is_checked():
    bucket = Bucket(4, 256, max_chunks=2)
    VarlenBatch.build([0, 64, 128], bucket)
    with pytest.raises(ValueError, match=r"has 3 chunks of 64, more than the bucket's 2"):
        VarlenBatch.build([0, 64, 65, 128], bucket)


def test_batch_is_a_pytree_with_one_int32_leaf():
    bucket = Bucket(8, 128)
    a = VarlenBatch.build([0, 5, 5, 70], bucket)
    b = VarlenBatch.from_lengths([1, 1, 1, 1, 100], bucket)
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b  # the bucket is the only static part
    assert len(leaves_a) == 1 and leaves_a[0].dtype == np.int32
    assert leaves_a[0].shape == (bucket.metadata_size,)
    moved = jax.device_put(a)  # the one host-to-device transfer
    assert isinstance(moved, VarlenBatch) and moved.bucket == bucket
    assert isinstance(moved.metadata, jax.Array)
    np.testing.assert_array_equal(np.asarray(moved.table("cu_seqlens"))[:4], [0, 5, 5, 70])
    assert VarlenBatch.build([0, 3]).bucket == Bucket(1, 4)  # default: Bucket.fit


def test_batch_checks_its_metadata():
    bucket = Bucket(4, 64)
    with pytest.raises(ValueError, match=r"metadata must be int32 \[\d+\] for Bucket"):
        VarlenBatch(np.zeros(3, np.int32), bucket)
    with pytest.raises(ValueError, match=r"metadata must be int32.*got int64"):
        VarlenBatch(np.zeros(bucket.metadata_size, np.int64), bucket)
    with pytest.raises(TypeError, match=r"metadata must be an int32 array, got list"):
        VarlenBatch([0] * bucket.metadata_size, bucket)
    with pytest.raises(TypeError, match=r"bucket must be a kda_jax.Bucket, got tuple"):
        VarlenBatch(np.zeros(bucket.metadata_size, np.int32), (4, 64))
    batch = VarlenBatch.build([0, 3], bucket)
    with pytest.raises(Exception, match="immutable"):
        batch.bucket = Bucket(8, 64)


def test_pad_tokens():
    batch = VarlenBatch.build([0, 3, 5], Bucket(2, 8))
    x = np.ones((1, 5, 2), np.float32)
    padded = batch.pad_tokens(x)
    assert padded.shape == (1, 8, 2) and isinstance(padded, np.ndarray)
    assert padded[:, 5:].sum() == 0 and padded[:, :5].sum() == 10
    assert isinstance(batch.pad_tokens(jnp.asarray(x)), jax.Array)
    with pytest.raises(ValueError, match=r"x has 9 tokens on axis 1, more than the bucket's"):
        batch.pad_tokens(np.ones((1, 9, 2)))
    with pytest.raises(ValueError, match=r"x has 6 tokens on axis 1 .*the batch holds 5"):
        batch.pad_tokens(np.ones((1, 6, 2)))
    with pytest.raises(ValueError, match=r"x has 2 tokens on axis 1 \(shape \(5, 2, 4\)\)"):
        batch.pad_tokens(np.ones((5, 2, 4)))  # no batch axis: axis 1 is the heads
    with pytest.raises(ValueError, match=r"axis=3 is out of range"):
        batch.pad_tokens(x, axis=3)
    # A batch on the device: its real count is device data, not checked.
    assert jax.device_put(batch).pad_tokens(np.ones((1, 6, 2))).shape == (1, 8, 2)


def test_device_bounds_error_names_the_bucketed_form():
    x = kda_jax.testing.make_inputs(0, T=4, H=1, K=8, V=8)
    with pytest.raises(TypeError, match=r"cu_seqlens is a .*device data.*VarlenBatch.build"):
        kda_jax.chunk_kda(*x.args(), cu_seqlens=jnp.asarray([0, 4]))
    with pytest.raises(TypeError, match=r"a VarlenBatch \(the bucketed form\) is taken by "):
        Bucket.fit(VarlenBatch.build([0, 4]))


def test_host_tables_stay_cached_per_bounds():
    """The bucketed builder reuses the static form's per-bounds cache."""
    bounds = SeqBounds.from_lengths([3, 70])
    before = chunk_offsets.cache_info().hits
    for _ in range(3):
        bucketed_metadata(bounds, Bucket(4, 128))
    assert chunk_offsets.cache_info().hits > before


@pytest.mark.parametrize("lens, uniform", [
    ([1] * 5, 1), ([64, 64, 64], 64), ([0, 0], 0), ([1, 2], None), ([3, 0, 3], None)])
def test_kernel_metadata_names_a_uniform_length(lens, uniform):
    """Host bounds of one length let the decode kernel skip its bound loads."""
    from kda_jax.batch import kernel_metadata

    bounds = SeqBounds.from_lengths(np.array(lens, np.int64))
    assert kernel_metadata(bounds, 64).uniform_len == uniform
    batch = VarlenBatch.from_lengths(lens, Bucket(8, 256))  # device bounds: never uniform
    assert kernel_metadata(batch, 64).uniform_len is None


def test_from_lengths_reuses_a_read_only_buffer():
    bucket = Bucket(8, 64)
    a = VarlenBatch.from_lengths([1] * 5, bucket)
    b = VarlenBatch.from_lengths(np.ones(5, np.int32), bucket)
    assert a.metadata is b.metadata and not a.metadata.flags.writeable
    np.testing.assert_array_equal(a.metadata, VarlenBatch.build([0, 1, 2, 3, 4, 5], bucket).metadata)
    c = VarlenBatch.from_lengths([1, 2, 1, 1, 1], bucket)
    assert c.metadata is not a.metadata and (c.metadata[1], a.metadata[1]) == (6, 5)  # tokens
    # Not integers: named, not rounded into a cached entry.
    with pytest.raises(TypeError, match=r"lengths must hold integers"):
        VarlenBatch.from_lengths([1.5, 2.0], bucket)
    with pytest.raises(ValueError, match=r"lengths must be >= 0"):
        VarlenBatch.from_lengths([3, -1], bucket)


def test_max_len_is_checked():
    with pytest.raises(ValueError, match=r"max_len=0 must be a positive int"):
        Bucket(4, 8, max_len=0)
    decode = Bucket(4, 8, max_len=1)
    assert decode.why_not([0, 1, 1, 2]) is None
    assert "longer than the bucket's max_len=1" in decode.why_not([0, 2, 3])
    assert Bucket(4, 8).why_not([0, 2, 3]) is None
