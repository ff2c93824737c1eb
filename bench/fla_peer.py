"""The PyTorch peers' side of every benchmark (fla, and cuDNN's KDA in the sweeps), in a
process of its own.

fla (PyTorch) and torch's Triton run badly beside JAX and jax-triton in one
process (torch's Triton lost its cache directory once jax-triton was imported),
so the benchmarks start this module as a child and talk to it in JSON lines:
the parent writes one job per line on the child's stdin; the child answers
lines on stdout, one per measured row as soon as it is timed ({"row": ...}),
then {"done": true}. The child stays alive between jobs, so a benchmark can
alternate its own measurements with fla's (bench.decode --rounds).

Jobs (bf16 q/k/v, float32 g and beta, inputs from bench.inputs, but for "gradients"):
  {"job": "sweep", "library": "fla" | "cudnn", "mode": "forward" | "backward",
   "rows": [[B, T, H, K, V, cu or null, gates], ...], "references": [.npy path or null, ...]}
      fla's chunk_kda, or cuDNN frontend's kimi_delta_attention on THD views (with backward:
      plus autograd's backward), on bench.inputs.make_gated at each row's gate regime;
      rows {"index": i, "ms": ...}, with "o_rel_rms_to_triton" where a reference o is
      given (forward), or "ms": null and "refused" (the library declined the call),
      "unavailable" (not importable here) or "error"
  {"job": "serving", "sets": [[lengths], ...], "heads": H, "head_dim": D}
      the mixed serving step with device cu_seqlens, and with cu_seqlens_cpu
  {"job": "decode", "n": N, "heads": H, "head_dim": D, "forms": ["dense", "pool"]}
      fused_recurrent_kda over N one-token sequences: dense states, or a pool
      updated in place through ssm_state_indices (fla's serving decode)
  {"job": "gradients", "inputs": .npz path, "out": .npz path, "dtype": "bfloat16",
   "l2norm": bool, "scale": float}
      fla's chunk_kda with the in-kernel gate on the arrays of ``inputs`` (GRADIENT_INPUTS,
      float32 values; q, k, v, beta cast to ``dtype``), autograd of sum(o * w_o) +
      sum(final_state * w_f); the gradients go to ``out`` as float32, the row is {"out": path}
Each job may carry "iters" and "repeats" (bench.timing.time_calls).

    python -m bench.fla_peer      # the child; the parent side is FlaPeer
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np

from bench.inputs import make, make_gated, options


# --------------------------------------------------------------------------- #
# The parent's side (no torch).
# --------------------------------------------------------------------------- #


class FlaUnavailable(RuntimeError):
    """The fla child did not start or died (fla, torch or a GPU missing)."""


def child_env() -> dict:
    """This process's environment less an empty TRITON_CACHE_DIR: importing
    jax-triton sets it to "", and torch's Triton in the child then fails with
    "Could not create or locate cache dir"; without it Triton uses its default."""
    env = dict(os.environ)
    if not env.get("TRITON_CACHE_DIR"):
        env.pop("TRITON_CACHE_DIR", None)
    return env


class FlaPeer:
    """The fla child: ``with FlaPeer() as fla: for msg in fla.run(job): ...``.
    ``versions`` holds the child's torch and fla versions."""

    def __init__(self, argv=None):
        # stderr joins stdout: a pipe nobody reads fills up and stalls a chatty child.
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "bench.fla_peer"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=child_env())
        self.other = collections.deque(maxlen=20)  # the child's last non-JSON lines
        hello = self._next()
        if not hello.get("ready"):
            raise FlaUnavailable(f"the fla child did not start: {self.tail()}")
        self.versions = {k: v for k, v in hello.items() if k != "ready"}

    def tail(self) -> str:
        return "\n".join(self.other)[-600:]

    def _next(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
            self.other.append(line.rstrip())
        self.proc.wait()
        return {}

    def run(self, job: dict):
        """Yields the child's messages for ``job`` until it is done; raises
        FlaUnavailable when the child dies first (rows already yielded stand)."""
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise FlaUnavailable(f"the fla child is gone: {self.tail()}") from e
        while True:
            msg = self._next()
            if not msg:
                raise FlaUnavailable(f"the fla child died: {self.tail()}")
            if msg.get("done"):
                return
            yield msg

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------- #
# The child (torch and fla, no JAX).
# --------------------------------------------------------------------------- #


def _cuda(x, dtype=None):
    import torch

    return torch.tensor(x, device="cuda", dtype=dtype)


def _inputs(b, t, h, kd, vd, seed=0):
    import torch

    arrays = make(b, t, h, kd, vd, seed=seed)
    return [_cuda(a, torch.bfloat16 if i < 3 else torch.float32) for i, a in enumerate(arrays)]


def _timed(call, iters, repeats):
    import torch

    from bench.timing import time_calls

    return time_calls(call, torch.cuda.synchronize, iters, repeats)


def _syncs(call) -> int:
    """Synchronizing calls torch reports for one ``call(0)`` (its sync debug mode)."""
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def fla_call(x, gates, cu):
    """() -> o [B, T, H, V]: fla's chunk_kda on the tensors ``x`` (cu: varlen bounds, B = 1)."""
    import torch
    from fla.ops.kda import chunk_kda

    static = options(gates, "fla")
    if cu is not None:
        static.update(cu_seqlens=_cuda(cu, torch.long), cu_seqlens_cpu=torch.tensor(cu))

    def call():  # views are taken per call: autograd sees them anew each step
        kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"].flatten()) if "A_log" in x else {}
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **static, **kw)[0]

    return call


