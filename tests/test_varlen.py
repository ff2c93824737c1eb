"""Variable-length (packed) calls against the reference run per sequence.

The expected values come from slicing each sequence out of the packed inputs,
running the float32 reference on it alone (B = 1, no cu_seqlens) and
concatenating, so the reference's own varlen path is checked too.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax import SeqBounds
from kda_jax.testing import make_inputs

IMPLS = {"chunk": kda_jax.chunk_kda, "recurrent": kda_jax.fused_recurrent_kda}
# Empty sequences first, in the middle and last; length 1; longer than several
# chunks of 32 and of 64.
MIXED = (0, 5, 0, 1, 70, 0, 130, 1, 0)


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(seed, lengths, *, H=1, HV=2, K=32, V=32, **kw):
    return make_inputs(seed, B=1, T=int(sum(lengths)), H=H, HV=HV, K=K, V=V,
                       N=len(lengths), **kw)


def _per_sequence_reference(x, lengths, *, state_v_first=False, **kw):
    """(o [1, T, HV, V], final [N, ...]) from the reference run on each sequence alone."""
    cu = _cu(lengths)
    hv, vd, kd = x.v.shape[2], x.v.shape[3], x.q.shape[3]
    outs, finals = [], []
    for i in range(len(lengths)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        h0 = None if x.initial_state is None else x.initial_state[i : i + 1]
        if hi == lo:
            shape = (hv, vd, kd) if state_v_first else (hv, kd, vd)
            finals.append(np.zeros(shape, np.float32) if h0 is None else h0[0])
            continue
        part = lambda a: a[:, lo:hi]
        o_i, f_i = kda_jax.naive_recurrent_kda(
            *map(part, x.args()), initial_state=h0, output_final_state=True,
            state_v_first=state_v_first, **kw,
        )
        outs.append(np.asarray(o_i))
        finals.append(np.asarray(f_i)[0])
    o = np.concatenate(outs, axis=1) if outs else np.zeros((1, 0, hv, vd), np.float32)
    return o, np.stack(finals)


def _check(o, final, x, lengths, ref_o, ref_final, check_close, what, extreme_gates=False):
    assert o.shape == ref_o.shape and o.dtype == x.q.dtype
    assert final.shape == ref_final.shape and final.dtype == jnp.float32
    assert np.std(ref_o) > 1e-2  # not a trivial case
    # o by the input dtype; the state is float32 from the same input values.
    # Gates of -1000: testing.TOLERANCES["float32-extreme-gates"] (documented there).
    f32 = "float32-extreme-gates" if extreme_gates else "float32"
    check_close(o, ref_o, "bfloat16" if x.q.dtype == jnp.bfloat16 else f32, f"o varlen {what}")
    check_close(final, ref_final, f32, f"final varlen {what}")
    lengths = np.asarray(lengths)
    if x.initial_state is not None:
        # An empty sequence's final state is its initial state, bit for bit ...
        np.testing.assert_array_equal(np.asarray(final)[lengths == 0],
                                      x.initial_state[lengths == 0])
        # ... and the others really moved.
        moved = np.abs(np.asarray(final) - x.initial_state).max(axis=(1, 2, 3))
        assert np.all(moved[lengths > 0] > 1e-3)


_MIXED_CACHE: dict = {}


def _mixed():
    if not _MIXED_CACHE:
        x = _inputs(1, MIXED)
        _MIXED_CACHE["x"] = x
        _MIXED_CACHE["ref"] = _per_sequence_reference(x, MIXED)
    return _MIXED_CACHE["x"], _MIXED_CACHE["ref"]


FORMS = {
    "numpy": lambda cu: cu,
    "numpy-int64": lambda cu: cu.astype(np.int64),
    "list": lambda cu: cu.tolist(),
    "tuple": lambda cu: tuple(int(c) for c in cu),
    "SeqBounds": SeqBounds,
}


@pytest.mark.parametrize(
    "impl,form,chunk_size",
    [("chunk", f, 64) for f in FORMS]
    + [("chunk", "numpy", 32), ("chunk", "SeqBounds", 32)]
    + [("recurrent", f, None) for f in FORMS],
)
def test_mixed_lengths_all_bound_forms(impl, form, chunk_size, check_close):
    x, (ref_o, ref_final) = _mixed()
    kw = {} if chunk_size is None else dict(chunk_size=chunk_size)
    o, final = IMPLS[impl](*x.args(), initial_state=x.initial_state, output_final_state=True,
                           cu_seqlens=FORMS[form](_cu(MIXED)), implementation="xla", **kw)
    _check(o, final, x, MIXED, ref_o, ref_final, check_close, f"{impl} {form}")


def test_reference_varlen_matches_per_sequence(check_close):
    x, (ref_o, ref_final) = _mixed()
    o, final = kda_jax.naive_recurrent_kda(*x.args(), initial_state=x.initial_state,
                                           output_final_state=True, cu_seqlens=_cu(MIXED))
    _check(o, final, x, MIXED, ref_o, ref_final, check_close, "reference")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_state", [True, False], ids=["h0", "no-h0"])
def test_all_sequences_empty(impl, with_state):
    lengths = (0, 0, 0)
    x = _inputs(2, lengths, with_state=with_state)
    assert x.q.shape[1] == 0
    o, final = IMPLS[impl](*x.args(), initial_state=x.initial_state, output_final_state=True,
                           cu_seqlens=_cu(lengths), implementation="xla")
    assert o.shape == (1, 0, 2, 32) and o.dtype == x.q.dtype
    assert final.shape == (3, 2, 32, 32) and final.dtype == jnp.float32
    expected = x.initial_state if with_state else np.zeros((3, 2, 32, 32), np.float32)
    np.testing.assert_array_equal(np.asarray(final), expected)
    ref_o, ref_final = kda_jax.naive_recurrent_kda(
        *x.args(), initial_state=x.initial_state, output_final_state=True,
        cu_seqlens=_cu(lengths))
    assert ref_o.shape == (1, 0, 2, 32)
    np.testing.assert_array_equal(np.asarray(ref_final), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_batch_with_no_tokens(impl):
    x = make_inputs(3, B=2, T=0, H=1, HV=2, K=32, V=32)
    o, final = IMPLS[impl](*x.args(), initial_state=x.initial_state, output_final_state=True,
                           implementation="xla")
    assert o.shape == (2, 0, 2, 32)
    np.testing.assert_array_equal(np.asarray(final), x.initial_state)


LENGTH_SETS = {
    "decode-ones": (1, 1, 1, 1, 1),
    "one-long": (200,),
    "exact-chunks": (64, 0, 32, 128),
    "one-then-long": (1, 0, 0, 97),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", LENGTH_SETS)
def test_length_sets(name, impl, check_close):
    lengths = LENGTH_SETS[name]
    x = _inputs(4, lengths)
    ref_o, ref_final = _per_sequence_reference(x, lengths)
    o, final = IMPLS[impl](*x.args(), initial_state=x.initial_state, output_final_state=True,
                           cu_seqlens=_cu(lengths), implementation="xla")
    _check(o, final, x, lengths, ref_o, ref_final, check_close, f"{impl} {name}")


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_with_every_transform_bf16(impl, check_close):
    """Flags, GVA, V-first states and bf16 together, packed; no initial state."""
    lengths = (0, 33, 1, 0, 70)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    x = _inputs(5, lengths, H=2, HV=4, K=40, V=24, dtype=jnp.bfloat16, normalized_k=False,
                raw_gate=True, beta_logits=True, with_state=False)
    gate = dict(A_log=x.A_log, dt_bias=x.dt_bias)
    ref_o, ref_final = _per_sequence_reference(x, lengths, state_v_first=True, **flags, **gate)
    kw = dict(chunk_size=32) if impl == "chunk" else {}
    o, final = IMPLS[impl](*x.args(), output_final_state=True, state_v_first=True,
                           cu_seqlens=_cu(lengths), implementation="xla", **flags, **gate, **kw)
    assert final.shape == (5, 4, 24, 40)
    _check(o, final, x, lengths, ref_o, ref_final, check_close, f"{impl} flags")
    # Sequences without tokens and without an initial state end at zero.
    assert np.all(np.asarray(final)[[0, 3]] == 0)


@pytest.mark.parametrize("impl,chunk_size", [("chunk", 32), ("chunk", 64), ("recurrent", None)])
def test_gate_floor_minus_1000(impl, chunk_size, check_close):
    """Every 7th token decays by exp(-1000): finite, and matching the reference."""
    lengths = (3, 0, 90, 64, 17)
    x = _inputs(6, lengths, gate_floor=-1000.0)
    assert np.any(x.g == -1000.0)
    ref_o, ref_final = _per_sequence_reference(x, lengths)
    assert np.all(np.isfinite(ref_o)) and np.all(np.isfinite(ref_final))
    kw = dict(chunk_size=chunk_size) if impl == "chunk" else {}
    o, final = IMPLS[impl](*x.args(), initial_state=x.initial_state, output_final_state=True,
                           cu_seqlens=_cu(lengths), implementation="xla", **kw)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(final)))
    _check(o, final, x, lengths, ref_o, ref_final, check_close, f"{impl} gate-1000",
           extreme_gates=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_equals_dense_batch(impl):
    """B equal-length sequences packed along T give the dense batch's results."""
    x = make_inputs(7, B=3, T=37, H=1, HV=2, K=32, V=32)
    packed = [a.reshape((1, 3 * 37) + a.shape[2:]) for a in x.args()]
    fn = IMPLS[impl]
    o_d, f_d = fn(*x.args(), initial_state=x.initial_state, output_final_state=True,
                  implementation="xla")
    o_p, f_p = fn(*packed, initial_state=x.initial_state, output_final_state=True,
                  cu_seqlens=[0, 37, 74, 111], implementation="xla")
    np.testing.assert_allclose(np.asarray(o_p).reshape(o_d.shape), np.asarray(o_d),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(f_p), np.asarray(f_d), rtol=1e-5, atol=1e-6)
