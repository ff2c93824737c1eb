"""Inputs, error measures and tolerances shared by the tests, the demo and the benchmarks.

Realistic shapes live here in one list so that tests, benchmarks and tuning see
the same cases.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "Case",
    "CASES",
    "case",
    "GATE_PARAM_GRID",
    "GATE_PARAM_GRID_SMALL",
    "GRAD_TOLERANCES",
    "KdaInputs",
    "gate_param_inputs",
    "resolve_params",
    "weighted_loss",
    "make_inputs",
    "rel_rms",
    "max_abs",
    "TOLERANCES",
    "DENSE_SWEEP",
    "SERVING_LENGTHS",
]

# (B, T, H) of the forward benchmark sweep, K = V = 128, bf16.
DENSE_SWEEP = (
    (1, 8192, 32), (1, 8192, 64), (1, 16384, 32), (1, 32768, 32), (2, 16384, 32),
    (4, 4096, 16), (8, 4096, 16), (8, 2048, 16), (1, 65536, 12),
)
# The serving step of the seed: 12 one-token decodes plus three prefills.
SERVING_LENGTHS = (1,) * 12 + (1100, 1300, 900)


@dataclasses.dataclass(frozen=True)
class Case:
    """A named correctness case: shapes (HV None: H), chunk size C, input
    dtype name, ``make_inputs`` keyword arguments and API keyword arguments
    (as (name, value) pairs; A_log / dt_bias True: pass make_inputs'), and
    ``off``: API keyword arguments that switch the case's feature off (the
    reference with them must differ, so the case exercises it).
    ``cu_seqlens``: host bounds of sequences packed along T (B must be 1).
    ``grad``: the arguments whose gradients the suite checks (names of
    chunk_kda's arrays: q, k, v, g, beta, initial_state, A_log, dt_bias);
    empty: a forward case. A gradient case checks o and the final state too,
    so the forward tests leave it out.

    tags: "interpret": small enough for Triton's interpreter (the Triton
    suite's cases without a GPU); "big": GPU sizes only (the Triton suite on a
    GPU; too slow for the XLA path on a CPU)."""

    id: str
    B: int = 2
    T: int = 45
    H: int = 2
    HV: int | None = None
    K: int = 32
    V: int = 32
    C: int = 64
    dtype: str = "float32"
    inputs: tuple = ()
    flags: tuple = ()
    off: tuple | None = None
    cu_seqlens: tuple | None = None
    grad: tuple = ()
    tags: frozenset = frozenset()

    def __str__(self):
        return self.id

    def make(self) -> "KdaInputs":
        """The case's inputs (seeded by its id)."""
        import zlib

        from ml_dtypes import bfloat16

        dtype = bfloat16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        n = None if self.cu_seqlens is None else len(self.cu_seqlens) - 1
        return make_inputs(zlib.crc32(self.id.encode()), B=self.B, T=self.T, H=self.H,
                           HV=self.HV, K=self.K, V=self.V, N=n, dtype=dtype,
                           **dict(self.inputs))

    def kwargs(self, x: "KdaInputs", overrides=()) -> dict:
        """The API keyword arguments for inputs ``x`` (with the initial state
        and the final state asked for), ``overrides`` last."""
        kw = dict(initial_state=x.initial_state, output_final_state=True)
        if self.cu_seqlens is not None:
            kw["cu_seqlens"] = np.asarray(self.cu_seqlens)
        for name, value in self.flags + tuple(overrides):
            if name in ("A_log", "dt_bias") and value is True:
                value = getattr(x, name)
            kw[name] = value
        return kw

    def tolerance(self, quantity: str, state_dtype: str = "float32") -> str:
        """The TOLERANCES entry of ``quantity`` ("o" or "final"): o by the
        input dtype, the final state by ``state_dtype`` (a path that computes
        the state in float32 from the same values meets "float32"); float32
        with gates of -1000 takes "float32-extreme-gates" (chunk-local cumsums
        of ~-1e4 cost the float32 differences G_i - G_j about 1e-4
        relative)."""
        name = self.dtype if quantity == "o" else state_dtype
        if name == "float32" and "gate_floor" in dict(self.inputs):
            name = "float32-extreme-gates"
        return name