def cudnn_call(x, gates, cu):
    """() -> o [B, T, H, V]: cuDNN frontend's kimi_delta_attention on THD views [B * T, H, D]
    of ``x`` with int32 cu_seqlens (``cu``, or B sequences of T tokens)."""
    import torch
    from cudnn.linear_attention import kimi_delta_attention

    b, t = x["q"].shape[:2]
    static = dict(options(gates, "cudnn"),
                  cu_seqlens=_cuda(np.arange(b + 1) * t if cu is None else cu, torch.int32))
    if "A_log" in x:
        static.update(a_log=x["A_log"], dt_bias=x["dt_bias"])

    def call():
        thd = [x[n].flatten(0, 1) for n in ("q", "k", "v", "g", "beta")]
        return kimi_delta_attention(*thd, **static)[0].view(x["v"].shape)

    return call


CALLS = {"fla": (fla_call, "fla.ops.kda"), "cudnn": (cudnn_call, "cudnn.linear_attention.ops.kda")}


def peer_row(library, backward, b, t, h, kd, vd, cu, gates, reference=None, iters=20,
             repeats=5):
    """One timed call of a peer (forward, or forward + autograd backward of sum(o * do) for
    every input, A_log and dt_bias included): {"ms", "host_ms"} and, forward with a reference
    o (.npy), its relative RMS difference."""
    import torch

    x = {n: _cuda(a, torch.bfloat16 if n in ("q", "k", "v") else torch.float32)
         for n, a in make_gated(b, t, h, kd, vd, gates).items()}
    call, row = CALLS[library][0](x, gates, cu), {}
    if not backward:
        if reference is not None:  # the first call, before the timing's warm-up
            ref = torch.from_numpy(np.load(reference)).cuda()
            d = call().float() - ref
            row["o_rel_rms_to_triton"] = float(((d * d).mean() / (ref * ref).mean()).sqrt())
        step = lambda _: call()
    else:
        for a in x.values():
            a.requires_grad_(True)
        do = torch.randn(b, t, h, vd, device="cuda", dtype=torch.bfloat16)

        def step(_):
            for a in x.values():
                a.grad = None  # no accumulation into earlier gradients
            torch.autograd.backward(call(), do)
    ms, host_ms = _timed(step, iters, repeats)
    return dict(row, ms=ms, host_ms=host_ms)


def failure(e: Exception) -> dict:
    """{"refused": text} where the library declined the call (cuDNN: NotImplementedError,
    cudnnGraphNotSupportedError or an "unsupported" message), else {"error": text}."""
    text = f"{type(e).__name__}: {str(e)[:800]}"
    refused = (isinstance(e, NotImplementedError) or "NotSupported" in type(e).__name__
               or "unsupported" in text.lower() or "not supported" in text.lower())
    return {"refused" if refused else "error": text}


