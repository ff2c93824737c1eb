"""Launch configurations per GPU architecture, chosen at trace time.

Nothing here probes a device at import. :func:`current_arch` reads the default
JAX device when a call is traced; :func:`override` replaces the choice for the
calls traced inside it (the override is part of the jit cache key through the
config value the glue passes on). :func:`target_arch` names the arch instead
of the device, to lower on a machine without that GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

__all__ = ["ForwardConfig", "ARCHS", "FORWARD", "FORWARD_C32", "current_arch", "forward_config"]

ARCHS = ("sm90", "gfx950", "gfx1250", "gfx942", "default")
# Product precisions: the kernels' DOT constexprs, tl.dot's input_precision names and
# "bf16" (operands rounded to bf16; kda_jax/kernels/common.py, dot).
DOT_MODES = ("ieee", "tf32x3", "tf32", "bf16", "bf16x3", "bf16x6")


def _check_inverse_dot(name: str, value: str):
    """The inverse's merge products compound rounding through nilpotent powers:
    float32-grade modes or tf32 (with 16-bit inputs only, where X is used at
    16-bit or tf32 precision afterwards); never bf16."""
    if value not in ("ieee", "tf32x3", "tf32", "bf16x3", "bf16x6"):
        raise ValueError(f"{name}={value!r} must be 'ieee', 'tf32x3', 'tf32', 'bf16x3' or "
                         "'bf16x6' (the inverse's merge; bf16 operands lose too much)")


def _check_fp32_grade(name: str, value: str):
    """Products of the inverse (its merge compounds rounding through nilpotent
    powers) and with it in float32 work: only the float32-grade modes."""
    if value not in ("ieee", "tf32x3", "bf16x6"):
        raise ValueError(f"{name}={value!r} must be 'ieee', 'tf32x3' or 'bf16x6' "
                         "(float32-grade products)")


def _check_fields(config, *, blocks=(), warps=(), stages=(), dots=(), min_block=16):
    """Each named field of ``config`` against its kind: a power-of-two block
    >= min_block, a warp count, a stage count or a product precision."""
    for name in blocks:
        value = getattr(config, name)
        if not isinstance(value, int) or value < min_block or value & (value - 1):
            raise ValueError(f"{name}={value!r} must be a power of two >= {min_block}")
    for name in warps:
        if getattr(config, name) not in (1, 2, 4, 8, 16):
            raise ValueError(f"{name}={getattr(config, name)!r} must be one of 1, 2, 4, 8, 16")
    for name in stages:
        if getattr(config, name) not in (1, 2, 3, 4):
            raise ValueError(f"{name}={getattr(config, name)!r} must be one of 1, 2, 3, 4")
    for name in dots:
        if getattr(config, name) not in DOT_MODES:
            raise ValueError(f"{name}={getattr(config, name)!r} must be one of "
                             f"{', '.join(DOT_MODES)}")


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Launch parameters of the two forward kernels. Every field applies as
    it is (none stands in for another); the defaults are the "default"
    arch's entry.

    The prepare kernel (one program per chunk and value head):
    prepare_block_k / prepare_block_k_fp32: its K slice (the intra-chunk
      products loop over K in slices of this width) with 16-bit / float32
      inputs; float32 ones take fp32-grade products, which hold more registers.
    prepare_warps / prepare_stages: its num_warps / num_stages.
    prepare_split / prepare_split_fp32: Aqk and Akk in a pass over K each
      (one matrix's accumulators live at a time: fewer registers, the k and
      log-decay tiles read twice) instead of one pass for both, with 16-bit /
      float32 inputs.
    prepare_batched_l1: the two-level products' level 1 (pairs within 8-row
      blocks) as products batched over the 16-row diagonal blocks (at chunk
      64 a quarter of a whole-chunk product's registers and work, at 32
      half) instead of whole-chunk products masked to its pairs (docs/kda.md
      section 3).
    prepare_dot: precision of its intra-chunk products Akk and Aqk with
      16-bit inputs: "ieee" (fp32), "tf32x3" (NVIDIA only; three tf32
      products, about fp32 accuracy), "tf32" (NVIDIA only), "bf16" (operands
      rounded to bf16), "bf16x3" (three bf16 products of a two-term split,
      about 1e-5 relative; NVIDIA and AMD) or "bf16x6" (six products of a
      three-term split, about fp32 accuracy; NVIDIA and AMD).
    prepare_wu_dot: precision of w = X (beta k e^G) and u = X (beta v), with
      16-bit inputs.
    inverse_dot: precision of the products that merge the inverse's 16-row
      diagonal blocks (which are always exact float32 sweeps), with 16-bit
      inputs: "ieee", "tf32x3", "tf32", "bf16x3" or "bf16x6".
    fp32_dot: precision of every product of both kernels when the inputs are
      float32: users of float32 expect float32 accuracy, which the 16-bit
      and tf32 modes above do not give. (The state kernel multiplies 16-bit
      intermediates natively: exact products.)

    The state-and-output kernel (one program per sequence, value head and V
    block; its state tile is [K (padded), block_v] fp32), in three cases:
    state_block_v / state_warps / state_stages: 16-bit intermediates, K <= 128.
    state_block_v_wide / state_warps_wide: 16-bit intermediates, K > 128.
    state_block_v_fp32 / state_warps_fp32 / state_stages_fp32: float32
      intermediates (float32 inputs).
    Past K = 128 it always runs one stage: two stages of its [BT, K] tiles
    outgrow shared memory (an H200's 227 KiB; docs/tuning.md).
    """

    prepare_block_k: int = 64
    prepare_block_k_fp32: int = 64
    prepare_warps: int = 4
    prepare_stages: int = 1
    prepare_split: bool = False
    prepare_split_fp32: bool = False
    prepare_batched_l1: bool = False
    prepare_dot: str = "ieee"
    prepare_wu_dot: str = "ieee"
    inverse_dot: str = "ieee"
    fp32_dot: str = "ieee"
    state_block_v: int = 32
    state_warps: int = 4
    state_stages: int = 2
    state_block_v_wide: int = 32
    state_warps_wide: int = 4
    state_block_v_fp32: int = 32
    state_warps_fp32: int = 4
    state_stages_fp32: int = 2

    def __post_init__(self):
        _check_fields(
            self, blocks=("prepare_block_k", "prepare_block_k_fp32", "state_block_v",
                          "state_block_v_wide", "state_block_v_fp32"),
            warps=("prepare_warps", "state_warps", "state_warps_wide", "state_warps_fp32"),
            stages=("prepare_stages", "state_stages", "state_stages_fp32"),
            dots=("prepare_dot", "prepare_wu_dot", "inverse_dot", "fp32_dot"))
        _check_inverse_dot("inverse_dot", self.inverse_dot)
        for name in ("prepare_split", "prepare_split_fp32", "prepare_batched_l1"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")


# One entry per arch at chunk 64, then one per arch at chunk 32; every field
# written out. Why each is as it is, in a sentence; the measurements behind
# them are in docs/tuning.md ("Launch configs").
FORWARD = {
    # Whole-chunk [64, 16] prepare tiles at 8 warps (at 4, two programs fit
    # an SM but the in-kernel gate and L2 norm spill), their K-slice loads
    # staged three deep (one stage: 26 % slower at 4 warps); float32 inputs'
    # Aqk and Akk in a pass each (in one, their split products spill at
    # K = 128); tf32 Akk/Aqk and bf16 w/u stay within the bf16 tolerance
    # (fp32-grade products cost 10-60 %), float32 inputs get fp32-grade
    # products; three state stages, two for float32 tiles (three outgrow
    # shared memory).
    "sm90": ForwardConfig(
        prepare_block_k=16, prepare_block_k_fp32=16, prepare_warps=8, prepare_stages=3,
        prepare_split_fp32=True,
        prepare_dot="tf32", prepare_wu_dot="bf16", inverse_dot="tf32", fp32_dot="bf16x3",
        state_block_v=32, state_warps=4, state_stages=3,
        state_block_v_wide=16, state_warps_wide=8,
        state_block_v_fp32=16, state_warps_fp32=8, state_stages_fp32=2),
    # AMD: every product on bf16 matrix instructions (fp32 ones run at a small
    # fraction of their rate): bf16 w/u as on sm90, bf16x3 (about 1e-5
    # relative) where sm90 runs tf32 (Akk/Aqk, the inverse's merge, whose X is
    # rounded to bf16 for w/u anyway) and for float32 inputs as sm90 does;
    # Triton >= 3.6 (kda_jax.triton.compat.check_dot_mode). gfx950: sm90's
    # tiles at 4 waves of 64 compile without spills, Aqk and Akk in a pass
    # each (in one, their four [64, 64] accumulators take 301 VGPRs, one wave
    # per SIMD, against 254 and two); float32 state tiles take one stage to
    # fit 160 KiB of LDS.
    "gfx950": ForwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=4, prepare_stages=1,
        prepare_split=True,
        prepare_dot="bf16x3", prepare_wu_dot="bf16", inverse_dot="bf16x3", fp32_dot="bf16x3",
        state_block_v=32, state_warps=2, state_stages=2,
        state_block_v_wide=32, state_warps_wide=2,
        state_block_v_fp32=32, state_warps_fp32=2, state_stages_fp32=1),
    # gfx950's entry (the same wave64 CU, CDNA3, with 64 KiB of LDS) but for
    # the prepare kernel at 8 waves (at 4 it spilled 2 VGPRs with every
    # transform on) in one pass for 16-bit inputs (occupancy 2 either way),
    # in a pass each for float32 ones (in one, 4 VGPRs spill at K = 128 with
    # every transform on), and the float32 state tiles: [K, 16] at 4 waves, since
    # bf16x3 products of [K, 32] at 2 waves take 277 VGPRs and halve the
    # occupancy.
    "gfx942": ForwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=8, prepare_stages=1,
        prepare_split_fp32=True,
        prepare_dot="bf16x3", prepare_wu_dot="bf16", inverse_dot="bf16x3", fp32_dot="bf16x3",
        state_block_v=32, state_warps=2, state_stages=2,
        state_block_v_wide=32, state_warps_wide=2,
        state_block_v_fp32=16, state_warps_fp32=4, state_stages_fp32=1),
    # Wave32: twice gfx950's warps for the same tiles (docs/rocm.md).
    "gfx1250": ForwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=8, prepare_stages=1,
        prepare_dot="bf16x3", prepare_wu_dot="bf16", inverse_dot="bf16x3", fp32_dot="bf16x3",
        state_block_v=32, state_warps=4, state_stages=2,
        state_block_v_wide=32, state_warps_wide=4,
        state_block_v_fp32=32, state_warps_fp32=4, state_stages_fp32=2),
    # Any other GPU: fp32 products, moderate tiles.
    "default": ForwardConfig(
        prepare_block_k=64, prepare_block_k_fp32=64, prepare_warps=4, prepare_stages=1,
        prepare_dot="ieee", prepare_wu_dot="ieee", inverse_dot="ieee", fp32_dot="ieee",
        state_block_v=32, state_warps=4, state_stages=2,
        state_block_v_wide=32, state_warps_wide=4,
        state_block_v_fp32=32, state_warps_fp32=4, state_stages_fp32=2),
}
FORWARD_C32 = {
    # As at chunk 64 but one stage; the float32 state kernel takes 4 warps (8
    # spill at K = 128).
    "sm90": ForwardConfig(
        prepare_block_k=16, prepare_block_k_fp32=16, prepare_warps=8, prepare_stages=1,
        prepare_dot="tf32", prepare_wu_dot="bf16", inverse_dot="tf32", fp32_dot="bf16x3",
        state_block_v=32, state_warps=4, state_stages=3,
        state_block_v_wide=16, state_warps_wide=8,
        state_block_v_fp32=16, state_warps_fp32=4, state_stages_fp32=2),
    # As at chunk 64: the smaller chunk holds fewer registers and less LDS.
    "gfx950": FORWARD["gfx950"],
    "gfx942": FORWARD["gfx942"],
    "gfx1250": FORWARD["gfx1250"],
    "default": FORWARD["default"],
}


