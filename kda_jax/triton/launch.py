"""One way to launch a Triton kernel from JAX: jax-triton on a GPU, or Triton's
interpreter on the host when ``KDA_JAX_INTERPRET=1``.

The interpreter dereferences raw host pointers, so an access outside an array
may read or overwrite neighbouring heap memory without a sign. With
``KDA_JAX_INTERPRET_GUARD=1`` (or ``end``) every array a kernel gets (inputs
and outputs) sits at the end of its own mmap'd region, between two
inaccessible (PROT_NONE) pages: an access past its end faults at once
(SIGSEGV). ``KDA_JAX_INTERPRET_GUARD=start`` places each array at the start of
its region instead, so that an access before its start faults at once. A test
mode: it costs a region and two copies per array and launch.

Kernel parameters follow jax-triton's order: array and scalar inputs, then one
pointer per output, then constexprs by name. :func:`launch_kernel` takes the
kernels of ``kda_jax.kernels`` by argument name, in the order of their table
(``kda_jax.kernels.signatures``); :func:`launch` is the positional form under it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import inspect
import mmap
import os
import sys
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import configs, vma
from kda_jax.configs import DOT_MODES
from kda_jax.kernels import signatures
from kda_jax.triton import compat, host_call

__all__ = ["KernelLaunch", "interpret_mode", "guard_mode", "available", "unavailable_reason",
           "kernels", "kernel_function", "runtime_params", "launch", "launch_kernel", "stand_in",
           "transform_constexprs"]


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """What one kernel launch compiles with: the kernel's function name (a key
    of ``kda_jax.kernels.signatures.SIGNATURES``), its constexprs and its
    launch options. The glue derives these once per kernel family
    (forward_launches, backward_launches, recurrent_launch); the launches and
    bench.aot both use them."""

    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int


def stand_in(dtype=np.float32) -> jax.Array:
    """Four values for a pointer argument the kernel leaves unread (an absent
    A_log, initial state, index...), a literal of the compiled program. Not
    all equal, on purpose: XLA rewrites a constant whose elements are all equal
    (``np.zeros`` as much as ``jnp.zeros``) into a broadcast, and a broadcast
    is a kernel launch per call (two showed beside the decode kernel on the
    H200); arange-like values become an iota launch the same way."""
    return jnp.asarray(np.array([1, 0, 0, 0], dtype))


def interpret_mode() -> bool:
    """True when KDA_JAX_INTERPRET=1: kernels run in Triton's interpreter on the host."""
    return os.environ.get("KDA_JAX_INTERPRET", "") == "1"


def dot_precision(mode: str) -> str:
    """The kernels' DOT constexpr (a string, as ``tl.dot``'s input_precision)
    for product precision ``mode``, an entry of :data:`kda_jax.configs.DOT_MODES`.
    Triton's interpreter computes every product in float32 and accepts only
    "ieee", "tf32" and "tf32x3", so the split-bf16 modes run as "ieee" there;
    elsewhere they need Triton >= 3.6 (:func:`kda_jax.triton.compat.check_dot_mode`)."""
    if mode not in DOT_MODES:
        raise ValueError(f"product precision {mode!r}: one of {', '.join(DOT_MODES)}")
    if interpret_mode() and mode in ("bf16x3", "bf16x6"):
        return "ieee"
    compat.check_dot_mode(mode)
    return mode


_GUARD_MODES = {"": None, "0": None, "1": "end", "end": "end", "start": "start"}


def guard_mode() -> str | None:
    """Where the interpreter places arrays between guard pages
    (``KDA_JAX_INTERPRET_GUARD``): "end", "start", or None (off)."""
    value = os.environ.get("KDA_JAX_INTERPRET_GUARD", "")
    if value not in _GUARD_MODES:
        raise ValueError(f"KDA_JAX_INTERPRET_GUARD={value!r} must be one of "
                         f"{sorted(_GUARD_MODES)}: 1 or end (faults past an array's end), "
                         "start (faults before its start), empty or 0 (off)")
    return _GUARD_MODES[value]


