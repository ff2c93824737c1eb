"""The correctness suite every backend runs: chunk_kda and fused_recurrent_kda
against the float32 reference on the cases of :data:`kda_jax.testing.CASES`,
and chunk_kda's gradients against autodiff of that reference on its gradient
cases (``Case.grad``).

A backend's test module subclasses :class:`ReferenceSuite` and names its
``implementation``, which cases it takes (:meth:`ReferenceSuite.takes`,
:meth:`ReferenceSuite.takes_recurrent`, :meth:`ReferenceSuite.takes_grad`) and
its bars where they differ from the input dtype's
(:meth:`ReferenceSuite.state_tolerance`, :meth:`ReferenceSuite.grad_tolerance`).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax.testing import CASES, GRAD_TOLERANCES, Case

_REFERENCE: dict[str, tuple] = {}
_REFERENCE_GRADS: dict[str, tuple] = {}


def reference(case: Case):
    """(inputs, reference o, reference final state), computed once per case."""
    if case.id not in _REFERENCE:
        x = case.make()
        o, final = kda_jax.naive_recurrent_kda(*x.args(), **case.kwargs(x))
        _REFERENCE[case.id] = (x, np.asarray(o), None if final is None else np.asarray(final))
    return _REFERENCE[case.id]


def _loss(fn, case: Case, x, w_o, w_f, out_dtype, **extra):
    """sum(o * w_o) + sum(final_state * w_f) as a function of the arrays named
    by ``case.grad`` (o rounded to ``out_dtype`` first: a 16-bit o's
    cotangent is itself 16-bit, for the API and the reference alike), with
    (o, final_state) as auxiliary outputs; and those arrays."""
    arrays = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, initial_state=x.initial_state,
                  A_log=x.A_log, dt_bias=x.dt_bias)

    def loss(params):
        a = {**arrays, **params}
        kw = case.kwargs(x)
        kw.update({n: a[n] for n in ("initial_state", "A_log", "dt_bias") if n in kw})
        o, final = fn(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw, **extra)
        total = jnp.sum(o.astype(out_dtype).astype(jnp.float32) * w_o)
        return total + jnp.sum(final * w_f), (o, final)

    return loss, {n: arrays[n] for n in case.grad}


def reference_grads(case: Case):
    """(inputs, w_o, w_f, gradients): autodiff of the float32 reference's
    weighted loss (random weights seeded by the case, so that every output
    and state element carries its own cotangent), computed once per case."""
    if case.id not in _REFERENCE_GRADS:
        x, ref_o, ref_final = reference(case)
        rng = np.random.default_rng(zlib.crc32(case.id.encode()) + 1)
        w_o = rng.standard_normal(ref_o.shape).astype(np.float32)
        w_f = rng.standard_normal(ref_final.shape).astype(np.float32)
        x32 = dataclasses.replace(x, **{
            n: np.asarray(getattr(x, n), np.float32) for n in ("q", "k", "v", "g", "beta")})
        loss, params = _loss(kda_jax.naive_recurrent_kda, case, x32, w_o, w_f, x.q.dtype)
        grads, _ = jax.jit(jax.grad(loss, has_aux=True))(params)
        _REFERENCE_GRADS[case.id] = (x, w_o, w_f, grads)
    return _REFERENCE_GRADS[case.id]


def case_grads(case: Case, implementation: str, fn=kda_jax.chunk_kda, **extra):
    """(gradients, (o, final_state)) of the case's weighted loss through ``fn``
    (chunk_kda at the case's chunk size, or fused_recurrent_kda) on
    ``implementation``."""
    x, w_o, w_f, _ = reference_grads(case)
    if fn is kda_jax.chunk_kda:
        extra = dict(extra, chunk_size=case.C)
    loss, params = _loss(fn, case, x, w_o, w_f, x.q.dtype, implementation=implementation,
                         **extra)
    return jax.jit(jax.grad(loss, has_aux=True))(params)


class ReferenceSuite:
    """Subclass as ``Test<Backend>`` with ``implementation`` set."""

    implementation: str = ""

    @classmethod
    def takes(cls, case: Case) -> bool:
        """Whether this backend runs ``case`` (default: all but the GPU sizes)."""
        return "big" not in case.tags

    @classmethod
    def takes_recurrent(cls, case: Case) -> bool:
        """Whether this backend runs fused_recurrent_kda on ``case`` too."""
        return cls.takes(case)

    @classmethod
    def takes_grad(cls, case: Case) -> bool:
        """Whether this backend runs chunk_kda's gradients on ``case`` (a
        gradient case, ``case.grad``, that it takes)."""
        return cls.takes(case)

    @classmethod
    def state_tolerance(cls, case: Case) -> str:
        """The TOLERANCES entry of the final state's dtype: "float32" for a
        path that computes the state in float32 from the inputs' values."""
        return "float32"

    @classmethod
    def grad_tolerance(cls, case: Case, name: str) -> float:
        """The relative RMS bar of the gradient of ``name``
        (testing.GRAD_TOLERANCES by input dtype)."""
        return GRAD_TOLERANCES[case.dtype][name]

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            name, cls = metafunc.function.__name__, metafunc.cls
            if name == "test_grad":
                cases = [c for c in CASES if c.grad and cls.takes_grad(c)]
            else:
                takes = cls.takes_recurrent if name == "test_fused_recurrent_kda" else cls.takes
                cases = [c for c in CASES if not c.grad and takes(c)]
            cases = cases or [pytest.param(
                None, marks=pytest.mark.skip(reason=f"{cls.__name__} takes no case for this "
                                                    "test here"), id="none")]
            metafunc.parametrize("case", cases, ids=str)

    def _check_outputs(self, case: Case, o, final, what: str, check_close):
        x, ref_o, ref_final = reference(case)
        kw = case.kwargs(x)
        hv = case.HV or case.H
        n = case.B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
        assert o.shape == (case.B, case.T, hv, case.V)
        assert o.dtype == x.q.dtype
        assert np.std(ref_o) > 1e-2  # the case is not trivial: the reference output varies
        check_close(o, ref_o, case.tolerance("o"), f"o {what}")
        if not kw["output_final_state"]:
            assert final is None and ref_final is None
            return
        shape = (n, hv, case.V, case.K) if kw.get("state_v_first") else (n, hv, case.K, case.V)
        assert final.shape == shape and final.dtype == jnp.float32
        if x.initial_state is not None:
            assert not np.allclose(ref_final, x.initial_state, atol=1e-2)
        check_close(final, ref_final, case.tolerance("final", self.state_tolerance(case)),
                    f"final {what}")

    def _check(self, case: Case, fn, what: str, check_close, **extra):
        x, _, _ = reference(case)
        o, final = fn(*x.args(), implementation=self.implementation, **case.kwargs(x),
                      **extra)
        self._check_outputs(case, o, final, what, check_close)

    def test_chunk_kda(self, case: Case, check_close):
        self._check(case, kda_jax.chunk_kda, "chunk", check_close, chunk_size=case.C)

    def test_fused_recurrent_kda(self, case: Case, check_close):
        self._check(case, kda_jax.fused_recurrent_kda, "recurrent", check_close)

    def check_grads(self, case: Case, check_close, check_rel_rms, kind: str | None = None,
                    fn=kda_jax.chunk_kda):
        """``fn``'s outputs on ``case`` (under the configs in force), and the
        gradients of ``case.grad`` against autodiff of the float32 reference,
        each held to its own bar (the failure names every gradient that
        missed)."""
        x, w_o, w_f, ref = reference_grads(case)
        got, (o, final) = case_grads(case, self.implementation, fn)
        self._check_outputs(case, o, final, "grad-case", check_close)
        failures = []
        for n in case.grad:
            assert got[n].shape == ref[n].shape and got[n].dtype == getattr(x, n).dtype, n
            assert np.abs(np.asarray(ref[n])).max() > 1e-6, f"d{n} of the reference is ~0"
            try:
                check_rel_rms(got[n], ref[n], self.grad_tolerance(case, n), f"d{n}",
                              kind=kind or f"grad {case.dtype}")
            except AssertionError as e:
                failures.append(str(e))
        assert not failures, f"{case.id}: " + "; ".join(failures)
        if case.cu_seqlens is not None and "initial_state" in case.grad:
            # An empty sequence's final state is its initial state: the gradient is w_f.
            empty = np.diff(case.cu_seqlens) == 0
            np.testing.assert_array_equal(np.asarray(got["initial_state"])[empty], w_f[empty])

    def test_grad(self, case: Case, check_close, check_rel_rms):
        self.check_grads(case, check_close, check_rel_rms)
