"""The config types: one small frozen config per kernel, grouped per kernel
family, each kernel's configs keyed by variant.

A variant is the case a launch falls in: the dtype of the intermediates
(``"bf16"``, ``"fp16"``, ``"fp32"``, or ``"16bit"`` for both 16-bit ones)
and, for the state passes, K past 128 (``"16bit_wide"``, ``"fp32_wide"``).
:func:`variant_key` picks the most specific key a kernel has. The per-arch
values are in this package's arch modules; why each is as it is, and the
measurements, in docs/tuning.md ("Launch configs").
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Iterator, Mapping, TypeVar

__all__ = ["DOT_MODES", "Variants", "variant_key", "PrepareConfig", "StateConfig", "BlockConfig",
           "IntraConfig", "GradsConfig", "FoldConfig", "DecodeConfig", "SegmentRule", "ForwardConfig",
           "BackwardConfig", "RecurrentConfig", "SegmentConfig", "as_dict", "replace"]

# Product precisions: the kernels' DOT constexprs, tl.dot's input_precision names and
# "bf16" (operands rounded to bf16; kda_jax/kernels/common.py, dot).
DOT_MODES = ("ieee", "tf32x3", "tf32", "bf16", "bf16x3", "bf16x6")
# The inverse's merge compounds rounding through nilpotent powers: float32-grade
# modes or tf32 (16-bit inputs only, where X is used at 16-bit or tf32 precision
# afterwards); never bf16.
INVERSE_DOTS = ("ieee", "tf32x3", "tf32", "bf16x3", "bf16x6")
FP32_GRADE = ("ieee", "tf32x3", "bf16x6")
# The fold carries float32 states.
FOLD_DOTS = ("ieee", "tf32x3", "bf16x3", "bf16x6")
WORK_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# BackwardConfig.chunk_states: the backward's per-chunk states in float32, or
# in the intermediates' dtype.
CHUNK_STATES = ("fp32", "work")
# BackwardConfig.normalized_qk: the in-kernel L2-normalized q, k reach the
# backward's kernels in float32, or rounded to the caller's 16-bit dtype.
NORMALIZED_QK = ("fp32", "input")
# DecodeConfig.state_cast: a bfloat16 pool row's rounding, on the bits or by
# Triton's conversion.
STATE_CASTS = ("bits", "native")
# BackwardConfig.transform_residuals: what the input transforms keep for their
# gradient, which runs after the backward's kernels.
TRANSFORM_RESIDUALS = ("saved", "recompute")
# BackwardConfig.nonfinite_flags: where the per-token non-finite flags are computed.
NONFINITE_FLAGS = ("backward", "forward", "prepare")


def _fail(owner: str, name: str, value, must: str):
    raise ValueError(f"{owner}: {name}={value!r} {must}")


def _check_int(owner, name, value, allowed=None, *, power_of_two_from=None, minimum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(owner, name, value, "must be an int")
    if allowed is not None and value not in allowed:
        _fail(owner, name, value, f"must be one of {', '.join(map(str, allowed))}")
    if power_of_two_from is not None and (value < power_of_two_from or value & (value - 1)):
        _fail(owner, name, value, f"must be a power of two >= {power_of_two_from}")
    if minimum is not None and value < minimum:
        _fail(owner, name, value, f"must be >= {minimum}")


def _check_bool(owner, name, value):
    if not isinstance(value, bool):
        _fail(owner, name, value, "must be True or False")


def _check_choice(owner, name, value, allowed, why=""):
    if value not in allowed:
        _fail(owner, name, value, f"must be one of {', '.join(map(repr, allowed))}{why}")


def _check_dot(owner, name, value, allowed=DOT_MODES, why=""):
    _check_choice(owner, name, value, allowed, why)


_WARPS = (1, 2, 4, 8, 16)
_STAGES = (1, 2, 3, 4)

# --------------------------------------------------------------------------- #
# One config per kernel.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """The intra-chunk prepare kernel (``kda_fwd_prepare_kernel``: the
    forward's, and the backward's recompute, which stores X too); one
    program per chunk and value head.

    block_k: its K slice (the intra-chunk products loop over K in slices).
    warps / stages: num_warps / num_stages.
    dot: precision of Akk and Aqk; wu_dot: of w = X (beta k e^G) and
      u = X (beta v); inverse_dot: of the products that merge the inverse's
      16-row diagonal blocks (which are exact float32 sweeps). Modes:
      "ieee" (fp32), "tf32x3" (NVIDIA only; about fp32 accuracy), "tf32"
      (NVIDIA only), "bf16" (operands rounded to bf16), "bf16x3" (three bf16
      products of a two-term split, about 1e-5 relative) or "bf16x6" (about
      fp32 accuracy). Users of float32 expect float32 accuracy: the "fp32"
      variant takes one mode for all three.
    split: Aqk and Akk in a pass over K each (one matrix's accumulators live
      at a time: fewer registers, the k and log-decay tiles read twice).
    batched_l1: the two-level products' level 1 (pairs within 8-row blocks)
      as products batched over the 16-row diagonal blocks instead of
      whole-chunk products masked to its pairs (docs/kda.md section 3).
    """

    block_k: int
    warps: int
    stages: int
    dot: str
    wu_dot: str
    inverse_dot: str
    split: bool = False
    batched_l1: bool = False

    def __post_init__(self):
        owner = "PrepareConfig"
        _check_int(owner, "block_k", self.block_k, power_of_two_from=16)
        _check_int(owner, "warps", self.warps, _WARPS)
        _check_int(owner, "stages", self.stages, _STAGES)
        _check_dot(owner, "dot", self.dot)
        _check_dot(owner, "wu_dot", self.wu_dot)
        _check_dot(owner, "inverse_dot", self.inverse_dot, INVERSE_DOTS,
                   " (the inverse's merge; bf16 operands lose too much)")
        _check_bool(owner, "split", self.split)
        _check_bool(owner, "batched_l1", self.batched_l1)


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """A pass over the chunks carrying the [K, block_v] float32 state (one
    program per sequence, value head and V block): the forward's
    state-output kernel, its map over segments, and the backward's forward
    (h) and reverse (dS) passes.

    block_v / warps / stages: its V block, num_warps and num_stages (past
      K = 128 one stage: two stages of its [BT, K] tiles outgrow shared
      memory, so the wide variants must say 1).
    dot: precision of its products with float32 intermediates ("ieee" for
      the 16-bit variants, whose products are exact).
    split_k: hold the state as two K halves where the intermediates call for
      it (float32 ones from K = 128: kda_jax.triton.forward.split_state_k);
      False keeps one [K, block_v] tile.
    """

    block_v: int
    warps: int
    stages: int
    dot: str = "ieee"
    split_k: bool = True

    def __post_init__(self):
        owner = "StateConfig"
        _check_int(owner, "block_v", self.block_v, power_of_two_from=16)
        _check_int(owner, "warps", self.warps, _WARPS)
        _check_int(owner, "stages", self.stages, _STAGES)
        _check_dot(owner, "dot", self.dot)
        _check_bool(owner, "split_k", self.split_k)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A per-chunk backward kernel over [block_k, block_v] tiles: the inter
    kernel (the state terms; grid chunks x heads x K blocks, looping over V
    blocks) and the wy kernel (the gradients through X; grid chunks x heads,
    looping over K and V blocks).

    dot: the inter kernel's products with float32 intermediates ("ieee" for
      16-bit ones, exact); the wy kernel's dots with X^T and dw w^T (its
      "fp32" variant float32-grade: "ieee", "tf32x3" or "bf16x6").
    """

    block_k: int
    block_v: int
    warps: int
    dot: str

    def __post_init__(self):
        owner = type(self).__name__
        _check_int(owner, "block_k", self.block_k, power_of_two_from=16)
        _check_int(owner, "block_v", self.block_v, power_of_two_from=16)
        _check_int(owner, "warps", self.warps, _WARPS)
        _check_dot(owner, "dot", self.dot)


