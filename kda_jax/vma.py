"""Varying manual axes (vma) inside ``jax.shard_map``.

With ``check_vma=True`` (shard_map's default) every value carries the set of
manual mesh axes over which it may differ between devices. Two places in
kda_jax create values whose type would otherwise say "the same on every
device" while they mix with per-device data:

- a loop's initial carry built from constants (``jnp.zeros``): lax.scan and
  lax.fori_loop demand that the carry's type, vma included, is the same
  before and after the body, and the body mixes it with the varying inputs;
- the outputs of a kernel launch (``jax.pure_callback``, jax-triton's custom
  call): their abstract values name no axis, while they are computed from
  the device's own inputs.

:func:`like` gives such values the axes of the inputs they come from. Outside
shard_map (or with ``check_vma=False``) every value's set is empty and it is
the identity. A leaf module: it imports only JAX.
"""

from __future__ import annotations

import jax

__all__ = ["axes_of", "checked", "like"]


def _varying(x) -> frozenset:
    """The manual axes over which the array ``x`` varies (empty for NumPy
    arrays, Python scalars and values outside shard_map)."""
    if not isinstance(x, jax.Array):  # NumPy and Python values: constants
        return frozenset()
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # newer JAX spells it aval.vma
    if vma is None:
        mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying
        vma = getattr(mat, "varying", frozenset())
    return frozenset(vma)


def checked() -> bool:
    """Whether the values traced here carry their varying axes: inside a
    ``jax.shard_map`` with ``check_vma=True``. (Elsewhere, or with
    ``check_vma=False``, every value's set is empty, which tells nothing.)"""
    from jax._src import config  # shard_map's own switch; no public spelling
    state = getattr(config, "_check_vma", None)
    return bool(getattr(state, "value", False))


def axes_of(*trees) -> frozenset:
    """The union of the varying manual axes of every array leaf in ``trees``
    (None leaves and non-arrays count for none)."""
    axes = frozenset()
    for leaf in jax.tree_util.tree_leaves(trees):
        axes |= _varying(leaf)
    return axes


def like(tree, *refs):
    """``tree`` (a pytree of arrays) with every leaf varying over the manual
    axes of the array leaves of ``refs`` as well as its own: a no-op cast
    (``jax.lax.pcast(..., to="varying")``) of the axes a leaf lacks. Same
    values, shapes and dtypes; the identity outside shard_map."""
    axes = axes_of(*refs)
    if not axes:
        return tree

    def cast(leaf):
        missing = axes - _varying(leaf)
        if not missing:
            return leaf
        return jax.lax.pcast(leaf, tuple(missing), to="varying")  # pcast orders them

    return jax.tree_util.tree_map(cast, tree)
