"""Argument checks of the public entry points, before any backend runs.

Every bad input raises ``ValueError`` or ``TypeError`` naming the argument, its
value and the fix. :func:`check_call` runs the checks of one call in order.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax.batch import VarlenBatch, num_seqs
from kda_jax.bounds import SeqBounds, as_seq_bounds, checkpoint_counts
from kda_jax.options import KdaOptions
from kda_jax import pool as state_pool

__all__ = ["check_call", "check_chunk_size", "check_checkpoints", "CHUNK_SIZES",
           "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("xla", "triton")
CHUNK_SIZES = (32, 64)


# --------------------------------------------------------------------------- #
# Checks, one concern each; check_call runs them in order.
# --------------------------------------------------------------------------- #

# The floating dtypes every array argument may have (states: float32 inside).
FLOAT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
_FLOAT_NAMES = "bf16, fp16 or fp32"


class _Dims(NamedTuple):
    """The sizes of one call: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``."""

    b: int
    t: int
    h: int
    hv: int
    kd: int
    vd: int


def _array(x, name: str, ndim: int, layout: str) -> tuple[int, ...]:
    """Checks that ``x`` is an array of rank ``ndim`` and a bf16/fp16/fp32 dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be rank {ndim} {layout}, got shape {tuple(x.shape)}")
    dtype = np.dtype(x.dtype)
    if dtype not in FLOAT_DTYPES:
        # float8, float64, complex, integers and bool alike: the kernels and the
        # XLA path compute in float32 from these three input types only.
        raise TypeError(
            f"{name} must be floating point ({_FLOAT_NAMES}), got dtype {dtype}; cast it, "
            f"e.g. {name}.astype(jnp.bfloat16) or .astype(jnp.float32)"
        )
    return tuple(int(d) for d in x.shape)


def _expect(x, name: str, expected: tuple[int, ...], layout: str):
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} {layout}, got {tuple(x.shape)}")


def _check_inputs(q, k, v, g, beta) -> _Dims:
    """Shapes and dtypes of q, k, v, g, beta; the sizes they agree on."""
    b, t, h, kd = _array(q, "q", 4, "[B, T, H, K]")
    _array(k, "k", 4, "[B, T, H, K]")
    _expect(k, "k", (b, t, h, kd), "[B, T, H, K] like q")
    _, _, hv, vd = _array(v, "v", 4, "[B, T, HV, V]")
    _expect(v, "v", (b, t, hv, vd), "[B, T, HV, V] (B, T as q)")
    dims = _Dims(b, t, h, hv, kd, vd)
    _check_head_sizes(dims)
    _array(g, "g", 4, "[B, T, HV, K]")
    _expect(g, "g", (b, t, hv, kd), "[B, T, HV, K]")
    _array(beta, "beta", 3, "[B, T, HV]")
    _expect(beta, "beta", (b, t, hv), "[B, T, HV]")
    return dims


def _check_head_sizes(dims: _Dims):
    """H, HV, K and V must be positive, HV a multiple of H. (B = 0 and T = 0
    are fine: no sequence, or no token, give an exact empty result.)"""
    for size, what, where in ((dims.h, "H (q/k heads)", "q.shape[2]"),
                              (dims.hv, "HV (value heads)", "v.shape[2]"),
                              (dims.kd, "K (key head size)", "q.shape[3]"),
                              (dims.vd, "V (value head size)", "v.shape[3]")):
        if size == 0:
            raise ValueError(
                f"{what}={size} ({where}) must be >= 1: each head carries a [K, V] state, "
                "and a call with no heads or an empty head dimension computes nothing; "
                "skip the call instead"
            )
    if dims.hv % dims.h:
        raise ValueError(
            f"the value heads HV={dims.hv} (v.shape[2]) must be a multiple of the q/k heads "
            f"H={dims.h}"
        )


def _flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _check_flags(**flags) -> dict[str, bool]:
    return {name: _flag(value, name) for name, value in flags.items()}


