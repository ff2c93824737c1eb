"""A device-to-host guard that fires on a CPU too."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax._src import array as jax_array


def _refuse(x):
    raise RuntimeError(f"a read of a {x.dtype}{list(x.shape)} array's value inside "
                       "no_device_reads")


def _refusing(convert):
    def checked(x, *args, **kwargs):
        if isinstance(x, jax_array.ArrayImpl):
            _refuse(x)
        return convert(x, *args, **kwargs)
    return checked


@contextlib.contextmanager
def no_device_reads(strict: bool = True):
    """``jax.transfer_guard_device_to_host("disallow")``; with ``strict``, also
    every read of an array's value (np.asarray, np.array, float(), .tolist(),
    jax.device_get) raises inside it. jax's guard never fires on a CPU, whose
    buffers are host memory: there the strict form is the check. Not strict:
    Triton's interpreter, whose callbacks read their operands on the host by
    design."""
    with jax.transfer_guard_device_to_host("disallow"):
        if not strict:
            yield
            return
        # np.asarray reads a CPU array through the buffer protocol, not _value.
        saved = jax_array.ArrayImpl._value, np.asarray, np.array
        jax_array.ArrayImpl._value = property(_refuse)
        np.asarray, np.array = _refusing(np.asarray), _refusing(np.array)
        try:
            yield
        finally:
            jax_array.ArrayImpl._value, np.asarray, np.array = saved
