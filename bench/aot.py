"""Ahead-of-time compile of the forward and backward kernels, with no GPU present.

    python -m bench.aot --targets gfx950,gfx1250,gfx942,sm90 --json PATH --summary PATH

Compiles every kernel of ``kda_jax.kernels.chunk_fwd`` and ``chunk_bwd`` for
each target at that target's shipped config (``kda_jax.configs.FORWARD`` and
``BACKWARD``) over the representative specializations of :data:`SPECS`, with
the constexprs and launch options that
:func:`kda_jax.triton.forward.forward_launches` and
:func:`kda_jax.triton.backward.backward_launches` give the real launches and the
pointer specialization jax-triton 0.3.1 uses (every array 16-byte aligned,
integer scalars unspecialized). For each compile it records register use,
spills, scratch, LDS / shared memory and occupancy, prints a table, optionally
writes JSON, and exits 1 when a compile fails or a kernel spills to memory:

* HIP (gfx*): from the code object's metadata in ``asm["amdgcn"]``; failure is
  a VGPR spill or scratch (private segment) > 0, or LDS over the CU's size.
  SGPR spills land in VGPR lanes and are only recorded.
* CUDA (sm90): from ``ptxas -v`` (the log of Triton's own ptxas run);
  ``vgprs`` is registers per thread, ``vgpr_spills`` the spill-store bytes,
  ``scratch`` the stack frame and ``local_ops`` the PTX's local-memory loads
  and stores; failure is spill stores > 0, a stack frame the PTX loads or
  stores (ptxas keeps an 8-byte frame for a declared but unused local depot,
  which costs nothing) or shared memory over 227 KB. Occupancy is resident
  warps per SM from registers (65536, 256 per warp granule), shared memory
  (228 KB, 1 KB reserved per block) and the 64-warp limit.

``lds_bytes`` is ``compiled.metadata.shared`` (what a launch allocates).

Each row also has the matrix instructions by opcode and an estimated
matrix-core cycle count per program (:mod:`bench.aot_isa`, fields in
:func:`_matrix_fields`): static counts from the AMDGCN or PTX, scaled by the
loop trip counts the constexprs fix; a proxy, not a measurement. ``--json``
writes every row (CI output, not committed); ``--summary`` the small file
committed as ``bench/results/aot-summary.json`` (:func:`summary`). The
printout ends with one line per kernel and target.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import hashlib
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

__all__ = ["TARGETS", "SPECS", "SUMMARY_SPEC", "Spec", "compile_one", "plan_one", "run",
           "summary", "summary_table", "main"]

KERNELS = ("kda_fwd_prepare_kernel", "kda_fwd_state_output_kernel")
# The kernels of a differentiated call beyond the forward's: the forward's
# prepare kernel as a differentiated call launches it where the target's
# backward config has it store the non-finite flags (nonfinite_flags "prepare";
# no row elsewhere), and the backward's
# kernels (kda_jax.kernels.chunk_bwd), at the constexprs that
# kda_jax.triton.backward.backward_launches gives them: the inter, wy and intra
# kernels, or where the target's config sets fused_grads their work in one (the
# other form has no row there).
BWD_KERNELS = ("kda_fwd_prepare_flags", "kda_bwd_recompute", "kda_bwd_state_kernel",
               "kda_bwd_dstate_kernel", "kda_bwd_inter_kernel", "kda_bwd_wy_kernel",
               "kda_bwd_intra_kernel", "kda_bwd_grads_kernel")
# The kernels with a row only where the target's config launches them.
_CONDITIONAL = ("kda_fwd_prepare_flags",)
# The per-chunk kernels of which a config launches the first three or the last.
_PER_CHUNK = ("kda_bwd_inter_kernel", "kda_bwd_wy_kernel", "kda_bwd_intra_kernel",
              "kda_bwd_grads_kernel")
# The decode kernel (kda_jax.kernels.fused_recurrent), at recurrent_constexprs'.
DECODE_KERNELS = ("kda_fused_recurrent_kernel",)
# The segmented state chain at the launches kda_jax.triton.forward.segmented_launches
# and kda_jax.triton.backward.segmented_backward_launches give: the chain's
# kernels (kda_jax.kernels.segments; map, fold from the forward's state pass,
# map_bwd, fold_bwd, fold_reverse from the backward's) and the state passes
# as they run over segments (K-first states from start states; the reverse
# pass from zero storing only start cotangents, "own"); only at the specs
# whose state pass holds the state whole (the others never segment).
SEGMENT_KERNELS = ("kda_segment_map_kernel", "kda_segment_fold_kernel", "kda_segment_map_bwd",
                   "kda_segment_fold_bwd", "kda_segment_fold_reverse",
                   "kda_fwd_state_output_seg", "kda_bwd_state_seg", "kda_bwd_dstate_seg",
                   "kda_bwd_dstate_own")
ALL_KERNELS = KERNELS + DECODE_KERNELS + BWD_KERNELS + SEGMENT_KERNELS

# target name -> (backend, arch, warp size); the name keys configs.FORWARD.
TARGETS = {
    "gfx950": ("hip", "gfx950", 64),
    "gfx1250": ("hip", "gfx1250", 32),
    "gfx942": ("hip", "gfx942", 64),
    "sm90": ("cuda", 90, 32),
}

# LDS per workgroup limit (bytes), from LLVM's AMDGPU targets; sm90 per block.
_LDS_LIMIT = {"gfx950": 160 * 1024, "gfx1250": 320 * 1024, "gfx942": 64 * 1024,
              "sm90": 227 * 1024}


# --------------------------------------------------------------------------- #
# The specializations: one table.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Spec:
    """One specialization: head dims, input dtype, chunk size, flag set and
    the state pool's dtype.

    ``state`` is the dtype of the state buffer of the kernels that read and
    write a pool (:data:`POOL_KERNELS`; the backward's per-chunk states take
    the config's ``chunk_states``, :data:`CHUNK_STATE_KERNELS`): "fp32",
    or "bf16", a bfloat16 pool (computed on in float32, each stored tile
    rounded by kda_jax/kernels/state_io._rounded), which the forward's state pass then
    reads indexed, since a 16-bit state is only ever a pool's. At "fp32" the
    forward's state pass compiles dense float32 states and the decode kernel's
    "all" flags a float32 pool."""

    shape: str
    K: int
    V: int
    dtype: str  # "bf16", "fp16" or "fp32": q, k, v, g, beta and o
    chunk: int
    flags: str  # "default" or "all"
    H: int = 16
    HV: int = 16
    state: str = "fp32"

    @property
    def name(self) -> str:
        pool = "" if self.state == "fp32" else f"/{self.state}-pool"
        return f"{self.shape}/c{self.chunk}/{self.flags}{pool}"


#        shape     K    V    dtype
SHAPES = (("main", 128, 128, "bf16"),     # the main case
          ("fp32", 64, 64, "fp32"),
          ("fp32w", 128, 128, "fp32"),    # float32 at the main head dims
          ("large", 256, 256, "bf16"),    # largest head dims
          ("masked", 100, 60, "bf16"))    # non-power-of-two, masked
CHUNKS = (64, 32)
# "all": l2norm, gate with A_log + dt_bias, lower_bound, beta sigmoid, negative
# eigenvalues, V-first state, initial and final state; and in the forward's
# state-output kernel prefill checkpoints every 2 chunks (ALL_CHECKPOINT_CHUNKS).
FLAG_SETS = ("default", "all")
# The kernels whose state buffer may be a 16-bit pool (Spec.state).
POOL_KERNELS = ("kda_fwd_state_output_kernel", "kda_fused_recurrent_kernel")
# The backward's launches whose "state" arguments are the per-chunk states h and
# dS, in BackwardConfig.chunk_states' dtype (kda_bwd_dstate_own stores none).
CHUNK_STATE_KERNELS = ("kda_bwd_state_kernel", "kda_bwd_dstate_kernel", "kda_bwd_inter_kernel",
                       "kda_bwd_grads_kernel",
                       "kda_bwd_state_seg", "kda_bwd_dstate_seg")
# The spec whose pool is bfloat16 (the rounding store compiled on every
# target): one existing spec rather than new rows, for CI time; its decode
# kernel differs from main/c32/all's (one more compile per target), and
# main/c32/all keeps the float32 forms at the main shape.
BF16_POOL_SPEC = ("main", 64, "all")
ALL_CHECKPOINT_CHUNKS = 2


def _spec(shape, kd, vd, dt, bt, fl) -> Spec:
    state = "bf16" if (shape, bt, fl) == BF16_POOL_SPEC else "fp32"
    return Spec(shape, kd, vd, dt, bt, fl, state=state)


# float16 inputs, whose intermediates are float16 (the backward's "fp16" wy and
# intra variants, and every 16-bit kernel at float16 types): one spec, for CI time.
EXTRA_SPECS = (Spec("fp16", 128, 128, "fp16", 64, "default"),)
SPECS = tuple(_spec(shape, kd, vd, dt, bt, fl)
              for (shape, kd, vd, dt), bt, fl in itertools.product(SHAPES, CHUNKS, FLAG_SETS)
              ) + EXTRA_SPECS


def _in_dtype(spec: Spec):
    """The JAX dtype of the spec's inputs."""
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[spec.dtype]


def _spec_options(spec: Spec):
    """(KdaOptions, has_a_log, has_dt_bias, has_initial_state) of a spec."""
    from kda_jax.options import KdaOptions

    scale = spec.K ** -0.5
    if spec.flags == "default":
        return KdaOptions(scale=scale, chunk_size=spec.chunk), False, False, False
    if spec.flags == "all":
        opts = KdaOptions(
            scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=True, state_v_first=True, chunk_size=spec.chunk,
        )
        return opts, True, True, True
    raise ValueError(f"unknown flag set {spec.flags!r}")


# The backward's recompute is the forward's prepare kernel with STORE_X at the
# backward config (kda_jax.triton.backward.recompute_launch). Every other
# kernel name is its function's; the functions' arguments and their kinds are
# kda_jax.kernels.signatures'.
_FUNCTION = {"kda_bwd_recompute": "kda_fwd_prepare_kernel",
             "kda_fwd_prepare_flags": "kda_fwd_prepare_kernel",
             "kda_segment_map_bwd": "kda_segment_map_kernel",
             "kda_segment_fold_bwd": "kda_segment_fold_kernel",
             "kda_segment_fold_reverse": "kda_segment_fold_kernel",
             "kda_fwd_state_output_seg": "kda_fwd_state_output_kernel",
             "kda_bwd_state_seg": "kda_bwd_state_kernel",
             "kda_bwd_dstate_seg": "kda_bwd_dstate_kernel",
             "kda_bwd_dstate_own": "kda_bwd_dstate_kernel"}

_TRITON_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _decode_launch_for(kernel: str, target: str, spec: Spec):
    """_launch_for of the decode kernel (config: configs.RECURRENT[target]; the
    spec's chunk size does not apply; "default" flags compile the uniform
    one-token form of a dense decode step with a float32 initial and final
    state, as a decode loop runs it, "all" flags the varlen form with the
    state pool of the spec's state dtype: at chunk 64 writing final states,
    at chunk 32 (which the kernel would otherwise compile identically) a
    speculative verify of 1 + 3 tokens writing the state after each)."""
    import dataclasses

    from kda_jax.configs import recurrent_config
    from kda_jax.triton.recurrent import recurrent_launch

    opts, has_a_log, has_dt_bias, has_h0 = _spec_options(spec)
    if spec.flags == "default":
        # A decode step carries its state in and out; without them the
        # kernel would compile to a form no decode loop launches.
        opts, has_h0 = dataclasses.replace(opts, output_final_state=True), True
    config = recurrent_config(target)
    launch = recurrent_launch(
        h=spec.H, hv=spec.HV, kd=spec.K, vd=spec.V, opts=opts, config=config,
        has_a_log=has_a_log, has_dt_bias=has_dt_bias, has_initial_state=has_h0,
        indexed_state=spec.flags == "all", uniform_len=1 if spec.flags == "default" else None,
        write_columns=4 if spec.flags == "all" and spec.chunk == 32 else 0)
    return launch, config, spec.dtype


def _bwd_launch_for(kernel: str, target: str, spec: Spec):
    """_launch_for of a kernel of BWD_KERNELS (config: configs.BACKWARD[target]),
    or None where the config does not launch it (the inter, wy and intra
    kernels, or their fused form: BackwardConfig.grads_for; the flag-storing
    prepare: _prepare_flags_launch)."""
    import jax.numpy as jnp

    from kda_jax.configs import backward_config
    from kda_jax.triton.backward import backward_launches, backward_work_dtype, recompute_launch

    opts, _, _, has_h0 = _spec_options(spec)
    config = backward_config(target, spec.chunk)
    # The work dtype of the spec's input dtype, not of the kernels' q, k
    # (kda_jax.triton.backward.kernel_qk_dtype): where the in-kernel L2 norm
    # hands the kernels float32 q, k (normalized_qk="fp32") and K is past
    # gate_fp32_max_k, a call runs float32 intermediates that this compiles as
    # 16-bit: sm90 chunk 32 at main, large and masked "all" specs, gfx942 at
    # large "all". Compiled as they run, sm90's float32 state passes at chunk
    # 32 spill there (large: 72 and 712 bytes; masked: 8 and 56), so the gate
    # keeps this form until their configs compile without spills.
    work = backward_work_dtype(_in_dtype(spec), opts, config, spec.K)
    if kernel == "kda_fwd_prepare_flags":
        return _prepare_flags_launch(target, spec, config)
    if kernel == "kda_bwd_recompute":
        launch = recompute_launch(h=spec.H, hv=spec.HV, kd=spec.K, vd=spec.V, opts=opts,
                                  config=config, work=work)
    else:
        launch = backward_launches(h=spec.H, hv=spec.HV, kd=spec.K, vd=spec.V, opts=opts,
                                   config=config, has_initial_state=has_h0,
                                   has_final_grad=opts.output_final_state,
                                   work=work).get(kernel)
        if launch is None:
            return None
    return launch, config, _TRITON_DTYPE[jnp.dtype(work).name]


def _prepare_flags_launch(target: str, spec: Spec, bwd_config):
    """The forward's prepare kernel as a differentiated call launches it
    (storing the non-finite flags), or None where ``bwd_config`` does not
    have it store them (nonfinite_flags other than "prepare") or XLA computes
    them (flags_in_prepare)."""
    import jax.numpy as jnp

    from kda_jax.configs import forward_config
    from kda_jax.triton.forward import flags_in_prepare, forward_launches, work_dtype

    opts, has_a_log, has_dt_bias, has_h0 = _spec_options(spec)
    config = forward_config(target, spec.chunk)
    if (bwd_config.nonfinite_flags != "prepare"
            or not flags_in_prepare(config, _in_dtype(spec), spec.K)):
        return None
    work = work_dtype(_in_dtype(spec))
    prep, _ = forward_launches(h=spec.H, hv=spec.HV, kd=spec.K, vd=spec.V, opts=opts,
                               config=config, work=work, has_a_log=has_a_log,
                               has_dt_bias=has_dt_bias, has_initial_state=has_h0,
                               store_flags=True)
    return prep, config, _TRITON_DTYPE[jnp.dtype(work).name]


def _segment_launch_for(kernel: str, target: str, spec: Spec):
    """_launch_for of a segmented-chain launch, or None where the spec's
    state pass splits K (that call never segments)."""
    import jax.numpy as jnp

    from kda_jax.configs import backward_config, forward_config
    from kda_jax.triton.backward import backward_work_dtype, segmented_backward_launches
    from kda_jax.triton.forward import segmented_launches, work_dtype

    opts, _, _, has_h0 = _spec_options(spec)
    in_dtype = _in_dtype(spec)
    shape = dict(h=spec.H, hv=spec.HV, kd=spec.K, vd=spec.V, opts=opts,
                 has_initial_state=has_h0)
    if kernel in ("kda_segment_map_kernel", "kda_segment_fold_kernel",
                  "kda_fwd_state_output_seg"):
        config = forward_config(target, spec.chunk)
        work = work_dtype(in_dtype)
        state, chain = segmented_launches(config=config, work=work, input_dtype=in_dtype,
                                          **shape)
        launch = {"kda_segment_map_kernel": chain.map, "kda_segment_fold_kernel": chain.fold,
                  "kda_fwd_state_output_seg": state}[kernel]
    else:
        config = backward_config(target, spec.chunk)
        work = backward_work_dtype(in_dtype, opts, config, spec.K)
        L = segmented_backward_launches(config=config, work=work,
                                        has_final_grad=opts.output_final_state, **shape)
        state = L["state"]
        launch = {"kda_segment_map_bwd": L["chain"].map,
                  "kda_segment_fold_bwd": L["chain"].fold,
                  "kda_segment_fold_reverse": L["chain"].fold_reverse,
                  "kda_bwd_state_seg": state, "kda_bwd_dstate_seg": L["dstate"],
                  "kda_bwd_dstate_own": L["own"]}[kernel]
    if state.constexprs["SPLIT_K"] or state.constexprs["BK"] > 128:
        return None
    return launch, config, _TRITON_DTYPE[jnp.dtype(work).name]


# The state passes' segment launches differ from their one-pass launches in
# the state I/O flags only: compiled at chunk 64 (a CI-time budget), the
# chain's own kernels at every spec.
_SEGMENT_STATE_PASSES = ("kda_fwd_state_output_seg", "kda_bwd_state_seg", "kda_bwd_dstate_seg",
                         "kda_bwd_dstate_own")


def applies(kernel: str, target: str, spec: Spec) -> bool:
    """Whether ``kernel`` has a row at ``spec``: the segmented chain's launches
    only where its state pass holds the state whole (and its state passes at
    chunk 64); the per-chunk gradient kernels, or their fused form, as the
    target's config launches them (fused_grads); the flag-storing prepare
    where the target's backward config selects it (_prepare_flags_launch);
    every other kernel everywhere."""
    if kernel in _PER_CHUNK + _CONDITIONAL:
        return _bwd_launch_for(kernel, target, spec) is not None
    if kernel not in SEGMENT_KERNELS:
        return True
    if kernel in _SEGMENT_STATE_PASSES and spec.chunk != 64:
        return False
    return _segment_launch_for(kernel, target, spec) is not None


def _launch_for(kernel: str, target: str, spec: Spec):
    """(KernelLaunch, config, work dtype name) of ``kernel`` for this target/spec."""
    if kernel in SEGMENT_KERNELS:
        found = _segment_launch_for(kernel, target, spec)
        if found is None:
            raise ValueError(f"{kernel} does not run at {spec.name}: its state pass splits K")
        return found
    if kernel in BWD_KERNELS:
        found = _bwd_launch_for(kernel, target, spec)
        if found is None:
            raise ValueError(f"{kernel} does not run at {spec.name} under {target}'s config")
        return found
    if kernel in DECODE_KERNELS:
        return _decode_launch_for(kernel, target, spec)
    import jax.numpy as jnp

    from kda_jax.configs import forward_config
    from kda_jax.triton.forward import forward_launches, work_dtype

    opts, has_a_log, has_dt_bias, has_h0 = _spec_options(spec)
    config = forward_config(target, spec.chunk)
    in_dtype = _in_dtype(spec)
    work = work_dtype(in_dtype)
    prep, state = forward_launches(
        h=spec.H, hv=spec.HV, kd=spec.K, vd=spec.V, opts=opts, config=config, work=work,
        has_a_log=has_a_log, has_dt_bias=has_dt_bias, has_initial_state=has_h0,
        indexed_state=spec.state != "fp32",
        checkpoint_chunks=ALL_CHECKPOINT_CHUNKS if spec.flags == "all" else 0,
    )
    launch = {prep.kernel: prep, state.kernel: state}[kernel]
    return launch, config, _TRITON_DTYPE[jnp.dtype(work).name]


def _signature(fn, function: str, in_dtype: str, work: str, constexprs: dict,
               state: str = "fp32"):
    """(signature, attrs) for ASTSource from the kernel's signature table
    (kda_jax.kernels.signatures), checked against its parameters; ``in_dtype``,
    ``work`` and ``state`` are Triton type names ("bf16", "fp32") of the "in",
    "work" and "state" arrays (a 16-bit pool changes only the state rows' load
    and store). A function of its arguments only: :func:`plan_one`'s binary
    key relies on it."""
    from kda_jax.kernels.signatures import SIGNATURES
    from kda_jax.triton.launch import runtime_params

    params = list(fn.params)
    table = SIGNATURES[function].args
    runtime = runtime_params(fn)
    consts = {p.name for p in params if p.is_constexpr}
    if runtime != [name for name, _ in table]:
        raise RuntimeError(f"{function}: runtime arguments {runtime} differ from "
                           "kda_jax.kernels.signatures'")
    if consts != set(constexprs):
        raise RuntimeError(
            f"{function}: constexprs {sorted(consts)} differ from the launch's "
            f"{sorted(constexprs)}")
    kinds = dict(table)
    signature, attrs = {}, {}
    for i, p in enumerate(params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        kind = kinds[p.name]
        ty = {"in": "*" + in_dtype, "work": "*" + work, "state": "*" + state}.get(kind, kind)
        signature[p.name] = ty
        # jax-triton 0.3.1: arrays are assumed 16-byte aligned, scalars unspecialized.
        attrs[(i,)] = [["tt.divisibility", 16]] if ty.startswith("*") else []
    return signature, attrs


# --------------------------------------------------------------------------- #
# Reading the compiled kernel.
# --------------------------------------------------------------------------- #


def _amdgcn_stats(asm: str) -> dict:
    def field(key):
        m = re.search(rf"^\s*-?\s*\.{key}:\s+(\d+)", asm, re.M)
        return int(m.group(1)) if m else None

    occ = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    return dict(
        vgprs=field("vgpr_count"), agprs=field("agpr_count"), sgprs=field("sgpr_count"),
        vgpr_spills=field("vgpr_spill_count"), sgpr_spills=field("sgpr_spill_count"),
        scratch=field("private_segment_fixed_size"),
        occupancy=int(occ.group(1)) if occ else None,
    )


def _ptxas_stats(log: str) -> dict:
    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    return dict(
        vgprs=num(r"Used (\d+) registers"), sgprs=None,
        vgpr_spills=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
        sgpr_spills=None, scratch=num(r"(\d+) bytes stack frame"),
        static_smem=num(r"(\d+) bytes smem") or 0,
    )


def _ptxas_rerun(ptx: str) -> str:
    """``ptxas -v`` on the PTX with Triton's own ptxas (when its log was not seen)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "-lineinfo", "--regAllocOptLevel=2",
                            "--gpu-name=sm_90a", src, "-o", src + ".o"],
                           capture_output=True, text=True, check=True)
    return r.stderr + r.stdout


def _sm90_occupancy(regs: int, smem: int, num_warps: int) -> int:
    """Resident warps per SM on sm90 (H100/H200)."""
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    blocks = min(32, 64 // num_warps, (65536 // per_warp) // num_warps)
    if smem > 0:
        blocks = min(blocks, (228 * 1024) // (smem + 1024))
    return blocks * num_warps


def _sass_matrix_ops(cubin: bytes):
    """{opcode: count} of HGMMA / HMMA in the SASS (``cuobjdump -sass`` of
    Triton's bundled cuobjdump), or None where it cannot run. The raw listing
    is read: triton.tools.disasm.get_sass reformats every line, which costs
    time and changes no opcode."""
    try:
        from triton import knobs

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path],
                                  capture_output=True, text=True, check=True).stdout
    except Exception:  # no cuobjdump: the PTX's counts stand alone
        return None
    ops: dict = {}
    for op in re.findall(r"\b(H(?:GMMA|MMA)\.[0-9A-Za-z_.]+)", sass):
        ops[op] = ops.get(op, 0) + 1
    return dict(sorted(ops.items()))


def _matrix_fields(compiled, backend=None, target=None, launch=None) -> dict:
    """A row's matrix-instruction fields (bench.aot_isa); all None without a compile.

    matrix_ops: static {opcode: count} per wave (HIP) or per warp / warpgroup
    (PTX); matrix_ops_per_program: times the known trip counts of the loops
    around them (matrix_count_basis: the runtime loops they stay per
    iteration of); est_matrix_cycles(_static): the matrix-core cycles of one
    program from those counts (aot_isa.matrix_cycles); sass_matrix_ops: sm90's
    SASS HGMMA/HMMA counts, a cross-check of the PTX (ptxas unrolls loops of
    known trip count, so they can exceed the PTX's static counts)."""
    fields = dict(matrix_ops=None, matrix_ops_per_program=None, matrix_loops=None,
                  matrix_count_basis=None, est_matrix_cycles=None,
                  est_matrix_cycles_static=None, matrix_cost_estimated=None,
                  matrix_ops_uncosted=None, sass_matrix_ops=None, matrix_error=None)
    if compiled is None:
        return fields
    from bench import aot_isa

    try:  # a report of the compiled code; its failure does not fail the compile
        asm = compiled.asm["amdgcn" if backend == "hip" else "ptx"]
        prof = aot_isa.matrix_profile(asm, backend, dict(launch.constexprs))
        fields.update(prof)
        per = aot_isa.matrix_cycles(target, prof["matrix_ops_per_program"], launch.num_warps)
        static = aot_isa.matrix_cycles(target, prof["matrix_ops"], launch.num_warps)
        fields.update(est_matrix_cycles=per["cycles"], est_matrix_cycles_static=static["cycles"],
                      matrix_cost_estimated=per["estimated"], matrix_ops_uncosted=per["uncosted"])
        if backend == "cuda":
            fields["sass_matrix_ops"] = _sass_matrix_ops(compiled.asm["cubin"])
    except Exception as e:
        fields["matrix_error"] = f"{type(e).__name__}: {e}"
    return fields


# --------------------------------------------------------------------------- #
# One compile.
# --------------------------------------------------------------------------- #


def _compile_args(kernel: str, target: str, spec: Spec, launch, work: str, config):
    """(fn, signature, attrs, options): with ``launch.constexprs`` and the
    target, everything ``triton.compile`` is given for this row (``config``:
    the row's config, whose ``chunk_states`` types the backward's h and dS)."""
    import triton

    from kda_jax.triton.launch import kernel_function

    name = _FUNCTION.get(kernel, kernel)
    fn = kernel_function(name)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(
            f"{kernel} is a {type(fn).__name__}, not a JITFunction: TRITON_INTERPRET=1 was "
            "set when the kernels were imported; compile through bench.aot.run, whose "
            "worker processes drop it")
    # The backward casts its inputs to float32 with float32 intermediates.
    # (BWD_KERNELS and the segmented backward's state passes: the kda_bwd_ names.)
    in_dtype = "fp32" if kernel.startswith("kda_bwd_") and work == "fp32" else spec.dtype
    if kernel in POOL_KERNELS:
        state = spec.state
    elif kernel in CHUNK_STATE_KERNELS and config.chunk_states == "work":
        state = work
    else:
        state = "fp32"
    signature, attrs = _signature(fn, name, in_dtype, work, launch.constexprs, state)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, num_ctas=1,
                   enable_fp_fusion=True, debug=False)  # as jax-triton compiles
    return fn, signature, attrs, options


def _launch_fields(launch, config) -> dict:
    """A row's fields that come from the launch (they differ between the rows
    of one binary: the config may hold values this kernel does not read)."""
    from kda_jax.configs import as_dict

    return dict(config=as_dict(config), num_warps=launch.num_warps,
                num_stages=launch.num_stages, constexprs=launch.constexprs)


def plan_one(kernel: str, target: str, spec: Spec):
    """(binary key, launch fields) of a row, or (None, None) when its launch
    cannot be worked out (:func:`compile_one` then records why).

    The key is every input of ``triton.compile`` (:func:`_compile_args`): the
    kernel function, signature, constexprs, attributes, target and options;
    rows with equal keys compile to the same binary. Runs in :func:`run`'s
    workers, where the kernels are real JITFunctions."""
    try:
        launch, config, work = _launch_for(kernel, target, spec)
        fn, signature, attrs, options = _compile_args(kernel, target, spec, launch, work,
                                                       config)
    except Exception:
        return None, None
    key = (_FUNCTION.get(kernel, kernel), TARGETS[target], tuple(sorted(signature.items())),
           tuple(sorted((k, repr(v)) for k, v in launch.constexprs.items())),
           tuple(sorted((k, repr(v)) for k, v in attrs.items())), tuple(sorted(options.items())))
    return key, _launch_fields(launch, config)


def compile_one(kernel: str, target: str, spec: Spec) -> dict:
    """Compiles ``kernel`` for ``target`` at ``spec``; returns its result row."""
    t0 = time.perf_counter()
    row = dict(kernel=kernel, target=target, spec=spec.name, spec_detail=dataclasses.asdict(spec),
               config=None, num_warps=None, num_stages=None,
               vgprs=None, agprs=None, sgprs=None, vgpr_spills=None, spill_loads=None,
               sgpr_spills=None, scratch=None, local_ops=None, lds_bytes=None, occupancy=None,
               ok=False, error=None, compile_s=None, same_binary_as=None,
               **_matrix_fields(None))
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        launch, config, work = _launch_for(kernel, target, spec)
        row.update(_launch_fields(launch, config))
        fn, signature, attrs, options = _compile_args(kernel, target, spec, launch, work,
                                                       config)
        backend, arch, warp = TARGETS[target]
        src = ASTSource(fn, signature, dict(launch.constexprs), attrs)
        log = io.StringIO()
        if backend == "cuda":
            triton.knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
        row["lds_bytes"] = int(compiled.metadata.shared)
        problems = []
        if backend == "hip":
            row.update(_amdgcn_stats(compiled.asm["amdgcn"]))
            missing = [k for k in ("vgprs", "sgprs", "vgpr_spills", "sgpr_spills", "scratch",
                                   "occupancy") if row[k] is None]
            if missing:
                problems.append(f"amdgcn metadata lacks {missing}")
            if row["vgpr_spills"]:
                problems.append(f"{row['vgpr_spills']} VGPR spills")
            if row["scratch"]:
                problems.append(f"{row['scratch']} bytes scratch")
        else:
            text = log.getvalue()
            if "Used" not in text or "registers" not in text:
                text = _ptxas_rerun(compiled.asm["ptx"])
            stats = _ptxas_stats(text)
            static = stats.pop("static_smem")
            row.update(stats)
            if row["vgprs"] is None or row["vgpr_spills"] is None:
                problems.append("ptxas -v output not understood")
            else:
                row["occupancy"] = _sm90_occupancy(row["vgprs"], row["lds_bytes"] + static,
                                                   launch.num_warps)
            if row["vgpr_spills"]:
                problems.append(f"{row['vgpr_spills']} bytes spill stores "
                                f"({row['spill_loads']} bytes spill loads, "
                                f"{row['vgprs']} registers)")
            row["local_ops"] = len(re.findall(r"\b(?:ld|st)\.local\b", compiled.asm["ptx"]))
            if row["scratch"] and row["local_ops"]:
                problems.append(f"{row['scratch']} bytes stack frame used by "
                                f"{row['local_ops']} local loads / stores")
        row.update(_matrix_fields(compiled, backend, target, launch))
        if row["lds_bytes"] > _LDS_LIMIT[target]:
            problems.append(f"{row['lds_bytes']} bytes LDS > {_LDS_LIMIT[target]}")
        row["ok"] = not problems
        row["error"] = "; ".join(problems) or None
    except Exception as e:  # a failed compile is a result, not a crash
        msg = f"{type(e).__name__}: {e}"
        row["error"] = msg if len(msg) <= 4000 else msg[:1000] + "\n...\n" + msg[-3000:]
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _worker_init(cache_dir: str):
    # Compiles need real @triton.jit kernels: Triton decorates them for its
    # interpreter when TRITON_INTERPRET=1 is set at import (as the test suite
    # does), so workers drop it before they import triton.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("KDA_JAX_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _shared_row(compiled: dict, kernel: str, target: str, spec: Spec, fields: dict) -> dict:
    """The row of (kernel, target, spec), whose binary ``compiled``'s compile made."""
    row = copy.deepcopy(compiled)
    row.update(kernel=kernel, target=target, spec=spec.name, spec_detail=dataclasses.asdict(spec),
               **copy.deepcopy(fields), compile_s=None,
               same_binary_as=f"{compiled['kernel']} {compiled['spec']}")
    return row


def run(targets=tuple(TARGETS), specs=SPECS, kernels=ALL_KERNELS, jobs: int = 2,
        progress=None) -> list[dict]:
    """Compiles every (kernel, target, spec); rows in that order.

    Compiles in ``jobs`` fresh processes (so an interpreter setting of the
    caller does not leak in) over a fresh Triton cache (so every row comes from
    a real compile and sm90's ptxas log is seen). Rows whose compile inputs
    agree (:func:`plan_one`; e.g. a kernel that reads neither the chunk size
    nor the flags) share one compile: each still gets its row, its launch
    fields its own, ``same_binary_as`` naming the row compiled ("kernel spec")
    and ``compile_s`` None; a compile that fails or spills fails them all.
    """
    work = [(kn, tg, sp) for tg in targets for sp in specs for kn in kernels
            if applies(kn, tg, sp)]
    rows = [None] * len(work)
    with tempfile.TemporaryDirectory(prefix="kda_aot_cache_") as cache:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
                max_workers=max(1, min(jobs, len(work))), mp_context=ctx,
                initializer=_worker_init, initargs=(cache,)) as pool:
            plans = list(pool.map(plan_one, *zip(*work), chunksize=16)) if work else []
            first: dict = {}  # binary key -> index of the row that compiles it
            followers: dict = {}  # index of a compiled row -> indices of rows sharing it
            for i, (key, _) in enumerate(plans):
                if key is not None and key in first:
                    followers.setdefault(first[key], []).append(i)
                    continue
                if key is not None:
                    first[key] = i
            futures = {pool.submit(compile_one, *work[i]): i
                       for i in range(len(work)) if plans[i][0] is None or first[plans[i][0]] == i}
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                try:
                    rows[i] = fut.result()
                except Exception as e:  # a worker died
                    kn, tg, sp = work[i]
                    rows[i] = dict(kernel=kn, target=tg, spec=sp.name, ok=False,
                                   error=f"worker failed: {type(e).__name__}: {e}")
                for j in [i] + followers.get(i, []):
                    if j != i:
                        rows[j] = _shared_row(rows[i], *work[j], plans[j][1])
                    if progress:
                        progress(rows[j])
    return rows


# --------------------------------------------------------------------------- #
# Command line.
# --------------------------------------------------------------------------- #

_SHORT = {"kda_fwd_prepare_kernel": "prepare", "kda_fwd_prepare_flags": "prepare_flags",
          "kda_fwd_state_output_kernel": "state_output",
          "kda_fused_recurrent_kernel": "decode",
          "kda_bwd_recompute": "bwd_recompute", "kda_bwd_state_kernel": "bwd_state",
          "kda_bwd_dstate_kernel": "bwd_dstate",
          "kda_bwd_inter_kernel": "bwd_inter",
          "kda_bwd_wy_kernel": "bwd_wy", "kda_bwd_intra_kernel": "bwd_intra",
          "kda_bwd_grads_kernel": "bwd_grads",
          "kda_segment_map_kernel": "seg_map", "kda_segment_fold_kernel": "seg_fold",
          "kda_segment_map_bwd": "seg_map_bwd", "kda_segment_fold_bwd": "seg_fold_bwd",
          "kda_segment_fold_reverse": "seg_fold_rev",
          "kda_fwd_state_output_seg": "seg_state_output", "kda_bwd_state_seg": "seg_bwd_state",
          "kda_bwd_dstate_seg": "seg_bwd_dstate", "kda_bwd_dstate_own": "seg_bwd_dstate_own"}


def _fmt(v):
    return "-" if v is None else str(v)


def table(rows: list[dict]) -> str:
    head = ("kernel", "target", "spec", "w/s", "vgpr", "agpr", "sgpr", "vspill", "sspill",
            "scratch", "lds", "occ", "s", "status")
    lines = [head]
    for r in rows:
        status = "ok" if r.get("ok") else "FAIL: " + (r.get("error") or "").splitlines()[-1][:90]
        lines.append((
            _SHORT.get(r["kernel"], r["kernel"]), r["target"], r["spec"],
            f"{_fmt(r.get('num_warps'))}/{_fmt(r.get('num_stages'))}",
            _fmt(r.get("vgprs")), _fmt(r.get("agprs")), _fmt(r.get("sgprs")),
            _fmt(r.get("vgpr_spills")), _fmt(r.get("sgpr_spills")), _fmt(r.get("scratch")),
            _fmt(r.get("lds_bytes")), _fmt(r.get("occupancy")), _fmt(r.get("compile_s")), status,
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1]
        for line in lines)


# The spec whose rows the committed summary keeps (the main case).
SUMMARY_SPEC = "main/c64/default"
_SUMMARY_FIELDS = ("spec", "num_warps", "num_stages", "vgprs", "agprs", "sgprs", "vgpr_spills",
                   "sgpr_spills", "scratch", "lds_bytes", "occupancy", "matrix_ops",
                   "matrix_ops_per_program", "matrix_count_basis", "est_matrix_cycles",
                   "sass_matrix_ops")


def spilled(row: dict) -> bool:
    """Whether a compile row goes to memory for registers: spill stores, a
    HIP private segment, or a CUDA stack frame the PTX loads or stores."""
    if row.get("vgpr_spills"):
        return True
    if row.get("target", "").startswith("sm"):
        return bool(row.get("scratch") and row.get("local_ops"))
    return bool(row.get("scratch"))


def summary(rows: list[dict], triton_version: str) -> dict:
    """The small report committed as bench/results/aot-summary.json.

    Per kernel and target: the row at :data:`SUMMARY_SPEC` (or the first spec
    compiled, when the run left it out) with the fields of
    ``_SUMMARY_FIELDS``, and over every spec compiled: compiles, failures,
    spills, the most registers and LDS and the least occupancy. No source
    hashes: a comment edit does not make it stale."""
    out: dict = {}
    for r in rows:
        entry = out.setdefault(r["kernel"], {}).setdefault(r["target"], {})
        if "spec" not in entry or (r["spec"] == SUMMARY_SPEC and entry["spec"] != SUMMARY_SPEC):
            entry.update({k: r[k] for k in _SUMMARY_FIELDS if r.get(k) is not None})
        agg = entry.setdefault("all_specs", dict(compiles=0, failed=0, spilled=0, max_vgprs=None,
                                                 max_lds_bytes=None, min_occupancy=None))
        agg["compiles"] += 1
        agg["failed"] += 0 if r.get("ok") else 1
        agg["spilled"] += 1 if spilled(r) else 0
        for key, field, pick in (("max_vgprs", "vgprs", max), ("max_lds_bytes", "lds_bytes", max),
                                 ("min_occupancy", "occupancy", min)):
            if r.get(field) is not None:
                agg[key] = r[field] if agg[key] is None else pick(agg[key], r[field])
    for entry in (e for per in out.values() for e in per.values()):
        entry["all_specs"] = entry.pop("all_specs")  # last, after the spec's fields
    return {
        "triton": triton_version,
        "spec": SUMMARY_SPEC,
        "units": {
            "hip": "vgprs/agprs/sgprs per lane or wave, lds_bytes bytes, occupancy waves per "
                   "SIMD; matrix ops per wave",
            "cuda": "vgprs = registers per thread, vgpr_spills = spill-store bytes, lds_bytes = "
                    "shared bytes, occupancy = resident warps per SM; matrix ops per warp "
                    "(mma.sync) or warpgroup (wgmma), from the PTX; sass_matrix_ops from the SASS",
            "matrix": "matrix_ops: static count, a loop body once; matrix_ops_per_program: "
                      "times the loops' trip counts known from the constexprs, ops in runtime "
                      "loops (matrix_count_basis) once per iteration; est_matrix_cycles: "
                      "matrix-core cycles of one program, its CU/SM to itself, from "
                      "bench.aot_isa.COST (a proxy, partly estimated)",
        },
        "kernels": out,
    }


def _ops_text(ops) -> str:
    if not ops:
        return "-"
    # wgmma's and mma's ".sync.aligned" says nothing about the work.
    return " ".join(f"{n}x{op.replace('.sync.aligned', '').replace('.mma_async', '')}"
                    for op, n in ops.items())


def summary_table(report: dict) -> str:
    """One line per kernel and target of a :func:`summary`."""
    lines = [("kernel", "target", "spec", "w/s", "vgpr", "spill", "lds", "occ",
              "est_cyc", "matrix ops (static -> per program)")]
    for kernel, per in report["kernels"].items():
        for target, e in per.items():
            static, prog = e.get("matrix_ops"), e.get("matrix_ops_per_program")
            ops = _ops_text(static)
            if prog and prog != static:
                ops += " -> " + _ops_text(prog)
            if e.get("matrix_count_basis"):
                ops += " (per iteration of: " + "; ".join(e["matrix_count_basis"]) + ")"
            lines.append((_SHORT.get(kernel, kernel), target, e["spec"],
                          f"{_fmt(e.get('num_warps'))}/{_fmt(e.get('num_stages'))}",
                          _fmt(e.get("vgprs")), _fmt(e.get("vgpr_spills")),
                          _fmt(e.get("lds_bytes")), _fmt(e.get("occupancy")),
                          _fmt(e.get("est_matrix_cycles")), ops))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]) - 1)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1]
                     for line in lines)


