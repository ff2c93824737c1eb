"""The runtime arguments of every kernel, in the kernel's order: the one table
that the launches (kda_jax.triton.launch.launch_kernel, which passes them by
name), the ahead-of-time compile (bench.aot) and the tests read. Constexprs
are not listed: they are passed by name.

Each argument has a kind, which fixes its type:
  "in"     pointer to the inputs' dtype (q, k, v, g, beta; o; the cotangent do)
  "work"   pointer to the intermediates' dtype (kda_jax.triton.forward.work_dtype)
  "*fp32"  pointer to float32
  "state"  pointer to a state buffer: float32, or a pool's bfloat16 / float16
           (kernels/state_io.py loads into float32 and rounds on the store), or
           the backward's per-chunk states in the intermediates' dtype
           (configs.BackwardConfig.chunk_states)
  "*i32"   pointer to int32
  "*i8"    pointer to int8
  "i32"    integer scalar
Inputs come first, then one pointer per output (jax-triton's order).
Plain data: importing this module imports neither Triton nor JAX.
"""

from typing import NamedTuple

IN, WORK, F32, STATE, I32_PTR, I8_PTR, I32 = ("in", "work", "*fp32", "state", "*i32", "*i8",
                                             "i32")
KINDS = (IN, WORK, F32, STATE, I32_PTR, I8_PTR, I32)


class Signature(NamedTuple):
    """A kernel's module (under kda_jax.kernels), its inputs and its outputs,
    each a tuple of (name, kind)."""

    module: str
    inputs: tuple
    outputs: tuple

    @property
    def args(self) -> tuple:
        """Every runtime argument, (name, kind), in the kernel's order."""
        return self.inputs + self.outputs


# The varlen metadata buffer and its offsets (kernels/varlen.py).
_META_CHUNKS = (("meta", I32_PTR), ("off_cu", I32), ("off_ct", I32), ("n_bounds", I32),
                ("n_tokens", I32))
_META_SEQS = (("meta", I32_PTR), ("off_cu", I32), ("off_co", I32))

SIGNATURES = {
    "kda_fwd_prepare_kernel": Signature(
        "chunk_fwd",
        inputs=(("q", IN), ("k", IN), ("v", IN), ("g", IN), ("beta", IN), ("A_log", F32),
                ("dt_bias", F32)) + _META_CHUNKS,
        outputs=(("w", WORK), ("u", WORK), ("qg", WORK), ("kt", WORK), ("aqk", WORK),
                 ("gl", F32), ("x", F32), ("gc", F32), ("flags", I8_PTR)),
    ),
    "kda_fwd_state_output_kernel": Signature(
        "chunk_fwd",
        inputs=(("w", WORK), ("u", WORK), ("qg", WORK), ("kt", WORK), ("aqk", WORK),
                ("gl", F32), ("h0", STATE), ("read_idx", I32_PTR), ("write_idx", I32_PTR),
                ("ckpt_idx", I32_PTR))
        + _META_SEQS + (("n_seqs", I32), ("n_tokens", I32), ("n_chunk_rows", I32),
                        ("slots", I32), ("ckpt_cols", I32)),
        outputs=(("o", IN), ("ht", STATE), ("hc", F32)),
    ),
    "kda_fused_recurrent_kernel": Signature(
        "fused_recurrent",
        inputs=(("q", IN), ("k", IN), ("v", IN), ("g", IN), ("beta", IN), ("A_log", F32),
                ("dt_bias", F32), ("h0", STATE), ("read_idx", I32_PTR), ("write_idx", I32_PTR),
                ("meta", I32_PTR), ("off_cu", I32), ("n_seqs", I32), ("n_tokens", I32),
                ("slots", I32)),
        outputs=(("o", IN), ("ht", STATE)),
    ),
    # The state chain over segments (kernels/segments.py).
    "kda_segment_map_kernel": Signature(
        "segments",
        inputs=(("w", WORK), ("u", WORK), ("kt", WORK), ("gl", F32)) + _META_SEQS
        + (("n_tokens", I32), ("n_chunk_rows", I32)),
        outputs=(("e", F32), ("m", F32)),
    ),
    "kda_segment_fold_kernel": Signature(
        "segments",
        inputs=(("e", F32), ("m", F32), ("h0", F32), ("meta", I32_PTR), ("off_chains", I32)),
        outputs=(("s", F32),),
    ),
    # The backward (q, k, g, beta are the transformed inputs; "in" covers do).
    "kda_bwd_state_kernel": Signature(
        "chunk_bwd",
        inputs=(("w", WORK), ("u", WORK), ("kt", WORK), ("gl", F32), ("h0", F32))
        + _META_SEQS + (("n_tokens", I32), ("n_chunk_rows", I32)),
        outputs=(("h", STATE), ("vn", WORK)),
    ),
    "kda_bwd_dstate_kernel": Signature(
        "chunk_bwd",
        inputs=(("qg", WORK), ("kt", WORK), ("w", WORK), ("aqk", WORK), ("gl", F32),
                ("do", IN), ("dht", F32)) + _META_SEQS + (("n_tokens", I32),
                                                           ("n_chunk_rows", I32)),
        outputs=(("dh", STATE), ("dvn", WORK), ("dh0", F32)),
    ),
    "kda_bwd_inter_kernel": Signature(
        "chunk_bwd",
        inputs=(("q", IN), ("k", IN), ("gc", F32), ("g", IN), ("h", STATE), ("dh", STATE),
                ("vn", WORK), ("dvn", WORK), ("do", IN)) + _META_CHUNKS,
        outputs=(("dq", F32), ("dk", F32), ("dg", F32), ("dw", F32)),
    ),
    "kda_bwd_wy_kernel": Signature(
        "chunk_bwd",
        inputs=(("k", IN), ("v", IN), ("gc", F32), ("beta", IN), ("x", F32), ("w", WORK),
                ("u", WORK), ("vn", WORK), ("dvn", WORK), ("do", IN), ("dk_p", F32),
                ("dg_p", F32), ("dw", F32)) + _META_CHUNKS,
        outputs=(("dv", F32), ("dk_w", F32), ("dg_w", F32), ("dl", F32), ("daqk", F32),
                 ("dbeta", F32)),
    ),
    "kda_bwd_grads_kernel": Signature(
        "chunk_bwd",
        inputs=(("q", IN), ("k", IN), ("v", IN), ("g", IN), ("gc", F32), ("beta", IN),
                ("x", F32), ("h", STATE), ("dh", STATE), ("vn", WORK), ("dvn", WORK),
                ("do", IN)) + _META_CHUNKS,
        outputs=(("dq", F32), ("dk", F32), ("dv", F32), ("dg", F32), ("dbeta", F32),
                 ("dl", F32), ("daqk", F32)),
    ),
    "kda_bwd_intra_kernel": Signature(
        "chunk_bwd",
        inputs=(("q", IN), ("k", IN), ("g", IN), ("beta", IN), ("dl", F32),
                ("daqk", F32), ("dq_p", F32), ("dk_w", F32), ("dg_w", F32)) + _META_CHUNKS,
        outputs=(("dq", F32), ("dk", F32), ("dg", F32), ("dbeta_k", F32)),
    ),
}
