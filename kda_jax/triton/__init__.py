"""The Triton backend: jax-triton launches of the kernels in ``kda_jax.kernels``.

With ``KDA_JAX_INTERPRET=1`` the same launches run the kernels in Triton's
interpreter on the CPU (through ``jax.pure_callback``), for tests without a GPU.
"""

from kda_jax.triton.backward import chunk_kda_triton_grad
from kda_jax.triton.forward import chunk_kda_triton, chunk_kda_triton_serving
from kda_jax.triton.launch import available, interpret_mode, unavailable_reason
from kda_jax.triton.recurrent import fused_recurrent_kda_triton

__all__ = ["chunk_kda_triton", "chunk_kda_triton_serving", "chunk_kda_triton_grad",
           "fused_recurrent_kda_triton", "available", "interpret_mode", "unavailable_reason"]