def current_arch() -> str:
    """The default device's architecture key (one of ARCHS), read at trace time,
    or the arch chosen with :func:`target_arch`."""
    explicit = explicit_arch()
    if explicit is not None:
        return explicit
    import jax

    device = jax.devices()[0]
    if device.platform in ("gpu", "cuda"):
        cc = getattr(device, "compute_capability", None)
        if cc is not None and str(cc).split(".")[0] == "9":
            return "sm90"
        return "default"
    if device.platform == "rocm":
        kind = str(getattr(device, "compute_capability", "") or device.device_kind).lower()
        for arch in ("gfx950", "gfx1250", "gfx942"):
            if arch in kind:
                return arch
        return "default"
    return "default"


class _Table:
    """The per-arch configs of one kernel family, by chunk size (the key None
    for a family whose configs do not depend on it), with a trace-time
    override (a context variable, so the override is local to the thread and
    the ``with`` block)."""

    def __init__(self, kind: type, by_chunk: dict):
        self.kind, self.by_chunk = kind, by_chunk
        for chunk, table in by_chunk.items():
            missing = [a for a in ARCHS if a not in table]
            if missing:
                raise ValueError(f"the {kind.__name__} table at chunk {chunk} lacks {missing}")
        self.chosen = contextvars.ContextVar(f"kda_jax_{kind.__name__}", default=None)

    def get(self, arch: str | None, chunk_size: int | None = None):
        chosen = self.chosen.get()
        if chosen is not None:
            return chosen
        arch = current_arch() if arch is None else arch
        table = self.by_chunk.get(None if None in self.by_chunk else chunk_size)
        if table is None:
            raise ValueError(f"chunk_size={chunk_size!r} has no {self.kind.__name__} table; "
                             f"known: {', '.join(map(str, self.by_chunk))}")
        if arch not in table:
            raise ValueError(f"arch={arch!r} has no {self.kind.__name__}; known: "
                             f"{', '.join(table)}")
        return table[arch]

    @contextlib.contextmanager
    def override(self, config):
        if not isinstance(config, self.kind):
            raise TypeError(f"config must be a {self.kind.__name__}, got "
                            f"{type(config).__name__}")
        token = self.chosen.set(config)
        try:
            yield config
        finally:
            self.chosen.reset(token)


