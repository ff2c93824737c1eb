"""The launch configs for any other GPU (fp32 products, moderate tiles): one line per kernel and
variant (kda_jax.configs.types). Why each value is as it is, and the
measurements behind it: docs/tuning.md ("Launch configs")."""

from kda_jax.configs.types import (BackwardConfig, BlockConfig, DecodeConfig, FoldConfig,
                                   ForwardConfig, IntraConfig, PrepareConfig,
                                   RecurrentConfig, SegmentConfig, SegmentRule, StateConfig)

FORWARD_64 = ForwardConfig(
    prepare={
        "16bit": PrepareConfig(block_k=64, warps=4, stages=1, dot="ieee", wu_dot="ieee", inverse_dot="ieee", batched_l1=True),
        "fp32": PrepareConfig(block_k=64, warps=4, stages=1, dot="ieee", wu_dot="ieee", inverse_dot="ieee", batched_l1=True)},
    state={
        "16bit": StateConfig(block_v=32, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=32, warps=4, stages=1),
        "fp32": StateConfig(block_v=32, warps=4, stages=2),
        "fp32_wide": StateConfig(block_v=32, warps=4, stages=1)},
    segment_state={"16bit": StateConfig(block_v=32, warps=4, stages=2), "fp32": StateConfig(block_v=32, warps=4, stages=2)},
    map={"16bit": StateConfig(block_v=32, warps=4, stages=2), "fp32": StateConfig(block_v=32, warps=4, stages=2)},
    fold=FoldConfig(block_j=16, warps=4, dot="ieee"))

FORWARD_32 = FORWARD_64

BACKWARD_64 = BackwardConfig(
    recompute={
        "16bit": PrepareConfig(block_k=64, warps=4, stages=1, dot="ieee", wu_dot="ieee", inverse_dot="ieee", batched_l1=True),
        "fp32": PrepareConfig(block_k=64, warps=4, stages=1, dot="ieee", wu_dot="ieee", inverse_dot="ieee", batched_l1=True)},
    state={
        "16bit": StateConfig(block_v=32, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=32, warps=4, stages=1),
        "fp32": StateConfig(block_v=32, warps=4, stages=2),
        "fp32_wide": StateConfig(block_v=32, warps=4, stages=1)},
    dstate={
        "16bit": StateConfig(block_v=32, warps=4, stages=2),
        "16bit_wide": StateConfig(block_v=32, warps=4, stages=1),
        "fp32": StateConfig(block_v=32, warps=4, stages=2),
        "fp32_wide": StateConfig(block_v=32, warps=4, stages=1)},
    inter={"16bit": BlockConfig(block_k=64, block_v=64, warps=4, dot="ieee"),
           "fp32": BlockConfig(block_k=64, block_v=64, warps=4, dot="ieee")},
    wy={"bf16": BlockConfig(block_k=32, block_v=32, warps=4, dot="ieee"),
        "fp16": BlockConfig(block_k=32, block_v=32, warps=4, dot="ieee"),
        "fp32": BlockConfig(block_k=32, block_v=32, warps=4, dot="ieee")},
    intra={"bf16": IntraConfig(block_k=32, warps=4, dot="ieee", batched_l1=True),
           "fp16": IntraConfig(block_k=32, warps=4, dot="ieee", batched_l1=True),
           "fp32": IntraConfig(block_k=32, warps=4, dot="ieee", batched_l1=True)},
    fold=FoldConfig(block_j=16, warps=4, dot="ieee"),
    gate_fp32_max_k=256)

BACKWARD_32 = BACKWARD_64

RECURRENT = RecurrentConfig(decode={
    "dense": DecodeConfig(block_v=32, warps=4, stages=2),
    "varlen": DecodeConfig(block_v=32, warps=4, stages=2),
    "wide": DecodeConfig(block_v=32, warps=4, stages=2)})

SEGMENTS = SegmentConfig(
    forward=SegmentRule(min_programs=0, target_programs=1024, min_segment_chunks=8),
    backward=SegmentRule(min_programs=0, target_programs=1024, min_segment_chunks=8))
