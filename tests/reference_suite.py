"""The correctness suite every backend runs: chunk_kda and fused_recurrent_kda
against the float32 reference on the cases of :data:`kda_jax.testing.CASES`.

A backend's test module subclasses :class:`ReferenceSuite` and names its
``implementation``, which cases it takes (:meth:`ReferenceSuite.takes`,
:meth:`ReferenceSuite.takes_recurrent`) and the bar of its final states
(:meth:`ReferenceSuite.state_tolerance`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kda_jax
from kda_jax.testing import CASES, Case

_REFERENCE: dict[str, tuple] = {}


def reference(case: Case):
    """(inputs, reference o, reference final state), computed once per case."""
    if case.id not in _REFERENCE:
        x = case.make()
        o, final = kda_jax.naive_recurrent_kda(*x.args(), **case.kwargs(x))
        _REFERENCE[case.id] = (x, np.asarray(o), None if final is None else np.asarray(final))
    return _REFERENCE[case.id]


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
    def state_tolerance(cls, case: Case) -> str:
        """The TOLERANCES entry of the final state's dtype: "float32" for a
        path that computes the state in float32 from the inputs' values."""
        return "float32"

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            takes = (metafunc.cls.takes_recurrent
                     if metafunc.function.__name__ == "test_fused_recurrent_kda"
                     else metafunc.cls.takes)
            cases = [c for c in CASES if takes(c)] or [pytest.param(
                None, marks=pytest.mark.skip(reason=f"{metafunc.cls.__name__} takes no case "
                                                    "for this test here"), id="none")]
            metafunc.parametrize("case", cases, ids=str)

    def _check(self, case: Case, fn, what: str, check_close, **extra):
        x, ref_o, ref_final = reference(case)
        kw = case.kwargs(x)
        o, final = fn(*x.args(), implementation=self.implementation, **kw, **extra)
        hv = case.HV or case.H
        assert o.shape == (case.B, case.T, hv, case.V)
        assert o.dtype == x.q.dtype
        assert np.std(ref_o) > 1e-2  # the case is not trivial: the reference output varies
        check_close(o, ref_o, case.tolerance("o"), f"o {what}")
        if not kw["output_final_state"]:
            assert final is None and ref_final is None
            return
        shape = (case.B, hv, case.V, case.K) if kw.get("state_v_first") else (
            case.B, hv, case.K, case.V)
        assert final.shape == shape and final.dtype == jnp.float32
        if x.initial_state is not None:
            assert not np.allclose(ref_final, x.initial_state, atol=1e-2)
        check_close(final, ref_final, case.tolerance("final", self.state_tolerance(case)),
                    f"final {what}")

    def test_chunk_kda(self, case: Case, check_close):
        self._check(case, kda_jax.chunk_kda, "chunk", check_close, chunk_size=case.C)

    def test_fused_recurrent_kda(self, case: Case, check_close):
        self._check(case, kda_jax.fused_recurrent_kda, "recurrent", check_close)
