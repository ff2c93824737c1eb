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

__all__ = ["ForwardConfig", "ARCHS", "FORWARD", "FORWARD_C32", "current_arch", "forward_config", "override"]

ARCHS = ("sm90", "gfx950", "gfx1250", "gfx942", "default")
# Product precisions of the prepare kernel, in the order of its DOT constexpr.
DOT_MODES = ("ieee", "tf32x3", "tf32", "bf16")


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
      about fp32 accuracy), "tf32" (NVIDIA only) or "bf16" (operands rounded
      to bf16). The inverse itself is always exact fp32 arithmetic.
    prepare_wu_dot: precision of w = X (beta k e^G) and u = X (beta v).
    """

    prepare_block_k: int = 64
    prepare_warps: int = 4
    prepare_stages: int = 1
    state_block_v: int = 32
    state_warps: int = 4
    state_stages: int = 2
    prepare_dot: str = "ieee"
    prepare_wu_dot: str = "ieee"

    def __post_init__(self):
        for name in ("prepare_dot", "prepare_wu_dot"):
            value = getattr(self, name)
            if value not in DOT_MODES:
                raise ValueError(f"{name}={value!r} must be one of {', '.join(DOT_MODES)}")
        for name in ("prepare_block_k", "state_block_v"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        for name in ("prepare_warps", "state_warps"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={value} must be one of 1, 2, 4, 8, 16")


# sm90: measured on the H200 (bench.tune_forward). AMD: from the AOT report
# (no AMD GPU here): whole-chunk [64, 32] tiles at 4 waves keep gfx950's
# prepare kernel near 230 VGPRs with no spills (2 waves per SIMD); fp32
# "ieee" products run on the fp32 MFMA/WMMA units, since these parts have no
# safe TF32 (ROCM_NOTES.md). gfx1250 is wave32: a warp there is half a gfx950
# wave and gets twice the warps for the same tile. AITER's FlashKDA recurrence
# uses 2 warps per 16-32 wide V block on gfx950.
FORWARD = {
    "sm90": ForwardConfig(prepare_block_k=32, prepare_warps=8, prepare_stages=1,
                          state_block_v=32, state_warps=4, state_stages=2,
                          prepare_dot="tf32x3", prepare_wu_dot="bf16"),
    "gfx950": ForwardConfig(prepare_block_k=32, prepare_warps=4, prepare_stages=1,
                            state_block_v=32, state_warps=2, state_stages=2),
    "gfx942": ForwardConfig(prepare_block_k=32, prepare_warps=4, prepare_stages=1,
                            state_block_v=32, state_warps=2, state_stages=2),
    "gfx1250": ForwardConfig(prepare_block_k=32, prepare_warps=8, prepare_stages=1,
                             state_block_v=32, state_warps=4, state_stages=2),
    "default": ForwardConfig(),
}
# Chunk 32 where it differs: on sm90 the [32, 32] tiles of 8 warps replicate
# MMA operands enough to spill at a 32-wide K slice; 4 warps over 16-wide
# slices stay at 188 registers (AOT report).
FORWARD_C32 = {
    "sm90": dataclasses.replace(FORWARD["sm90"], prepare_block_k=16, prepare_warps=4),
}

_OVERRIDE: contextvars.ContextVar[ForwardConfig | None] = contextvars.ContextVar(
    "kda_jax_forward_config", default=None
)


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


def forward_config(arch: str | None = None, chunk_size: int = 64) -> ForwardConfig:
    """The forward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    chosen = _OVERRIDE.get()
    if chosen is not None:
        return chosen
    arch = current_arch() if arch is None else arch
    if arch not in FORWARD:
        raise ValueError(f"arch={arch!r} has no config; known: {', '.join(FORWARD)}")
    if chunk_size == 32:
        return FORWARD_C32.get(arch, FORWARD[arch])
    return FORWARD[arch]


@contextlib.contextmanager
def override(config: ForwardConfig):
    """Uses ``config`` for every chunk_kda traced inside the ``with`` block."""
    if not isinstance(config, ForwardConfig):
        raise TypeError(f"config must be a ForwardConfig, got {type(config).__name__}")
    token = _OVERRIDE.set(config)
    try:
        yield config
    finally:
        _OVERRIDE.reset(token)


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
    warps / stages: num_warps / num_stages.
    """

    block_v: int = 32
    warps: int = 4
    stages: int = 2

    def __post_init__(self):
        if self.block_v < 8 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v={self.block_v} must be a power of two >= 8")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps={self.warps} must be one of 1, 2, 4, 8, 16")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1")


# Untuned starting points. A [128, 32] fp32 tile over 128 lanes is 32 values
# per lane (64 at K = 256): 4 warps of 32 on sm90 and gfx1250 (wave32), 2
# waves of 64 on gfx950 and gfx942.
RECURRENT = {
    "sm90": RecurrentConfig(block_v=32, warps=4, stages=2),
    "gfx950": RecurrentConfig(block_v=32, warps=2, stages=2),
    "gfx942": RecurrentConfig(block_v=32, warps=2, stages=2),
    "gfx1250": RecurrentConfig(block_v=32, warps=4, stages=2),
    "default": RecurrentConfig(),
}

_RECURRENT_OVERRIDE: contextvars.ContextVar[RecurrentConfig | None] = contextvars.ContextVar(
    "kda_jax_recurrent_config", default=None
)


def recurrent_config(arch: str | None = None) -> RecurrentConfig:
    """The decode kernel's config for ``arch`` (default: the current device), or
    the override."""
    chosen = _RECURRENT_OVERRIDE.get()
    if chosen is not None:
        return chosen
    arch = current_arch() if arch is None else arch
    if arch not in RECURRENT:
        raise ValueError(f"arch={arch!r} has no config; known: {', '.join(RECURRENT)}")
    return RECURRENT[arch]


@contextlib.contextmanager
def override_recurrent(config: RecurrentConfig):
    """Uses ``config`` for every fused_recurrent_kda traced inside the ``with`` block."""
    if not isinstance(config, RecurrentConfig):
        raise TypeError(f"config must be a RecurrentConfig, got {type(config).__name__}")
    token = _RECURRENT_OVERRIDE.set(config)
    try:
        yield config
    finally:
        _RECURRENT_OVERRIDE.reset(token)


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
