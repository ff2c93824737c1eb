"""The launch configs for sm90 (NVIDIA H100, H200): one line per kernel and
variant (kda_jax.configs.types). Why each value is as it is, and the
measurements behind it: docs/tuning.md ("Launch configs")."""

from kda_jax.configs.types import (BackwardConfig, BlockConfig, DecodeConfig, FoldConfig,
                                   ForwardConfig, GradsConfig, IntraConfig, PrepareConfig,
                                   RecurrentConfig, SegmentConfig, SegmentRule, StateConfig)

FORWARD_64 = ForwardConfig(
    prepare={
        "16bit": PrepareConfig(block_k=16, warps=4, stages=3, dot="tf32", wu_dot="bf16", inverse_dot="tf32", batched_l1=True),
        "fp32": PrepareConfig(block_k=16, warps=8, stages=3, dot="bf16x3", wu_dot="bf16x3", inverse_dot="bf16x3", split=True, batched_l1=True)},
    state={
        "16bit": StateConfig(block_v=32, warps=4, stages=3),
        "16bit_wide": StateConfig(block_v=16, warps=8, stages=1),
        "fp32": StateConfig(block_v=16, warps=8, stages=2, dot="bf16x3"),
        "fp32_wide": StateConfig(block_v=16, warps=8, stages=1, dot="bf16x3")},
    segment_state={"16bit": StateConfig(block_v=64, warps=4, stages=3), "fp32": StateConfig(block_v=16, warps=8, stages=2, dot="bf16x3")},
    map={"16bit": StateConfig(block_v=64, warps=4, stages=2), "fp32": StateConfig(block_v=64, warps=8, stages=2, dot="bf16x3")},
    fold=FoldConfig(block_j=128, warps=8, dot="bf16x3"))

FORWARD_32 = ForwardConfig(
    prepare={
        "16bit": PrepareConfig(block_k=16, warps=8, stages=1, dot="tf32", wu_dot="bf16", inverse_dot="tf32"),
        "fp32": PrepareConfig(block_k=16, warps=8, stages=1, dot="bf16x3", wu_dot="bf16x3", inverse_dot="bf16x3")},
    state={
        "16bit": StateConfig(block_v=32, warps=4, stages=3),
        "16bit_wide": StateConfig(block_v=16, warps=8, stages=1),
        "fp32": StateConfig(block_v=16, warps=4, stages=2, dot="bf16x3"),
        "fp32_wide": StateConfig(block_v=16, warps=4, stages=1, dot="bf16x3")},
    segment_state={"16bit": StateConfig(block_v=64, warps=4, stages=3), "fp32": StateConfig(block_v=16, warps=4, stages=2, dot="bf16x3")},
    map={"16bit": StateConfig(block_v=64, warps=4, stages=2), "fp32": StateConfig(block_v=64, warps=4, stages=2, dot="bf16x3")},
    fold=FoldConfig(block_j=128, warps=8, dot="bf16x3"))

