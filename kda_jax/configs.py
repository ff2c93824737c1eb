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

__all__ = ["ForwardConfig", "ARCHS", "FORWARD", "FORWARD_C32", "current_arch", "forward_config",
           "override"]

ARCHS = ("sm90", "gfx950", "gfx1250", "gfx942", "default")
# Product precisions of the prepare kernel, in the order of its DOT constexpr.
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


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Launch parameters of the two forward kernels.

    prepare_block_k: K slice of the prepare kernel (its intra-chunk products
      loop over K in slices of this width).
    prepare_warps / prepare_stages: that kernel's num_warps / num_stages.
    state_block_v: V block of the state-and-output kernel (one program per
      sequence, head and V block); its state tile is [K (padded), block_v] fp32.
    state_warps / state_stages: that kernel's num_warps / num_stages.
    prepare_dot: precision of the prepare kernel's intra-chunk products Akk
      and Aqk: "ieee" (fp32), "tf32x3" (NVIDIA only; three tf32 products,
      about fp32 accuracy), "tf32" (NVIDIA only), "bf16" (operands rounded
      to bf16), "bf16x3" (three bf16 products of a two-term split, about
      1e-5 relative; NVIDIA and AMD) or "bf16x6" (six products of a
      three-term split, about fp32 accuracy; NVIDIA and AMD).
    inverse_dot: precision of the products that merge the inverse's 16-row
      diagonal blocks (which are always exact float32 sweeps) with 16-bit
      inputs: "ieee" or, on NVIDIA, "tf32x3" or "tf32". With float32 inputs
      the merge takes fp32_dot.
    prepare_wu_dot: precision of w = X (beta k e^G) and u = X (beta v).
    fp32_dot: precision of every product of the prepare kernel when the
      inputs are float32: users of float32 expect float32 accuracy, which the
      16-bit and tf32 modes above do not give.
    fp32_block_k: the prepare kernel's K slice with float32 inputs (None:
      prepare_block_k); fp32-grade products hold more registers.
    state_block_v_wide / state_warps_wide / state_stages_wide: the state
      kernel's V block, warps and stages for wide tiles, K > 128 or float32
      intermediates (None: the values above).
    state_warps_fp32: the state kernel's warps with float32 intermediates
      (None: as wide tiles); 16-bit ones past K = 128 keep state_warps_wide.
    """

    prepare_block_k: int = 64
    prepare_warps: int = 4
    prepare_stages: int = 1
    state_block_v: int = 32
    state_warps: int = 4
    state_stages: int = 2
    prepare_dot: str = "ieee"
    prepare_wu_dot: str = "ieee"
    inverse_dot: str = "ieee"
    fp32_dot: str = "ieee"
    fp32_block_k: int | None = None
    state_block_v_wide: int | None = None
    state_warps_wide: int | None = None
    state_stages_wide: int | None = None
    state_warps_fp32: int | None = None

    def __post_init__(self):
        for name in ("prepare_dot", "prepare_wu_dot", "inverse_dot", "fp32_dot"):
            value = getattr(self, name)
            if value not in DOT_MODES:
                raise ValueError(f"{name}={value!r} must be one of {', '.join(DOT_MODES)}")
        _check_inverse_dot("inverse_dot", self.inverse_dot)
        optional = ("fp32_block_k", "state_block_v_wide", "state_warps_wide", "state_stages_wide",
                    "state_warps_fp32")
        for name in ("prepare_block_k", "state_block_v", "fp32_block_k", "state_block_v_wide"):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        for name in ("prepare_warps", "state_warps", "state_warps_wide", "state_warps_fp32"):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={value} must be one of 1, 2, 4, 8, 16")
        for name in ("prepare_stages", "state_stages", "state_stages_wide"):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if value not in (1, 2, 3, 4):
                raise ValueError(f"{name}={value} must be one of 1, 2, 3, 4")


# Why each entry is as it is, in one line; the measurements behind them are in
# docs/tuning.md. sm90: whole-chunk [64, 32] tiles at 4 warps, tf32 Akk/Aqk and
# bf16 w/u (errors within the bf16 tolerance; fp32-grade products cost 10-60 %),
# float32 inputs fp32-grade everywhere, three state stages (wide tiles two: three
# exceed the 227 KiB of shared memory). AMD targets: the same tiles at 4 waves of
# 64 keep gfx950's prepare kernel under 256 VGPRs without spills; gfx1250 is
# wave32 and takes twice the warps for the same tile (docs/rocm.md).
FORWARD = {
    "sm90": ForwardConfig(prepare_block_k=32, prepare_warps=4, prepare_stages=1,
                          state_block_v=32, state_warps=4, state_stages=3,
                          prepare_dot="tf32", prepare_wu_dot="bf16", inverse_dot="tf32",
                          fp32_dot="bf16x3",
                          fp32_block_k=16, state_block_v_wide=16, state_warps_wide=8,
                          state_stages_wide=2),
    # gfx950: float32 at K = 128 takes 232 KiB of LDS at two stages (160 KiB
    # per workgroup), 16 KiB and 245 VGPRs at one (kda_jax.aot).
    "gfx950": ForwardConfig(prepare_block_k=32, prepare_warps=4, prepare_stages=1,
                            state_block_v=32, state_warps=2, state_stages=2,
                            state_stages_wide=1),
    "gfx942": ForwardConfig(prepare_block_k=32, prepare_warps=4, prepare_stages=1,
                            state_block_v=32, state_warps=2, state_stages=2,
                            state_stages_wide=1),  # 64 KiB of LDS
    "gfx1250": ForwardConfig(prepare_block_k=32, prepare_warps=8, prepare_stages=1,
                             state_block_v=32, state_warps=4, state_stages=2),
    "default": ForwardConfig(),
}
# Chunk 32 where it differs: on sm90 ptxas caps the prepare kernel at 128
# registers with 16-wide K slices and at 168 with 32-wide ones, and the masked
# K = 100 case spills under both caps (AOT report); 64-wide slices compile
# without spills at every spec (204-234 registers). The float32 state kernel
# at K = 128 spills 96-112 bytes at 8 warps and none at 4 (253-255 registers).
FORWARD_C32 = {
    "sm90": dataclasses.replace(FORWARD["sm90"], prepare_block_k=64, prepare_warps=4,
                                fp32_block_k=64, state_warps_fp32=4),
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
    """The per-arch configs of one kernel family (by chunk size where that
    matters), with a trace-time override (a context variable, so the override
    is local to the thread and the ``with`` block)."""

    def __init__(self, kind: type, by_arch: dict, by_arch_c32: dict | None = None):
        self.kind, self.by_arch, self.by_arch_c32 = kind, by_arch, by_arch_c32 or {}
        self.chosen = contextvars.ContextVar(f"kda_jax_{kind.__name__}", default=None)

    def get(self, arch: str | None, chunk_size: int = 64):
        chosen = self.chosen.get()
        if chosen is not None:
            return chosen
        arch = current_arch() if arch is None else arch
        if arch not in self.by_arch:
            raise ValueError(f"arch={arch!r} has no {self.kind.__name__}; known: "
                             f"{', '.join(self.by_arch)}")
        if chunk_size == 32:
            return self.by_arch_c32.get(arch, self.by_arch[arch])
        return self.by_arch[arch]

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


_FORWARD = _Table(ForwardConfig, FORWARD, FORWARD_C32)


def forward_config(arch: str | None = None, chunk_size: int = 64) -> ForwardConfig:
    """The forward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    return _FORWARD.get(arch, chunk_size)