def _check_static_number(value, name: str):
    if isinstance(value, jax.Array):  # tracers are jax.Arrays too
        raise TypeError(
            f"{name} must be a Python number (it is fixed at trace time), got a {type(value).__name__}"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def check_chunk_size(chunk_size) -> int:
    """A Python int (or NumPy integer, as elsewhere in the API) of CHUNK_SIZES:
    it picks the compiled kernels, so it is fixed at trace time."""
    if (isinstance(chunk_size, (bool, np.bool_, jax.Array))
            or not isinstance(chunk_size, (int, np.integer))):
        raise TypeError(
            f"chunk_size must be a Python int, 32 or 64 (it is fixed at trace time), got "
            f"{chunk_size!r} ({type(chunk_size).__name__}); pass chunk_size=32 or 64"
        )
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size={int(chunk_size)} must be 32 or 64")
    return int(chunk_size)


def _check_scale(scale, kd: int) -> float:
    if scale is None:
        return kd**-0.5
    scale = _check_static_number(scale, "scale")
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale} must be a positive finite number")
    return scale


def _check_gate(use_gate_in_kernel: bool, A_log, dt_bias, lower_bound, dims: _Dims):
    """The in-kernel gate's arguments; returns lower_bound as a float or None."""
    if not use_gate_in_kernel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(
                    f"{name} is only used with use_gate_in_kernel=True, got {name}="
                    f"{value if name == 'lower_bound' else 'an array'} with "
                    "use_gate_in_kernel=False; drop it or enable the in-kernel gate"
                )
        return None
    if lower_bound is not None:
        lower_bound = _check_static_number(lower_bound, "lower_bound")
        if not -5.0 <= lower_bound < 0.0:
            raise ValueError(f"lower_bound={lower_bound} must lie in [-5, 0)")
    elif A_log is None:
        raise ValueError(
            "use_gate_in_kernel=True with lower_bound=None needs A_log [HV] "
            "(g_eff = -exp(A_log) * softplus(g + dt_bias)); pass A_log or set lower_bound"
        )
    if A_log is not None:
        _array(A_log, "A_log", 1, "[HV]")
        _expect(A_log, "A_log", (dims.hv,), "[HV]")
    if dt_bias is not None:
        _array(dt_bias, "dt_bias", 1, "[HV * K]")
        _expect(dt_bias, "dt_bias", (dims.hv * dims.kd,), "[HV * K]")
    return lower_bound


def _check_implementation(implementation):
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is unknown; use None (best available), "
            f"{' or '.join(repr(i) for i in IMPLEMENTATIONS)}"
        )


def _resolve_bounds(cu_seqlens, dims: _Dims, chunk_size: int | None, context_devices: int = 1
                    ) -> SeqBounds | VarlenBatch | None:
    """Host bounds over the flattened B * T tokens, the bucketed batch, or None
    for B = 0 without cu_seqlens (no sequence). ``chunk_size``: chunk_kda's (a
    batch must be built for it), None for fused_recurrent_kda (any serves).
    ``dims.t``: all devices' tokens with a context axis of ``context_devices``."""
    b, t = dims.b, dims.t
    if cu_seqlens is None:
        return SeqBounds.from_lengths(np.full(b, t, np.int64)) if b else None
    if isinstance(cu_seqlens, VarlenBatch):
        bucket = cu_seqlens.bucket
        if b != 1 or t != bucket.max_tokens:
            raise ValueError(
                f"with a VarlenBatch as cu_seqlens, q, k, v, g, beta must be [1, "
                f"max_tokens={bucket.max_tokens}, ...] (tokens packed along T, padded to the "
                f"bucket), got B={b}, T={t}; pad them with batch.pad_tokens(x)"
            )
        if chunk_size is not None and bucket.chunk_size != chunk_size:
            raise ValueError(
                f"chunk_size={chunk_size} differs from the VarlenBatch's bucket chunk_size="
                f"{bucket.chunk_size} (its chunk table is built for that size); pass "
                f"chunk_size={bucket.chunk_size} or build the batch with "
                f"kda_jax.Bucket(..., chunk_size={chunk_size})"
            )
        return cu_seqlens
    _check_unmapped_bounds(cu_seqlens)
    bounds = as_seq_bounds(cu_seqlens)
    if b != 1:
        raise ValueError(
            f"with cu_seqlens the batch must be packed along T with B == 1, got B={b}; "
            "reshape q, k, v, g, beta to [1, B * T, ...]"
        )
    if bounds.total_tokens != t:
        raise ValueError(
            f"cu_seqlens[-1]={bounds.total_tokens} must equal the number of tokens T={t}"
            + (f" ({t // context_devices} per device x {context_devices} devices of the "
               "context axis: cu_seqlens are the global bounds)" if context_devices > 1 else "")
        )
    return bounds