_GATE = (("raw_gate", True),)
_ALL = ("q", "k", "v", "g", "beta", "initial_state")
_SMALL = frozenset({"interpret"})
# Awkward shapes (T not a multiple of the chunk, K/V not powers of two,
# HV = H/2H/4H, B > 1), every flag, fp32/bf16/fp16 inputs: a covering set, not
# the cartesian product. Every backend's suite runs them (tests/reference_suite.py).
CASES = (
    # Shapes, default flags.
    Case("T1-K32", B=1, T=1),
    Case("T17-B2-HV2H-K60-V40-c32", B=2, T=17, H=2, HV=4, K=60, V=40, C=32),
    Case("T63-HV4H-V48-bf16", B=1, T=63, H=2, HV=8, K=32, V=48, dtype="bfloat16"),
    Case("T65-B2-K60-V60", B=2, T=65, H=2, K=60, V=60),
    Case("T65-B2-K60-V60-c32-bf16", B=2, T=65, H=2, K=60, V=60, C=32, dtype="bfloat16"),
    Case("T100-K100-V128-HV2H-c32-bf16", B=1, T=100, H=1, HV=2, K=100, V=128, C=32,
         dtype="bfloat16"),
    Case("T130-K128-V100", B=1, T=130, H=1, K=128, V=100),
    Case("T70-HV2H-c32-f16", B=2, T=70, H=1, HV=2, K=48, V=32, C=32, dtype="float16"),
    Case("T150-gate-1000", B=2, T=150, K=32, V=32, inputs=(("gate_floor", -1000.0),)),
    Case("T70-fp32", B=1, T=70, tags=_SMALL),
    Case("T70-V48-c32-bf16", B=1, T=70, V=48, C=32, dtype="bfloat16", tags=_SMALL),
    Case("T45-B2-HV2H-K60-V100", B=2, T=45, H=1, HV=2, K=60, V=100, tags=_SMALL),
    Case("T40-HV4H-c32", B=1, T=40, H=1, HV=4, C=32, tags=_SMALL),
    Case("T80-gate-1000", B=1, T=80, inputs=(("gate_floor", -1000.0),), tags=_SMALL),
    # K > 64 with float32 intermediates (the interpreter's, and float32 inputs'
    # on a GPU): the Triton state kernel holds the state as two K halves, the
    # upper one masked at K = 100.
    Case("T70-K100-V24-v-first", B=1, T=70, K=100, V=24, inputs=(("state_v_first", True),),
         flags=(("state_v_first", True),), tags=_SMALL),
    Case("T45-K128-V16-c32", B=1, T=45, H=1, K=128, V=16, C=32, tags=_SMALL),
    # Flags.
    Case("l2norm", T=65, C=32, inputs=(("normalized_k", False),),
         flags=(("use_qk_l2norm_in_kernel", True),), off=(("use_qk_l2norm_in_kernel", False),)),
    Case("l2norm-HV2H-bf16", T=33, H=1, HV=2, dtype="bfloat16", inputs=(("normalized_k", False),),
         flags=(("use_qk_l2norm_in_kernel", True),), off=(("use_qk_l2norm_in_kernel", False),)),
    Case("l2norm-sigmoid-negeig", B=1, T=50, inputs=(("normalized_k", False),
                                                     ("beta_logits", True)),
         flags=(("use_qk_l2norm_in_kernel", True), ("use_beta_sigmoid_in_kernel", True),
                ("allow_neg_eigval", True)), off=(("use_qk_l2norm_in_kernel", False),),
         tags=_SMALL),
    Case("gate-Alog-dtbias", T=65, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True)),
         off=(("dt_bias", None),)),
    Case("gate-softplus-T66", B=1, T=66, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True)),
         off=(("dt_bias", None),), tags=_SMALL),
    Case("gate-Alog-c32-bf16", T=40, C=32, dtype="bfloat16", inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True)),
         off=(("lower_bound", -1.0),)),
    Case("gate-lb5-Alog-dtbias", T=50, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True),
                ("lower_bound", -5.0)),
         off=(("A_log", None),)),
    Case("gate-lb5-T66", B=1, T=66, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True),
                ("lower_bound", -5.0)),
         off=(("A_log", None),), tags=_SMALL),
    Case("gate-lb1-dtbias", T=50, C=32, H=1, HV=2, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("dt_bias", True), ("lower_bound", -1.0)),
         off=(("dt_bias", None),)),
    Case("gate-lb1-Alog", T=50, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("lower_bound", -1.0)),
         off=(("lower_bound", -5.0),)),
    Case("gate-lb5-bare-bf16", T=50, dtype="bfloat16", inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("lower_bound", -5.0)),
         off=(("lower_bound", -1.0),)),
    Case("beta-sigmoid", T=40, inputs=(("beta_logits", True),),
         flags=(("use_beta_sigmoid_in_kernel", True),),
         off=(("use_beta_sigmoid_in_kernel", False),)),
    Case("beta-sigmoid-negeig", T=40, C=32, inputs=(("beta_logits", True),),
         flags=(("use_beta_sigmoid_in_kernel", True), ("allow_neg_eigval", True)),
         off=(("allow_neg_eigval", False),)),
    Case("state-v-first-V48", T=40, K=32, V=48, inputs=(("state_v_first", True),),
         flags=(("state_v_first", True),)),
    Case("v-first-scale-V64", B=1, T=33, V=64, inputs=(("state_v_first", True),),
         flags=(("state_v_first", True), ("scale", 0.3)), off=(("scale", None),), tags=_SMALL),
    Case("no-initial-state", T=40, inputs=(("with_state", False),)),
    Case("no-initial-state-T20", B=1, T=20, inputs=(("with_state", False),), tags=_SMALL),
    Case("no-final-state", T=40, flags=(("output_final_state", False),)),
    Case("scale", T=40, flags=(("scale", 0.3),), off=(("scale", None),)),
    Case("all-flags-HV2H-c32-bf16", T=47, H=2, HV=4, K=48, V=40, C=32, dtype="bfloat16",
         inputs=(("normalized_k", False), ("raw_gate", True), ("beta_logits", True),
                 ("state_v_first", True)),
         flags=(("use_qk_l2norm_in_kernel", True), ("use_gate_in_kernel", True),
                ("A_log", True), ("dt_bias", True), ("use_beta_sigmoid_in_kernel", True),
                ("allow_neg_eigval", True), ("state_v_first", True), ("scale", 0.2))),
    # Gradient cases (the suite's test_grad; they check o and the final state too).
    Case("grad-B2-T80-K20-V28-c32", B=2, T=80, K=20, V=28, C=32, grad=_ALL),
    Case("grad-gate-lb2-B2-T33-V24", B=2, T=33, H=1, K=16, V=24, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True),
                ("lower_bound", -2.0)), grad=("g", "A_log", "dt_bias", "k")),
    Case("grad-HV2H-v-first-scale-K24", B=1, T=70, HV=4, K=24, V=16,
         inputs=(("state_v_first", True),), flags=(("state_v_first", True), ("scale", 0.3)),
         grad=_ALL),
    Case("grad-B2-T70-K32", T=70, H=1, grad=_ALL, tags=_SMALL),
    Case("grad-K60-V100-HV2H-c32", B=1, T=45, H=1, HV=2, K=60, V=100, C=32, grad=_ALL,
         tags=_SMALL),
    Case("grad-HV4H-v-first-scale-c32", B=1, T=40, H=1, HV=4, K=16, V=16, C=32,
         inputs=(("state_v_first", True),), flags=(("state_v_first", True), ("scale", 0.3)),
         grad=_ALL, tags=_SMALL),
    Case("grad-gate-softplus-c32", B=1, T=40, H=1, K=16, V=16, C=32, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True)),
         grad=_ALL + ("A_log", "dt_bias"), tags=_SMALL),
    Case("grad-gate-lb2-T66-V24", B=1, T=66, H=1, K=16, V=24, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True),
                ("lower_bound", -2.0)), grad=_ALL + ("A_log", "dt_bias"), tags=_SMALL),
    Case("grad-gate-lb1-bare-c32", B=1, T=40, H=1, K=16, V=16, C=32, inputs=_GATE,
         flags=(("use_gate_in_kernel", True), ("lower_bound", -1.0)), grad=_ALL,
         tags=_SMALL),
    Case("grad-l2norm-sigmoid-negeig-c32", B=1, T=50, K=16, V=16, C=32,
         inputs=(("normalized_k", False), ("beta_logits", True)),
         flags=(("use_qk_l2norm_in_kernel", True), ("use_beta_sigmoid_in_kernel", True),
                ("allow_neg_eigval", True)), grad=_ALL, tags=_SMALL),
    # Empty and one-token sequences; the empty ones' initial-state gradient is
    # the final state's cotangent itself.
    Case("grad-varlen-empty-len1-c32", B=1, T=42, H=1, HV=2, K=16, V=16, C=32,
         cu_seqlens=(0, 0, 1, 36, 36, 41, 42), grad=_ALL, tags=_SMALL),
    Case("grad-varlen-no-h0", B=1, T=70, H=1, K=16, V=16, inputs=(("with_state", False),),
         cu_seqlens=(0, 1, 1, 66, 70), grad=_ALL[:5], tags=_SMALL),
    # K > 64 with float32 intermediates: both state passes split the state in K.
    Case("grad-K100-V16-v-first", B=1, T=70, H=1, K=100, V=16,
         inputs=(("state_v_first", True),), flags=(("state_v_first", True),), grad=_ALL,
         tags=_SMALL),
    Case("grad-K128-V16-c32", B=1, T=45, H=1, K=128, V=16, C=32, grad=_ALL, tags=_SMALL),
    Case("grad-big-K128-HV2H", B=2, T=600, H=2, HV=4, K=128, V=128, grad=_ALL,
         tags=frozenset({"big"})),
    Case("grad-big-K256-c32", B=1, T=300, H=1, K=256, V=256, C=32, flags=(("scale", 0.25),),
         grad=_ALL, tags=frozenset({"big"})),
    # Scale 0.5: at K^-0.5 the normalized q and k leave o's spread under the
    # suite's 1e-2 floor.
    Case("grad-big-varlen-every-transform", B=1, T=1301, H=2, K=128, V=64,
         inputs=(("raw_gate", True), ("normalized_k", False), ("beta_logits", True)),
         flags=(("use_gate_in_kernel", True), ("A_log", True), ("dt_bias", True),
                ("use_qk_l2norm_in_kernel", True), ("use_beta_sigmoid_in_kernel", True),
                ("scale", 0.5)),
         cu_seqlens=(0, 1, 400, 400, 1290, 1301), grad=_ALL + ("A_log", "dt_bias"),
         tags=frozenset({"big"})),
    # GPU sizes.
    # K = 256 at scale 0.25 (K^-0.5 = 1/16 leaves o's spread under the suite's 1e-2 floor).
    Case("big-K256-bf16", B=1, T=300, H=2, K=256, V=256, dtype="bfloat16",
         flags=(("scale", 0.25),), tags=frozenset({"big"})),
    Case("big-128-bf16", B=2, T=1000, H=4, K=128, V=128, dtype="bfloat16",
         tags=frozenset({"big"})),
    Case("big-128-HV2H-c32", B=1, T=500, H=2, HV=4, K=128, V=128, C=32,
         tags=frozenset({"big"})),
)

