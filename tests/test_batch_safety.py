"""Memory safety of the bucketed form: host checks of a VarlenBatch's buffer,
and kernels that stay inside their arrays whatever a device buffer holds.

A NumPy buffer is checked on construction (every table against its bucket).
A device buffer is not (no read-back), so arbitrary int32 buffers go to
chunk_kda and fused_recurrent_kda as device data, on both backends, each batch
of them in a child process (a fault must fail the test, not end the run): the
Triton kernels run in the interpreter with every array between guard pages
(KDA_JAX_INTERPRET_GUARD), so an access outside an array faults. A valid
buffer must give the float32 reference's result (no token dropped); on the
XLA path an invalid one must give NaN.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_jax
from kda_jax import batch as batch_mod
from kda_jax.bounds import check_bucketed_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I32 = np.iinfo(np.int32)

def _batch(lengths, bucket=kda_jax.Bucket(4, 64, chunk_size=32)):
    return kda_jax.VarlenBatch.build(np.cumsum([0] + list(lengths)), bucket)


# --------------------------------------------------------------------------- #
# Host checks of a NumPy buffer.
# --------------------------------------------------------------------------- #


def test_buffer_of_another_bucket_is_refused():
    # Issue 17's reproducer: same buffer size, 67 tokens in a 64-token bucket.
    other = kda_jax.VarlenBatch.from_lengths([67], kda_jax.Bucket(4, 67))
    assert other.bucket.metadata_size == kda_jax.Bucket(4, 64).metadata_size
    with pytest.raises(ValueError, match=r"'header'.*header\[1\] \(tokens\)=67"):
        kda_jax.VarlenBatch(other.metadata, kda_jax.Bucket(4, 64))


def _offset(bucket, name):
    return bucket.offset(name)


# (what is changed, the table the error must name); lengths [3, 0, 40].
CORRUPTIONS = {
    "tokens past the bucket": (lambda m, b: m.__setitem__(1, 65), "'header'"),
    "chunk size": (lambda m, b: m.__setitem__(3, 64), "'header'"),
    "chunk count": (lambda m, b: m.__setitem__(2, 4), "'header'"),
    "tokens not cu_seqlens[N]": (lambda m, b: m.__setitem__(1, 42), "'cu_seqlens'"),
    "cu_seqlens[0]": (lambda m, b: m.__setitem__(_offset(b, "cu_seqlens"), 1), "'cu_seqlens'"),
    "cu_seqlens decreasing": (
        lambda m, b: m.__setitem__(_offset(b, "cu_seqlens") + 2, 2), "'cu_seqlens'"),
    "cu_seqlens padding": (
        lambda m, b: m.__setitem__(_offset(b, "cu_seqlens") + 4, 44), "'cu_seqlens'"),
    "cu_seqlens sentinel": (
        lambda m, b: m.__setitem__(_offset(b, "cu_seqlens") + 5, 0), "'cu_seqlens'"),
    "chunk_offsets": (
        lambda m, b: m.__setitem__(_offset(b, "chunk_offsets") + 2, 2), "'chunk_offsets'"),
    "chunk_offsets padding": (
        lambda m, b: m.__setitem__(_offset(b, "chunk_offsets") + 5, 9), "'chunk_offsets'"),
    "chunk_table sequence": (
        lambda m, b: m.__setitem__(_offset(b, "chunk_table"), 7), "'chunk_table'"),
    "chunk_table chunk index": (
        lambda m, b: m.__setitem__(_offset(b, "chunk_table") + 3, 5), "'chunk_table'"),
    "chunk_table padded row": (
        lambda m, b: m.__setitem__(_offset(b, "chunk_table") + 2 * 4, 0), "'chunk_table'"),
    "padding between tables": (lambda m, b: m.__setitem__(b.metadata_size - 1, 1), "padding"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_corrupted_table_is_named(case):
    good = _batch([3, 0, 40])
    bucket = good.bucket
    assert bucket.layout[-1][1] + 10 < bucket.metadata_size  # the last case hits padding
    change, name = CORRUPTIONS[case]
    bad = good.metadata.copy()
    change(bad, bucket)
    assert not np.array_equal(bad, good.metadata)
    with pytest.raises(ValueError, match=name):
        kda_jax.VarlenBatch(bad, bucket)


def test_bounds_past_a_buckets_max_len_are_refused():
    decode = kda_jax.Bucket(4, 4, max_len=1)
    loose = kda_jax.Bucket(4, 4)
    assert loose.metadata_size == decode.metadata_size
    buffer = kda_jax.VarlenBatch.build([0, 2, 3], loose).metadata
    with pytest.raises(ValueError, match="max_len=1"):
        kda_jax.VarlenBatch(buffer, decode)


def test_a_valid_host_buffer_is_accepted_as_it_is():
    good = _batch([3, 0, 40])
    again = kda_jax.VarlenBatch(good.metadata.copy(), good.bucket)
    np.testing.assert_array_equal(again.metadata, good.metadata)
    assert check_bucketed_metadata(good.metadata, good.bucket).lengths.tolist() == [3, 0, 40]


def test_built_buffers_are_not_checked_again(monkeypatch):
    # build and from_lengths make the buffer themselves: the serving step's
    # host cost stays the builder's (or the cache lookup's).
    def refuse(*args):
        raise AssertionError("a built buffer was checked again")

    monkeypatch.setattr(batch_mod, "check_bucketed_metadata", refuse)
    kda_jax.VarlenBatch.from_lengths([1, 2, 3], kda_jax.Bucket(4, 64, chunk_size=32))
    kda_jax.VarlenBatch.build([0, 5, 9], kda_jax.Bucket(4, 64, chunk_size=32))
    with pytest.raises(AssertionError, match="checked again"):
        kda_jax.VarlenBatch(_batch([1]).metadata.copy(), kda_jax.Bucket(4, 64, chunk_size=32))


def test_a_device_buffer_is_not_checked():
    bucket = kda_jax.Bucket(4, 64, chunk_size=32)
    garbage = jnp.full((bucket.metadata_size,), -7, jnp.int32)
    assert kda_jax.VarlenBatch(garbage, bucket).metadata is garbage


# --------------------------------------------------------------------------- #
# Pickling and copies.
# --------------------------------------------------------------------------- #


ROUND_TRIPS = {
    "pickle": lambda b: pickle.loads(pickle.dumps(b)),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
def test_round_trips(how, on_device):
    batch = kda_jax.VarlenBatch.from_lengths([2, 0, 5], kda_jax.Bucket(4, 64, chunk_size=32))
    if on_device:
        batch = jax.device_put(batch)
    again = ROUND_TRIPS[how](batch)
    assert isinstance(again, kda_jax.VarlenBatch)
    assert again.bucket == batch.bucket
    np.testing.assert_array_equal(np.asarray(again.metadata), np.asarray(batch.metadata))
    with pytest.raises(AttributeError):
        again.bucket = None


def test_an_unpickled_host_buffer_is_checked():
    batch = _batch([3, 0, 40])
    bad = batch.metadata.copy()
    bad[1] = 65
    blob = pickle.dumps(batch).replace(batch.metadata.tobytes(), bad.tobytes())
    with pytest.raises(ValueError, match="'header'"):
        pickle.loads(blob)


# --------------------------------------------------------------------------- #
# Device buffers: any int32 contents, in a child process.
# --------------------------------------------------------------------------- #

# The child: one process for every device-buffer test (its start and the
# compiles are paid once). It reads one request per line (a guard placement
# and int32 buffers), runs each buffer through both functions on both
# backends with the inputs of a fixed bucket, answers "done" or an assertion
# message, and names each call before making it, so that the last line of a
# child that died says which buffer and call faulted.
_CHILD = textwrap.dedent("""
    import json, os, sys, traceback
    import numpy as np
    import jax, jax.numpy as jnp
    import kda_jax
    from kda_jax.bounds import check_bucketed_metadata
    from kda_jax.testing import assert_close, make_inputs
    sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
    from test_xla_vs_reference import _spec_kda_f64

    spec = json.loads(sys.stdin.readline())
    bucket = kda_jax.Bucket(**spec["bucket"])
    nb, tb = bucket.max_seqs, bucket.max_tokens
    x = make_inputs(0, T=tb, H=1, K=16, V=16, N=nb)
    args = [jnp.asarray(a) for a in x.args()]
    h0 = jnp.asarray(x.initial_state)
    fns = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}
    extra = {"chunk": dict(chunk_size=bucket.chunk_size), "recurrent": {}}
    steps = {
        (name, impl): jax.jit(lambda q, k, v, g, beta, h0, batch, name=name, impl=impl: fns[name](
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=batch,
            implementation=impl, **extra[name]))
        for name in fns for impl in ("xla", "triton")
    }
    covered = np.zeros(bucket.metadata_size, bool)
    for _, off, shape in bucket.layout:
        covered[off:off + int(np.prod(shape))] = True

    def check(i, buf):
        try:  # the padding between tables is read by nobody
            bounds = check_bucketed_metadata(np.where(covered, buf, 0).astype(np.int32), bucket)
        except ValueError:
            bounds = None
        batch = kda_jax.VarlenBatch(jnp.asarray(buf), bucket)  # device data: not checked
        for (name, impl), step in steps.items():
            print("buffer", i, name, impl, "valid" if bounds else "invalid", buf.tolist(),
                  flush=True)
            o, ht = (np.asarray(a) for a in step(*args, h0, batch))
            if bounds is None:
                if impl == "xla":
                    assert np.isnan(o).all() and np.isnan(ht).all(), "xla: garbage passed silently"
                continue
            n, t = bounds.num_seqs, bounds.total_tokens
            ref_o, ref_ht = _spec_kda_f64(*(a[:, :t] for a in args), initial_state=h0[:n],
                                          cu_seqlens=bounds.cu_seqlens)
            assert_close(o[:, :t], ref_o, "float32", f"{name} {impl} o")
            assert_close(ht[:n], ref_ht, "float32", f"{name} {impl} final state")
            assert (o[:, t:] == 0).all(), f"{name} {impl}: o past the real tokens must be 0"
            np.testing.assert_array_equal(ht[n:], np.asarray(h0)[n:])

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        os.environ["KDA_JAX_INTERPRET_GUARD"] = request["guard"]
        try:
            for i, buf in enumerate(request["buffers"]):
                check(i, np.asarray(buf, np.int32))
            print("done", flush=True)
        except AssertionError:
            print("failed:", traceback.format_exc().replace(chr(10), " | "), flush=True)