@dataclasses.dataclass(frozen=True)
class IntraConfig:
    """The backward of the intra-chunk products (``kda_bwd_intra_kernel``;
    grid chunks x heads x K blocks).

    block_k / warps: its K block and num_warps.
    dot: precision of its products (PrepareConfig's modes).
    batched_l1: level 1 batched over diagonal blocks (PrepareConfig's), as
      the recompute computes it.
    """

    block_k: int
    warps: int
    dot: str
    batched_l1: bool = False

    def __post_init__(self):
        owner = "IntraConfig"
        _check_int(owner, "block_k", self.block_k, power_of_two_from=16)
        _check_int(owner, "warps", self.warps, _WARPS)
        _check_dot(owner, "dot", self.dot)
        _check_bool(owner, "batched_l1", self.batched_l1)


@dataclasses.dataclass(frozen=True)
class GradsConfig(BlockConfig):
    """Every per-chunk gradient term in one launch (``kda_bwd_grads_kernel``;
    grid chunks x heads, looping over V blocks of ``block_v``, then twice over
    K blocks of ``block_k``): the inter, wy and intra kernels' work.
    BlockConfig's fields, ``dot`` the state terms' products (the inter
    kernel's: "ieee" for 16-bit intermediates, exact), and

    x_dot: the products with X^T and of the cotangents with v_new (the wy
      kernel's ``dot``; the "fp32" variant float32-grade).
    product_dot: the intra-chunk products' backward (IntraConfig's ``dot``).
    batched_l1: level 1 batched over diagonal blocks (IntraConfig's).
    stages: Triton's software pipelining of the loops' loads (num_stages).
    """

    x_dot: str
    product_dot: str
    batched_l1: bool = False
    stages: int = 1

    def __post_init__(self):
        super().__post_init__()
        _check_dot("GradsConfig", "x_dot", self.x_dot)
        _check_dot("GradsConfig", "product_dot", self.product_dot)
        _check_bool("GradsConfig", "batched_l1", self.batched_l1)
        _check_int("GradsConfig", "stages", self.stages, (1, 2, 3, 4))


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """The fold over segments (``kda_segment_fold_kernel``): it walks each
    sequence's segments, reading the [K, K] maps in column slices of
    ``block_j`` (at least K: whole, one product per segment), at ``warps``,
    with float32 products at ``dot`` ("ieee", "tf32x3", "bf16x3" or
    "bf16x6")."""

    block_j: int
    warps: int
    dot: str

    def __post_init__(self):
        owner = "FoldConfig"
        _check_int(owner, "block_j", self.block_j, power_of_two_from=16)
        _check_int(owner, "warps", self.warps, (1, 2, 4, 8))
        _check_dot(owner, "dot", self.dot, FOLD_DOTS, " (the fold carries float32 states)")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The token-by-token kernel (``kda_fused_recurrent_kernel``; one program
    per sequence, value head and V block, the whole of K in each program):
    its V block (its state tile [K (padded), block_v] float32 in registers),
    num_warps, and num_stages, which is also the software-pipelining depth
    of the token loop (its next token's loads issued before this token's
    update). ``state_cast``: how a bfloat16 pool's rows get the float32
    state, rounded to nearest even either way: "bits", the rounding written
    out on the bits; "native", Triton's conversion (on sm90 one instruction
    per pair: a quarter of the kernel's instructions fewer). Triton's
    interpreter truncates in its conversion, so it always runs "bits".
    float16 pools always take the conversion."""

    block_v: int
    warps: int
    stages: int
    state_cast: str = "bits"

    def __post_init__(self):
        owner = "DecodeConfig"
        _check_int(owner, "block_v", self.block_v, power_of_two_from=8)
        _check_int(owner, "warps", self.warps, _WARPS)
        _check_int(owner, "stages", self.stages, minimum=1)
        _check_choice(owner, "state_cast", self.state_cast, STATE_CASTS)


# --------------------------------------------------------------------------- #
# A kernel's configs by variant.
# --------------------------------------------------------------------------- #

C = TypeVar("C")


class Variants(Mapping[str, C], Generic[C]):
    """One kernel's configs by variant: an immutable, hashable mapping (so a
    family config can key the jit cache). Built from a dict."""

    __slots__ = ("_items", "_hash")

    def __init__(self, configs: Mapping[str, C]):
        self._items = tuple(configs.items())
        # Family configs are hashed on every traced call (the jit cache key).
        self._hash = hash(tuple(sorted(self._items, key=lambda kv: kv[0])))

    def __getitem__(self, key: str) -> C:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self._items) + "}"


def variant_key(variants: Mapping[str, object], work: str, kd: int) -> str:
    """The key of ``variants`` for a launch whose intermediates are ``work``
    (a dtype name: "bfloat16", "float16" or "float32") at K = ``kd``: the
    first present of the dtype's own key and its class's ("16bit" for both
    16-bit dtypes), each preceded by its "_wide" form past K = 128 (padded to
    a power of two)."""
    if work not in WORK_KEYS:
        raise ValueError(f"work={work!r} must be one of {', '.join(WORK_KEYS)}")
    own = WORK_KEYS[work]
    klass = "fp32" if own == "fp32" else "16bit"
    keys = [own, klass]
    if 1 << max(int(kd) - 1, 0).bit_length() > 128:
        keys = [own + "_wide", klass + "_wide"] + keys
    for key in keys:
        if key in variants:
            return key
    raise KeyError(f"no variant for {work} intermediates at K = {kd}: tried {keys}, "
                   f"have {list(variants)}")


def _variants(owner: str, name: str, value, kind: type, *, wide: bool, exact16: bool = False,
              keys=("16bit", "16bit_wide", "bf16", "fp16", "fp16_wide", "bf16_wide", "fp32",
                    "fp32_wide"), complete: bool = True):
    """``value`` (a dict or Variants of ``kind``) as Variants, checked: every
    key known, every config a ``kind``, every dtype covered unless not
    ``complete`` (past K = 128
    too when ``wide``: its own variants, whose stages must be 1); with
    ``exact16``, the 16-bit variants' products "ieee" (a kernel that
    multiplies 16-bit intermediates exactly: another mode would round them)."""
    if not isinstance(value, Mapping) or not value:
        _fail(owner, name, value, f"must be a non-empty dict of variant -> {kind.__name__}")
    for key, config in value.items():
        if key not in keys:
            _fail(owner, name, value, f"has the variant {key!r}; known: {', '.join(keys)}")
        if not isinstance(config, kind):
            _fail(owner, f"{name}[{key!r}]", config, f"must be a {kind.__name__}")
    for work in WORK_KEYS if complete else ():
        for kd in (128, 256) if wide else (128,):
            try:
                key = variant_key(value, work, kd)
            except KeyError:
                _fail(owner, name, value, f"lacks a variant for {work} intermediates"
                      + (" past K = 128 (add a '_wide' variant)" if kd > 128 else ""))
            if kd > 128 and not key.endswith("_wide"):
                _fail(owner, name, value, f"lacks a '_wide' variant for {work} intermediates "
                      "(past K = 128 the state passes run one stage)")
            if kd > 128 and getattr(value[key], "stages", 1) != 1:
                _fail(owner, f"{name}[{key!r}].stages", value[key].stages,
                      "must be 1 (past K = 128 two stages of [BT, K] tiles outgrow shared "
                      "memory)")
    if exact16:
        for key, config in value.items():
            if not key.startswith("fp32") and config.dot != "ieee":
                _fail(owner, f"{name}[{key!r}].dot", config.dot,
                      "must be 'ieee' (16-bit intermediates multiply exactly; the precision "
                      "modes are for the 'fp32' variants)")
    return value if isinstance(value, Variants) else Variants(value)


def _set(config, name: str, value):
    object.__setattr__(config, name, value)


# --------------------------------------------------------------------------- #
# The kernel families.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """The forward's kernels (kda_jax.kernels.chunk_fwd, segments), each by
    variant (:func:`variant_key`, of the intermediates' dtype).

    prepare: the intra-chunk prepare ("16bit", "fp32").
    state: the state-output pass ("16bit", "16bit_wide", "fp32",
      "fp32_wide").
    segment_state: the state-output pass over segments ("16bit", "fp32"),
      where V is a multiple of its block_v (else ``state``'s: masked V
      columns spill at wider blocks).
    map: the segments' map kernel ("16bit", "fp32"): each segment's end state
      from zero and its [K, K] transition.
    fold: the fold over segments.
    The segment kernels run at K <= 128 only (kda_jax.triton.state_chain), so
    they have no "_wide" variants; their variant follows the inputs' dtype
    (the interpreter's float32 intermediates with 16-bit inputs take the
    16-bit launch, as a GPU does).
    """

    prepare: Mapping[str, PrepareConfig]
    state: Mapping[str, StateConfig]
    segment_state: Mapping[str, StateConfig]
    map: Mapping[str, StateConfig]
    fold: FoldConfig

    def __post_init__(self):
        owner = "ForwardConfig"
        _set(self, "prepare", _variants(owner, "prepare", self.prepare, PrepareConfig, wide=False))
        _set(self, "state", _variants(owner, "state", self.state, StateConfig, wide=True,
                                      exact16=True))
        _set(self, "segment_state", _variants(owner, "segment_state", self.segment_state,
                                              StateConfig, wide=False, exact16=True))
        _set(self, "map", _variants(owner, "map", self.map, StateConfig, wide=False,
                                    exact16=True))
        if not isinstance(self.fold, FoldConfig):
            _fail(owner, "fold", self.fold, "must be a FoldConfig")


def grads_from(inter: Mapping, wy: Mapping, intra: Mapping) -> Variants:
    """The fused gradient kernel's configs ("bf16", "fp16", "fp32") taken from
    the three kernels it replaces: the wy kernel's blocks, warps and products
    with X^T, the inter kernel's state products, the intra kernel's products
    and level-1 form."""
    out = {}
    for key, work in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        ic, wc, ac = (c[variant_key(c, work, 128)] for c in (inter, wy, intra))
        out[key] = GradsConfig(block_k=wc.block_k, block_v=wc.block_v, warps=wc.warps,
                               dot=ic.dot, x_dot=wc.dot, product_dot=ac.dot,
                               batched_l1=ac.batched_l1)
    return Variants(out)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """The backward's kernels (kda_jax.kernels.chunk_bwd), each by variant
    (:func:`variant_key`, of the backward's intermediates).

    recompute: the forward's prepare kernel on the transformed inputs,
      storing X too ("16bit", "fp32").
    state / dstate: the forward (h) and reverse (dS) state passes ("16bit",
      "16bit_wide", "fp32", "fp32_wide"); the reverse pass pipelines five
      tiles to the forward pass's three, so each stage costs it more shared
      memory.
    inter, wy: the state terms and the gradients through X (inter: "16bit",
      "fp32"; wy: "bf16", "fp16", "fp32", the last float32-grade).
    intra: the products' backward ("bf16", "fp16", "fp32": float16's bar is
      2.5x tighter than bfloat16's, kda_jax.testing). Its batched_l1 is
      independent of the recompute's: either form of level 1 gives the same
      matrices and gradients.
    fold: the transposed fold over segments (the backward's map runs at its
      state pass's launch).
    grads: every per-chunk gradient term in one launch ("bf16", "fp16",
      "fp32", or some of them), which runs in place of the inter, wy and
      intra kernels where ``fused_grads`` is True, it has the intermediates'
      variant (:meth:`grads_for`) and its blocks divide K and V; by default
      every variant, its fields the three kernels' (:func:`grads_from`).
    gate_fp32_max_k: with the in-kernel gate (use_gate_in_kernel), 16-bit
      inputs get float32 intermediates, as float32 inputs do, for K up to
      this (0: never). The gate parameters' gradients (dA_log, ddt_bias) sum
      the per-token gate gradient over every token and channel; that
      gradient is a difference of nearly equal sums, and the rounding of
      each 16-bit intermediate moves those sums coherently, each by
      0.5-9e-3 relative on its own: only float32 throughout brings them
      under 1e-3 (docs/kda.md section 6).
    chunk_states: the dtype in which the state passes store each chunk's
      state h and state cotangent dS for the inter kernel: "fp32", or
      "work", the intermediates' dtype. The inter kernel rounds both to the
      intermediates' dtype for its products anyway; only its sum over V of
      dS * h (a term of dG) sees the difference. 16-bit ones halve the
      passes' largest stores and the inter kernel's largest loads.
    normalized_qk: with ``use_qk_l2norm_in_kernel`` and 16-bit inputs, the
      normalized q, k that the backward's kernels take: "fp32" (as the
      transform computes them, which makes every intermediate float32), or
      "input", rounded to the inputs' dtype first, as fla's separate L2-norm
      kernel writes them, so that the intermediates are 16-bit (unless
      ``gate_fp32_max_k`` asks for float32). The norm's own gradient stays
      float32 either way; the forward keeps its float32 norm in the kernel,
      so the gradient is that of q, k rounded after the norm (fla rounds them
      in both passes).
    transform_residuals: the input transforms (the non-finite zeroing, and
      the in-kernel L2 norm, gate and beta sigmoid where asked) run in XLA
      before the backward's kernels, their gradient after them. "saved":
      autodiff keeps its residuals across the kernels (with every transform
      on, 24 arrays of [T, HV, K], 72 bytes per entry, written and read
      back); "recompute": where an in-kernel transform (L2 norm, gate, beta
      sigmoid or negative eigenvalues) is on, only the raw inputs are kept
      and the gradient's pass recomputes the transforms from them
      (jax.checkpoint), in the fusions that apply the cotangents. With the
      zeroing alone there is no transcendental to keep, and XLA recomputes
      its masks inside the gradient's fusions by itself; the checkpoint's
      barrier stopped that (2.5 % slower at init on an H100,
      docs/tuning.md), so it is not applied there.
    nonfinite_flags: where the per-token flags of non-finite inputs (which
      rows' cotangents are zeroed) are computed: "backward", with the input
      transforms before the kernels, where XLA fuses their reductions over K
      with the transformed gate (one fusion of 0.75 ms at (1, 8192, 32) on an
      H100, at about 0.4 TB/s); or "forward", by the forward of a
      differentiated call from the raw inputs, kept as one int8 [B, T, HV]
      residual (a forward without a gradient computes nothing more), by XLA
      in reductions of their own; or "prepare", as "forward" but stored by
      the forward's prepare kernel as it reads the inputs where
      ``kda_jax.triton.forward.flags_in_prepare`` allows (16-bit inputs, K a
      multiple of its K slice; XLA's elsewhere).
    fused_grads: the per-chunk gradients in one launch (``grads``) rather
      than three (``inter``, ``wy``, ``intra``): dw stays in registers and
      no partial gradient crosses a launch.
    """

    recompute: Mapping[str, PrepareConfig]
    state: Mapping[str, StateConfig]
    dstate: Mapping[str, StateConfig]
    inter: Mapping[str, BlockConfig]
    wy: Mapping[str, BlockConfig]
    intra: Mapping[str, IntraConfig]
    fold: FoldConfig
    gate_fp32_max_k: int
    chunk_states: str = "fp32"
    normalized_qk: str = "fp32"
    transform_residuals: str = "saved"
    nonfinite_flags: str = "backward"
    grads: Mapping[str, GradsConfig] | None = None
    fused_grads: bool = False

    def __post_init__(self):
        owner = "BackwardConfig"
        _set(self, "recompute", _variants(owner, "recompute", self.recompute, PrepareConfig,
                                          wide=False))
        _set(self, "state", _variants(owner, "state", self.state, StateConfig, wide=True,
                                      exact16=True))
        _set(self, "dstate", _variants(owner, "dstate", self.dstate, StateConfig, wide=True,
                                       exact16=True))
        _set(self, "inter", _variants(owner, "inter", self.inter, BlockConfig, wide=False,
                                      exact16=True))
        _set(self, "wy", _variants(owner, "wy", self.wy, BlockConfig, wide=False))
        _set(self, "intra", _variants(owner, "intra", self.intra, IntraConfig, wide=False))
        wy32 = self.wy[variant_key(self.wy, "float32", 128)]
        _check_dot(owner, "wy['fp32'].dot", wy32.dot, FP32_GRADE,
                   " (float32-grade: the products with X in float32 work)")
        if not isinstance(self.fold, FoldConfig):
            _fail(owner, "fold", self.fold, "must be a FoldConfig")
        _check_int(owner, "gate_fp32_max_k", self.gate_fp32_max_k, minimum=0)
        _check_choice(owner, "chunk_states", self.chunk_states, CHUNK_STATES)
        _check_choice(owner, "normalized_qk", self.normalized_qk, NORMALIZED_QK)
        _check_choice(owner, "transform_residuals", self.transform_residuals, TRANSFORM_RESIDUALS)
        _check_choice(owner, "nonfinite_flags", self.nonfinite_flags, NONFINITE_FLAGS)
        if self.grads is None:
            _set(self, "grads", grads_from(self.inter, self.wy, self.intra))
        _set(self, "grads", _variants(owner, "grads", self.grads, GradsConfig, wide=False,
                                      complete=False))
        if "fp32" in self.grads:
            _check_dot(owner, "grads['fp32'].x_dot", self.grads["fp32"].x_dot, FP32_GRADE,
                       " (float32-grade: the products with X in float32 work)")
        _check_bool(owner, "fused_grads", self.fused_grads)

    def grads_for(self, work: str, kd: int) -> GradsConfig | None:
        """The fused gradient kernel's config for intermediates of dtype name
        ``work`` at K = ``kd``, or None where the inter, wy and intra kernels
        run (``fused_grads`` off, or no variant of ``grads`` for it; the
        launch also runs them where its blocks leave a masked one:
        kda_jax.triton.backward.backward_launches)."""
        if not self.fused_grads:
            return None
        try:
            return self.grads[variant_key(self.grads, work, kd)]
        except KeyError:
            return None


RECURRENT_VARIANTS = ("dense", "varlen", "wide")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """The token-by-token kernel by variant: "dense" (K <= 128, host bounds
    whose sequences all have one length: no bound is loaded), "varlen"
    (K <= 128, the kernel loads the sequence bounds: varlen and bucketed
    batches, the serving decode) and "wide" (past K = 128, where the tile
    is twice as tall)."""

    decode: Mapping[str, DecodeConfig]

    def __post_init__(self):
        owner = "RecurrentConfig"
        value = self.decode
        if not isinstance(value, Mapping) or set(value) != set(RECURRENT_VARIANTS):
            _fail(owner, "decode", value, f"must be a dict with the variants "
                  f"{', '.join(RECURRENT_VARIANTS)}")
        for key, config in value.items():
            if not isinstance(config, DecodeConfig):
                _fail(owner, f"decode[{key!r}]", config, "must be a DecodeConfig")
        _set(self, "decode", value if isinstance(value, Variants) else Variants(value))


@dataclasses.dataclass(frozen=True)
class SegmentRule:
    """When one direction's state passes are cut into segments, and how long
    the segments are (the rule: :func:`kda_jax.segments.segment_chunks`).

    min_programs: segment when the state pass has fewer programs than this
      (non-empty sequences x value heads x V blocks); 0: never (unless the
      segment length is forced).
    target_programs: the cut sequences' segments give at most this many
      programs of the state pass over segments.
    min_segment_chunks: no segment shorter than this many chunks (each adds
      a [K, K] transition and a step of the fold); segments run from this
      length to just under twice it.
    """

    min_programs: int = 0
    target_programs: int = 1024
    min_segment_chunks: int = 8

    def __post_init__(self):
        owner = "SegmentRule"
        _check_int(owner, "min_programs", self.min_programs, minimum=0)
        _check_int(owner, "target_programs", self.target_programs, minimum=0)
        _check_int(owner, "min_segment_chunks", self.min_segment_chunks, minimum=1)


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """When chunk_kda cuts long sequences into segments whose chunk-state
    chains run in parallel (docs/kda.md section 7). The segment kernels'
    launches are ForwardConfig's and BackwardConfig's.

    forward / backward: each direction's rule (the backward's reverse pass
      runs twice over the segments, so it pays off at fewer programs).
    min_segments: segment only when some sequence makes at least this many
      segments (>= 2; two halves save little: the map and the state pass
      each walk half the chunks).
    segment_chunks: the segment length, skipping the rules (None: the
      rules decide); a call whose sequences all stay whole still runs
      unsegmented.
    xla: apply the forward rule on the XLA path too (its state pass is a
      scan over the longest segment's chunks instead of the longest
      sequence's).
    """

    forward: SegmentRule = SegmentRule()
    backward: SegmentRule = SegmentRule()
    min_segments: int = 2
    segment_chunks: int | None = None
    xla: bool = False

    def __post_init__(self):
        owner = "SegmentConfig"
        for name in ("forward", "backward"):
            if not isinstance(getattr(self, name), SegmentRule):
                _fail(owner, name, getattr(self, name), "must be a SegmentRule")
        _check_int(owner, "min_segments", self.min_segments, minimum=2)
        if self.segment_chunks is not None:
            _check_int(owner, "segment_chunks", self.segment_chunks, minimum=1)
        _check_bool(owner, "xla", self.xla)


# --------------------------------------------------------------------------- #
# Changing one value.
# --------------------------------------------------------------------------- #


_MISSING = object()


def replace(config, path, value=_MISSING):
    """``config`` with the field at ``path`` set to ``value``: dotted names
    through the family's kernels, variants and fields, e.g.
    ``replace(forward, "prepare.16bit.warps", 4)``; ``*`` for every variant
    (``"prepare.*.batched_l1"``); or several at once, ``replace(forward,
    {"prepare.*.split": True, "state.16bit.stages": 2})``. Values are taken as
    given (bench.sweep reads them from text). A path that names no field, or a
    value the config refuses, raises ValueError naming the whole path."""
    if isinstance(path, Mapping):
        if value is not _MISSING:
            raise TypeError(f"replace(config, {{path: value, ...}}) takes no value; got "
                            f"value={value!r} too")
        for each, v in path.items():
            config = replace(config, each, v)
        return config
    if not isinstance(path, str) or value is _MISSING:
        raise TypeError(f"replace(config, path, value) takes a dotted path string and a value, "
                        f"or replace(config, {{path: value, ...}}); got path={path!r}"
                        + ("" if value is not _MISSING else " and no value"))
    try:
        return _replace(config, path.split("."), value)
    except ValueError as e:
        raise ValueError(f"{path}={value!r}: {e}") from None


def _replace(config, names: list, value):
    head, rest = names[0], names[1:]
    if isinstance(config, Mapping):
        keys = list(config) if head == "*" else [head]
        unknown = [k for k in keys if k not in config]
        if unknown:
            raise ValueError(f"no variant {unknown[0]!r}; have {', '.join(config)}")
        if not rest:
            raise ValueError(f"{head!r} names a variant, not a field: add the field")
        return Variants({k: _replace(v, rest, value) if k in keys else v
                         for k, v in config.items()})
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"{config!r} has no field {head!r}")
    names_here = [f.name for f in dataclasses.fields(config)]
    if head not in names_here:
        raise ValueError(f"{type(config).__name__} has no field {head!r}; fields: "
                         f"{', '.join(names_here)}")
    new = _replace(getattr(config, head), rest, value) if rest else value
    return dataclasses.replace(config, **{head: new})


def as_dict(config):
    """``config`` as plain dicts, lists and values (for JSON reports)."""
    if isinstance(config, Mapping):
        return {k: as_dict(v) for k, v in config.items()}
    if dataclasses.is_dataclass(config):
        return {f.name: as_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return config
