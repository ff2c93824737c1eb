"""Where a dense decode step's time goes: the copy ceiling, the kernel's shape,
and where the state buffers lie (GPU only).

    python -m bench.decode_memory [--n 256] [--rounds 3] [--vloop 32x4x2,...]
        [--copies KIND:BLOCKxWARPS[xSTAGESxPER_SM],...] [--ours BVxWARPS,...]
        [--persistent BVxWARPSxSTAGESxPER_SM,...] [--no-placement] [--no-jax] [--json PATH]

A dense decode step of N one-token sequences (H = 32, K = V = 128) reads a
float32 state and writes a new one: 2 x N x H x K x V x 4 bytes (1.07 GB at
N = 256), everything else is under 1 %. So the step is a copy with a little
arithmetic on the way, and its floor is the device's copy bandwidth. Timed in
one PyTorch process, in rounds (rows in turn, --rounds times), each row the
median wall-clock and CUDA-event time per call (bench.decode_kernels_torch):

  copy: torch's ``ht.copy_(h0)``; a Triton copy of 16 KiB contiguous blocks;
        a Triton copy in the decode kernel's tiles ([K, BV] of a [K, V] state,
        grid (V blocks, heads, sequences)): the ceilings of the step.
  kernel: kda_jax's decode kernel at sm90's shipped tile (launched by Triton,
        bench.decode_kernels_torch) and fla's fused_recurrent_kda; a
        one-program-per-head form that walks the V blocks in a
        software-pipelined loop (``vloop``, configs
        BLOCK_VxWARPSxSTAGES), an experiment for the kernel's shape.
  placement: kda_jax's kernel with the initial and final state cut from one
        allocation at set distances, and (unless --no-jax) at the distance and
        alignment XLA gave them in this process's jitted step, which is timed
        in the same rounds; then the kernel launched by Triton on the jitted
        step's own buffers (through DLPack): the same buffers, another launcher.

Each kernel row also reports its largest difference from kda_jax's kernel (o
and final state) after one step from the same random state. Options add rows:
--copies (flat blocks, streaming hints, persistent grids, [K, BV] tiles),
--ours (kda_jax's kernel at other tiles), --persistent (a persistent decode
form). What it found on the H200: bench/results/README.md, session 11.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MIB = 1 << 20
# Distances (bytes) between the final and the initial state's starts, beyond
# the state's own size, for the placement rows.
GAPS = (0, 256, 4096, 64 * 1024, 2 * MIB, 2 * MIB + 256)
VLOOP_CONFIGS = "32x4x2,32x4x3,16x2x3,64x4x2"


def parse_vloop(text: str) -> list[tuple[int, int, int]]:
    """'BVxWARPSxSTAGES,...' -> [(block_v, warps, stages), ...]."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--vloop entry {item!r} must be BLOCK_VxWARPSxSTAGES, e.g. 32x4x2")
        out.append(tuple(int(p) for p in parts))
    return out


def slab_layout(size: int, gap: int, base: int = 0) -> tuple[int, int, int]:
    """(slab bytes, initial state's offset, final state's offset) for two
    ``size``-byte states in one allocation, the final one starting ``size +
    gap`` bytes after the initial one (``gap`` may be negative down to
    -2 * size: the final state first), the first of them ``base`` bytes in."""
    delta = size + gap
    if delta >= size:
        return base + delta + size, base, base + delta
    if delta <= -size:
        return base - delta + size, base - delta, base
    raise ValueError(f"the states would overlap: {size=} {gap=}")