_FORWARD = _Table(ForwardConfig, {64: FORWARD, 32: FORWARD_C32})


def forward_config(arch: str | None = None, chunk_size: int = 64) -> ForwardConfig:
    """The forward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    return _FORWARD.get(arch, chunk_size)


# --------------------------------------------------------------------------- #
# The token-by-token (decode) kernel.
# --------------------------------------------------------------------------- #

__all__ += ["RecurrentConfig", "RECURRENT", "recurrent_config"]


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Launch parameters of the fused recurrent kernel (one program per
    sequence, value head and V block; the whole of K in each program, its
    state tile [K (padded), block_v] fp32 in registers). Every field applies
    as it is; the defaults are the "default" arch's entry.

    block_v: the V block at K <= 128 with host bounds whose sequences all
      have one length (the dense decode: no bound is loaded).
    block_v_bounds: the V block at K <= 128 when the kernel loads the
      sequence bounds (varlen and bucketed batches: the serving decode).
    block_v_wide: the V block past K = 128, where the tile is twice as tall.
    warps: num_warps.
    stages: num_stages, and the software-pipelining depth of the token loop
      (its next token's loads issued before this token's update).
    """

    block_v: int = 32
    block_v_bounds: int = 32
    block_v_wide: int = 32
    warps: int = 4
    stages: int = 2

    def __post_init__(self):
        _check_fields(self, blocks=("block_v", "block_v_bounds", "block_v_wide"),
                      warps=("warps",), min_block=8)
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages={self.stages!r} must be >= 1")


# A [128, 32] fp32 tile over 64 lanes (2 warps or waves of 32, or 1 of 64) is
# 64 values per lane, over 128 lanes 32 (twice that at K = 256). One sentence
# each on why; measurements in docs/tuning.md ("Decode").
RECURRENT = {
    # 32-wide tiles at 2 warps: against 64-wide dense / 32-wide pool tiles at
    # 4 warps, the bf16 pool 0.307 against 0.358 ms and verify (S = 3) 1.028
    # against 1.103 at N = 256, the float32 pool equal, the dense step 0.383
    # against 0.374 (one H100 run, docs/tuning.md "Decode"); 64-wide dense
    # tiles at 2 warps put verify at 1.135.
    "sm90": RecurrentConfig(block_v=32, block_v_bounds=32, block_v_wide=32, warps=2, stages=2),
    # Untimed: 2 waves of 64 hold the tile over 128 lanes, as sm90's 4 warps of
    # 32 did before its 2-warp config.
    "gfx950": RecurrentConfig(block_v=32, block_v_bounds=32, block_v_wide=32, warps=2, stages=2),
    "gfx942": RecurrentConfig(block_v=32, block_v_bounds=32, block_v_wide=32, warps=2, stages=2),
    # Untimed: wave32, sm90's earlier 4 warps of 32 (128 lanes).
    "gfx1250": RecurrentConfig(block_v=32, block_v_bounds=32, block_v_wide=32, warps=4, stages=2),
    "default": RecurrentConfig(block_v=32, block_v_bounds=32, block_v_wide=32, warps=4, stages=2),
}