# Relative RMS and max-abs (scaled by the reference's max-abs) against the
# float32 reference, per input dtype.
TOLERANCES = {
    "float32": dict(rel_rms=1e-4, max_abs=1e-3),
    "float16": dict(rel_rms=2e-3, max_abs=2e-2),
    "bfloat16": dict(rel_rms=5e-3, max_abs=5e-2),
    # Gates of -1000 per step. The chunked paths floor the log-decay at -110
    # and take exponents that are differences of the chunk-local cumsum G as
    # partial sums of g, so they meet "float32" here too (measured about 2e-7
    # relative RMS on o, tests/test_gate_extremes.py); the looser entry is
    # kept for the tests that still name it.
    "float32-extreme-gates": dict(rel_rms=1e-3, max_abs=5e-3),
}

# Relative RMS of each gradient against autodiff of the float32 reference
# (whose o is rounded to the input dtype, as the API's is), per input dtype.
# 16-bit: fla's bars for its chunk_kda (tests/ops/test_kda.py::test_chunk), but
# the gate parameters' at fla v0.4.1's 1e-3, which the backward's float32 gate
# form meets (since v0.5.0 fla holds ddt_bias to 8e-3 and only warns for dA_log
# over 3e-3; the 16-bit form, sm90's chunk-64 default, is held to those in
# tests/test_triton_grad.py).
GRAD_TOLERANCES = {
    "float32": dict.fromkeys(("q", "k", "v", "g", "beta", "initial_state", "A_log",
                              "dt_bias"), 1e-4),
    "bfloat16": dict(q=8e-3, k=8e-3, v=8e-3, initial_state=8e-3, g=2e-2, beta=2e-2,
                     A_log=1e-3, dt_bias=1e-3),
}


