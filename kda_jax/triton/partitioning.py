"""Sharded ``jax.jit`` of the Triton path: custom_partitioning rules.

XLA cannot see into a Triton launch (jax-triton's custom call, or the
interpreter's host call), so under ``jax.jit`` with sharded operands its
partitioner would replicate them: an all-gather of every operand and each
device computing everything. :func:`partitioned` wraps a kernel-level
function (the forward, the backward under the custom_vjp, the decode launch,
each with or without a state pool) in a
``jax.experimental.custom_partitioning`` whose rule keeps two shardings:

* the dense batch B (rows of q, k, v, g, beta, o and the rows' states), when
  the call has one host sequence per row (``cu_seqlens`` None) and no pool;
* the heads, H and HV together (a GVA group of HV / H value heads stays with
  its q/k head), when H divides by the axes' size; a pool's rows
  ``[slots, HV, ., .]`` shard with them.

Each device then runs the same function on its shard (the host bounds of its
local batch, ``B / n`` rows of T, built in the rule), with no collective
around the kernels, forward and backward. The rule reads both from q's
sharding: every other operand is resharded to match. Everything else is
gathered by the rule, correct at the cost of the gather: T (sequences are
packed along T and a kernel walks a whole sequence), K and V (a state is one
[K, V] tile), heads that do not divide, the batch of a varlen or pool call
(its pool rows are shared by all sequences), and the pool's slots. XLA
all-gathers those operands before the call; the outputs come out sharded as
above. The gradients of the gate parameters A_log and dt_bias, summed over
tokens, are psum'd over the batch axes inside the rule: the data-parallel
reduction every replicated parameter's gradient needs. The non-finite flags a
forward keeps for its backward (BackwardConfig.nonfinite_flags) shard as beta does.

Shardy (JAX's default partitioner) propagates through the call by a
``sharding_rule`` built from the same roles; the GSPMD callbacks
(``infer_sharding_from_operands``, ``partition``) serve both partitioners.
Mesh axes of type Explicit are refused with an error naming the fix
(:func:`check_auto_axes`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from kda_jax.batch import VarlenBatch
from kda_jax.bounds import SeqBounds
from kda_jax.pool import StatePool
from kda_jax.triton import host_call

__all__ = ["partitioned", "unpartitioned_under_vmap", "check_auto_axes", "ROLES", "CALL", "GRAD_CALL", "GRADS", "PARAMS"]

# The role of each dimension: what it may be sharded with (None: gathered).
_B = "batch"  # B, the rows
_N = "sequences"  # a state's sequences: the rows when one sequence per row
_H = "heads"  # H, q/k heads
_HV = "value heads"  # HV = H * group: moves with its q/k head
_HVK = "value heads x K"  # dt_bias [HV * K]: a head's K entries are contiguous

ROLES = {
    "q": (_B, None, _H, None), "k": (_B, None, _H, None),
    "v": (_B, None, _HV, None), "g": (_B, None, _HV, None), "beta": (_B, None, _HV),
    "o": (_B, None, _HV, None),
    "flags": (_B, None, _HV),  # the backward's saved non-finite flags
    "state": (_N, _HV, None, None),  # [N, HV, K, V] or [N, HV, V, K]
    "A_log": (_HV,), "dt_bias": (_HVK,),
    "cache": (None, _HV, None, None), "indices": (None,), "has_initial_state": (None,),
    "metadata": (None,),  # a VarlenBatch's buffer
    # Prefill checkpoints: [C, HV, ., .], each sequence's in order (with one
    # sequence per row, a row's checkpoints are a contiguous block of C), and
    # a pool's checkpoint rows [N, J].
    "checkpoints": (_N, _HV, None, None), "checkpoint_indices": (None, None),
}

# The kernel-level calls' positional arguments: the forward and the decode
# launch (q, k, v, g, beta, initial_state, A_log, dt_bias, bounds, pool), and
# the backward (the forward's first nine, then the cotangents of o and of the
# final state, and the forward's non-finite flags or None) with its gradients
# (PARAMS: sums over the rows).
CALL = ("q", "k", "v", "g", "beta", "state", "A_log", "dt_bias", "bounds", "pool")
GRAD_CALL = CALL[:9] + ("o", "state", "flags")
GRADS = CALL[:8]
PARAMS = ("A_log", "dt_bias")


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    """What the rule needs of one call (a static argument of the
    custom_partitioning, by identity)."""

    run: Callable
    names: tuple  # a name per positional argument of run ("bounds": SeqBounds or VarlenBatch)
    outs: tuple  # a name per top-level output of run
    summed: frozenset  # outputs summed over the rows (parameter gradients)
    tree: object  # the treedef of the dynamic arguments
    roles: tuple  # per input leaf
    bounds: SeqBounds | None  # host bounds (rebuilt for the local batch), else None
    rows: bool  # the rows may shard (one host sequence per row, no pool)
    b: int
    t: int
    h: int
    group: int  # HV / H
    kd: int
    found: dict  # "outs": the output leaves' (role tuple, summed), set when traced


def _leaf_roles(name: str, value) -> list:
    if value is None:
        return []
    if isinstance(value, StatePool):
        return [ROLES["cache"], ROLES["indices"]] + (
            [] if value.has_initial_state is None else [ROLES["has_initial_state"]]) + (
            [] if value.write_indices is None
            else [ROLES["indices"] + (None,) * (value.write_indices.ndim - 1)])
    if isinstance(value, VarlenBatch):
        return [ROLES["metadata"]]
    return [ROLES[name]]


def _one_per_row(bounds, b: int, t: int) -> bool:
    return (isinstance(bounds, SeqBounds) and bounds.num_seqs == b
            and bool(np.all(bounds.lengths == t)))


def partitioned(run: Callable, names: tuple, outs: tuple, summed: tuple = ()) -> Callable:
    """``run`` with a custom_partitioning rule (same arguments and value).

    ``run(*args)``: positional arguments named by ``names`` (keys of
    :data:`ROLES`, "bounds" for the bounds, "pool" for a StatePool; the
    first is q ``[B, T, H, K]``); arrays, None, a StatePool, a VarlenBatch,
    or host bounds (SeqBounds, static: the rule rebuilds them for the local
    batch). It returns a tuple named by ``outs`` (entries may be None);
    outputs named in ``summed`` are sums over the rows (psum'd over the
    batch axes by the rule).
    """

    def call(*args):
        if len(args) != len(names):
            raise TypeError(f"partitioned: {len(args)} arguments for the names {names}")
        given = dict(zip(names, args))
        q, bounds, pool = given["q"], given.get("bounds"), given.get("pool")
        host = isinstance(bounds, SeqBounds)
        dynamic = tuple(None if (n == "bounds" and host) else a for n, a in zip(names, args))
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        check_auto_axes(leaves)
        b, t, h, kd = (int(d) for d in q.shape)
        spec = _Spec(run=run, names=tuple(names), outs=tuple(outs), summed=frozenset(summed),
                     tree=tree,
                     roles=tuple(r for n, a in zip(names, dynamic) for r in _leaf_roles(n, a)),
                     bounds=bounds if host else None,
                     rows=pool is None and _one_per_row(bounds, b, t), b=b, t=t, h=h,
                     group=int(given["v"].shape[2]) // h, kd=kd, found={})
        return _partitioned(spec, *leaves)

    return call


def _apply(spec: _Spec, bounds, leaves):
    """run on the dynamic leaves, with ``bounds`` as the host bounds."""
    args = list(jax.tree_util.tree_unflatten(spec.tree, leaves))
    if spec.bounds is not None:
        args[spec.names.index("bounds")] = bounds
    return spec.run(*args)


def _run(spec: _Spec, *leaves):
    # Inside a jit: custom_partitioning traces its function without
    # constants, and the launches hold some (the metadata, stand-ins).
    out = jax.jit(lambda *x: _apply(spec, spec.bounds, x))(*leaves)
    spec.found["outs"] = tuple(
        (ROLES["state" if n == "state" else n], n in spec.summed)
        for n, o in zip(spec.outs, out) if o is not None)
    return out


_partitioned = custom_partitioning(_run, static_argnums=(0,))


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _size(mesh, axes: tuple) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _plan(spec: _Spec, mesh, arg_shapes) -> tuple[tuple, tuple]:
    """(batch axes, head axes) the call runs sharded over, from q's sharding."""
    sharding = arg_shapes[0].sharding
    if not isinstance(sharding, NamedSharding):
        return (), ()
    dims = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    batch, heads = _axes(dims[0]), _axes(dims[2])
    if not spec.rows or spec.b % _size(mesh, batch):
        batch = ()
    if spec.h % _size(mesh, heads):
        heads = ()
    return batch, heads