def _check_unmapped_bounds(cu_seqlens):
    """cu_seqlens mapped by jax.vmap (a batch tracer) is refused with the
    fixes: the bounds are host data, one set for every mapped element."""
    if isinstance(cu_seqlens, jax.core.Tracer) and type(cu_seqlens).__name__ == "BatchTracer":
        raise ValueError(
            "cu_seqlens is mapped by jax.vmap: the bounds are host data, fixed at trace time "
            "and shared by every mapped element. Pass them unmapped (close over them, or "
            "in_axes=None for a NumPy array); for bounds that differ per element, pack all "
            "elements' sequences into one call (concatenate the tokens along T and their "
            "bounds into one cu_seqlens) instead of mapping"
        )


def _sequence_slots(bounds, cu_seqlens) -> tuple[int, str]:
    """(N, what N is) for messages about arrays with one entry per sequence."""
    if isinstance(bounds, VarlenBatch):
        return num_seqs(bounds), "the bucket's max_seqs"
    if cu_seqlens is not None:
        return num_seqs(bounds), "the number of sequences in cu_seqlens"
    return (0 if bounds is None else num_seqs(bounds)), "B"


def _check_initial_state(initial_state, n: int, what: str, dims: _Dims, v_first: bool):
    if initial_state is None:
        return
    state_shape = (n, dims.hv, dims.vd, dims.kd) if v_first else (n, dims.hv, dims.kd, dims.vd)
    layout = "[N, HV, V, K] (state_v_first)" if v_first else "[N, HV, K, V]"
    _array(initial_state, "initial_state", 4, layout)
    if tuple(initial_state.shape) != state_shape:
        raise ValueError(
            f"initial_state must have shape {state_shape} {layout} with N = {what} = {n}, "
            f"got {tuple(initial_state.shape)}"
        )


# -- the paged state pool ------------------------------------------------------


def _int_vector(x, name: str, n: int, what: str, kind: str):
    """Checks an index-like array ``[N]``; ``kind`` is "int" or "bool"."""
    wanted = "an int32" if kind == "int" else "a bool"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name} must be {wanted} array [N] (NumPy or jax), got {type(x).__name__}; "
            f"pass np.asarray({name}, {'np.int32' if kind == 'int' else 'bool'})"
        )
    if tuple(x.shape) != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) [N], one entry per sequence with N = {what} = {n}, "
            f"got {tuple(x.shape)}"
        )
    dtype = np.dtype(x.dtype)
    ok = dtype == np.bool_ if kind == "bool" else (np.issubdtype(dtype, np.integer)
                                                   and dtype != np.bool_)
    if not ok:
        raise TypeError(f"{name} must be {wanted} array [N], got dtype {dtype}")


def _check_rows(rows) -> state_pool.PoolRows:
    """The pool forms' ``rows``: a :class:`kda_jax.PoolRows` with its
    ``ssm_state_indices``."""
    if not isinstance(rows, state_pool.PoolRows):
        raise TypeError(
            f"rows must be a kda_jax.PoolRows (which pool rows each sequence reads and "
            f"writes), got {type(rows).__name__}; pass e.g. "
            f"rows=kda_jax.PoolRows(ssm_state_indices=np.asarray(indices, np.int32))")
    if rows.ssm_state_indices is None:
        raise ValueError(
            "rows.ssm_state_indices is None: a pool call needs the row each sequence "
            "starts from, int32 [N] (negative for a padding slot), or [N, 1 + drafts] for a "
            "speculative verify")
    return rows


