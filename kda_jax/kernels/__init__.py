"""KDA's Triton kernels: ``@triton.jit`` functions only, no JAX import.

Installed as ``kda_jax.kernels``; they compile ahead of time and run in
Triton's interpreter on their own.
"""