def _enter_interpreter() -> str | None:
    """Makes Triton decorate kernels for its interpreter. Triton reads
    TRITON_INTERPRET when it decorates a function, including its own library
    helpers, so the variable must be set before triton is first imported."""
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
        return (
            "KDA_JAX_INTERPRET=1 needs Triton's interpreter, but triton was imported "
            "before TRITON_INTERPRET=1 was set; set TRITON_INTERPRET=1 in the environment "
            "(or import kda_jax's Triton path before anything imports triton)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"KDA_JAX_INTERPRET=1 needs triton ({e})"
    return None


def unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here (None when it can)."""
    if interpret_mode():
        return _enter_interpreter()
    try:
        import jax_triton  # noqa: F401
    except ImportError as e:
        return f"jax-triton is not importable ({e}); pip install 'kda_jax[triton]'"
    backend = jax.default_backend()
    # Under configs.target_arch a host without the GPU may trace and lower for it.
    if backend not in ("gpu", "cuda", "rocm") and configs.explicit_arch() is None:
        return (
            f"the default JAX backend is {backend!r}; the Triton kernels need a CUDA or "
            "ROCm GPU (or KDA_JAX_INTERPRET=1 to run them in Triton's interpreter, or "
            "kda_jax.configs.target_arch to lower for a GPU)"
        )
    return None


def available() -> bool:
    return unavailable_reason() is None


def kernels(name: str):
    """Imports ``kda_jax.kernels.<name>``; in interpret mode Triton must see
    TRITON_INTERPRET=1 before the kernels are decorated, so it is set first."""
    if interpret_mode():
        reason = _enter_interpreter()
        if reason is not None:
            raise RuntimeError(reason)
    return importlib.import_module(f"kda_jax.kernels.{name}")


def transform_constexprs(opts, *, has_a_log: bool, has_dt_bias: bool) -> dict:
    """The constexprs of the in-kernel input transforms (scale, L2 norm, gate,
    beta sigmoid and x2) that the prepare and decode kernels share, from a
    call's ``kda_jax.options.KdaOptions``."""
    return dict(
        SCALE=float(opts.scale),
        USE_L2NORM=opts.use_qk_l2norm_in_kernel, USE_GATE=opts.use_gate_in_kernel,
        HAS_A_LOG=has_a_log, HAS_DT_BIAS=has_dt_bias,
        HAS_LOWER_BOUND=opts.lower_bound is not None,
        LOWER_BOUND=float(opts.lower_bound if opts.lower_bound is not None else 0.0),
        BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
        BETA_SCALE=2.0 if opts.allow_neg_eigval else 1.0,
    )


def kernel_function(kernel: str):
    """The ``@triton.jit`` function named ``kernel`` (a key of the signature
    table), imported from its module."""
    return getattr(kernels(signatures.SIGNATURES[kernel].module), kernel)


def runtime_params(fn) -> list[str]:
    """The names of a kernel's runtime (non-constexpr) parameters, in order,
    for a compiled (JITFunction) or interpreted kernel alike."""
    if hasattr(fn, "params"):
        return [p.name for p in fn.params if not p.is_constexpr]
    import triton.language as tl

    return [n for n, p in inspect.signature(fn.fn).parameters.items()
            if p.annotation is not tl.constexpr]


@functools.lru_cache(maxsize=None)
def _checked_signature(kernel: str, fn) -> signatures.Signature:
    """The kernel's table entry, once checked against its parameters."""
    sig = signatures.SIGNATURES[kernel]
    table = [n for n, _ in sig.args]
    params = runtime_params(fn)
    if params != table:
        raise RuntimeError(f"{kernel}: runtime parameters {params} differ from "
                           f"kda_jax.kernels.signatures' {table}")
    return sig


_POINTER_DTYPES = {signatures.F32: np.dtype(np.float32), signatures.I32_PTR: np.dtype(np.int32),
                   signatures.I8_PTR: np.dtype(np.int8)}
_KIND_TEXT = {signatures.IN: "a floating array (the inputs' dtype)",
              signatures.WORK: "a floating array (the intermediates' dtype)",
              signatures.F32: "a float32 array",
              signatures.STATE: "a float32, bfloat16 or float16 array (a state buffer: a "
                                "pool, or the backward's per-chunk states)",
              signatures.I32_PTR: "an int32 array",
              signatures.I8_PTR: "an int8 array",
              signatures.I32: "a Python int"}


def _check_kind(kernel: str, name: str, kind: str, value) -> None:
    """A runtime argument against its kind: an int for a scalar, an array (or
    ShapeDtypeStruct, for outputs) of the kind's dtype for a pointer."""
    if kind == signatures.I32:
        ok = isinstance(value, (int, np.integer))
    else:
        dtype = getattr(value, "dtype", None)
        want = _POINTER_DTYPES.get(kind)
        if dtype is None:
            ok = False
        elif kind == signatures.STATE:
            ok = jnp.dtype(dtype).name in ("float32", "bfloat16", "float16")
        else:
            ok = (jnp.dtype(dtype) == want if want is not None
                  else jnp.issubdtype(dtype, jnp.floating))
    if not ok:
        got = getattr(value, "dtype", None) or type(value).__name__
        raise TypeError(f"{kernel}: argument {name} must be {_KIND_TEXT[kind]} "
                        f"(kda_jax.kernels.signatures), got {got}")


def launch_kernel(spec: KernelLaunch, *, inputs: dict, outputs: dict, grid, name: str,
                  aliases: dict | None = None) -> dict:
    """Launches the kernel ``spec.kernel`` with its runtime arguments by name.

    ``inputs``: name -> jax array or int; ``outputs``: name -> ShapeDtypeStruct;
    both exactly the table's names (``kda_jax.kernels.signatures``), which
    give the order. ``aliases``: ``{input name: output name}``, that output
    being the input's buffer (see :func:`launch`). Returns the outputs by name.
    """
    fn = kernel_function(spec.kernel)
    sig = _checked_signature(spec.kernel, fn)
    for what, given, table in (("inputs", inputs, sig.inputs), ("outputs", outputs, sig.outputs)):
        names = [n for n, _ in table]
        if set(given) != set(names):
            raise ValueError(f"{spec.kernel}: {what} {sorted(given)} must be exactly {names} "
                             "(kda_jax.kernels.signatures)")
        for n, kind in table:
            _check_kind(spec.kernel, n, kind, given[n])
    in_names = [n for n, _ in sig.inputs]
    out_names = [n for n, _ in sig.outputs]
    positions = {in_names.index(i): out_names.index(o) for i, o in (aliases or {}).items()}
    outs = launch(fn, *(inputs[n] for n in in_names), grid=grid,
                  out_shape=[outputs[n] for n in out_names], name=name,
                  num_warps=spec.num_warps, num_stages=spec.num_stages,
                  input_output_aliases=positions or None, **spec.constexprs)
    return dict(zip(out_names, outs))


def launch(kernel, *args, grid, out_shape, name, num_warps=4, num_stages=2,
           zeroed_outputs=(), input_output_aliases=None, **constexprs):
    """Launches ``kernel`` over ``grid`` (a 3-tuple); returns the outputs as a list.

    ``args``: jax arrays and Python ints (runtime scalars), in kernel order.
    ``zeroed_outputs``: indices of outputs that must start as zeros; the others
    start uninitialized (NaN-poisoned in interpret mode, so a missed store shows).
    ``input_output_aliases``: ``{position in args: output index}``; that output
    is the input's buffer (same shape and dtype), so what the kernel does not
    store keeps the input's values. With the input donated to the enclosing
    jit, XLA updates it in place; otherwise XLA copies it first. In interpret
    mode the output starts as a copy of the input.
    """
    out_shape = list(out_shape)
    aliases = _check_aliases(args, out_shape, input_output_aliases)
    if interpret_mode():
        outs = _interpret(kernel, args, grid, out_shape, zeroed_outputs, constexprs, aliases)
    else:
        outs = _triton_call(kernel, args, grid, out_shape, name, num_warps, num_stages,
                            zeroed_outputs, aliases, constexprs)
    # Inside jax.shard_map the launch computes the device's own data, but
    # neither the callback nor the custom call types its outputs as varying
    # over the mesh axes: they take the inputs' axes (kda_jax.vma).
    return vma.like(outs, [a for a in args if not isinstance(a, (int, np.integer))])


def _triton_call(kernel, args, grid, out_shape, name, num_warps, num_stages, zeroed_outputs,
                 aliases, constexprs):
    """The launch through jax-triton's custom call (a GPU, or lowering for one)."""
    import jax_triton as jt

    compat.install()  # ROCm fixes and target-arch lowering, once (compat.py)

    # jax-triton numbers aliased inputs among the array arguments only
    # (scalars are not operands of its custom call).
    array_pos = [i for i, a in enumerate(args) if not isinstance(a, (int, np.integer))]
    outs = jt.triton_call(
        *args, kernel=kernel, out_shape=out_shape, grid=grid, name=name,
        num_warps=num_warps, num_stages=num_stages, zeroed_outputs=tuple(zeroed_outputs),
        input_output_aliases={array_pos.index(i): o for i, o in aliases.items()},
        **constexprs,
    )
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _check_aliases(args, out_shape, aliases) -> dict[int, int]:
    """``{position in args: output index}``, checked: an array input aliased to
    an output of the same shape and dtype, each output at most once."""
    aliases = dict(aliases or {})
    if len(set(aliases.values())) != len(aliases):
        raise ValueError(f"input_output_aliases={aliases} aliases an output twice")
    for i, o in aliases.items():
        if not 0 <= i < len(args) or isinstance(args[i], (int, np.integer)):
            raise ValueError(
                f"input_output_aliases: args[{i}] is not an array input of this launch")
        if not 0 <= o < len(out_shape):
            raise ValueError(f"input_output_aliases: output {o} does not exist")
        a, s = args[i], out_shape[o]
        if tuple(a.shape) != tuple(s.shape) or jnp.dtype(a.dtype) != jnp.dtype(s.dtype):
            raise ValueError(
                f"input_output_aliases: args[{i}] {tuple(a.shape)} {jnp.dtype(a.dtype)} cannot "
                f"alias output {o} {tuple(s.shape)} {jnp.dtype(s.dtype)}; shapes and dtypes "
                "must match")
    return aliases


# --------------------------------------------------------------------------- #
# Interpreter path.
# --------------------------------------------------------------------------- #


class _HostTensor:
    """A NumPy buffer dressed as the tensor Triton's interpreter expects."""

    def __init__(self, array: np.ndarray):
        import triton.language as tl

        self.array = array
        self.dtype = {
            "float32": tl.float32, "float16": tl.float16, "bfloat16": tl.bfloat16,
            "int32": tl.int32, "int64": tl.int64, "int8": tl.int8,
        }[array.dtype.name]

    def data_ptr(self):
        return self.array.ctypes.data

    # The interpreter's host-copy protocol; the data already lives on the host.
    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other):
        return self