def _check_cache(state_cache, dims: _Dims, v_first: bool) -> int:
    """The pool's layout and dtype; returns its slot count."""
    layout = "[slots, HV, V, K] (state_v_first)" if v_first else "[slots, HV, K, V]"
    _array(state_cache, "state_cache", 4, layout)
    row = (dims.hv, dims.vd, dims.kd) if v_first else (dims.hv, dims.kd, dims.vd)
    if tuple(state_cache.shape[1:]) != row or state_cache.shape[0] < 1:
        raise ValueError(
            f"state_cache must have shape (slots, {', '.join(map(str, row))}) {layout} with "
            f"slots >= 1, got {tuple(state_cache.shape)}"
        )
    # Its dtype is any of FLOAT_DTYPES (_array): a 16-bit pool is read into
    # float32 and rounded once on write-back.
    return int(state_cache.shape[0])


def _real_slots(bounds) -> int | None:
    """How many leading sequence slots are real sequences, where the host knows:
    all of them for host bounds, the header's count for a NumPy batch, None for
    a batch on the device (reading it would be a device-to-host transfer)."""
    if not isinstance(bounds, VarlenBatch):
        return 0 if bounds is None else num_seqs(bounds)  # None: B = 0, no sequence
    header = bounds.host_header()
    return None if header is None else header[0]


def _host_rows(idx: np.ndarray, valid: np.ndarray, slots: int, name: str, *,
               shared_rows: bool = False, skip: str = "-1 for a padding slot",
               owners: str = "sequences") -> np.ndarray:
    """NumPy pool indices of any rank: the entries where ``valid`` must name
    rows in [0, slots) or be negative, distinct unless ``shared_rows`` (rows
    only read); errors give the entry's position in ``idx``. Returns int64
    rows, -1 for every negative or invalid entry."""
    at = lambda pos: ", ".join(str(int(i)) for i in pos)
    rows = np.where(valid & (idx >= 0), idx, -1)  # compared in idx's own dtype: nothing wraps
    past = np.argwhere(rows >= slots)
    if past.size:
        raise ValueError(
            f"{name}[{at(past[0])}]={int(idx[tuple(past[0])])} is >= slots={slots} "
            f"(state_cache.shape[0]); use a row in [0, slots), or {skip}")
    rows = rows.astype(np.int64)
    named, counts = np.unique(rows[rows >= 0], return_counts=True)
    if np.any(counts > 1) and not shared_rows:
        row = int(named[np.flatnonzero(counts > 1)[0]])
        where = [f"[{at(p)}]" for p in np.argwhere(rows == row)[:4]]
        raise ValueError(
            f"{name} names row {row} more than once (at {', '.join(where)}); two {owners} "
            f"cannot share a pool row (which state lands there would be undefined): give "
            f"each its own row, or {skip}")
    return rows


def _check_host_indices(idx: np.ndarray, slots: int, real: int, name: str,
                        shared_rows: bool = False) -> np.ndarray:
    """NumPy indices ``[N]`` or ``[N, W]``: the first ``real`` rows must name
    pool rows in [0, slots) or be negative (padding), distinct unless
    ``shared_rows`` (rows only read: sequences may start from one cached
    prefix); the rest are padding slots of a batch and become -1 unseen.
    Returns them as int32, every padding slot -1."""
    live = np.arange(idx.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 1)) < real
    return _host_rows(idx, np.broadcast_to(live, idx.shape), slots, name,
                      shared_rows=shared_rows).astype(np.int32)


