"""The bucketed serving step lowered on a CPU for ROCm (gfx950) and CUDA (sm90).

A jitted step with a VarlenBatch and a donated state pool, for chunk_kda_pool
and fused_recurrent_kda_pool on the Triton path, lowered with test_lowering's stand-in
launcher (jax-triton compiles the kernels for the real target; see there).
Checked: the grids come from the bucket (a tail program past the sequence
slots), no int32 constant carries bounds (the metadata is an argument), two
bounds of the bucket lower to the same module, and the pool reaches the
kernel as an operand aliased to its output, from a donated argument, so XLA
can update it in place. The lowering runs in a child process, as in
test_lowering.py.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from kda_jax import Bucket
from kda_jax.triton.launch import stand_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"gfx950": "rocm", "sm90": "cuda"}
BUCKET = Bucket(max_seqs=8, max_tokens=128)
LENGTHS = ([1, 1, 40, 0, 1], [70, 1, 1, 1, 1, 1, 1, 1])
HV, K, V, SLOTS = 2, 64, 64, 16


def _child(archs) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_lowering as base

    import jax._src.lib

    jax._src.lib.gpu_triton = base._stand_in_launcher()  # before jax_triton imports it
    try:
        import jax_triton  # noqa: F401
        import triton.backends.amd.compiler  # noqa: F401
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as e:
        return {"skip": f"jax-triton or a Triton GPU backend is not importable: {e}"}
    import jax
    import jax.numpy as jnp
    from jax._src.lib.mlir import ir

    import kda_jax
    from kda_jax import configs

    t = BUCKET.max_tokens
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    inputs = (spec(1, t, 1, K), spec(1, t, 1, K), spec(1, t, HV, V),
              spec(1, t, HV, K, dtype=jnp.float32), spec(1, t, HV, dtype=jnp.float32))
    pool = spec(SLOTS, HV, K, V, dtype=jnp.float32)
    idx = spec(BUCKET.max_seqs, dtype=jnp.int32)
    fns = {"chunk": kda_jax.chunk_kda_pool, "recurrent": kda_jax.fused_recurrent_kda_pool}
    out = {}
    for arch in archs:
        for name, fn in fns.items():
            texts = []
            for lens in LENGTHS:
                batch = kda_jax.VarlenBatch.from_lengths(lens, BUCKET)

                def step(pool, idx, q, k, v, g, beta, batch, fn=fn):
                    return fn(q, k, v, g, beta, pool, kda_jax.PoolRows(idx), cu_seqlens=batch,
                              implementation="triton")

                with configs.target_arch(arch):
                    lowered = jax.jit(step, donate_argnums=0).trace(
                        pool, idx, *inputs, batch).lower(lowering_platforms=(TARGETS[arch],))
                module = lowered.compiler_ir("stablehlo")
                texts.append(str(module))
            aliased = []

            def visit(op):
                op = op.operation
                if op.name == "stablehlo.custom_call":
                    attrs = op.attributes
                    has = "output_operand_aliases" in attrs
                    aliased.append(has and "output_operand_alias<" in str(
                        attrs["output_operand_aliases"]))
                return ir.WalkResult.ADVANCE

            module.operation.walk(visit)
            out[f"{arch}/{name}"] = dict(base._module_contents(module), aliased=aliased,
                                         same_module=texts[0] == texts[1],
                                         donated="tf.aliasing_output" in texts[0])
    return out


@pytest.fixture(scope="module")
def lowered():
    # Imported here, not at the top: the child runs this file as a script and
    # must not import conftest (it turns interpret mode on without a GPU).
    from conftest import run_lowering_child

    return run_lowering_child(__file__, list(TARGETS))


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("arch", list(TARGETS))
def test_bucketed_step_lowers_with_bucket_grids_and_an_aliased_pool(lowered, arch, fn):
    got = lowered[f"{arch}/{fn}"]
    grids = {c["kernel"]: c["grid"] for c in got["calls"]}
    seq_programs = BUCKET.max_seqs + 1  # the sequence slots plus the tail program
    if fn == "chunk":
        assert sorted(grids) == ["kda_fwd_prepare_kernel", "kda_fwd_state_output_kernel"]
        assert grids["kda_fwd_prepare_kernel"] == [BUCKET.max_chunks, HV, 1]
        state = grids["kda_fwd_state_output_kernel"]  # (sequences, heads, V blocks)
        assert state[:2] == [seq_programs, HV] and state[2] >= 1
        # Only the state kernel takes the pool: its output aliases it.
        assert sorted(got["aliased"]) == [False, True]
    else:
        assert list(grids) == ["kda_fused_recurrent_kernel"]
        decode = grids["kda_fused_recurrent_kernel"]  # (V blocks, heads, sequences)
        assert decode[0] >= 1 and decode[1:] == [HV, seq_programs]
        assert got["aliased"] == [True]
    # The metadata is an argument: no int32 constant holds bounds (only stand-ins).
    unread = np.asarray(stand_in(np.int32)).tolist()
    assert all(c == unread for c in got["i32_constants"]), got["i32_constants"]
    assert got["same_module"], "two bounds of one bucket lowered differently"
    assert got["donated"], "the donated pool does not alias an output of the step"


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:] or list(TARGETS))))