def sweep_job(job):
    import importlib

    library, rows = job.get("library", "fla"), job["rows"]
    references = job.get("references") or [None] * len(rows)
    try:
        importlib.import_module(CALLS[library][1])
    except (ImportError, OSError) as e:  # this library's rows only: the other peer still runs
        yield from ({"index": i, "ms": None, "unavailable": f"{type(e).__name__}: {e}"}
                    for i in range(len(rows)))
        return
    for i, (b, t, h, kd, vd, cu, *gates) in enumerate(rows):
        try:
            row = peer_row(library, job.get("mode") == "backward", b, t, h, kd, vd, cu,
                           gates[0] if gates else "mild", references[i],
                           job.get("iters", 20), job.get("repeats", 5))
        except Exception as e:  # noqa: BLE001 - a failure costs this row only
            row = {"ms": None, **failure(e)}
            if "torch" in sys.modules:
                sys.modules["torch"].cuda.empty_cache()
        yield {"index": i, **row}


def serving_job(job):
    import inspect

    import torch
    from fla.ops.kda import chunk_kda

    sets, h, d = job["sets"], job["heads"], job["head_dim"]
    q, k, v, g, beta = _inputs(1, max(map(sum, sets)), h, d, d)
    h0 = torch.zeros((max(map(len, sets)), h, d, d), device="cuda")
    has_cpu = "cu_seqlens_cpu" in inspect.signature(chunk_kda).parameters
    for name, with_cpu in (("fla chunk_kda, device cu_seqlens", False),
                           ("fla chunk_kda, + cu_seqlens_cpu", True)):
        if with_cpu and not has_cpu:
            yield {"implementation": name, "ms": None,
                   "error": "this fla's chunk_kda has no cu_seqlens_cpu"}
            continue

        def call(i, with_cpu=with_cpu):
            lens = sets[i % len(sets)]
            cu = torch.tensor(np.r_[0, np.cumsum(lens)], dtype=torch.long).pin_memory()
            kw = dict(cu_seqlens=cu.to("cuda", non_blocking=True))
            if with_cpu:
                kw["cu_seqlens_cpu"] = cu
            t = int(sum(lens))
            chunk_kda(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t],
                      initial_state=h0[: len(lens)], output_final_state=True, **kw)

        ms, host_ms = _timed(call, job.get("iters", 50), job.get("repeats", 5))
        yield {"implementation": name, "ms": ms, "host_ms": host_ms, "syncs_per_step": _syncs(call)}


def decode_calls(n, h, d, drafts=3):
    """fla's decode steps over ``n`` one-token sequences: {form: call(i)}. "dense":
    [N, 1] tokens, a float32 initial state and a new final state (the public
    fused_recurrent_kda); "pool": packed [1, N] tokens with device cu_seqlens, the
    states read from and written to a pool's rows in place through
    ssm_state_indices (fla's internal fused_recurrent_kda_fwd: the public function
    has no pool); "pool bf16": the same over a bfloat16 pool; "verify": N
    sequences of 1 + drafts tokens, ssm_state_indices [N, 1 + drafts] and
    num_accepted_tokens [N] (vLLM's speculative verify), a float32 pool."""
    import torch
    from fla.ops.kda import fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    x = _inputs(1, n, h, d, d, seed=1)
    dense = [y.reshape((n, 1) + y.shape[2:]) for y in x]
    h0 = torch.zeros((n, h, d, d), device="cuda")
    pools = {dt: torch.zeros((n, h, d, d), device="cuda", dtype=dt)
             for dt in (torch.float32, torch.bfloat16)}
    idx = torch.arange(n, device="cuda", dtype=torch.int32)
    cu = torch.arange(n + 1, device="cuda", dtype=torch.long)
    w = 1 + drafts
    xv = _inputs(1, n * w, h, d, d, seed=2)
    vpool = torch.zeros((n * w, h, d, d), device="cuda")
    vidx = torch.arange(n * w, device="cuda", dtype=torch.int32).reshape(n, w)
    vacc = (torch.arange(n, device="cuda", dtype=torch.int32) % w) + 1
    vcu = torch.arange(n + 1, device="cuda", dtype=torch.long) * w
    pool_step = lambda pool: lambda i: fused_recurrent_kda_fwd(
        *x, initial_state=pool, inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=idx)
    return {
        "dense": lambda i: fused_recurrent_kda(*dense, initial_state=h0, output_final_state=True),
        "pool": pool_step(pools[torch.float32]),
        "pool bf16": pool_step(pools[torch.bfloat16]),
        "verify": lambda i: fused_recurrent_kda_fwd(
            *xv, initial_state=vpool, inplace_final_state=True, cu_seqlens=vcu,
            ssm_state_indices=vidx, num_accepted_tokens=vacc),
    }