_RECURRENT = _Table(RecurrentConfig, {None: RECURRENT})


def recurrent_config(arch: str | None = None) -> RecurrentConfig:
    """The decode kernel's config for ``arch`` (default: the current device), or
    the override."""
    return _RECURRENT.get(arch)


# --------------------------------------------------------------------------- #
# The target without its GPU: lowering or exporting on another machine.
# --------------------------------------------------------------------------- #

__all__ += ["target_arch", "explicit_arch"]

_TARGET_ARCH: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kda_jax_target_arch", default=None
)


def explicit_arch() -> str | None:
    """The arch chosen with :func:`target_arch`, or None (the device decides)."""
    return _TARGET_ARCH.get()


@contextlib.contextmanager
def target_arch(arch: str):
    """Traces and lowers the calls inside the ``with`` block for ``arch`` (one
    of ARCHS but "default") instead of the default device: its config, and in
    the Triton path the code object and launch (kda_jax.triton.compat). This
    lets a machine without that GPU lower for it, e.g.
    ``jax.jit(f).trace(*specs).lower(lowering_platforms=("rocm",))``.

    jax caches traces and lowerings per function, not per arch: lower a
    freshly defined function for each arch.
    """
    if arch not in ARCHS or arch == "default":
        known = ", ".join(a for a in ARCHS if a != "default")
        raise ValueError(f"arch={arch!r} is not a target; use one of {known}")
    token = _TARGET_ARCH.set(arch)
    try:
        yield arch
    finally:
        _TARGET_ARCH.reset(token)


# --------------------------------------------------------------------------- #
# The backward kernels of chunk_kda (kda_jax.kernels.chunk_bwd).
# --------------------------------------------------------------------------- #

