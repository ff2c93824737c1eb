"""A host function as an XLA:CPU custom call that needs no executable state:
how Triton's interpreter runs inside a custom_partitioning rule.

``jax.pure_callback`` registers its function with the module being lowered,
and the executable finds it there by index at run time. A
``custom_partitioning`` rule lowers its per-device function into a module of
its own, during the compilation of the enclosing program, after that
program's callbacks were handed to the compiler: a callback lowered there
points at nothing (a segfault at run time; JAX issue 34349). So inside a
rule (:func:`local_lowering`) the interpreter launches go through
:func:`host_call` instead: one custom call target registered once per
process (a ctypes function with the legacy CPU custom call signature of
``API_VERSION_STATUS_RETURNING_UNIFIED``), whose backend config names the
host function in a process-wide table. Inputs are copied out of XLA's
buffers, the function runs, its results are copied into XLA's buffers.

Failures: the CPU custom call status cannot be set from Python (the symbol
is not exported), so an exception in the host function prints its traceback
to stderr and leaves the outputs NaN (integer outputs at their minimum): the
result is visibly wrong, never plausibly wrong.

Interpret mode only (a test mode): the table keeps every host function of
every compiled rule alive for the life of the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
import traceback

import jax
import numpy as np

__all__ = ["host_call", "local_lowering", "in_local_lowering"]

_TARGET = "kda_jax_host_call"
_STATE = threading.local()
_TABLE: dict[int, tuple] = {}
_TABLE_LOCK = threading.Lock()

# void(void* out, const void** in, const char* opaque, size_t opaque_len,
#      XlaCustomCallStatus* status): XLA:CPU's legacy unified signature.
_SIGNATURE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p)
_API_VERSION = 3  # API_VERSION_STATUS_RETURNING_UNIFIED


@contextlib.contextmanager
def local_lowering():
    """Marks the tracing of a custom_partitioning rule's per-device function:
    :func:`in_local_lowering` is True inside (per thread)."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def in_local_lowering() -> bool:
    return getattr(_STATE, "depth", 0) > 0


def _view(address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype).reshape(shape)


def _poison(array: np.ndarray) -> None:
    if np.issubdtype(array.dtype, np.integer):
        array[...] = np.iinfo(array.dtype).min
    else:
        array[...] = np.nan


def _run(out, ins, opaque, opaque_len, status):
    """The custom call target: looks up the host function, runs it on copies
    of the inputs and writes its results into the output buffers."""
    del status
    key = int(ctypes.string_at(opaque, opaque_len))
    fn, in_specs, out_specs = _TABLE[key]
    # One result is passed as its buffer; several as an array of buffers.
    if len(out_specs) == 1:
        out_ptrs = [out]
    else:
        out_array = ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))
        out_ptrs = [out_array[i] for i in range(len(out_specs))]
    outs = [_view(p, shape, dtype) for p, (shape, dtype) in zip(out_ptrs, out_specs)]
    try:
        args = [_view(ins[i], shape, dtype).copy() for i, (shape, dtype) in enumerate(in_specs)]
        results = fn(*args)
        for o, r in zip(outs, results):
            o[...] = np.asarray(r).reshape(o.shape)
    except BaseException:  # no exception may cross the C boundary
        sys.stderr.write("kda_jax host_call: the host function failed; its outputs are NaN\n"
                         + traceback.format_exc())
        for o in outs:
            _poison(o)


@functools.cache
def _register() -> _SIGNATURE:
    """Registers the custom call target (once); returns the ctypes function,
    which must stay alive as long as the process may run it."""
    function = _SIGNATURE(_run)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    capsule = new_capsule(ctypes.cast(function, ctypes.c_void_p).value,
                          b"xla._CUSTOM_CALL_TARGET", None)
    jax.ffi.register_ffi_target(_TARGET, capsule, platform="cpu", api_version=0)
    return function


def host_call(fn, out_shapes, *arrays) -> list:
    """``fn(*numpy arrays) -> sequence of numpy arrays`` (shapes and dtypes of
    ``out_shapes``, ShapeDtypeStructs) as an XLA:CPU custom call on ``arrays``.

    The value of ``jax.pure_callback(fn, out_shapes, *arrays)``; unlike it,
    valid inside a custom_partitioning rule. No batching or differentiation
    rule; CPU devices only."""
    if jax.default_backend() != "cpu":
        raise RuntimeError(
            "KDA_JAX_INTERPRET=1 under a sharded jax.jit runs Triton's interpreter on CPU "
            f"devices only, but the default JAX backend is {jax.default_backend()!r}; run the "
            "interpreter with JAX_PLATFORMS=cpu, or the compiled kernels without "
            "KDA_JAX_INTERPRET")
    _register()
    in_specs = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
    out_specs = tuple((tuple(s.shape), np.dtype(s.dtype)) for s in out_shapes)
    with _TABLE_LOCK:
        key = len(_TABLE)
        _TABLE[key] = (fn, in_specs, out_specs)
    call = jax.ffi.ffi_call(
        _TARGET, [jax.ShapeDtypeStruct(s, d) for s, d in out_specs],
        custom_call_api_version=_API_VERSION, legacy_backend_config=str(key),
        has_side_effect=False)
    return list(call(*arrays))