def _check_verify(state_indices, num_accepted_tokens, slots: int, *, bounds, n: int,
                  what: str) -> state_pool.StatePool:
    """Speculative verify: ``state_indices`` int ``[N, W]`` (W = 1 + drafts) and
    ``num_accepted_tokens`` int ``[N]`` or None. Returns a StatePool without
    its cache: ``indices`` the row each sequence starts from, column
    ``num_accepted_tokens[n] - 1`` (column 0 without them; -1 where that
    count is outside [1, W], so that nothing is read), and ``write_indices``
    the ``[N, W]`` rows of the states after each token.

    NumPy indices are checked on the host as 1-D ones are (written rows in
    range and distinct over the whole matrix); where the host knows the
    lengths (host bounds, a NumPy VarlenBatch), every sequence must fit its W
    columns. NumPy counts are checked to lie in [1, W]. ``state_indices`` is
    an array (:func:`_check_pool` checked)."""
    w = int(state_indices.shape[1])
    if tuple(state_indices.shape) != (n, w) or w < 1:
        raise ValueError(
            f"rows.ssm_state_indices [N, 1 + drafts] (speculative verify) must have "
            f"N = {what} = {n} rows and at least one column, got shape "
            f"{tuple(state_indices.shape)}")
    dtype = np.dtype(state_indices.dtype)
    if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise TypeError(f"rows.ssm_state_indices must be an int32 array [N, 1 + drafts], got "
                        f"dtype {dtype}; pass np.asarray(ssm_state_indices, np.int32)")
    real = _real_slots(bounds)
    lens = None if bounds is None else _host_lengths(bounds)
    if lens is not None:
        long = np.flatnonzero(lens > w)
        if long.size:
            i = int(long[0])
            raise ValueError(
                f"sequence {i} has {int(lens[i])} tokens but rows.ssm_state_indices has {w} "
                f"columns (one per token's state in a verify step, shape "
                f"{tuple(state_indices.shape)}): "
                f"give ssm_state_indices at least {int(lens.max())} columns, or verify at most {w} "
                f"tokens per sequence")
    if isinstance(state_indices, np.ndarray) and real is not None:
        rows = _check_host_indices(state_indices, slots, real, "rows.ssm_state_indices")
    else:
        rows = state_pool.narrow_indices(state_indices, slots)
    if num_accepted_tokens is None:
        return state_pool.StatePool(None, rows[:, 0], None, rows)
    _int_vector(num_accepted_tokens, "rows.num_accepted_tokens", n, what, "int")
    if isinstance(num_accepted_tokens, np.ndarray) and real is not None:
        acc = num_accepted_tokens[:real]
        bad = np.flatnonzero((acc < 1) | (acc > w))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"rows.num_accepted_tokens[{i}]={int(acc[i])} is outside [1, {w}] "
                f"(rows.ssm_state_indices has {w} columns): sequence n starts from column "
                f"num_accepted_tokens[n] - 1, the state after its last accepted token; pass a "
                f"count in [1, {w}]")
    return state_pool.StatePool(None, state_pool.start_rows(rows, num_accepted_tokens), None,
                                rows)