def _kernels():
    """The experiment's Triton kernels (defined here so that importing this
    module needs no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_flat_kernel(src, dst, BLOCK: tl.constexpr, STREAM: tl.constexpr):
        o_x = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if STREAM:  # read once, written once: keep neither in L2
            tl.store(dst + o_x, tl.load(src + o_x, eviction_policy="evict_first"),
                     cache_modifier=".cs")
        else:
            tl.store(dst + o_x, tl.load(src + o_x))

    @triton.jit
    def copy_persistent_kernel(src, dst, n_blocks, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        # A grid of a few programs per multiprocessor, each walking blocks
        # num_programs apart, the next block's load in flight (STAGES > 1).
        for i_b in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
            o_x = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + o_x, tl.load(src + o_x))

    @triton.jit
    def copy_tiles_kernel(h0, ht, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BV: tl.constexpr):
        i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        p_s = (i_n.to(tl.int64) * HV + i_hv) * K * V
        o_s = tl.arange(0, K)[:, None] * V + (i_v * BV + tl.arange(0, BV))[None, :]
        tl.store(ht + p_s + o_s, tl.load(h0 + p_s + o_s))

    @triton.jit
    def decode_vloop_kernel(q, k, v, g, beta, h0, o, ht, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                            SCALE: tl.constexpr, STAGES: tl.constexpr):
        # One program per (head, sequence): q, k, exp(g) and beta once, then
        # the state's V blocks in a pipelined loop (the next block's load in
        # flight while this one is updated and stored).
        i_hv, i_n = tl.program_id(0), tl.program_id(1)
        i_h = i_hv // (HV // H)
        o_k = tl.arange(0, K)
        b_q = tl.load(q + (i_n * H + i_h) * K + o_k).to(tl.float32)
        b_k = tl.load(k + (i_n * H + i_h) * K + o_k).to(tl.float32)
        b_d = tl.exp(tl.load(g + (i_n * HV + i_hv) * K + o_k).to(tl.float32))
        b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
        p_s = (i_n.to(tl.int64) * HV + i_hv) * K * V
        p_v = (i_n * HV + i_hv) * V
        for i_v in tl.range(0, V // BV, num_stages=STAGES):
            o_v = i_v * BV + tl.arange(0, BV)
            o_s = o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h0 + p_s + o_s) * b_d[:, None]
            b_v = tl.load(v + p_v + o_v).to(tl.float32)
            b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
            b_h += b_k[:, None] * b_v[None, :]
            b_o = tl.sum(b_h * b_q[:, None], axis=0) * SCALE
            tl.store(o + p_v + o_v, b_o.to(o.dtype.element_ty))
            tl.store(ht + p_s + o_s, b_h)

    @triton.jit
    def decode_persistent_kernel(q, k, v, g, beta, h0, o, ht, n_tiles, H: tl.constexpr,
                                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                 BV: tl.constexpr, SCALE: tl.constexpr, STAGES: tl.constexpr):
        # A few programs per multiprocessor walk the (V block, head, sequence)
        # tiles num_programs apart: the next tile's loads in flight (STAGES > 1).
        o_k = tl.arange(0, K)
        for i_t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            i_v = i_t % (V // BV)
            i_hv = (i_t // (V // BV)) % HV
            i_n = i_t // (V // BV * HV)
            i_h = i_hv // (HV // H)
            o_v = i_v * BV + tl.arange(0, BV)
            p_s = (i_n.to(tl.int64) * HV + i_hv) * K * V
            o_s = o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h0 + p_s + o_s)
            b_q = tl.load(q + (i_n * H + i_h) * K + o_k).to(tl.float32)
            b_k = tl.load(k + (i_n * H + i_h) * K + o_k).to(tl.float32)
            b_g = tl.load(g + (i_n * HV + i_hv) * K + o_k).to(tl.float32)
            b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
            b_v = tl.load(v + (i_n * HV + i_hv) * V + o_v).to(tl.float32)
            b_h = b_h * tl.exp(b_g)[:, None]
            b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
            b_h += b_k[:, None] * b_v[None, :]
            b_o = tl.sum(b_h * b_q[:, None], axis=0) * SCALE
            tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty))
            tl.store(ht + p_s + o_s, b_h)

    return decode_persistent_kernel, copy_flat_kernel, copy_persistent_kernel, copy_tiles_kernel, decode_vloop_kernel


def jax_step(n: int, h: int, d: int, arrays):
    """kda_jax's dense decode step, jitted: (call(i), sync(), state) where
    state["ht"] is the last final state and state["h0"] the initial one."""
    import jax
    import jax.numpy as jnp

    import kda_jax

    x = [jnp.asarray(y, jnp.bfloat16 if i < 3 else jnp.float32).reshape((n, 1) + y.shape[2:])
         for i, y in enumerate(arrays)]
    step = jax.jit(lambda h0, *x: kda_jax.fused_recurrent_kda(
        *x, initial_state=h0, output_final_state=True, implementation="triton")[1])
    state = {"h0": jnp.zeros((n, h, d, d), jnp.float32)}

    def call(i):
        state["ht"] = step(state["h0"], *x)

    return call, lambda: jax.block_until_ready(state["ht"]), state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vloop", default=VLOOP_CONFIGS)
    p.add_argument("--copies", default="",
                   help="more copy rows, KIND:BLOCKxWARPS[xSTAGESxPROGRAMS_PER_SM],... with KIND "
                        "flat, stream (evict-first load, streaming store), persistent, or "
                        "tiles (BLOCK = the tile's V width)")
    p.add_argument("--ours", default="",
                   help="kda_jax's kernel at more tiles, BLOCK_VxWARPS,...")
    p.add_argument("--persistent", default="",
                   help="persistent decode rows, BLOCK_VxWARPSxSTAGESxPROGRAMS_PER_SM,...")
    p.add_argument("--no-placement", action="store_true", help="skip the placement rows")
    p.add_argument("--no-jax", action="store_true", help="skip the jitted step and its placement")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    vloop = parse_vloop(a.vloop)
    from kda_jax.configs import RECURRENT

    # kda_jax's kernel rows at the tile sm90 ships for the dense step.
    shipped = RECURRENT["sm90"]
    n, h, d, bv_ours, warps_ours = a.n, a.heads, 128, shipped.block_v, shipped.warps

    from bench.inputs import make
    arrays = make(1, n, h, d, d, seed=1)
    jx = None
    if not a.no_jax:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
        cache = os.environ.get("TRITON_CACHE_DIR")
        jx = jax_step(n, h, d, arrays)
        jx[0](0)  # traced and compiled now: the trace imports jax-triton
        jx[1]()
        if cache:  # importing jax-triton empties it; torch's Triton launches need it
            os.environ["TRITON_CACHE_DIR"] = cache

    import torch
    from fla.ops.kda import fused_recurrent_kda

    from bench.decode_kernels_torch import decode_constexprs, kda_kernels, wall_and_event_ms
    from bench.serving import wall_ms

    decode_persistent, copy_flat, copy_persistent, copy_tiles, decode_vloop = _kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ours_kernel = kda_kernels().kda_fused_recurrent_kernel
    consts = decode_constexprs(h, d, bv_ours, "dense")
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.bfloat16).reshape(n, 1, h, d)
               for x in arrays[:3])
    g, beta = (torch.tensor(x, device="cuda").reshape((n, 1) + x.shape[2:]) for x in arrays[3:])
    dummy_f = torch.zeros(4, device="cuda")
    dummy_i = torch.zeros(4, device="cuda", dtype=torch.int32)
    shape = (n, h, d, d)
    numel = n * h * d * d
    size = numel * 4
    h_rand = torch.randn(shape, device="cuda") * 0.1
    h_zero = torch.zeros(shape, device="cuda")

    def new_o():
        return torch.empty((n, h, d), device="cuda", dtype=torch.bfloat16)

    def ours(h0, ht=None, bv=bv_ours, warps=warps_ours):
        consts_bv = dict(consts, BV=bv)

        def call():
            o, out = new_o(), (torch.empty(shape, device="cuda") if ht is None else ht)
            ours_kernel[(d // bv, h, n)](
                q, k, v, g, beta, dummy_f, dummy_f, h0, dummy_i, dummy_i, dummy_i, 0, n, n, 0,
                o, out, **consts_bv, num_warps=warps, num_stages=2)
            return o, out
        return call

    def vloop_call(bv, warps, stages, h0):
        def call():
            o, ht = new_o(), torch.empty(shape, device="cuda")
            decode_vloop[(h, n)](q, k, v, g, beta, h0, o, ht, H=h, HV=h, K=d, V=d, BV=bv,
                                 SCALE=d ** -0.5, STAGES=stages, num_warps=warps)
            return o, ht
        return call

    def persistent_call(bv, warps, stages, per_sm, h0):
        tiles = d // bv * h * n

        def call():
            o, ht = new_o(), torch.empty(shape, device="cuda")
            decode_persistent[(sms * per_sm,)](
                q, k, v, g, beta, h0, o, ht, tiles, H=h, HV=h, K=d, V=d, BV=bv,
                SCALE=d ** -0.5, STAGES=stages, num_warps=warps)
            return o, ht
        return call

    def copies(kind, block=4096, warps=4, stages=1, per_sm=4):
        dst = torch.empty(shape, device="cuda")

        def call():
            if kind == "torch":
                dst.copy_(h_rand)
            elif kind in ("flat", "stream"):
                copy_flat[(numel // block,)](h_rand, dst, BLOCK=block, STREAM=kind == "stream",
                                             num_warps=warps)
            elif kind == "persistent":
                copy_persistent[(sms * per_sm,)](h_rand, dst, numel // block, BLOCK=block,
                                                  STAGES=stages, num_warps=warps)
            else:  # the decode kernel's tiles, [K, block] of a [K, V] state
                copy_tiles[(d // block, h, n)](h_rand, dst, HV=h, K=d, V=d, BV=block,
                                               num_warps=warps)
            return None, dst
        return call

    def slab_rows(tag, gap, base=0):
        total, at0, at1 = slab_layout(size, gap, base)
        slab = torch.empty(total // 4 + 1, device="cuda")
        h0 = slab[at0 // 4: at0 // 4 + numel].view(shape)
        h0.copy_(h_rand)
        ht = slab[at1 // 4: at1 // 4 + numel].view(shape)
        return f"placement {tag}", ours(h0, ht)

    rows = {
        "copy torch": copies("torch"),
        "copy flat 16 KiB blocks": copies("flat"),
    }
    for spec in filter(None, a.copies.split(",")):
        kind, sizes = spec.split(":")
        block, warps, stages, per_sm = (int(x) for x in (sizes.split("x") + ["1", "4"])[:4])
        rows[f"copy {spec}"] = copies(kind, block, warps, stages, per_sm)
    rows |= {
        "copy in the kernel's tiles": copies("tiles", bv_ours, warps_ours),
        "kda_jax kernel, random state": ours(h_rand),
        "kda_jax kernel, zero state": ours(h_zero),
        "fla fused_recurrent_kda": lambda: fused_recurrent_kda(
            q, k, v, g, beta, initial_state=h_rand, output_final_state=True),
    }
    for bv, w, s in vloop:
        rows[f"vloop {bv}x{w}x{s}"] = vloop_call(bv, w, s, h_rand)
    for spec in filter(None, a.ours.split(",")):
        bv, w = (int(x) for x in spec.split("x"))
        rows[f"kda_jax kernel {spec}"] = ours(h_rand, bv=bv, warps=w)
    for spec in filter(None, a.persistent.split(",")):
        bv, w, st, per_sm = (int(x) for x in spec.split("x"))
        rows[f"persistent {spec}"] = persistent_call(bv, w, st, per_sm, h_rand)
    for gap in () if a.no_placement else GAPS:
        name, call = slab_rows(f"gap {gap}", gap)
        rows[name] = call
    info = {}
    if jx is not None:
        call, sync, state = jx
        call(0)
        sync()
        a0 = state["h0"].unsafe_buffer_pointer()
        a1 = state["ht"].unsafe_buffer_pointer()
        info = dict(jax_h0_addr=a0, jax_ht_addr=a1, jax_gap=a1 - a0 - size,
                    jax_h0_mod_2mib=a0 % (2 * MIB), jax_ht_mod_2mib=a1 % (2 * MIB))
        print(f"jax buffers: h0 {a0:#x} ht {a1:#x} gap {info['jax_gap']} bytes", flush=True)
        name, slab = slab_rows("as jax's", info["jax_gap"], a0 % (2 * MIB))
        rows[name] = slab
        # The jitted step's own buffers under Triton's launcher (ht is written
        # in place: the jitted step is timed in its own row, not on this one).
        jh0, jht = torch.from_dlpack(state["h0"]), torch.from_dlpack(state["ht"])
        rows["kda_jax kernel on jax's buffers"] = ours(jh0, jht)

    def timed(name, call):
        if name == "kda_jax jitted step":
            jcall, sync, _ = jx
            ms = wall_ms(jcall, sync, 50, 5)[0]
            return dict(wall_ms=ms, event_ms=None)
        wall, event = wall_and_event_ms(call)
        return dict(wall_ms=wall, event_ms=event)

    order = list(rows) + (["kda_jax jitted step"] if jx is not None else [])
    ref_o, ref_h = ours(h_rand)()
    ref_o, ref_h = ref_o.float().clone(), ref_h.clone()
    results = []
    for rnd in range(a.rounds):
        names = order if rnd % 2 == 0 else order[::-1]
        for name in names:
            r = dict(round=rnd, row=name, **timed(name, rows.get(name)))
            if name.startswith(("kda_jax kernel", "fla", "vloop", "persistent")) and "zero" not in name and "buffers" not in name:
                o, ht = rows[name]()
                r["o_max_diff"] = float((o.reshape(ref_o.shape).float() - ref_o).abs().max())
                r["state_max_diff"] = float((ht - ref_h).abs().max())
            r["gb_per_s"] = 2 * size / (r["wall_ms"] * 1e-3) / 1e9
            results.append(r)
            ev = f"{r['event_ms']:.4f}" if r["event_ms"] is not None else "-"
            extra = (f"  o diff {r['o_max_diff']:.1e} state diff {r['state_max_diff']:.1e}"
                     if "o_max_diff" in r else "")
            print(f"{rnd} {name:36s} wall {r['wall_ms']:.4f} ms  events {ev} ms  "
                  f"{r['gb_per_s']:.0f} GB/s{extra}", flush=True)
    if a.json:
        from bench.timing import versions

        with open(a.json, "w") as f:
            json.dump(dict(rows=results, info=info, n=n, heads=h, head_dim=d,
                           state_bytes=size, versions=dict(versions(), torch=torch.__version__),
                           command="python -m bench.decode_memory " + " ".join(
                               argv if argv is not None else sys.argv[1:])), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