BACKWARD_64 = BackwardConfig(
    recompute={
        "16bit": PrepareConfig(block_k=16, warps=4, stages=3, dot="tf32", wu_dot="bf16", inverse_dot="tf32", batched_l1=True),
        "fp32": PrepareConfig(block_k=16, warps=4, stages=1, dot="bf16x3", wu_dot="bf16x3", inverse_dot="bf16x3", split=True, batched_l1=True)},
    state={
        "16bit": StateConfig(block_v=16, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=16, warps=8, stages=1),
        "fp32": StateConfig(block_v=32, warps=4, stages=2, dot="bf16x3"),
        "fp32_wide": StateConfig(block_v=32, warps=8, stages=1, dot="bf16x3")},
    dstate={
        "16bit": StateConfig(block_v=16, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=16, warps=8, stages=1),
        "fp32": StateConfig(block_v=32, warps=4, stages=2, dot="bf16x3"),
        "fp32_wide": StateConfig(block_v=32, warps=8, stages=1, dot="bf16x3")},
    inter={"16bit": BlockConfig(block_k=32, block_v=64, warps=4, dot="ieee"),
           "fp32": BlockConfig(block_k=32, block_v=32, warps=4, dot="bf16x3")},
    wy={"bf16": BlockConfig(block_k=16, block_v=32, warps=4, dot="bf16"),
        "fp16": BlockConfig(block_k=32, block_v=32, warps=8, dot="bf16x3"),
        "fp32": BlockConfig(block_k=16, block_v=32, warps=8, dot="tf32x3")},
    intra={"bf16": IntraConfig(block_k=16, warps=4, dot="bf16x3", batched_l1=True),
           "fp16": IntraConfig(block_k=32, warps=8, dot="bf16x3", batched_l1=True),
           "fp32": IntraConfig(block_k=32, warps=8, dot="bf16x3", batched_l1=True)},
    fold=FoldConfig(block_j=128, warps=8, dot="bf16x3"),
    gate_fp32_max_k=0, chunk_states="work", normalized_qk="input", transform_residuals="recompute",
    nonfinite_flags="forward", fused_grads=True,
    grads={"bf16": GradsConfig(block_k=16, block_v=32, warps=4, dot="ieee", x_dot="bf16",
                               product_dot="bf16x3", batched_l1=True)})

BACKWARD_32 = BackwardConfig(
    recompute={
        "16bit": PrepareConfig(block_k=32, warps=8, stages=1, dot="bf16x3", wu_dot="tf32x3", inverse_dot="bf16x3", split=True),
        "fp32": PrepareConfig(block_k=32, warps=8, stages=1, dot="bf16x3", wu_dot="bf16x3", inverse_dot="bf16x3", split=True)},
    state={
        "16bit": StateConfig(block_v=16, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=16, warps=8, stages=1),
        "fp32": StateConfig(block_v=16, warps=4, stages=2, dot="tf32x3"),
        "fp32_wide": StateConfig(block_v=16, warps=8, stages=1, dot="tf32x3")},
    dstate={
        "16bit": StateConfig(block_v=16, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=16, warps=8, stages=1),
        "fp32": StateConfig(block_v=16, warps=4, stages=2, dot="tf32x3", split_k=False),
        "fp32_wide": StateConfig(block_v=16, warps=8, stages=1, dot="tf32x3", split_k=False)},
    inter={"16bit": BlockConfig(block_k=16, block_v=16, warps=4, dot="ieee"),
           "fp32": BlockConfig(block_k=16, block_v=16, warps=4, dot="tf32x3")},
    wy={"bf16": BlockConfig(block_k=16, block_v=16, warps=4, dot="bf16x3"),
        "fp16": BlockConfig(block_k=16, block_v=16, warps=4, dot="bf16x3"),
        "fp32": BlockConfig(block_k=16, block_v=16, warps=4, dot="ieee")},
    intra={"bf16": IntraConfig(block_k=16, warps=8, dot="bf16x3"),
           "fp16": IntraConfig(block_k=16, warps=8, dot="bf16x3"),
           "fp32": IntraConfig(block_k=16, warps=8, dot="bf16x3")},
    fold=FoldConfig(block_j=128, warps=8, dot="bf16x3"),
    gate_fp32_max_k=64)

RECURRENT = RecurrentConfig(decode={
    "dense": DecodeConfig(block_v=32, warps=2, stages=2, state_cast="native"),
    "varlen": DecodeConfig(block_v=32, warps=2, stages=2, state_cast="native"),
    "wide": DecodeConfig(block_v=32, warps=2, stages=2, state_cast="native")})

SEGMENTS = SegmentConfig(
    forward=SegmentRule(min_programs=128, target_programs=128, min_segment_chunks=64),
    backward=SegmentRule(min_programs=64, target_programs=512, min_segment_chunks=128), min_segments=4)