def _poisoned(shape, dtype, zero: bool) -> np.ndarray:
    dtype = np.dtype(dtype)
    if zero:
        return np.zeros(shape, dtype)
    if np.issubdtype(dtype, np.integer):
        return np.full(shape, np.iinfo(dtype).min, dtype)
    return np.full(shape, np.nan, dtype)


_PROT_NONE = 0


def _mprotect_none(address: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.mprotect(address, size, _PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")


def _guarded(array: np.ndarray, at_end: bool) -> np.ndarray:
    """A copy of ``array`` in its own mmap'd region, preceded and followed by
    a PROT_NONE page, flush against the following page (``at_end``) or the
    preceding one. The region is unmapped when the copy is collected."""
    page = mmap.PAGESIZE
    nbytes = array.nbytes
    body = max(-(-nbytes // page), 1) * page
    region = mmap.mmap(-1, body + 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    raw = np.frombuffer(region, np.uint8)
    base = raw.ctypes.data
    _mprotect_none(base, page)
    _mprotect_none(base + page + body, page)
    start = page + (body - nbytes if at_end else 0)
    out = raw[start:start + nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


# Triton's interpreter keeps the running grid in module state: launches from
# several host devices at once (shard_map over CPU devices runs each device's
# callbacks on its own thread) must take turns.
_INTERPRETER_LOCK = threading.Lock()


def _interpret(kernel, args, grid, out_shape, zeroed_outputs, constexprs, aliases=None):
    array_pos = [i for i, a in enumerate(args) if not isinstance(a, (int, np.integer))]
    arrays = [args[i] for i in array_pos]
    source = {o: i for i, o in (aliases or {}).items()}  # output -> aliased args position
    guard_mode()  # an unknown value is named at trace time

    def host(*host_arrays):
        guard = guard_mode()  # read per call: a test may move arrays between calls
        place = (lambda a: a) if guard is None else (lambda a: _guarded(a, guard == "end"))
        full = list(args)
        for i, a in zip(array_pos, host_arrays):
            full[i] = _HostTensor(place(np.ascontiguousarray(np.asarray(a))))
        # An aliased output starts as a copy of its input (on a GPU it is the
        # input's buffer); the input stays a separate, read-only copy here.
        outs = [
            place(np.array(full[source[i]].array, copy=True)) if i in source
            else place(_poisoned(s.shape, s.dtype, i in zeroed_outputs))
            for i, s in enumerate(out_shape)
        ]
        try:
            with _INTERPRETER_LOCK:
                kernel[tuple(grid)](*full, *(_HostTensor(o) for o in outs), **constexprs)
        except Exception as e:  # the callback boundary drops the traceback; keep it
            detail = "".join(traceback.format_exception(e))
            raise RuntimeError(f"{getattr(kernel, '__name__', kernel)} failed in Triton's interpreter:\n{detail}") from e
        # Guarded outputs leave their regions (JAX may keep a host array it is given).
        return outs if guard is None else [np.array(o, copy=True) for o in outs]

    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
    operands = [jnp.asarray(a) for a in arrays]
    if host_call.in_local_lowering():
        # A custom_partitioning rule's per-device function: a pure_callback
        # lowered there would point at nothing (kda_jax.triton.host_call).
        return host_call.host_call(host, shapes, *operands)
    return list(jax.pure_callback(host, shapes, *operands))