def _sharding(mesh, roles: tuple, rows: bool, batch: tuple, heads: tuple) -> NamedSharding:
    def entry(role):
        axes = ()
        if role == _B or (role == _N and rows):
            axes = batch
        elif role in (_H, _HV, _HVK):
            axes = heads
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    return NamedSharding(mesh, PartitionSpec(*(entry(r) for r in roles)))


def _out_shardings(spec, mesh, result_shape, batch, heads):
    found = spec.found["outs"]
    flat = [_sharding(mesh, roles, spec.rows, batch, heads) for roles, _ in found]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(result_shape), flat)


def _infer(spec, mesh, arg_shapes, result_shape):
    batch, heads = _plan(spec, mesh, arg_shapes)
    return _out_shardings(spec, mesh, result_shape, batch, heads)


def _partition(spec, mesh, arg_shapes, result_shape):
    batch, heads = _plan(spec, mesh, arg_shapes)
    arg_shardings = tuple(_sharding(mesh, r, spec.rows, batch, heads) for r in spec.roles)
    out_shardings = _out_shardings(spec, mesh, result_shape, batch, heads)
    bounds = spec.bounds
    if batch:
        bounds = SeqBounds.from_lengths(np.full(spec.b // _size(mesh, batch), spec.t, np.int64))
    summed = [s for _, s in spec.found["outs"]]

    def lower_fn(*leaves):
        with host_call.local_lowering():
            out = _apply(spec, bounds, leaves)
        flat, tree = jax.tree_util.tree_flatten(out)
        flat = [jax.lax.psum(x, batch) if s and batch else x for x, s in zip(flat, summed)]
        return jax.tree_util.tree_unflatten(tree, flat)

    return mesh, lower_fn, out_shardings, arg_shardings


def _rule(spec, mesh, operand_types, result_types):
    """The Shardy rule: b, h (and the group, and K for dt_bias, as compound
    factors after h) pass through; every other dimension is its own factor
    that needs replication."""
    sizes, replicated = {}, ["b"] if not spec.rows else []
    counter = iter(range(1 << 30))

    def factor(role):
        if role == _B or (role == _N and spec.rows):
            return "b"
        if role == _H:
            return "h"
        if role in (_HV, _HVK):
            parts = ["h"]
            if spec.group > 1:
                parts.append("gr")
                sizes["gr"] = spec.group
            if role == _HVK:
                parts.append("kd")
                sizes["kd"] = spec.kd
            return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"
        name = f"r{next(counter)}"
        replicated.append(name)
        return name

    side = lambda roles: ", ".join(" ".join(factor(r) for r in leaf) for leaf in roles)
    text = f"{side(spec.roles)} -> {side([r for r, _ in spec.found['outs']])}"
    return text, dict(need_replication_factors=tuple(replicated), **sizes)


_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)


def unpartitioned_under_vmap(fn: Callable, plain: Callable) -> Callable:
    """``fn`` (a :func:`partitioned` function), whose jax.vmap runs
    ``jax.vmap(plain)`` instead: custom_partitioning has no batching rule.
    ``plain`` computes the same value without the partitioning (its own
    batching rules fold the mapped axis into the launches)."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return fn(*args)

    @call.def_vmap
    def rule(size, in_batched, *args):
        axes = tuple(jax.tree.map(lambda b: 0 if b else None, batched)
                     for batched in in_batched)
        out = jax.vmap(plain, in_axes=axes, axis_size=size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return call


def check_auto_axes(arrays) -> None:
    """Raises when an operand's type is sharded, over mesh axes of type
    Explicit (``jax.sharding.AxisType.Explicit``): the Triton path partitions
    through XLA's automatic partitioner (custom_partitioning), which Explicit
    axes bypass."""
    for x in arrays:
        spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
        explicit = sorted({a for entry in spec for a in _axes(entry) if isinstance(a, str)})
        if explicit:
            raise NotImplementedError(
                f"the Triton path got an operand sharded over mesh axes {explicit} of type "
                "Explicit (its type is sharded); the Triton kernels partition under jax.jit "
                "through XLA's automatic partitioner: build the mesh with "
                "axis_types=(jax.sharding.AxisType.Auto, ...), or call kda_jax inside "
                "jax.sharding.auto_axes(f, out_sharding=...) or jax.shard_map")
