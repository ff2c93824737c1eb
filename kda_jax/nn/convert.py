"""fla's ``KimiDeltaAttention`` weights and caches to and from this package's layer.

fla (PyTorch) stores a Linear's ``weight`` as ``[out, in]``; Flax's
``kernel`` is ``[in, out]``. fla's ShortConvolution ``weight`` is
``[C, 1, W]``; here ``kernel`` is ``[W, C]``. Every other parameter keeps its
name and shape:

=====================  ==================================  ============================
fla key                this layer                          shape here
=====================  ==================================  ============================
q_proj.weight          q_proj.kernel                       [hidden, H * K]
k_proj.weight          k_proj.kernel                       [hidden, H * K]
v_proj.weight          v_proj.kernel                       [hidden, HV * V]
q_conv1d.weight        q_conv1d.kernel (and .bias)         [W, H * K]
k_conv1d.weight        k_conv1d.kernel (and .bias)         [W, H * K]
v_conv1d.weight        v_conv1d.kernel (and .bias)         [W, HV * V]
f_proj.0.weight        f_proj.layers[0].kernel             [hidden, V]
f_proj.1.weight        f_proj.layers[1].kernel             [V, HV * K]
b_proj.weight          b_proj.kernel                       [hidden, HV]
A_log                  A_log (float32)                     [HV]
dt_bias                dt_bias (float32)                   [HV * K]
g_proj.0.weight        g_proj.layers[0].kernel             [hidden, V]
g_proj.1.weight/.bias  g_proj.layers[1].kernel / .bias     [V, HV * V] / [HV * V]
o_norm.weight          o_norm.weight                       [V]
o_proj.weight          o_proj.kernel                       [HV * V, hidden]
=====================  ==================================  ============================

Caches: fla keeps each conv state as ``[N, C, W]`` (the last W inputs) and
its layer's KDA state V-first, ``[N, HV, V, K]``; :class:`kda_jax.nn.KDACache`
keeps ``[N, W - 1, C]`` (the last W - 1: the oldest of fla's W is never used
again) and ``[N, HV, K, V]`` unless the layer has ``state_v_first``.

Everything here is NumPy on the host: torch tensors are the caller's to
convert, ``{k: v.detach().float().cpu().numpy() for k, v in sd.items()}``
(``np.asarray`` of a bfloat16 tensor fails).
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kda_jax.nn.cache import KDACache

__all__ = ["from_fla_state_dict", "to_fla_state_dict", "cache_from_fla", "cache_to_fla"]


def _table(layer) -> list[tuple[str, tuple, str]]:
    """(fla key, path in the layer, kind) of every parameter; kind "linear"
    (transposed), "conv" ([C, 1, W] <-> [W, C]) or "same"."""
    rows = [("q_proj.weight", ("q_proj", "kernel"), "linear"),
            ("k_proj.weight", ("k_proj", "kernel"), "linear"),
            ("v_proj.weight", ("v_proj", "kernel"), "linear")]
    if layer.use_short_conv:
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            rows.append((f"{name}.weight", (name, "kernel"), "conv"))
            if getattr(layer, name).bias is not None:
                rows.append((f"{name}.bias", (name, "bias"), "same"))
    rows += [("f_proj.0.weight", ("f_proj", "layers", 0, "kernel"), "linear"),
             ("f_proj.1.weight", ("f_proj", "layers", 1, "kernel"), "linear"),
             ("b_proj.weight", ("b_proj", "kernel"), "linear"),
             ("A_log", ("A_log",), "same"),
             ("dt_bias", ("dt_bias",), "same"),
             ("g_proj.0.weight", ("g_proj", "layers", 0, "kernel"), "linear"),
             ("g_proj.1.weight", ("g_proj", "layers", 1, "kernel"), "linear"),
             ("g_proj.1.bias", ("g_proj", "layers", 1, "bias"), "same"),
             ("o_norm.weight", ("o_norm", "weight"), "same"),
             ("o_proj.weight", ("o_proj", "kernel"), "linear")]
    return rows


def _variable(layer, path):
    obj = layer
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj


def _to_fla(ours: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return ours.T
    if kind == "conv":
        return ours.T[:, None, :]
    return ours


def _from_fla(theirs: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return theirs.T
    if kind == "conv":
        return theirs[:, 0, :].T
    return theirs


def from_fla_state_dict(state_dict: Mapping, layer, *, prefix: str = "", strict: bool = True):
    """Loads fla's ``KimiDeltaAttention.state_dict()`` into ``layer`` (in place); returns it.

    Args:
      state_dict: fla's keys (after ``prefix``) to NumPy arrays (or anything
        ``np.asarray`` takes; torch tensors: ``.detach().float().cpu().numpy()``).
      layer: a :class:`kda_jax.nn.KimiDeltaAttention` built with the same sizes
        and options as fla's (conv_bias, use_short_conv, ...).
      prefix: prepended to every fla key, e.g. ``"model.layers.3.attn."``.
      strict: keys under ``prefix`` that the layer has no parameter for raise.

    Raises:
      ValueError naming the key: a missing key, a shape that is not fla's, or
      (strict) an unexpected key. Nothing is loaded unless every key is good.
    """
    table = _table(layer)
    known = {prefix + key for key, _, _ in table}
    missing = sorted(k for k in known if k not in state_dict)
    if missing:
        raise ValueError(f"state_dict lacks {missing} for this layer (prefix={prefix!r}); "
                         "build the layer with fla's options (use_short_conv, conv_bias, ...)")
    if strict:
        extra = sorted(k for k in state_dict if k.startswith(prefix) and k not in known)
        if extra:
            raise ValueError(f"state_dict has keys this layer has no parameter for: {extra}; "
                             "check the layer's options, or pass strict=False")
    values = []
    for key, path, kind in table:
        var = _variable(layer, path)
        theirs = np.asarray(state_dict[prefix + key])
        want = _to_fla(np.empty(var[...].shape, np.float32), kind).shape
        if theirs.shape != want:
            raise ValueError(f"state_dict[{prefix + key!r}] has shape {theirs.shape}, fla's "
                             f"layer of these sizes has {want}")
        values.append((var, jnp.asarray(_from_fla(theirs, kind), var[...].dtype)))
    for var, value in values:
        var[...] = value
    return layer


def to_fla_state_dict(tree, layer=None) -> dict[str, np.ndarray]:
    """fla's state dict (NumPy, fla's names and shapes) of ``tree``: a layer,
    or an ``nnx.State`` of its parameters (e.g. their gradients) with
    ``layer`` giving the structure."""
    if isinstance(tree, nnx.Module):
        layer, flat = tree, dict(nnx.to_flat_state(nnx.state(tree, nnx.Param)))
    else:
        if layer is None:
            raise TypeError("to_fla_state_dict(state, layer): a State needs the layer it "
                            "belongs to")
        flat = dict(nnx.to_flat_state(tree))
    out = {}
    for key, path, kind in _table(layer):
        value = flat[path]
        value = value[...] if isinstance(value, nnx.Variable) else value
        out[key] = _to_fla(np.asarray(value, np.float32), kind)
    return out


def cache_from_fla(conv_state, recurrent_state, layer, *, dtype=None) -> KDACache:
    """A dense :class:`KDACache` of fla's layer cache: ``conv_state`` the
    (q, k, v) tuple of ``[N, C, W]`` (or None), ``recurrent_state``
    ``[N, HV, V, K]`` (NumPy)."""
    convs = (None, None, None)
    if layer.use_short_conv:
        if conv_state is None:
            raise ValueError("conv_state is None but the layer has short convolutions")
        convs = tuple(jnp.asarray(np.swapaxes(np.asarray(c)[:, :, 1:], 1, 2),
                                  dtype or layer.dtype or jnp.float32) for c in conv_state)
    h = np.asarray(recurrent_state, np.float32)
    if not layer.state_v_first:
        h = np.swapaxes(h, -1, -2)
    return KDACache(*convs, jnp.asarray(h))


def cache_to_fla(cache: KDACache, layer) -> tuple[tuple | None, np.ndarray]:
    """fla's ``(conv_state, recurrent_state)`` of a dense cache, NumPy float32;
    each conv state's oldest column (unused by fla's next step) is 0."""
    conv = None
    if layer.use_short_conv:
        conv = tuple(np.concatenate(
            [np.zeros(c.shape[:1] + (1,) + c.shape[2:], np.float32),
             np.asarray(c, np.float32)], axis=1).swapaxes(1, 2) for c in
            (cache.conv_q, cache.conv_k, cache.conv_v))
    h = np.asarray(cache.recurrent, np.float32)
    return conv, (h if layer.state_v_first else np.swapaxes(h, -1, -2))