def case(case_id: str) -> Case:
    """The case of :data:`CASES` named ``case_id``."""
    for c in CASES:
        if c.id == case_id:
            return c
    raise KeyError(f"no case {case_id!r} in kda_jax.testing.CASES")


@dataclasses.dataclass
class KdaInputs:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    initial_state: np.ndarray | None
    A_log: np.ndarray | None = None
    dt_bias: np.ndarray | None = None

    def args(self):
        return self.q, self.k, self.v, self.g, self.beta


# The in-kernel gate's parameters at fla's KDA test grid (its
# tests/ops/test_kda.py::test_chunk, the use_gate_in_kernel rows, and the
# bf16 forms of them): uniform q, k, v in [0, 1) (l2-normalized outside or in
# the kernel), raw gate logits divided by a normalizer, sigmoid beta, scale 0.1,
# random cotangents for o and the final state.
# (B, T, H, K, input dtype, normalizer, in-kernel l2norm). The small grid runs
# in Triton's interpreter.
GATE_PARAM_GRID = (
    (2, 1500, 4, 128, "float16", 1.0, False),
    (4, 2048, 8, 64, "float16", 1.0, False),
    (2, 1500, 4, 128, "float16", 10.0, True),
    (1, 2048, 8, 128, "bfloat16", 1.0, True),
    (2, 1024, 4, 100, "bfloat16", 10.0, False),
)
GATE_PARAM_GRID_SMALL = ((1, 70, 1, 16, "float32", 1.0, False),
                         (1, 40, 2, 32, "bfloat16", 10.0, True))


