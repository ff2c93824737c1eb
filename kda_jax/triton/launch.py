"""One way to launch a Triton kernel from JAX: jax-triton on a GPU, or Triton's
interpreter on the host when ``KDA_JAX_INTERPRET=1``.

Kernel parameters follow jax-triton's order: array and scalar inputs, then one
pointer per output, then constexprs by name.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["interpret_mode", "available", "unavailable_reason", "kernels", "launch"]


def interpret_mode() -> bool:
    """True when KDA_JAX_INTERPRET=1: kernels run in Triton's interpreter on the host."""
    return os.environ.get("KDA_JAX_INTERPRET", "") == "1"


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
    if backend not in ("gpu", "cuda", "rocm"):
        return (
            f"the default JAX backend is {backend!r}; the Triton kernels need a CUDA or "
            "ROCm GPU (or KDA_JAX_INTERPRET=1 to run them in Triton's interpreter)"
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


def launch(kernel, *args, grid, out_shape, name, num_warps=4, num_stages=2,
           zeroed_outputs=(), **constexprs):
    """Launches ``kernel`` over ``grid`` (a 3-tuple); returns the outputs as a list.

    ``args``: jax arrays and Python ints (runtime scalars), in kernel order.
    ``zeroed_outputs``: indices of outputs that must start as zeros; the others
    start uninitialized (NaN-poisoned in interpret mode, so a missed store shows).
    """
    out_shape = list(out_shape)
    if interpret_mode():
        return _interpret(kernel, args, grid, out_shape, zeroed_outputs, constexprs)
    import jax_triton as jt

    outs = jt.triton_call(
        *args, kernel=kernel, out_shape=out_shape, grid=grid, name=name,
        num_warps=num_warps, num_stages=num_stages, zeroed_outputs=tuple(zeroed_outputs),
        **constexprs,
    )
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


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
            "int32": tl.int32, "int64": tl.int64,
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


def _interpret(kernel, args, grid, out_shape, zeroed_outputs, constexprs):
    array_pos = [i for i, a in enumerate(args) if not isinstance(a, (int, np.integer))]
    arrays = [args[i] for i in array_pos]

    def host(*host_arrays):
        full = list(args)
        for i, a in zip(array_pos, host_arrays):
            full[i] = _HostTensor(np.ascontiguousarray(np.asarray(a)))
        outs = [
            _poisoned(s.shape, s.dtype, i in zeroed_outputs) for i, s in enumerate(out_shape)
        ]
        try:
            kernel[tuple(grid)](*full, *(_HostTensor(o) for o in outs), **constexprs)
        except Exception as e:  # the callback boundary drops the traceback; keep it
            detail = "".join(traceback.format_exception(e))
            raise RuntimeError(f"{getattr(kernel, '__name__', kernel)} failed in Triton's interpreter:\n{detail}") from e
        return outs

    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
    return list(jax.pure_callback(host, shapes, *[jnp.asarray(a) for a in arrays]))