_DECODE_CACHE: dict = {}


def decode_job(job):
    key = (job["n"], job["heads"], job["head_dim"], job.get("drafts", 3))
    if key not in _DECODE_CACHE:  # rounds ask again and again: inputs made once
        _DECODE_CACHE[key] = decode_calls(*key)
    calls = _DECODE_CACHE[key]
    for form in job.get("forms", ("dense", "pool")):
        try:
            ms, host_ms = _timed(calls[form], job.get("iters", 50), job.get("repeats", 5))
            row = {"form": form, "ms": ms, "host_ms": host_ms}
            if job.get("syncs", True):
                row["syncs_per_step"] = _syncs(calls[form])
        except Exception as e:  # noqa: BLE001 - a failure costs this row only
            row = {"form": form, "ms": None, "error": f"{type(e).__name__}: {str(e)[-300:]}"}
        yield row


# The arrays of a gradients job (kda_jax.testing.gate_param_inputs' names), and the ones
# cast to the job's 16-bit dtype.
GRADIENT_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
SIXTEEN_BIT_INPUTS = ("q", "k", "v", "beta")


def gradients_job(job):
    import torch
    from fla.ops.kda import chunk_kda

    with np.load(job["inputs"]) as data:
        arrays = {n: data[n] for n in data.files}
    dtype = getattr(torch, job["dtype"])
    x = {n: _cuda(arrays[n], dtype if n in SIXTEEN_BIT_INPUTS else torch.float32).requires_grad_()
         for n in GRADIENT_INPUTS}
    o, final = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=job["scale"],
                         initial_state=x["initial_state"], output_final_state=True,
                         use_qk_l2norm_in_kernel=job["l2norm"], use_gate_in_kernel=True,
                         A_log=x["A_log"], dt_bias=x["dt_bias"])
    loss = ((o.float() * _cuda(arrays["w_o"])).sum()
            + (final.float() * _cuda(arrays["w_f"])).sum())
    loss.backward()
    np.savez(job["out"], **{n: x[n].grad.float().cpu().numpy() for n in GRADIENT_INPUTS})
    yield {"out": job["out"]}


JOBS = {"sweep": sweep_job, "serving": serving_job, "decode": decode_job,
        "gradients": gradients_job}


def child_main():
    import torch

    from bench.meta import versions

    found = versions(("fla", "cudnn_frontend"))
    serve(JOBS, torch.__version__, found["fla"], cudnn_frontend=found["cudnn_frontend"])


def serve(jobs, torch_version, fla_version, traceback_to_stdout=False, **more_versions):
    """The child's loop: says it is ready (with its versions), then runs one job per stdin
    line (``jobs[job["job"]](job)`` yields rows) until an empty line or EOF."""
    print(json.dumps({"ready": True, "torch": torch_version, "fla": fla_version,
                      **more_versions}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        try:
            for row in jobs[job["job"]](job):
                print(json.dumps({"row": row}), flush=True)
        except Exception as e:  # noqa: BLE001 - the parent records the failure
            if traceback_to_stdout:
                import traceback

                traceback.print_exc(file=sys.stdout)
            print(json.dumps({"error": f"{type(e).__name__}: {str(e)[-400:]}"}), flush=True)
        print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    child_main()