def _check_pool(state_cache, rows, *, bounds, n, what, dims: _Dims,
                v_first: bool) -> state_pool.StatePool:
    """The pool forms' ``state_cache`` and ``rows`` (a
    :class:`kda_jax.PoolRows`); returns a StatePool (int32 indices).

    NumPy indices are checked on the host: with host bounds all N of them,
    with a NumPy VarlenBatch the real sequences' (the header's count; the
    padded slots' are ignored, as on the device). With a batch already on the
    device the real count is unknown here, so NumPy indices are then treated
    as device indices are: only shape and dtype are checked; an index outside
    [0, slots) is padding, a row written twice is undefined (the rows read
    with ``write_indices`` may name a row more than once: those rows are only
    read). Indices wider than int32 are narrowed with out-of-range entries
    made -1 first, on the host or on the device (pool.narrow_indices), so a
    large index never wraps onto a row.
    """
    rows = _check_rows(rows)
    slots = _check_cache(state_cache, dims, v_first)
    indices, has_initial_state = rows.ssm_state_indices, rows.has_initial_state

    def checked(idx, name, shared_rows=False):
        _int_vector(idx, name, n, what, "int")
        if isinstance(idx, np.ndarray):
            real = _real_slots(bounds)
            if real is not None:
                return _check_host_indices(idx, slots, real, name, shared_rows)
        return state_pool.narrow_indices(idx, slots)

    if not hasattr(indices, "shape") or not hasattr(indices, "dtype"):
        raise TypeError(
            f"rows.ssm_state_indices must be an int32 array [N] or [N, 1 + drafts] (NumPy or "
            f"jax), got {type(indices).__name__}; pass np.asarray(ssm_state_indices, np.int32)")
    if has_initial_state is not None:
        _int_vector(has_initial_state, "rows.has_initial_state", n, what, "bool")
    if indices.ndim == 2:
        if rows.write_indices is not None:
            raise ValueError(
                f"rows.write_indices with a speculative-verify rows.ssm_state_indices of shape "
                f"{tuple(indices.shape)}: a verify writes the state after each token to the "
                f"rows of ssm_state_indices; drop write_indices, or pass ssm_state_indices [N]")
        verify = _check_verify(indices, rows.num_accepted_tokens, slots, bounds=bounds, n=n,
                               what=what)
        return verify._replace(cache=state_cache, has_initial_state=has_initial_state)
    if rows.num_accepted_tokens is not None:
        raise ValueError(
            "rows.num_accepted_tokens is only used with a speculative-verify "
            "rows.ssm_state_indices of shape [N, 1 + drafts] (one row per token's state), got "
            f"ssm_state_indices of shape {tuple(indices.shape)}; pass the "
            "[N, 1 + drafts] indices, or drop rows.num_accepted_tokens")
    if rows.write_indices is None:
        return state_pool.StatePool(state_cache, checked(indices, "rows.ssm_state_indices"),
                                    has_initial_state)
    read = checked(indices, "rows.ssm_state_indices", True)
    write = checked(rows.write_indices, "rows.write_indices")
    if isinstance(read, np.ndarray) and isinstance(write, np.ndarray):
        _check_row_owners(_readers(read, has_initial_state), write, "rows.write_indices")
    return state_pool.StatePool(state_cache, read, has_initial_state, write)


def _readers(read: np.ndarray, has_initial_state) -> np.ndarray:
    """The host rows sequences read: none (-1) where a NumPy has_initial_state
    is False. Device flags are unknown here: every named row counts as read."""
    if isinstance(has_initial_state, np.ndarray):
        return np.where(has_initial_state, read, -1)
    return read


def _check_row_owners(read: np.ndarray, written: np.ndarray, written_name: str):
    """Host rows: a row one sequence writes in a call is that sequence's alone
    in the call; no other sequence reads it (``read`` int [N], -1 for none;
    ``written`` int [N] or [N, J]). The kernels run the sequences' programs in
    no order, so such a read would see the row's old or new state. One
    vectorized comparison (it runs on the host at every serving call)."""
    pos = np.argwhere(written >= 0)  # [E, ndim]: each written entry, its sequence first
    rows = written[tuple(pos.T)]
    clash = (read[:, None] == rows[None, :]) & (np.arange(read.shape[0])[:, None]
                                                != pos[None, :, 0])
    if clash.any():
        n, e = (int(i) for i in np.argwhere(clash)[0])
        m, row, at = int(pos[e, 0]), int(rows[e]), ", ".join(str(int(i)) for i in pos[e])
        raise ValueError(
            f"rows.ssm_state_indices[{n}]={row} is the row sequence {m} writes in the same call "
            f"({written_name}[{at}]={row}): a row written in a call belongs to the "
            f"sequence that writes it, and the order between sequences is undefined (on a "
            f"GPU sequence {n} could read the old state or the new one). Read it in the "
            f"next call, or write sequence {m}'s state to another row")


