"""Launch configurations per GPU architecture, chosen at trace time.

Nothing here probes a device at import. :func:`current_arch` reads the default
JAX device when a call is traced; :func:`override` replaces the choice for the
calls traced inside it (the override is part of the jit cache key through the
config value the glue passes on).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

__all__ = ["ForwardConfig", "ARCHS", "FORWARD", "current_arch", "forward_config", "override"]

ARCHS = ("sm90", "gfx950", "gfx1250", "gfx942", "default")


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Launch parameters of the two forward kernels.

    prepare_block_k: K slice of the prepare kernel (its intra-chunk products
      loop over K in slices of this width).
    prepare_warps / prepare_stages: that kernel's num_warps / num_stages.
    state_block_v: V block of the state-and-output kernel (one program per
      sequence, head and V block); its state tile is [K (padded), block_v] fp32.
    state_warps / state_stages: that kernel's num_warps / num_stages.
    """

    prepare_block_k: int = 64
    prepare_warps: int = 4
    prepare_stages: int = 1
    state_block_v: int = 32
    state_warps: int = 4
    state_stages: int = 2

    def __post_init__(self):
        for name in ("prepare_block_k", "state_block_v"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        for name in ("prepare_warps", "state_warps"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={value} must be one of 1, 2, 4, 8, 16")


# Starting points, not tuned yet except where noted: AITER's FlashKDA on gfx950
# runs its prepare kernel with 2 warps and 1 stage and its recurrence with 2
# warps per 16-32 wide V block (ROCM_NOTES.md); gfx1250 is wave32, so a warp
# there is half a gfx950 wave and gets twice the warps for the same tile.
FORWARD = {
    "sm90": ForwardConfig(prepare_block_k=64, prepare_warps=4, prepare_stages=1,
                          state_block_v=32, state_warps=4, state_stages=2),
    "gfx950": ForwardConfig(prepare_block_k=64, prepare_warps=2, prepare_stages=1,
                            state_block_v=32, state_warps=2, state_stages=2),
    "gfx942": ForwardConfig(prepare_block_k=64, prepare_warps=2, prepare_stages=1,
                            state_block_v=32, state_warps=2, state_stages=2),
    "gfx1250": ForwardConfig(prepare_block_k=64, prepare_warps=4, prepare_stages=1,
                             state_block_v=32, state_warps=4, state_stages=2),
    "default": ForwardConfig(),
}

_OVERRIDE: contextvars.ContextVar[ForwardConfig | None] = contextvars.ContextVar(
    "kda_jax_forward_config", default=None
)


def current_arch() -> str:
    """The default device's architecture key (one of ARCHS), read at trace time."""
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


def forward_config(arch: str | None = None) -> ForwardConfig:
    """The forward config for ``arch`` (default: the current device), or the override."""
    chosen = _OVERRIDE.get()
    if chosen is not None:
        return chosen
    arch = current_arch() if arch is None else arch
    if arch not in FORWARD:
        raise ValueError(f"arch={arch!r} has no config; known: {', '.join(FORWARD)}")
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