def gate_param_inputs(seed, B, T, H, K, dtype, normalizer, l2norm):
    """One case of :data:`GATE_PARAM_GRID`: (arrays, w_o, w_f), ``arrays`` the
    jax arrays q, k, v, beta in ``dtype`` and g, initial_state, A_log, dt_bias
    in float32, and the NumPy cotangent weights of o ``[B, T, H, K]`` and of
    the final state ``[B, H, K, K]`` (V = K)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    q, k, v = (rng.random((B, T, H, K), dtype=np.float32) for _ in range(3))
    if not l2norm:
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = rng.standard_normal((B, T, H, K), dtype=np.float32) / normalizer
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H), dtype=np.float32)))
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta,
                  initial_state=rng.standard_normal((B, H, K, K), dtype=np.float32),
                  A_log=rng.standard_normal(H, dtype=np.float32),
                  dt_bias=rng.standard_normal(H * K, dtype=np.float32))
    sixteen = ("q", "k", "v", "beta")
    arrays = {n: jnp.asarray(a).astype(dtype if n in sixteen else jnp.float32)
              for n, a in arrays.items()}
    w_o = rng.standard_normal((B, T, H, K), dtype=np.float32)
    w_f = rng.standard_normal((B, H, K, K), dtype=np.float32)
    return arrays, w_o, w_f


def resolve_params(call_kw, arrays):
    """Call keywords with ``A_log=True`` / ``dt_bias=True`` replaced by ``arrays``' own."""
    return {n: (arrays[n] if n in ("A_log", "dt_bias") and v is True else v)
            for n, v in call_kw.items()}