def check_call(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, chunk_size,
                cu_seqlens, implementation, pool_form: bool = False, state_cache=None,
                rows=None, context_devices: int = 1):
    """Validates one call; returns (options, bounds, pool or None).

    ``pool_form``: the call is a pool form (``state_cache`` and ``rows``, a
    :class:`kda_jax.PoolRows`, are checked; None is refused by name).
    ``chunk_size``: chunk_kda's, checked (:func:`check_chunk_size`), or None
    for fused_recurrent_kda. ``bounds``
    is None when B = 0 without cu_seqlens: the call has no sequence.
    ``context_devices``: the devices of chunk_kda's context axis (1 without
    one); the bounds then cover all of them (T per device x devices).
    """
    dims = _check_inputs(q, k, v, g, beta)
    flags = _check_flags(
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
    )
    if flags["allow_neg_eigval"] and not flags["use_beta_sigmoid_in_kernel"]:
        raise ValueError(
            "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in fla: beta "
            "is then 2 sigmoid(beta), in [0, 2]); pass beta as logits with "
            "use_beta_sigmoid_in_kernel=True")
    scale = _check_scale(scale, dims.kd)
    lower_bound = _check_gate(flags["use_gate_in_kernel"], A_log, dt_bias, lower_bound, dims)
    _check_implementation(implementation)

    bounds = _resolve_bounds(cu_seqlens, dims._replace(t=dims.t * context_devices), chunk_size,
                             context_devices)
    n, what = _sequence_slots(bounds, cu_seqlens)
    _check_initial_state(initial_state, n, what, dims, flags["state_v_first"])
    pool = None
    if pool_form:
        pool = _check_pool(state_cache, rows, bounds=bounds, n=n, what=what, dims=dims,
                           v_first=flags["state_v_first"])
    opts = KdaOptions(
        scale=float(scale), lower_bound=lower_bound,
        chunk_size=CHUNK_SIZES[-1] if chunk_size is None else chunk_size, **flags,
    )
    return opts, bounds, pool


# -- prefill checkpoints (chunk_kda) --------------------------------------------


