"""The kernels' argument tables (kda_jax.kernels.signatures): each matches its
kernel's parameters, and a launch by name refuses names or kinds that do not
fit before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_jax.kernels.signatures import KINDS, SIGNATURES
from kda_jax.triton.launch import KernelLaunch, kernel_function, launch_kernel, runtime_params

@pytest.mark.parametrize("kernel", sorted(SIGNATURES))
def test_table_matches_the_kernel(kernel):
    sig = SIGNATURES[kernel]
    assert runtime_params(kernel_function(kernel)) == [n for n, _ in sig.args]
    assert all(kind in KINDS for _, kind in sig.args)
    assert sig.outputs, "jax-triton needs at least one output"


def _decode_args():
    f32 = lambda *s: jnp.zeros(s, jnp.float32)
    i32 = jnp.zeros((4,), jnp.int32)
    inputs = dict(q=f32(1, 1, 16), k=f32(1, 1, 16), v=f32(1, 1, 16), g=f32(1, 1, 16),
                  beta=f32(1, 1), A_log=f32(4), dt_bias=f32(4), h0=f32(4), read_idx=i32,
                  write_idx=i32, meta=i32, off_cu=0, n_seqs=1, n_tokens=1, slots=0)
    outputs = dict(o=jax.ShapeDtypeStruct((1, 1, 16), jnp.float32),
                   ht=jax.ShapeDtypeStruct((4,), jnp.float32))
    return inputs, outputs


SPEC = KernelLaunch("kda_fused_recurrent_kernel", {}, 1, 1)


@pytest.mark.parametrize("change, error, message", [
    (lambda i, o: i.pop("slots"), ValueError, "inputs .* must be exactly"),
    (lambda i, o: i.update(extra=1), ValueError, "inputs .* must be exactly"),
    (lambda i, o: o.pop("ht"), ValueError, "outputs .* must be exactly"),
    (lambda i, o: i.update(n_seqs=jnp.zeros((1,), jnp.int32)), TypeError,
     "argument n_seqs must be a Python int"),
    (lambda i, o: i.update(read_idx=jnp.zeros((4,), jnp.float32)), TypeError,
     "argument read_idx must be an int32 array .* got float32"),
    (lambda i, o: i.update(A_log=jnp.zeros((4,), jnp.bfloat16)), TypeError,
     "argument A_log must be a float32 array .* got bfloat16"),
    (lambda i, o: i.update(h0=np.zeros((4,), np.float64)), TypeError,
     r"argument h0 must be a float32, bfloat16 or float16 array \(a state buffer: .*\) .* got "
     "float64"),
    (lambda i, o: i.update(q=np.zeros((1, 1, 16), np.int32)), TypeError,
     "argument q must be a floating array .* got int32"),
], ids=["missing-input", "extra-input", "missing-output", "array-for-scalar",
        "float-index", "bf16-float32-only", "float64-state", "int-input"])
def test_launch_by_name_refuses_what_does_not_fit(change, error, message):
    inputs, outputs = _decode_args()
    change(inputs, outputs)
    with pytest.raises(error, match=message):
        launch_kernel(SPEC, inputs=inputs, outputs=outputs, grid=(1, 1, 1), name="decode")
