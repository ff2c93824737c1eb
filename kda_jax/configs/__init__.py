"""Launch configurations per GPU architecture, chosen at trace time.

One small frozen config per kernel (:mod:`kda_jax.configs.types`), grouped
per family (:class:`ForwardConfig`, :class:`BackwardConfig`,
:class:`RecurrentConfig`) and keyed by variant; the segmented schedule's
rule (:class:`SegmentConfig`). The values are data, one module per arch
(``kda_jax/configs/sm90.py``, ...); why each is as it is: docs/tuning.md.

Nothing here probes a device at import. :func:`current_arch` reads the default
JAX device when a call is traced; :func:`override` replaces the choice for the
calls traced inside it (the override is part of the jit cache key through the
config value the glue passes on). :func:`target_arch` names the arch instead
of the device, to lower on a machine without that GPU.
"""

from __future__ import annotations

import contextlib
import contextvars

from kda_jax.configs import default, gfx942, gfx950, gfx1250, sm90
from kda_jax.configs.types import (DOT_MODES, BackwardConfig, BlockConfig, DecodeConfig,
                                   FoldConfig, ForwardConfig, GradsConfig, IntraConfig,
                                   PrepareConfig,
                                   RecurrentConfig, SegmentConfig, SegmentRule, StateConfig,
                                   Variants, as_dict, replace, variant_key)

__all__ = ["ARCHS", "DOT_MODES", "FORWARD", "FORWARD_C32", "BACKWARD", "BACKWARD_C32",
           "RECURRENT", "SEGMENTS", "BackwardConfig", "BlockConfig", "DecodeConfig",
           "FoldConfig", "ForwardConfig", "GradsConfig", "IntraConfig", "PrepareConfig", "RecurrentConfig",
           "SegmentConfig", "SegmentRule", "StateConfig", "Variants", "as_dict", "backward_config",
           "current_arch", "explicit_arch", "forward_config", "override", "recurrent_config",
           "replace", "segment_config", "target_arch", "variant_key"]

ARCHS = ("sm90", "gfx950", "gfx1250", "gfx942", "default")
_MODULES = dict(sm90=sm90, gfx950=gfx950, gfx1250=gfx1250, gfx942=gfx942, default=default)

# The per-arch tables (arch -> config), assembled from the arch modules.
FORWARD = {a: m.FORWARD_64 for a, m in _MODULES.items()}
FORWARD_C32 = {a: m.FORWARD_32 for a, m in _MODULES.items()}
BACKWARD = {a: m.BACKWARD_64 for a, m in _MODULES.items()}
BACKWARD_C32 = {a: m.BACKWARD_32 for a, m in _MODULES.items()}
RECURRENT = {a: m.RECURRENT for a, m in _MODULES.items()}
SEGMENTS = {a: m.SEGMENTS for a, m in _MODULES.items()}


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
        token = self.chosen.set(config)
        try:
            yield config
        finally:
            self.chosen.reset(token)


_FORWARD = _Table(ForwardConfig, {64: FORWARD, 32: FORWARD_C32})
_BACKWARD = _Table(BackwardConfig, {64: BACKWARD, 32: BACKWARD_C32})
_RECURRENT = _Table(RecurrentConfig, {None: RECURRENT})
_SEGMENTS = _Table(SegmentConfig, {None: SEGMENTS})
_TABLES = (_FORWARD, _BACKWARD, _RECURRENT, _SEGMENTS)


def forward_config(arch: str | None = None, chunk_size: int = 64) -> ForwardConfig:
    """The forward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    return _FORWARD.get(arch, chunk_size)


def backward_config(arch: str | None = None, chunk_size: int = 64) -> BackwardConfig:
    """The backward config for ``arch`` (default: the current device) at
    ``chunk_size``, or the override."""
    return _BACKWARD.get(arch, chunk_size)


def recurrent_config(arch: str | None = None) -> RecurrentConfig:
    """The decode kernel's config for ``arch`` (default: the current device), or
    the override."""
    return _RECURRENT.get(arch)


def segment_config(arch: str | None = None) -> SegmentConfig:
    """The segmented schedule's rule for ``arch`` (default: the current
    device), or the override."""
    return _SEGMENTS.get(arch)


@contextlib.contextmanager
def override(*chosen):
    """Uses each config given (a ForwardConfig, BackwardConfig, RecurrentConfig
    or SegmentConfig, at most one of each kind) for every chunk_kda /
    fused_recurrent_kda traced inside the ``with`` block, on every arch and
    chunk size; the per-arch tables elsewhere. Yields the config, or the tuple
    of them. E.g. ``with override(SegmentConfig(segment_chunks=2)):`` forces
    segments; ``with override(forward_config("gfx950"), backward_config("gfx950")):``
    runs gfx950's configs on this device; ``replace(forward_config(),
    "prepare.16bit.warps", 4)`` changes one value."""
    kinds = "a ForwardConfig, BackwardConfig, RecurrentConfig or SegmentConfig"
    if not chosen:
        raise ValueError(f"override() needs a config: {kinds}")
    tables = []
    for config in chosen:
        table = next((t for t in _TABLES if isinstance(config, t.kind)), None)
        if table is None:
            raise TypeError(f"config must be {kinds}, got {type(config).__name__}: {config!r}")
        if table in tables:
            raise ValueError(f"two {table.kind.__name__}s given to override: pass one of "
                             "each kind")
        tables.append(table)
    with contextlib.ExitStack() as stack:
        for table, config in zip(tables, chosen):
            stack.enter_context(table.override(config))
        yield chosen[0] if len(chosen) == 1 else chosen