def _check_every(every, chunk_size: int) -> int:
    """checkpoint_every: a Python int (it fixes the launches and C at trace
    time), positive, a multiple of chunk_size (checkpoints sit at chunk starts)."""
    if isinstance(every, (bool, np.bool_, jax.Array)) or not isinstance(every, (int, np.integer)):
        raise TypeError(
            f"checkpoint_every must be a Python int, a multiple of chunk_size={chunk_size} (it "
            f"is fixed at trace time), got {every!r} ({type(every).__name__}); pass e.g. "
            f"checkpoint_every={4 * chunk_size}")
    every = int(every)
    if every <= 0 or every % chunk_size:
        below = max(every // chunk_size, 1) * chunk_size
        fix = (f"checkpoint_every={below} or {below + chunk_size}" if every > 0
               else f"checkpoint_every={chunk_size} (or a multiple)")
        raise ValueError(
            f"checkpoint_every={every} must be a positive multiple of chunk_size={chunk_size} "
            f"(a checkpoint is the state at a chunk's start); pass {fix}")
    return every


def _host_lengths(bounds) -> np.ndarray | None:
    """Each sequence slot's length where the host knows it: host bounds, or a
    NumPy VarlenBatch (its padded slots: 0); None for a batch on the device."""
    if not isinstance(bounds, VarlenBatch):
        return bounds.lengths
    header = bounds.host_header()
    if header is None:
        return None
    off = bounds.bucket.offset("cu_seqlens")
    cu = np.asarray(bounds.metadata[off:off + header[0] + 1], np.int64)
    lengths = np.zeros(bounds.bucket.max_seqs, np.int64)
    lengths[:header[0]] = np.diff(cu)
    return lengths


def _check_checkpoint_rows(idx: np.ndarray, used: np.ndarray, slots: int,
                           final_rows) -> np.ndarray:
    """NumPy checkpoint_indices: the entries of ``used`` (the checkpoints the
    sequences have) must name rows in [0, slots) or be negative (skip), named
    once, and none a row a final state is written to (``final_rows``, NumPy
    int32 [N] or None when device data). Returns them as int32, -1 for every
    entry skipped or unused."""
    rows = _host_rows(idx, used, slots, "rows.checkpoint_indices",
                      skip="-1 to skip that checkpoint", owners="checkpoints")
    if final_rows is not None:
        final = np.asarray(final_rows)
        both = np.intersect1d(rows[rows >= 0], final[final >= 0])
        if both.size:
            row = int(both[0])
            n, j = (int(i) for i in np.argwhere(rows == row)[0])
            raise ValueError(
                f"rows.checkpoint_indices[{n}, {j}]={row} is also the row sequence "
                f"{int(np.flatnonzero(final == row)[0])}'s final state is written to "
                "(rows.ssm_state_indices / rows.write_indices); a row takes one state: give the "
                "checkpoint another row, or -1 to skip it")
    return rows.astype(np.int32)


def check_checkpoints(checkpoint_every, checkpoint_indices, *, chunk_size: int, bounds,
                      pool) -> tuple[int | None, object]:
    """chunk_kda's prefill checkpoints: returns ``(every, indices)``, both None
    without checkpoints; ``indices`` is None for the ``[C, ...]`` output, else
    int32 ``[N, J]`` pool rows (NumPy checked on the host where the bounds
    are known, -1 for every entry skipped or unused; device data narrowed
    only). ``bounds``, ``pool``: :func:`check_call`'s."""
    if checkpoint_every is None:
        if checkpoint_indices is not None:
            raise ValueError(
                "rows.checkpoint_indices was passed without checkpoint_every; pass "
                "checkpoint_every=n (a multiple of chunk_size) too, or drop "
                "rows.checkpoint_indices")
        return None, None
    every = _check_every(checkpoint_every, chunk_size)
    if pool is None:
        if isinstance(bounds, VarlenBatch):
            raise ValueError(
                f"checkpoint_every={every} with a VarlenBatch as cu_seqlens needs the pool "
                "form: the number of checkpoints depends on the batch's bounds, device data "
                "unknown at trace time; call kda_jax.chunk_kda_pool with "
                "rows.checkpoint_indices int32 [max_seqs, J] (or pass host bounds for the "
                "[C, HV, K, V] output)")
        return every, None
    if checkpoint_indices is None:
        raise ValueError(
            f"checkpoint_every={every} with a pool writes the checkpoints into pool rows: "
            "pass rows.checkpoint_indices, int32 [N, J] (row of checkpoint j of sequence n, "
            "-1 to skip)")
    n = num_seqs(bounds) if bounds is not None else 0
    idx = checkpoint_indices
    if not hasattr(idx, "shape") or not hasattr(idx, "dtype"):
        raise TypeError(
            f"rows.checkpoint_indices must be an int32 array [N, J] (NumPy or jax), got "
            f"{type(idx).__name__}; pass np.asarray(checkpoint_indices, np.int32)")
    dtype = np.dtype(idx.dtype)
    if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise TypeError(f"rows.checkpoint_indices must be an int32 array [N, J], got dtype "
                        f"{dtype}")
    lengths = None if bounds is None else _host_lengths(bounds)
    need = 1 if lengths is None else int(checkpoint_counts(lengths, every).max(initial=1))
    if idx.ndim != 2 or idx.shape[0] != n or idx.shape[1] < need:
        raise ValueError(
            f"rows.checkpoint_indices must have shape ({n}, J) [N, J], one row per sequence slot "
            f"and J >= {need} columns (the most intervals of checkpoint_every={every} tokens "
            f"a sequence has; extra columns are ignored), got {tuple(idx.shape)}")
    slots = int(pool.cache.shape[0])
    if not isinstance(idx, np.ndarray) or lengths is None:
        return every, state_pool.narrow_indices(idx, slots)
    used = np.arange(idx.shape[1])[None, :] < checkpoint_counts(lengths, every)[:, None]
    final_rows = state_pool.write_index(pool)
    rows = _check_checkpoint_rows(
        idx, used, slots, final_rows if isinstance(final_rows, np.ndarray) else None)
    if isinstance(pool.indices, np.ndarray):
        _check_row_owners(_readers(pool.indices, pool.has_initial_state), rows,
                          "rows.checkpoint_indices")
    return every, rows