""")

# The bucket of the device-buffer tests: two chunks of 32 per full-length
# sequence, and the size of Bucket(4, 67, chunk_size=32)'s buffer (the
# out-of-bounds reproducer at chunk size 32).
DEVICE_BUCKET = kda_jax.Bucket(4, 64, chunk_size=32)


class _Child:
    """The child process, started on first use and again after it dies."""

    def __init__(self):
        self.proc = None

    def run(self, buffers, guard="end"):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        request = dict(guard=guard, buffers=[np.asarray(b, np.int64).tolist() for b in buffers])
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        lines = []
        for line in self.proc.stdout:
            if line.startswith("done"):
                return
            if line.startswith("failed:"):
                raise AssertionError(f"{lines[-1] if lines else ''}\n{line}")
            lines.append(line.rstrip())
        code = self.proc.wait()
        died = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        self.proc = None
        raise AssertionError(f"the child {died} at: {lines[-1] if lines else '(start)'}")

    def _start(self):
        env = dict(os.environ, PYTHONPATH=ROOT, KDA_JAX_INTERPRET="1", TRITON_INTERPRET="1",
                   JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        b = DEVICE_BUCKET
        self.proc.stdin.write(json.dumps(dict(bucket=dict(
            max_seqs=b.max_seqs, max_tokens=b.max_tokens, chunk_size=b.chunk_size))) + "\n")
        self.proc.stdin.flush()
        ready = self.proc.stdout.readline()
        assert ready.startswith("ready"), f"the child did not start: {ready!r}"

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def child():
    c = _Child()
    yield c
    c.close()


def _adversarial(bucket):
    """Buffers aimed at each index the kernels take from the metadata: a valid
    buffer with one entry pushed out of its range, two filled with extremes,
    and the valid one."""
    good = kda_jax.VarlenBatch.build([0, 30, 33, 63], bucket).metadata
    cu, co, ct = (bucket.offset(x) for x in ("cu_seqlens", "chunk_offsets", "chunk_table"))
    out = []
    for pos, value in ((1, bucket.max_tokens + 3),  # header T past the arrays
                       (0, I32.max),  # header N
                       (cu + 3, I32.max), (cu + 2, -(2 ** 20)),  # eos / bos
                       (cu + bucket.max_seqs + 1, I32.max),  # the sentinel's end
                       (co + 2, I32.max), (co + 2, -5),  # c0: rows of gl
                       (ct + 2, -1), (ct + 2, bucket.max_seqs + 1),  # sequence id
                       (ct + 3, I32.max), (ct + 3, I32.min)):  # chunk index
        bad = good.copy()
        bad[pos] = value
        out.append(bad)
    out.append(np.full(bucket.metadata_size, I32.max, np.int32))
    out.append(np.full(bucket.metadata_size, I32.min, np.int32))
    out.append(good)
    return out


def test_issue_reproducer_on_device_is_memory_safe_and_not_silent(child):
    # Issue 17's buffer (67 tokens in a 64-token bucket of the same size) as
    # device data, at the chunk size of the child's bucket.
    other = kda_jax.VarlenBatch.from_lengths([67], kda_jax.Bucket(4, 67, chunk_size=32))
    assert other.bucket.metadata_size == DEVICE_BUCKET.metadata_size
    child.run([other.metadata], guard="end")


@pytest.mark.parametrize("guard", ["end", "start"])
def test_adversarial_device_buffers_are_memory_safe(child, guard):
    buffers = _adversarial(DEVICE_BUCKET)
    if guard == "start":  # the entries that point before an array
        buffers = [b for b in buffers if (b < 0).any()]
    child.run(buffers, guard=guard)


def _int32s():
    return st.one_of(
        st.integers(I32.min, I32.max),
        st.integers(-3, 70),
        st.sampled_from([I32.min, I32.min + 1, -1, I32.max - 1, I32.max, 2 ** 24, -(2 ** 24)]),
    )


@st.composite
def _buffers(draw, bucket=DEVICE_BUCKET):
    kind = draw(st.sampled_from(["valid", "mutated", "random"]))
    if kind == "random":
        return np.array(draw(st.lists(_int32s(), min_size=bucket.metadata_size,
                                      max_size=bucket.metadata_size)), np.int32)
    n = draw(st.integers(1, bucket.max_seqs))
    lengths = draw(st.lists(st.integers(0, bucket.max_tokens), min_size=n, max_size=n))
    while sum(lengths) > bucket.max_tokens:
        lengths[lengths.index(max(lengths))] //= 2
    buffer = kda_jax.VarlenBatch.build(np.cumsum([0] + lengths), bucket).metadata.copy()
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            buffer[draw(st.integers(0, bucket.metadata_size - 1))] = draw(_int32s())
    return buffer


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(buffers=st.lists(_buffers(), min_size=2, max_size=2),
       guard=st.sampled_from(["end", "start"]))
def test_fuzzed_device_buffers_are_memory_safe(child, buffers, guard):
    child.run(buffers, guard=guard)


# --------------------------------------------------------------------------- #
# The guard mode itself.
# --------------------------------------------------------------------------- #

_OUT_OF_BOUNDS = textwrap.dedent('''
    import sys
    import numpy as np
    import jax
    import jax.numpy as jnp
    import triton
    import triton.language as tl
    from kda_jax.triton.launch import launch

    @triton.jit
    def read_one(x, i, y):
        tl.store(y, tl.load(x + i))

    for i in map(int, sys.argv[1:]):
        y, = launch(read_one, jnp.arange(5, dtype=jnp.float32), i, grid=(1, 1, 1),
                    out_shape=[jax.ShapeDtypeStruct((1,), jnp.float32)], name="read_one")
        print("read", i, float(np.asarray(y)[0]), flush=True)
''')


@pytest.mark.parametrize("guard,inside,outside", [("end", 4, 5), ("start", 0, -1)])
def test_guard_mode_faults_just_outside_an_array(tmp_path, guard, inside, outside):
    # The element next to the array's guarded end is read; one further faults.
    script = tmp_path / "read_one.py"
    script.write_text(_OUT_OF_BOUNDS)
    env = dict(os.environ, PYTHONPATH=ROOT, KDA_JAX_INTERPRET="1", TRITON_INTERPRET="1",
               KDA_JAX_INTERPRET_GUARD=guard, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), str(inside), str(outside)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert f"read {inside} {float(inside)}" in proc.stdout, proc.stderr[-2000:]
    assert f"read {outside}" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-2000:])


def test_unknown_guard_mode_is_named(monkeypatch):
    from kda_jax.triton.launch import guard_mode

    monkeypatch.setenv("KDA_JAX_INTERPRET_GUARD", "yes")
    with pytest.raises(ValueError, match="KDA_JAX_INTERPRET_GUARD='yes'"):
        guard_mode()