def weighted_loss(fn, arrays, call_kw, w_o, w_f, final=True, out_dtype=None):
    """``params -> sum(o * w_o) (+ sum(final_state * w_f))`` of ``fn`` (chunk_kda's
    signature) on ``arrays`` updated by ``params``: every output and state element
    carries its own cotangent. ``out_dtype``: o is rounded to it first, as chunk_kda
    rounds o to the inputs' dtype, so a reference given it receives the same
    (rounded) cotangent for o as the kernels do."""
    import jax.numpy as jnp

    def loss(params):
        a = {**arrays, **params}
        o, fs = fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                   output_final_state=final, **resolve_params(call_kw, a))
        if out_dtype is not None:
            o = o.astype(out_dtype)
        total = jnp.sum(o.astype(jnp.float32) * w_o)
        return total + jnp.sum(fs * w_f) if final else total

    return loss


def make_inputs(
    seed: int,
    *,
    B: int = 1,
    T: int = 64,
    H: int = 2,
    HV: int | None = None,
    K: int = 64,
    V: int = 64,
    N: int | None = None,
    dtype=np.float32,
    raw_gate: bool = False,
    beta_logits: bool = False,
    normalized_k: bool = True,
    with_state: bool = True,
    state_v_first: bool = False,
    gate_floor: float | None = None,
) -> KdaInputs:
    """Random KDA inputs in a realistic range.

    k is L2-normalized unless ``normalized_k`` is False (then use the in-kernel
    norm). g is a log-decay in about [-0.5, 0] (or raw gate values with
    ``raw_gate``, plus A_log and dt_bias); ``gate_floor`` forces every 7th
    token's gate to that value (e.g. -1000) to test extreme decay.
    ``dtype`` applies to q, k, v; g, beta and states are float32.
    """
    rng = np.random.default_rng(seed)
    HV = H if HV is None else HV
    N = B if N is None else N
    q = rng.standard_normal((B, T, H, K), dtype=np.float32)
    k = rng.standard_normal((B, T, H, K), dtype=np.float32)
    if normalized_k:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V), dtype=np.float32)
    A_log = dt_bias = None
    if raw_gate:
        g = rng.standard_normal((B, T, HV, K), dtype=np.float32)
        A_log = rng.uniform(-1.0, 1.0, (HV,)).astype(np.float32)
        dt_bias = (0.1 * rng.standard_normal(HV * K)).astype(np.float32)
    else:
        g = -np.exp(rng.uniform(-5.0, -0.7, (B, T, HV, K))).astype(np.float32)
        if gate_floor is not None:
            g[:, ::7] = np.float32(gate_floor)
    if beta_logits:
        beta = rng.standard_normal((B, T, HV), dtype=np.float32)
    else:
        beta = rng.uniform(0.05, 1.0, (B, T, HV)).astype(np.float32)
    h0 = None
    if with_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        h0 = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    cast = lambda x: x.astype(dtype)
    return KdaInputs(cast(q), cast(k), cast(v), g, beta, h0, A_log, dt_bias)


def _f64(x) -> np.ndarray:
    return np.asarray(np.asarray(x, dtype=np.float32), dtype=np.float64)


def rel_rms(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (0 when both are empty)."""
    a, e = _f64(actual), _f64(expected)
    if e.size == 0:
        return 0.0
    denom = np.sqrt(np.mean(e**2))
    return float(np.sqrt(np.mean((a - e) ** 2)) / max(denom, 1e-30))


def max_abs(actual, expected) -> float:
    """max |actual - expected| / max |expected| (relative max-abs)."""
    a, e = _f64(actual), _f64(expected)
    if e.size == 0:
        return 0.0
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def assert_close(actual, expected, dtype_name: str, what: str = "output"):
    """Asserts relative RMS and relative max-abs within the dtype's tolerance; NaN fails."""
    a = np.asarray(np.asarray(actual, dtype=np.float32))
    if not np.all(np.isfinite(a)):
        raise AssertionError(f"{what}: non-finite values")
    tol = TOLERANCES[dtype_name]
    r, m = rel_rms(actual, expected), max_abs(actual, expected)
    if r > tol["rel_rms"] or m > tol["max_abs"]:
        raise AssertionError(
            f"{what} ({dtype_name}): rel_rms={r:.3e} (tol {tol['rel_rms']:.0e}), "
            f"max_abs={m:.3e} (tol {tol['max_abs']:.0e})"
        )
    return r, m