__all__ += ["BackwardConfig", "BACKWARD", "BACKWARD_C32", "backward_config"]


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters of the backward's recompute and five kernels. Every
    field applies as it is; the defaults are the "default" arch's entry.

    The recompute (the forward's prepare kernel, storing X too):
    prepare_block_k / prepare_block_k_fp32 / prepare_warps / prepare_stages /
      prepare_split / prepare_split_fp32 / prepare_dot / prepare_wu_dot /
      inverse_dot: as ForwardConfig's.
    prepare_warps_fp32 / prepare_stages_fp32: its num_warps / num_stages with
      float32 intermediates (prepare_warps / prepare_stages: 16-bit ones).
    prepare_dot_fp32: every recompute product with float32 inputs (as
      ForwardConfig.fp32_dot).
    batched_l1: the two-level products' level 1 batched over diagonal blocks
      (ForwardConfig.prepare_batched_l1) in the recompute and the intra kernel.

    Both state passes (forward h and reverse dS; one program per sequence,
    head and V block):
    state_block_v / state_block_v_fp32: their V block with 16-bit / float32
      intermediates (the float32 one at most 16 where K or V is not a power
      of two: kda_jax.triton.backward.state_block_v).
    state_warps / state_warps_wide: their warps at K <= 128 / past it.
    state_stages / state_stages_fp32: the forward pass's stages at K <= 128
      with 16-bit / float32 intermediates (past K = 128 one stage: two
      outgrow shared memory, as in the forward).
    dstate_stages / dstate_stages_fp32: the reverse pass's, likewise (it
      pipelines five tiles to the forward pass's three, so each stage costs
      it more shared memory).
    dstate_split_k: the reverse pass holds dS as two K halves where the
      state passes hold the state so (float32 intermediates, K > 64:
      kda_jax.triton.forward.split_state_k); False keeps one [K, BV] tile.

    The per-chunk kernels:
    inter_block_k / inter_block_v / inter_block_v_fp32 / inter_warps: the
      state terms (grid chunks x heads x K blocks; loops over V blocks; the
      V block with 16-bit / float32 intermediates).
    wy_block_k / wy_block_k_fp32 / wy_block_v / wy_warps: the gradients
      through X (grid chunks x heads; loops over K and V blocks; the K block
      with 16-bit / float32 intermediates).
    wy_dot / wy_dot_fp16 / wy_dot_fp32: precision of its dots with X^T and
      of dw w^T with bfloat16 / float16 / float32 intermediates (the last
      float32-grade: "ieee", "tf32x3" or "bf16x6"); products of two 16-bit
      intermediates are native 16-bit products.
    intra_block_k / intra_warps: the products' backward (grid chunks x heads
      x K blocks).
    product_dot / product_dot_fp16 / product_dot_fp32: precision of the
      products' backward in the intra kernel with bfloat16 / float16 / float32
      intermediates (see ForwardConfig.prepare_dot). float16 has its own
      fields: its bar is 2.5x tighter than bfloat16's (kda_jax.testing).
    fp32_dot: precision of the state passes' and the inter kernel's products
      when the intermediates are float32 (16-bit ones multiply exactly).
    gate_fp32_max_k: with the in-kernel gate (use_gate_in_kernel), 16-bit
      inputs get float32 intermediates (and the *_fp32 fields), as float32
      inputs do, for K up to this (0: never; past it the float32 state passes
      spill on that arch and chunk). The gate parameters' gradients (dA_log, ddt_bias)
      sum the per-token gate gradient over every token and channel; that
      gradient is a difference of nearly equal sums, and the rounding of each
      16-bit intermediate (w, u, qg, kt, Aqk, v_new, dv_new, and h / dS
      rounded for their products) moves those sums coherently, each by
      0.5-9e-3 relative on its own: only float32 throughout brings them under
      1e-3 (docs/kda.md section 6). Without the in-kernel gate the per-token
      gradients meet their 16-bit bars with 16-bit intermediates.
    """

    prepare_block_k: int = 64
    prepare_block_k_fp32: int = 64
    prepare_warps: int = 4
    prepare_stages: int = 1
    prepare_warps_fp32: int = 4
    prepare_stages_fp32: int = 1
    prepare_split: bool = False
    prepare_split_fp32: bool = False
    prepare_dot: str = "ieee"
    prepare_wu_dot: str = "ieee"
    inverse_dot: str = "ieee"
    prepare_dot_fp32: str = "ieee"
    state_block_v: int = 32
    state_block_v_fp32: int = 32
    state_warps: int = 4
    state_warps_wide: int = 4
    state_stages: int = 2
    state_stages_fp32: int = 2
    dstate_stages: int = 2
    dstate_stages_fp32: int = 2
    dstate_split_k: bool = True
    inter_block_k: int = 64
    inter_block_v: int = 64
    inter_block_v_fp32: int = 64
    inter_warps: int = 4
    wy_block_k: int = 32
    wy_block_k_fp32: int = 32
    wy_block_v: int = 32
    wy_warps: int = 4
    wy_dot: str = "ieee"
    wy_dot_fp16: str = "ieee"
    wy_dot_fp32: str = "ieee"
    intra_block_k: int = 32
    intra_warps: int = 4
    batched_l1: bool = False
    product_dot: str = "ieee"
    product_dot_fp16: str = "ieee"
    product_dot_fp32: str = "ieee"
    fp32_dot: str = "ieee"
    gate_fp32_max_k: int = 256

    def __post_init__(self):
        _check_fields(
            self, blocks=("prepare_block_k", "prepare_block_k_fp32", "state_block_v",
                          "state_block_v_fp32", "inter_block_k", "inter_block_v",
                          "inter_block_v_fp32", "wy_block_k", "wy_block_k_fp32",
                          "wy_block_v", "intra_block_k"),
            warps=("prepare_warps", "prepare_warps_fp32", "state_warps", "state_warps_wide",
                   "inter_warps", "wy_warps", "intra_warps"),
            stages=("prepare_stages", "prepare_stages_fp32", "state_stages", "state_stages_fp32",
                    "dstate_stages", "dstate_stages_fp32"),
            dots=("prepare_dot", "prepare_wu_dot", "inverse_dot", "prepare_dot_fp32", "wy_dot",
                  "wy_dot_fp16", "wy_dot_fp32", "product_dot", "product_dot_fp16",
                  "product_dot_fp32", "fp32_dot"))
        _check_inverse_dot("inverse_dot", self.inverse_dot)
        _check_fp32_grade("wy_dot_fp32", self.wy_dot_fp32)
        for name in ("dstate_split_k", "prepare_split", "prepare_split_fp32", "batched_l1"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if (not isinstance(self.gate_fp32_max_k, int) or isinstance(self.gate_fp32_max_k, bool)
                or self.gate_fp32_max_k < 0):
            raise ValueError(f"gate_fp32_max_k={self.gate_fp32_max_k!r} must be an int >= 0 "
                             "(0: 16-bit intermediates with the in-kernel gate too)")


# One entry per arch at chunk 64, then at chunk 32; every field written out,
# one sentence each on why (measurements: docs/tuning.md, "Launch configs").
BACKWARD = {
    # The recompute as the forward's prepare runs with 16-bit intermediates
    # (its precisions, 8 warps, three stages, one pass): 0.7 ms faster at
    # (1, 8192, 32) than split-bf16 products at 4 warps, the bf16 gradients
    # within 3.5e-3 of the float32 reference (docs/tuning.md); with float32
    # ones as before: fp32-grade products at 4 warps and one stage, Aqk and
    # Akk in a pass each (at 8 warps and three stages they spilled 52 bytes,
    # in one pass 8-76, under Triton 3.9). bfloat16 intermediates: tf32
    # products in the products' backward and X^T rounded to bf16 in wy (as
    # the forward's w/u round it), 0.70 ms faster than split-bf16 ones, the
    # gradients within 3.6e-3 (bf16 products in both: 0.23 ms more off, dg at
    # 6.6e-3); float16 ones keep split-bf16 (with tf32 and bf16, dv and dg at
    # 1.9-2.0e-3 against the 2e-3 bar). Float32 intermediates (the layer's
    # in-kernel gate, float32 inputs): split-bf16 in the state passes, the
    # inter kernel and the products' backward, their state passes over
    # 32-wide V blocks (one wave of 128 programs at (1, 8192, 32), where
    # 16-wide ones took two), tf32x3 in wy over 16-wide K blocks (32 bytes
    # spill under Triton 3.6, none under 3.9): 11.30 against 12.45 ms at the
    # layer's gates, the GPU gradient tiers passing (docs/tuning.md).
    # 32-wide intra K blocks at 8 warps (each chunk's [BT, BT] work half as
    # often as at 16; 64-wide ones spill); the largest 16-bit wy blocks that
    # compile without spills at every spec; the in-kernel gate's float32
    # intermediates up to K = 128 (at K = 256 the float32 state passes spill
    # over a KiB); the state passes a launch each at two stages (one launch,
    # or the reverse pass at one stage, measured no faster: docs/tuning.md).
    "sm90": BackwardConfig(
        prepare_block_k=16, prepare_block_k_fp32=16, prepare_warps=8, prepare_stages=3,
        prepare_warps_fp32=4, prepare_stages_fp32=1,
        prepare_split=False, prepare_split_fp32=True,
        prepare_dot="tf32", prepare_wu_dot="bf16", inverse_dot="tf32",
        prepare_dot_fp32="bf16x3",
        state_block_v=16, state_block_v_fp32=32, state_warps=4,
        state_warps_wide=8, state_stages=2,
        state_stages_fp32=2, dstate_stages=2, dstate_stages_fp32=2,
        dstate_split_k=True,
        inter_block_k=32, inter_block_v=64, inter_block_v_fp32=32, inter_warps=4,
        wy_block_k=32, wy_block_k_fp32=16, wy_block_v=32, wy_warps=8,
        wy_dot="bf16", wy_dot_fp16="bf16x3",
        wy_dot_fp32="tf32x3",
        intra_block_k=32, intra_warps=8, product_dot="tf32", product_dot_fp16="bf16x3",
        product_dot_fp32="bf16x3", fp32_dot="bf16x3",
        gate_fp32_max_k=128),
    # AMD, untuned tiles: bf16x3 wherever sm90 runs split products (its tf32x3
    # w/u included); float32 intermediates keep "ieee" in the state passes and
    # the inter kernel (bf16x6 there halves occupancy or spills, for little
    # matrix work), and fp32 FMA products in the wy kernel's float32 form (its
    # 32-wide K blocks; 16 on gfx942). gfx950: 2
    # waves of 64 for the state passes, whose float32 form takes one stage to
    # fit 160 KiB of LDS; 16-wide intra K blocks, where 32-wide ones under
    # bf16x3 hold 264-352 VGPRs, one wave per SIMD.
    "gfx950": BackwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=4, prepare_stages=1,
        prepare_warps_fp32=4, prepare_stages_fp32=1,
        prepare_dot="bf16x3", prepare_wu_dot="bf16x3", inverse_dot="bf16x3",
        prepare_dot_fp32="bf16x3",
        state_block_v=32, state_block_v_fp32=32, state_warps=2,
        state_warps_wide=2, state_stages=2,
        state_stages_fp32=1, dstate_stages=2, dstate_stages_fp32=1,
        dstate_split_k=True,
        inter_block_k=64, inter_block_v=64, inter_block_v_fp32=64, inter_warps=2,
        wy_block_k=32, wy_block_k_fp32=32, wy_block_v=32, wy_warps=4,
        wy_dot="bf16x3", wy_dot_fp16="bf16x3",
        wy_dot_fp32="ieee",
        intra_block_k=16, intra_warps=4, product_dot="bf16x3", product_dot_fp16="bf16x3",
        product_dot_fp32="bf16x3",
        fp32_dot="ieee",
        gate_fp32_max_k=256),
    # 64 KiB of LDS fits the state passes at one stage and 4 waves; the intra
    # kernel takes 16-wide K blocks (32 spill a VGPR), the wy kernel 16 x 16
    # blocks (32 x 32 halve its occupancy under bf16x3); the in-kernel gate's
    # float32 intermediates up to K = 128 (at 256 its float32 state passes
    # drop to one wave).
    "gfx942": BackwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=8, prepare_stages=1,
        prepare_warps_fp32=8, prepare_stages_fp32=1,
        prepare_dot="bf16x3", prepare_wu_dot="bf16x3", inverse_dot="bf16x3",
        prepare_dot_fp32="bf16x3",
        state_block_v=32, state_block_v_fp32=32, state_warps=4,
        state_warps_wide=4, state_stages=1,
        state_stages_fp32=1, dstate_stages=1, dstate_stages_fp32=1,
        dstate_split_k=True,
        inter_block_k=64, inter_block_v=64, inter_block_v_fp32=64, inter_warps=2,
        wy_block_k=16, wy_block_k_fp32=16, wy_block_v=16, wy_warps=4,
        wy_dot="bf16x3", wy_dot_fp16="bf16x3",
        wy_dot_fp32="ieee",
        intra_block_k=16, intra_warps=8, product_dot="bf16x3", product_dot_fp16="bf16x3",
        product_dot_fp32="bf16x3",
        fp32_dot="ieee",
        gate_fp32_max_k=128),
    # Wave32: twice gfx950's warps for the recompute; the wy kernel at 16
    # warps and 32 x 64 blocks, where its halved X^T products fit 150 VGPRs
    # (6 waves per SIMD, as under ieee; docs/tuning.md); 16-wide intra K
    # blocks as gfx950's (32-wide ones hold 619 VGPRs at chunk 64).
    "gfx1250": BackwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=8, prepare_stages=1,
        prepare_warps_fp32=8, prepare_stages_fp32=1,
        prepare_split=True, prepare_split_fp32=True,
        prepare_dot="bf16x3", prepare_wu_dot="bf16x3", inverse_dot="bf16x3",
        prepare_dot_fp32="bf16x3",
        state_block_v=32, state_block_v_fp32=32, state_warps=4,
        state_warps_wide=4, state_stages=2,
        state_stages_fp32=2, dstate_stages=2, dstate_stages_fp32=2,
        dstate_split_k=True,
        inter_block_k=64, inter_block_v=64, inter_block_v_fp32=64, inter_warps=4,
        wy_block_k=32, wy_block_k_fp32=32, wy_block_v=64, wy_warps=16,
        wy_dot="bf16x3", wy_dot_fp16="bf16x3",
        wy_dot_fp32="ieee",
        intra_block_k=16, intra_warps=4, product_dot="bf16x3", product_dot_fp16="bf16x3",
        product_dot_fp32="bf16x3",
        fp32_dot="ieee",
        gate_fp32_max_k=256),
    # Any other GPU: fp32 products, moderate tiles.
    "default": BackwardConfig(
        prepare_block_k=64, prepare_block_k_fp32=64, prepare_warps=4, prepare_stages=1,
        prepare_warps_fp32=4, prepare_stages_fp32=1,
        prepare_dot="ieee", prepare_wu_dot="ieee", inverse_dot="ieee", prepare_dot_fp32="ieee",
        state_block_v=32, state_block_v_fp32=32, state_warps=4,
        state_warps_wide=4, state_stages=2,
        state_stages_fp32=2, dstate_stages=2, dstate_stages_fp32=2,
        dstate_split_k=True,
        inter_block_k=64, inter_block_v=64, inter_block_v_fp32=64, inter_warps=4,
        wy_block_k=32, wy_block_k_fp32=32, wy_block_v=32, wy_warps=4,
        wy_dot="ieee", wy_dot_fp16="ieee",
        wy_dot_fp32="ieee",
        intra_block_k=32, intra_warps=4, product_dot="ieee", product_dot_fp16="ieee",
        product_dot_fp32="ieee",
        fp32_dot="ieee",
        gate_fp32_max_k=256),
}
BACKWARD_C32 = {
    # 32-wide recompute slices at 8 warps, Aqk and Akk in a pass each (in
    # one, the two levels' four accumulators spill 32-68 bytes under Triton
    # 3.9; untimed) and 16-wide inter blocks, where the
    # chunk-64 entry spills under ptxas's register caps at chunk 32; dS in
    # one tile; the in-kernel gate's float32 intermediates up to K = 64 (the
    # float32 state passes spill 8-64 bytes at K = 100).
    "sm90": BackwardConfig(
        prepare_block_k=32, prepare_block_k_fp32=32, prepare_warps=8, prepare_stages=1,
        prepare_warps_fp32=8, prepare_stages_fp32=1,
        prepare_split=True, prepare_split_fp32=True,
        prepare_dot="bf16x3", prepare_wu_dot="tf32x3", inverse_dot="bf16x3",
        prepare_dot_fp32="bf16x3",
        state_block_v=16, state_block_v_fp32=16, state_warps=4,
        state_warps_wide=8, state_stages=2,
        state_stages_fp32=2, dstate_stages=2, dstate_stages_fp32=2,
        dstate_split_k=False,
        inter_block_k=16, inter_block_v=16, inter_block_v_fp32=16, inter_warps=4,
        wy_block_k=16, wy_block_k_fp32=16, wy_block_v=16, wy_warps=4,
        wy_dot="bf16x3", wy_dot_fp16="bf16x3",
        wy_dot_fp32="ieee",
        intra_block_k=16, intra_warps=8, product_dot="bf16x3", product_dot_fp16="bf16x3",
        product_dot_fp32="bf16x3",
        fp32_dot="tf32x3",
        gate_fp32_max_k=64),
    # As at chunk 64.
    "gfx950": BACKWARD["gfx950"],
    "gfx942": BACKWARD["gfx942"],
    "gfx1250": BACKWARD["gfx1250"],
    "default": BACKWARD["default"],
}

_BACKWARD = _Table(BackwardConfig, {64: BACKWARD, 32: BACKWARD_C32})


def backward_config(arch: str | None = None, chunk_size: int = 64) -> BackwardConfig:
    """The backward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    return _BACKWARD.get(arch, chunk_size)