def _source_hashes() -> dict:
    """sha256 of the kernel and launch sources that were compiled."""
    import importlib.util

    out = {}
    for mod in ("kda_jax.kernels.chunk_fwd", "kda_jax.kernels.common",
                "kda_jax.kernels.signatures", "kda_jax.kernels.state_io",
                "kda_jax.kernels.varlen", "kda_jax.kernels.gate", "kda_jax.configs",
                "kda_jax.triton.launch", "kda_jax.triton.forward",
                "kda_jax.kernels.fused_recurrent", "kda_jax.triton.recurrent",
                "kda_jax.kernels.chunk_bwd", "kda_jax.triton.backward"):
        path = importlib.util.find_spec(mod).origin
        with open(path, "rb") as f:
            out[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _pick(value: str | None, known, what: str):
    if not value:
        return tuple(known)
    chosen = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {unknown}; known: {', '.join(known)}")
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma list of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--specs", default=None,
                        help="comma list of spec names such as main/c64/default (default: all "
                             f"{len(SPECS)})")
    parser.add_argument("--quick", action="store_true",
                        help="only the main shape (K=V=128 bf16): 4 specs instead of "
                             f"{len(SPECS)}")
    parser.add_argument("--kernels", default=None,
                        help="comma list of kernel names (default: all, forward and backward)")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    parser.add_argument("--json", default=None, help="write the full report here")
    parser.add_argument("--summary", default=None,
                        help=f"write the small summary here (per kernel and target at "
                             f"{SUMMARY_SPEC}; bench/results/aot-summary.json)")
    parser.add_argument("--quiet", action="store_true", help="no per-compile progress lines")
    args = parser.parse_args(argv)

    import triton

    targets = _pick(args.targets, TARGETS, "targets")
    by_name = {s.name: s for s in SPECS}
    specs = tuple(by_name[n] for n in _pick(args.specs, by_name, "specs"))
    if args.quick:
        specs = tuple(s for s in specs if s.shape == "main")
    kernels = _pick(args.kernels, ALL_KERNELS, "kernels")

    def progress(r):
        if not args.quiet:
            state = "ok" if r.get("ok") else "FAIL"
            how = (f"same binary as {r['same_binary_as']}" if r.get("same_binary_as")
                   else f"{r.get('compile_s')} s")
            print(f"  {state:4} {r['target']:8} {r['spec']:22} {_SHORT.get(r['kernel'])} "
                  f"({how})", file=sys.stderr, flush=True)

    sources = _source_hashes()
    t0 = time.perf_counter()
    rows = run(targets, specs, kernels, jobs=args.jobs, progress=progress)
    elapsed = time.perf_counter() - t0
    changed = _source_hashes() != sources
    if changed:
        print("warning: the kernel or launch sources changed during the run", file=sys.stderr)
    print(table(rows))
    report_summary = summary(rows, triton.__version__)
    print("\nPer kernel and target (matrix counts are static proxies: see bench.aot_isa)")
    print(summary_table(report_summary))
    failed = [r for r in rows if not r.get("ok")]
    compiled = sum(1 for r in rows if not r.get("same_binary_as"))
    print(f"\n{len(rows)} rows, {compiled} compiles (the other rows share one's binary), "
          f"{len(failed)} failed, {elapsed:.0f} s (triton {triton.__version__}, {args.jobs} jobs)")
    for r in failed:
        print(f"FAIL {r['kernel']} {r['target']} {r['spec']}: {r.get('error')}\n")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {
            "triton": triton.__version__,
            "targets": list(targets),
            # Which kernel and launch sources were compiled.
            "sources_sha256": sources,
            "sources_changed_during_run": changed,
            "elapsed_s": round(elapsed, 1),
            "jobs": args.jobs,
            "units": {
                "hip": "vgprs/agprs/sgprs per lane or wave, spills in registers, scratch and "
                       "lds_bytes in bytes, occupancy waves per SIMD (amdgcn '; Occupancy')",
                "cuda": "vgprs = registers per thread, vgpr_spills/spill_loads = ptxas spill "
                        "store/load bytes, scratch = stack frame bytes, lds_bytes = shared "
                        "memory bytes, occupancy = resident warps per SM (of 64)",
            },
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(args.summary, "w") as f:
            json.dump(report_summary, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