def override(config: ForwardConfig):
    """Uses ``config`` for every chunk_kda traced inside the ``with`` block."""
    return _FORWARD.override(config)


# --------------------------------------------------------------------------- #
# The token-by-token (decode) kernel.
# --------------------------------------------------------------------------- #

__all__ += ["RecurrentConfig", "RECURRENT", "recurrent_config", "override_recurrent"]


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Launch parameters of the fused recurrent kernel (one program per
    sequence, value head and V block; the whole of K in each program).

    block_v: V block; the program's state tile is [K (padded), block_v] fp32
      in registers, and smaller blocks give more programs to small batches.
    warps: num_warps.
    stages: num_stages, and the software-pipelining depth of the token loop
      (its next token's loads issued before this token's update).
    block_v_wide: the V block past K = 128, where the tile is twice as tall
      (None: block_v).
    block_v_bounds: the V block when the kernel loads the sequence bounds
      (varlen and bucketed batches: the serving decode), at K <= 128; None:
      block_v. The dense decode (host bounds, all sequences one length) uses
      block_v.
    """

    block_v: int = 32
    warps: int = 4
    stages: int = 2
    block_v_wide: int | None = None
    block_v_bounds: int | None = None

    def __post_init__(self):
        for name in ("block_v", "block_v_wide", "block_v_bounds"):
            value = getattr(self, name)
            if value is not None and (value < 8 or value & (value - 1)):
                raise ValueError(f"{name}={value} must be a power of two >= 8")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps={self.warps} must be one of 1, 2, 4, 8, 16")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1")


# Untuned starting points. A [128, 32] fp32 tile over 128 lanes is 32 values
# per lane (64 at K = 256): 4 warps of 32 on sm90 and gfx1250 (wave32), 2
# waves of 64 on gfx950 and gfx942.
RECURRENT = {
    # sm90: rows of 64 floats copy faster than rows of 32 (the dense decode is a
    # state copy with arithmetic on the way); with bounds loaded from metadata
    # the 32-wide tile is faster; stages=2 pipelines the token loop
    # (docs/tuning.md, decode).
    "sm90": RecurrentConfig(block_v=64, warps=4, stages=2, block_v_wide=32, block_v_bounds=32),
    "gfx950": RecurrentConfig(block_v=32, warps=2, stages=2),
    "gfx942": RecurrentConfig(block_v=32, warps=2, stages=2),
    "gfx1250": RecurrentConfig(block_v=32, warps=4, stages=2),
    "default": RecurrentConfig(),
}

_RECURRENT = _Table(RecurrentConfig, RECURRENT)


def recurrent_config(arch: str | None = None) -> RecurrentConfig:
    """The decode kernel's config for ``arch`` (default: the current device), or
    the override."""
    return _RECURRENT.get(arch)


def override_recurrent(config: RecurrentConfig):
    """Uses ``config`` for every fused_recurrent_kda traced inside the ``with`` block."""
    return _RECURRENT.override(config)


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

__all__ += ["BackwardConfig", "BACKWARD", "BACKWARD_C32", "backward_config", "override_backward"]


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters of the six backward kernels.

    prepare_*: the recompute of w, u, qg, kt, Aqk, gl and X (as the forward's
      prepare kernel: K slice, warps, stages; prepare_dot, prepare_wu_dot and
      inverse_dot as the forward's).
    state_block_v / state_warps / state_stages: both state passes (forward
      h and reverse dS; one program per sequence, head and V block).
    state_warps_wide: both state passes' warps past K = 128.
    inter_block_k / inter_block_v / inter_warps: the per-chunk state terms
      (grid chunks x heads x K blocks; loops over V blocks).
    wy_block_k / wy_block_v / wy_warps: the per-chunk gradients through X
      (grid chunks x heads; loops over K and V blocks). wy_dot: precision of
      its dots with X^T and of dw w^T with 16-bit inputs (as prepare_dot);
      products of two 16-bit intermediates are native 16-bit products.
    wy_fp32_dot: the same with float32 inputs: "ieee" or "tf32x3".
    intra_block_k / intra_warps: the products' backward (grid chunks x heads
      x K blocks).
    product_dot: precision of the products' backward in the intra kernel
      (see ForwardConfig.prepare_dot).
    fp32_dot: precision of the state passes' and the inter kernel's products
      when the intermediates are float32 (16-bit ones multiply exactly).
    prepare_fp32_dot: the recompute's products with float32 inputs (as
      ForwardConfig.fp32_dot; the state passes and the inter kernel take
      fp32_dot).
    prepare_fp32_block_k / state_stages_fp32 / inter_block_v_fp32: the
      recompute's K slice (as ForwardConfig.fp32_block_k), both state passes'
      stages and the inter kernel's V block with float32 intermediates (None:
      prepare_block_k, state_stages, inter_block_v).
    dstate_split_k: the reverse state pass holds dS as two K halves where the
      state passes hold the state so (float32 intermediates, K > 64:
      kda_jax.triton.forward.split_state_k); False keeps one [K, BV] tile.
    """

    prepare_block_k: int = 64
    prepare_warps: int = 4
    prepare_stages: int = 1
    prepare_dot: str = "ieee"
    prepare_wu_dot: str = "ieee"
    inverse_dot: str = "ieee"
    state_block_v: int = 32
    state_warps: int = 4
    state_warps_wide: int = 4
    state_stages: int = 2
    inter_block_k: int = 64
    inter_block_v: int = 64
    inter_warps: int = 4
    wy_block_k: int = 32
    wy_block_v: int = 32
    wy_warps: int = 4
    wy_dot: str = "ieee"
    wy_fp32_dot: str = "ieee"
    intra_block_k: int = 32
    intra_warps: int = 4
    product_dot: str = "ieee"
    fp32_dot: str = "ieee"
    prepare_fp32_block_k: int | None = None
    prepare_fp32_dot: str = "ieee"
    state_stages_fp32: int | None = None
    inter_block_v_fp32: int | None = None
    dstate_split_k: bool = True

    def __post_init__(self):
        for name in ("product_dot", "prepare_dot", "prepare_wu_dot", "inverse_dot", "wy_dot",
                     "wy_fp32_dot", "fp32_dot", "prepare_fp32_dot"):
            if getattr(self, name) not in DOT_MODES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of "
                                 f"{', '.join(DOT_MODES)}")
        _check_inverse_dot("inverse_dot", self.inverse_dot)
        _check_fp32_grade("wy_fp32_dot", self.wy_fp32_dot)
        optional = ("prepare_fp32_block_k", "inter_block_v_fp32")
        for name in ("prepare_block_k", "state_block_v", "inter_block_k", "inter_block_v",
                     "wy_block_k", "wy_block_v", "intra_block_k") + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        for name in ("prepare_warps", "state_warps", "state_warps_wide", "inter_warps", "wy_warps",
                     "intra_warps"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={value} must be one of 1, 2, 4, 8, 16")
        if self.state_stages_fp32 is not None and self.state_stages_fp32 not in (1, 2, 3, 4):
            raise ValueError(f"state_stages_fp32={self.state_stages_fp32} must be one of "
                             "1, 2, 3, 4")
        if not isinstance(self.dstate_split_k, bool):
            raise ValueError(f"dstate_split_k={self.dstate_split_k!r} must be True or False")


# Untuned starting points (correctness first; the GPU tuning is still to do).
# AMD targets use 2 waves of 64 where NVIDIA uses 4 warps of 32, as in FORWARD.
BACKWARD = {
    # sm90: the largest blocks that compile without spills at every spec
    # (kda_jax.aot); tf32 products with 16-bit inputs, fp32-grade ones with
    # float32 inputs (docs/tuning.md, backward).
    "sm90": BackwardConfig(prepare_block_k=32, prepare_warps=4, prepare_dot="bf16x3",
                           prepare_wu_dot="tf32x3", inverse_dot="bf16x3", state_block_v=16,
                           state_warps_wide=8, inter_block_k=32,
                           wy_block_k=16, wy_block_v=16, wy_warps=8, wy_dot="bf16x3",
                           wy_fp32_dot="ieee",
                           intra_block_k=16, intra_warps=8, product_dot="bf16x3",
                           fp32_dot="tf32x3", inter_block_v_fp32=32, prepare_fp32_dot="bf16x3",
                           prepare_fp32_block_k=16),
    # gfx950: the float32 reverse state pass at K = 128 takes 248 KiB of LDS at
    # two stages (160 KiB per workgroup).
    "gfx950": BackwardConfig(prepare_block_k=32, prepare_warps=4, state_warps=2, state_warps_wide=2,
                             inter_warps=2, wy_warps=4, state_stages_fp32=1),
    # gfx942: 64 KiB of LDS; the reverse state pass fits at one stage, 4 waves.
    # Its intra kernel spills a VGPR at 32-wide K blocks (156 VGPRs at 16).
    "gfx942": BackwardConfig(prepare_block_k=32, prepare_warps=4, state_warps=4,
                             state_stages=1, inter_warps=2, wy_warps=4, intra_block_k=16),
    "gfx1250": BackwardConfig(prepare_block_k=32, prepare_warps=8, wy_warps=8),
    "default": BackwardConfig(),
}

# Chunk 32 on sm90: narrower inter blocks and 64-wide recompute slices, where the
# chunk-64 entry spills under ptxas's register caps (kda_jax.aot).
BACKWARD_C32 = {
    "sm90": dataclasses.replace(BACKWARD["sm90"], prepare_block_k=64, prepare_warps=4,
                                inter_block_k=16, inter_block_v=16, inter_block_v_fp32=None,
                                prepare_fp32_block_k=64, dstate_split_k=False, wy_warps=4),
}

_BACKWARD = _Table(BackwardConfig, BACKWARD, BACKWARD_C32)


def backward_config(arch: str | None = None, chunk_size: int = 64) -> BackwardConfig:
    """The backward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    return _BACKWARD.get(arch, chunk_size)


def override_backward(config: BackwardConfig):
    """Uses ``config`` for the backward of every chunk_kda traced inside the block."""
    return _BACKWARD.override(config)


# --------------------------------------------------------------------------- #
# The segmented schedule of chunk_kda (kda_jax.segments, kda_jax.segmented).
# --------------------------------------------------------------------------- #

__all__ += ["SegmentConfig", "SEGMENTS", "segment_config", "override_segments"]


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """When chunk_kda's Triton path cuts long sequences into segments whose
    chunk-state chains run in parallel (docs/kda.md section 7; the rule is
    :func:`kda_jax.segments.segment_chunks`).

    min_programs: segment when the state pass has fewer programs than this
      (sequences x value heads x V blocks of the state kernel); 0: never.
    target_programs: the segments aim at this many programs (counted at the
      call's V blocks; the segmented pass runs V + K columns, so more).
    min_segment_chunks: no segment shorter than this many chunks (each
      segment adds a [K, K] transition and a step of the fold).
    segment_chunks: chunks per segment, skipping the rule (None: the rule);
      a call whose sequences all fit in one segment still runs unsegmented.
    xla: apply the same rule to the XLA path (its state pass is a scan over
      the longest segment's chunks instead of the longest sequence's).
    """

    min_programs: int = 0
    target_programs: int = 1024
    min_segment_chunks: int = 8
    segment_chunks: int | None = None
    xla: bool = False

    def __post_init__(self):
        for name in ("min_programs", "target_programs", "min_segment_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if self.min_segment_chunks < 1:
            raise ValueError(f"min_segment_chunks={self.min_segment_chunks} must be >= 1")
        if self.segment_chunks is not None and (
                isinstance(self.segment_chunks, bool) or not isinstance(self.segment_chunks, int)
                or self.segment_chunks < 1):
            raise ValueError(f"segment_chunks={self.segment_chunks!r} must be None or an "
                             "int >= 1")
        if not isinstance(self.xla, bool):
            raise ValueError(f"xla={self.xla!r} must be True or False")


# sm90: an H200 has 132 SMs; below 128 state programs most idle (issue 20's
# rows: (1, 65536, 4), (1, 131072, 4), (1, 32768, 8), (1, 65536, 12)); every
# other row of the forward sweep has 128 or more and keeps one pass. Untuned
# starting points; AMD targets and unknown devices stay unsegmented until measured.
SEGMENTS = {
    "sm90": SegmentConfig(min_programs=128, target_programs=1024, min_segment_chunks=8),
    "gfx950": SegmentConfig(),
    "gfx942": SegmentConfig(),
    "gfx1250": SegmentConfig(),
    "default": SegmentConfig(),
}

_SEGMENTS = _Table(SegmentConfig, SEGMENTS)


def segment_config(arch: str | None = None) -> SegmentConfig:
    """The segmented schedule's config for ``arch`` (default: the current
    device), or the override."""
    return _SEGMENTS.get(arch)


def override_segments(config: SegmentConfig):
    """Uses ``config`` for every chunk_kda traced inside the ``with`` block
    (e.g. ``SegmentConfig(segment_chunks=2)`` to force segments)."""
    return _SEGMENTS.override(config)