# --------------------------------------------------------------------------- #
# The segmented schedule of chunk_kda (kda_jax.segments; the Triton path's
# kda_jax.triton.state_chain, the XLA path's kda_jax.segmented).
# --------------------------------------------------------------------------- #

__all__ += ["SegmentConfig", "SEGMENTS", "segment_config"]


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """When chunk_kda cuts long sequences into segments whose chunk-state
    chains run in parallel (docs/kda.md section 7; the rule is
    :func:`kda_jax.segments.segment_chunks`).

    min_programs: the forward segments when its state pass has fewer
      programs than this (non-empty sequences x value heads x V blocks of
      the state kernel); 0: never (unless segment_chunks forces it).
    backward_min_programs: the backward's threshold in place of
      min_programs (its reverse pass runs twice over the segments, so it
      pays off at fewer programs); 0: never (unless forced).
    target_programs: the cut sequences' segments give at most this many
      programs of the forward's state-output pass over segments (at its V
      blocks: state_block_v below; min_segment_chunks may make fewer, and a
      sequence too short to cut adds its own). When fewer than min_segments
      segments per sequence fit, the call runs one pass.
    min_segment_chunks: no segment shorter than this many chunks (each
      segment adds a [K, K] transition and a step of the fold); segments run
      from this length to just under twice it.
    backward_target_programs / backward_min_segment_chunks: the same for
      the backward, counted at its state pass's V blocks (None: the
      forward's values).
    min_segments: segment only when some sequence makes at least this many
      segments (>= 2; two halves save little: the map and the state pass each
      walk half the chunks).
    segment_chunks: the segment length, skipping the thresholds (None: the
      rule); a call whose sequences all stay whole still runs unsegmented.
    xla: apply the rule on the XLA path too (its state pass is a scan over
      the longest segment's chunks instead of the longest sequence's).
    state_block_v / state_warps: the forward's state-output pass over
      segments with 16-bit inputs, when V is a multiple of the block: its V
      block and warps (None, float32 inputs and masked V columns:
      ForwardConfig's, as the one pass).
    map_block_v / map_warps / map_stages: the forward's map kernel: its
      column block, warps and pipeline stages (kda_jax/kernels/segments.py; None:
      those of the forward's state pass over segments). The backward's map
      takes its state pass's.
    fold_dot: the fold kernel's product precision (float32 states and maps;
      'ieee', 'tf32x3', 'bf16x3' or 'bf16x6'), forward and backward alike.
    fold_block_j / fold_warps: the fold's [K, K] maps are read in column
      slices of fold_block_j (None: whole, one product per segment), at
      fold_warps warps; forward and backward alike.
    """

    min_programs: int = 0
    target_programs: int = 1024
    min_segment_chunks: int = 8
    min_segments: int = 2
    segment_chunks: int | None = None
    xla: bool = False
    backward_min_programs: int = 0
    backward_target_programs: int | None = None
    backward_min_segment_chunks: int | None = None
    state_block_v: int | None = None
    state_warps: int | None = None
    map_block_v: int | None = None
    map_warps: int | None = None
    map_stages: int | None = None
    fold_dot: str = "ieee"
    fold_block_j: int | None = 16  # slices of 16 compile without spills on every target
    fold_warps: int = 4

    def __post_init__(self):
        if self.fold_dot not in ("ieee", "tf32x3", "bf16x3", "bf16x6"):
            raise ValueError(f"fold_dot={self.fold_dot!r} must be 'ieee', 'tf32x3', 'bf16x3' "
                             "or 'bf16x6' (the fold carries float32 states)")
        for name, allowed in (("map_block_v", (16, 32, 64, 128)), ("map_warps", (1, 2, 4, 8)),
                              ("map_stages", (1, 2, 3, 4)),
                              ("state_block_v", (16, 32, 64, 128)), ("state_warps", (1, 2, 4, 8)),
                              ("fold_block_j", (16, 32, 64, 128))):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in allowed):
                raise ValueError(f"{name}={value!r} must be None or one of {allowed}")
        if isinstance(self.fold_warps, bool) or self.fold_warps not in (1, 2, 4, 8):
            raise ValueError(f"fold_warps={self.fold_warps!r} must be one of (1, 2, 4, 8)")
        optional = ("backward_target_programs", "backward_min_segment_chunks")
        for name in ("min_programs", "target_programs", "min_segment_chunks",
                     "backward_min_programs", "min_segments") + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        for name in ("min_segment_chunks", "backward_min_segment_chunks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.min_segments < 2:
            raise ValueError(f"min_segments={self.min_segments} must be >= 2 (one segment is "
                             "the one pass)")
        if self.segment_chunks is not None and (
                isinstance(self.segment_chunks, bool) or not isinstance(self.segment_chunks, int)
                or self.segment_chunks < 1):
            raise ValueError(f"segment_chunks={self.segment_chunks!r} must be None or an "
                             "int >= 1")
        if not isinstance(self.xla, bool):
            raise ValueError(f"xla={self.xla!r} must be True or False")


# sm90: the forward segments when its state pass has fewer than 128 programs
# (the H200 has 132 SMs) and a sequence makes 4 segments of 64 chunks or more,
# into segments that give at most 128 programs of its state-output pass over
# segments, which takes 64-wide V blocks (two per head at V = 128): one wave
# at one block per SM (its three stages hold 208 KiB of shared memory). The
# map kernel at 64 columns and two stages (88 KiB, two blocks per SM) walks
# the same segments in one wave of up to 256 programs. The backward segments
# below 64 programs, at its own V blocks (8 at V = 128), in segments of at
# least 128 chunks that give at most 512 programs. The fold reads each map
# whole at 8 warps (170 registers at K = 128). Measured on the H200 in
# docs/tuning.md ("Segmented state chain", "Segment geometry"). At 17 to 31
# heads fewer than 4 segments per sequence fit in 128 programs, so the forward
# runs one pass there (not measured).
# The segmented state passes keep three stages: at one (three blocks per SM)
# the forward was 14-46 % slower.
# The AMD targets and other GPUs: off until measured there (force it with
# override; the kernels compile for every target, bench.aot). The
# fold's products: bf16x3 on sm90 and the AMD targets (about 1e-5 relative, as
# their float32 state passes' products, ForwardConfig.fp32_dot), ieee elsewhere;
# the AMD targets read the maps in 16-column slices (at 32, bf16x3 products
# spilled on gfx942 at 8 warps).
SEGMENTS = {
    "sm90": SegmentConfig(
        min_programs=128, target_programs=128, min_segment_chunks=64, min_segments=4,
        backward_min_programs=64, backward_target_programs=512,
        backward_min_segment_chunks=128, state_block_v=64, map_block_v=64, map_stages=2,
        fold_dot="bf16x3", fold_block_j=None, fold_warps=8),
    "gfx950": SegmentConfig(fold_dot="bf16x3"),
    "gfx942": SegmentConfig(fold_dot="bf16x3"),
    "gfx1250": SegmentConfig(fold_dot="bf16x3"),
    "default": SegmentConfig(),
}

_SEGMENTS = _Table(SegmentConfig, {None: SEGMENTS})


def segment_config(arch: str | None = None) -> SegmentConfig:
    """The segmented schedule's config for ``arch`` (default: the current
    device), or the override."""
    return _SEGMENTS.get(arch)


# --------------------------------------------------------------------------- #
# Choosing configs for a block of code.
# --------------------------------------------------------------------------- #

__all__ += ["override"]
_TABLES = (_FORWARD, _BACKWARD, _RECURRENT, _SEGMENTS)


@contextlib.contextmanager
def override(*chosen):
    """Uses each config given (a ForwardConfig, BackwardConfig, RecurrentConfig
    or SegmentConfig, at most one of each kind) for every chunk_kda /
    fused_recurrent_kda traced inside the ``with`` block, on every arch and
    chunk size; the per-arch tables elsewhere. Yields the config, or the tuple
    of them. E.g. ``with override(SegmentConfig(segment_chunks=2)):`` forces
    segments; ``with override(forward_config("gfx950"), backward_config("gfx950")):``
    runs gfx950's configs on this device."""
    tables = []
    for config in chosen:
        table = next((t for t in _TABLES if isinstance(config, t.kind)), None)
        if table is None:
            raise TypeError("config must be a ForwardConfig, BackwardConfig, RecurrentConfig "
                            f"or SegmentConfig, got {type(config).__name__}: {config!r}")
        if table in tables:
            raise ValueError(f"two {table.kind.__name__}s given to override: pass one of "
                             "each kind")
        tables.append(table)
    if not chosen:
        raise ValueError("override() needs a config: a ForwardConfig, BackwardConfig, "
                         "RecurrentConfig or SegmentConfig")
    with contextlib.ExitStack() as stack:
        for table, config in zip(tables, chosen):
            stack.enter_context(table.override(config))
        yield chosen[0] if len(chosen) == 1 else chosen
