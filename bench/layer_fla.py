"""fla's side of bench.layer, in a process of its own (the protocol of
bench.fla_peer: the parent writes one JSON job per line, this child answers
{"row": ...} lines, then {"done": true}).

Jobs:
  {"job": "parity", "config": {...}, "cases": {...}, "dir": PATH}
      builds fla's KimiDeltaAttention (bf16, on the GPU), writes its weights
      (bf16 values as float32) to PATH/weights.npz, and for every case the
      inputs (PATH/<case>-inputs.npz) and the results of fla's layer twice:
      "triton" (the bf16 layer as shipped) and "naive" (a float32 copy of the
      same weights with fla.layers.kda's chunk_kda / fused_recurrent_kda
      replaced by fla's naive_recurrent_kda plus the in-kernel transforms
      written out here), to PATH/<case>-<variant>.npz. Cases: "dense" /
      "varlen" (training mode: y, dx and every parameter's gradient for the
      cotangent dy) and "decode" (eval mode with a cache: a prefill, then one
      token per sequence; outputs and the caches after each). With --cpu:
      on the CPU, fla's Triton kernels in the interpreter, "naive" only.
  {"job": "timing", "config": {...}, "tokens": T, "decode_seqs": N, "iters", "repeats",
   "dir": PATH or absent}
      the layer's forward and forward + backward at [1, T, hidden], and one
      decode step of N sequences with a cache, on timing_inputs; rows {"what",
      "ms"}; with "dir", the layer's weights first go to PATH/weights.npz (the
      parent times its layer with the same parameters).
The config's gate form (GATE_FORMS: "safe_gate", "lower_bound") reaches fla's layer.

NumPy helpers at the top are shared with the parent (no torch, no JAX there).

    python -m bench.layer_fla [--cpu | --first-config]   # the child; bench.layer starts it
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import numpy as np

# --------------------------------------------------------------------------- #
# Shared with the parent: the cases and their inputs (NumPy only).
# --------------------------------------------------------------------------- #

FULL = dict(hidden=2048, heads=16, head_dim=128, seed=0)
SMOKE = dict(hidden=32, heads=2, head_dim=16, seed=0)
# fla's layer on the CPU (--cpu): GVA (4 value heads on 2 q/k heads) and V = 2 K.
CPU = dict(hidden=32, heads=2, v_heads=4, head_dim=8, expand_v=2, seed=0)
# The layer's gate forms (bench.layer --gates): "softplus", fla's default
# -exp(A_log) * softplus(x + dt_bias), and "safe", lower_bound * sigmoid(exp(A_log) *
# (x + dt_bias)) at -5 with fla's safe_gate (its init: A_log = 0).
GATE_FORMS = {"softplus": {}, "safe": dict(safe_gate=True, lower_bound=-5.0)}
CASES = {
    "full": {"dense": dict(b=2, t=512), "varlen": dict(lengths=[1, 63, 200, 500, 260]),
             "decode": dict(b=4, prefill=100)},
    "smoke": {"dense": dict(b=2, t=20), "varlen": dict(lengths=[1, 7, 12]),
              "decode": dict(b=2, prefill=6)},
}


def case_inputs(name: str, case: dict, hidden: int, seed: int) -> dict[str, np.ndarray]:
    """float32 NumPy inputs of a case (the child rounds them to bf16 values):
    x [B, T, hidden] (varlen: [1, T, hidden] and cu_seqlens), dy like x;
    decode: x_prefill [b, prefill, hidden] and x_step [b, 1, hidden]."""
    rng = np.random.default_rng(seed + {"dense": 1, "varlen": 2, "decode": 3}[name])
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    if name == "decode":
        return {"x_prefill": f(case["b"], case["prefill"], hidden),
                "x_step": f(case["b"], 1, hidden)}
    if name == "varlen":
        t = int(sum(case["lengths"]))
        return {"x": f(1, t, hidden), "dy": f(1, t, hidden),
                "cu_seqlens": np.r_[0, np.cumsum(case["lengths"])].astype(np.int64)}
    return {"x": f(case["b"], case["t"], hidden), "dy": f(case["b"], case["t"], hidden)}


def timing_inputs(hidden: int, tokens: int, decode_seqs: int, seed: int = 0):
    """float32 x [1, tokens, hidden], dy like x and x_step [decode_seqs, 1, hidden] of the
    timing (both sides take them as bf16)."""
    rng = np.random.default_rng(seed + 4)
    f = lambda *s: rng.standard_normal(s, np.float32)
    return f(1, tokens, hidden), f(1, tokens, hidden), f(decode_seqs, 1, hidden)


# --------------------------------------------------------------------------- #
# The child (torch and fla).
# --------------------------------------------------------------------------- #


class LayerCache:
    """The least of fla's cache that its layer uses: ``len``, ``[layer_idx]``
    (a dict with "conv_state" and "recurrent_state") and ``update(...)``."""

    def __init__(self, states=None):
        self.states = [] if states is None else [states]

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def update(self, recurrent_state=None, conv_state=None, layer_idx=0, **_):
        if len(self.states) <= layer_idx:
            self.states.append({"recurrent_state": None, "conv_state": None})
        state = self.states[layer_idx]
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if conv_state is not None:
            state["conv_state"] = conv_state
        return state


def naive_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False,
              use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
              **_):
    """fla's chunk_kda / fused_recurrent_kda by fla's naive_recurrent_kda in
    float32: the in-kernel transforms written out, one sequence at a time."""
    import torch
    import torch.nn.functional as F
    from fla.ops.kda.naive import naive_recurrent_kda

    NAIVE_CALLS[0] += 1
    out_dtype = q.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if use_gate_in_kernel:
        hv, kd = g.shape[-2:]
        x = g if dt_bias is None else g + dt_bias.float().view(hv, kd)
        if lower_bound is None:
            g = -A_log.float().exp()[:, None] * F.softplus(x)
        else:
            a = 1.0 if A_log is None else A_log.float().exp()[:, None]
            g = lower_bound * torch.sigmoid(a * x)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid()
    if allow_neg_eigval:
        beta = beta * 2
    h0 = None if initial_state is None else initial_state.float()
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    b, t = q.shape[:2]
    if cu_seqlens is None:
        pieces = [(i, slice(None), i) for i in range(b)]  # (row, tokens, sequence)
    else:
        cu = cu_seqlens.tolist()
        pieces = [(0, slice(cu[n], cu[n + 1]), n) for n in range(len(cu) - 1)]
    outs, finals = [], []
    for row, tok, n in pieces:
        sl = lambda a: a[row:row + 1, tok]
        o, s = naive_recurrent_kda(sl(q), sl(k), sl(v), sl(g), sl(beta), scale=scale,
                                   initial_state=None if h0 is None else h0[n:n + 1],
                                   output_final_state=True)
        outs.append(o)
        finals.append(s[0])
    o = torch.cat(outs, dim=0 if cu_seqlens is None else 1).to(out_dtype)
    if not output_final_state:
        return o, None
    final = torch.stack(finals)
    return o, (final.transpose(-1, -2) if state_v_first else final).contiguous()


NAIVE_CALLS = [0]


@contextlib.contextmanager
def naive_ops(active: bool):
    """fla.layers.kda's KDA functions replaced by :func:`naive_kda` inside;
    raises if the layer called neither (a layer that no longer looks them up
    in its module would otherwise pass its Triton results off as naive ones)."""
    _fla_layer_class()
    fla_kda = sys.modules["fla.layers.kda"]

    saved = fla_kda.chunk_kda, fla_kda.fused_recurrent_kda
    before = NAIVE_CALLS[0]
    if active:
        fla_kda.chunk_kda = fla_kda.fused_recurrent_kda = naive_kda
    try:
        yield
    finally:
        fla_kda.chunk_kda, fla_kda.fused_recurrent_kda = saved
    if active and NAIVE_CALLS[0] == before:
        raise RuntimeError("fla's layer did not call fla.layers.kda.chunk_kda / "
                           "fused_recurrent_kda: the naive path cannot be swapped in")


# "cuda", or "cpu" (python -m bench.layer_fla --cpu): fla's layer on the CPU, its
# Triton kernels (short convolution, gated norm) in Triton's interpreter, the
# float32 naive variant only: a check of the layer's function without a GPU.
DEVICE = ["cuda"]


def _first_config_only():
    """Before fla is imported: each autotuned kernel keeps its first config
    (parity only: the results do not depend on the tuning, and fla's
    autotuning of every new shape takes minutes)."""
    import triton.runtime.autotuner as autotuner

    init = autotuner.Autotuner.__init__

    def first_config_only(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.configs = self.configs[:1]

    autotuner.Autotuner.__init__ = first_config_only


def _cpu_setup():
    """Before triton is imported: the interpreter, and one config per autotuned
    kernel (the interpreter has no benchmarking driver)."""
    os.environ["TRITON_INTERPRET"] = "1"
    _first_config_only()
    DEVICE[0] = "cpu"


def _fla_layer_class():
    """fla.layers.kda.KimiDeltaAttention; where fla.layers' package imports fail
    on transformers (absent beside fla-core alone), the module is loaded by
    itself (it does not need transformers)."""
    try:
        from fla.layers.kda import KimiDeltaAttention
    except ModuleNotFoundError as e:
        if "transformers" not in str(e):
            raise
        import types

        import fla

        for name in [m for m in sys.modules if m.startswith("fla.layers")]:
            del sys.modules[name]
        package = types.ModuleType("fla.layers")
        package.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
        sys.modules["fla.layers"] = package
        from fla.layers.kda import KimiDeltaAttention
    return KimiDeltaAttention


def build_layer(config):
    import torch

    KimiDeltaAttention = _fla_layer_class()

    torch.manual_seed(config["seed"])
    layer = KimiDeltaAttention(hidden_size=config["hidden"], head_dim=config["head_dim"],
                               num_heads=config["heads"], num_v_heads=config.get("v_heads"),
                               expand_v=config.get("expand_v", 1), mode="chunk", layer_idx=0,
                               safe_gate=config.get("safe_gate", False),
                               lower_bound=config.get("lower_bound"))
    return layer.to(device=DEVICE[0], dtype=torch.bfloat16)


def _np(t):
    # A copy: on the CPU .numpy() shares memory with a tensor fla updates in place.
    return np.array(t.detach().float().cpu().numpy())


def _train_case(layer, inputs, dtype):
    import torch

    layer.train()
    for p in layer.parameters():
        p.grad = None
    x = torch.tensor(inputs["x"], device=DEVICE[0], dtype=dtype, requires_grad=True)
    kw = {}
    if "cu_seqlens" in inputs:
        kw["cu_seqlens"] = torch.tensor(inputs["cu_seqlens"], device=DEVICE[0],
                                        dtype=torch.long)
    y = layer(x, **kw)[0]
    y.backward(torch.tensor(inputs["dy"], device=DEVICE[0], dtype=dtype))
    out = {"y": _np(y), "dx": _np(x.grad)}
    out.update({f"grad/{n}": _np(p.grad) for n, p in layer.named_parameters()})
    return out


def _cache_arrays(cache, tag):
    state = cache[0]
    out = {f"{tag}/recurrent": _np(state["recurrent_state"])}
    for name, c in zip("qkv", state["conv_state"]):
        out[f"{tag}/conv_{name}"] = _np(c)
    return out


def _decode_case(layer, inputs, dtype):
    import torch

    layer.eval()
    cache = LayerCache()
    with torch.no_grad():
        x0 = torch.tensor(inputs["x_prefill"], device=DEVICE[0], dtype=dtype)
        y0 = layer(x0, past_key_values=cache, use_cache=True)[0]
        out = {"y_prefill": _np(y0), **_cache_arrays(cache, "prefill")}  # copies: the step
        x1 = torch.tensor(inputs["x_step"], device=DEVICE[0], dtype=dtype)  # updates in place
        y1 = layer(x1, past_key_values=cache, use_cache=True)[0]
    out.update({"y_step": _np(y1), **_cache_arrays(cache, "step")})
    return out


def parity_job(job):
    import torch

    config, directory = job["config"], job["dir"]
    layer = build_layer(config)
    weights = {n: _np(p) for n, p in layer.state_dict().items()}
    np.savez(os.path.join(directory, "weights.npz"), **weights)
    reference = copy.deepcopy(layer).float()
    for name, case in job["cases"].items():
        inputs = case_inputs(name, case, config["hidden"], config["seed"])
        # bf16 values (as float32) on both sides.
        inputs = {k: (v if k == "cu_seqlens" else
                      torch.tensor(v).bfloat16().float().numpy()) for k, v in inputs.items()}
        np.savez(os.path.join(directory, f"{name}-inputs.npz"), **inputs)
        variants = [("naive", reference, torch.float32)]
        if DEVICE[0] == "cuda":
            variants.insert(0, ("triton", layer, torch.bfloat16))
        for variant, model, dtype in variants:
            run = _decode_case if name == "decode" else _train_case
            with naive_ops(variant == "naive"):
                result = run(model, inputs, dtype)
            path = os.path.join(directory, f"{name}-{variant}.npz")
            np.savez(path, **result)
            yield {"case": name, "variant": variant, "file": path}


def timing_job(job):
    import torch

    from bench.timing import time_calls

    config = job["config"]
    layer = build_layer(config)
    if job.get("dir"):
        np.savez(os.path.join(job["dir"], "weights.npz"),
                 **{n: _np(p) for n, p in layer.state_dict().items()})
    hidden, t, n = config["hidden"], job["tokens"], job["decode_seqs"]
    iters, repeats = job.get("iters", 20), job.get("repeats", 5)
    sync = torch.cuda.synchronize
    bf16 = lambda a: torch.tensor(a, device="cuda", dtype=torch.bfloat16)
    x, dy, x_step = map(bf16, timing_inputs(hidden, t, n, config["seed"]))

    def forward(_):
        with torch.no_grad():
            layer(x)

    xg = x.clone().requires_grad_(True)

    def forward_backward(_):
        for p in layer.parameters():
            p.grad = None
        xg.grad = None
        layer(xg)[0].backward(dy)

    # One decode step of n sequences from a cache (fla updates the conv states in place).
    kd, vd = config["head_dim"], config["head_dim"]
    heads, w = config["heads"], layer.conv_size
    zeros = lambda c: torch.zeros(n, c, w, device="cuda", dtype=torch.bfloat16)
    states = {"conv_state": (zeros(heads * kd), zeros(heads * kd), zeros(heads * vd)),
              "recurrent_state": torch.zeros(n, heads, vd, kd, device="cuda")}
    cache = LayerCache(states)

    def decode(_):
        with torch.no_grad():
            layer(x_step, past_key_values=cache, use_cache=True)

    for what, call, mode in (("forward", forward, "eval"),
                             ("forward+backward", forward_backward, "train"),
                             ("decode step", decode, "eval")):
        getattr(layer, mode)()
        try:
            ms, host_ms = time_calls(call, sync, iters, repeats)
            yield {"what": what, "ms": ms, "host_ms": host_ms}
        except Exception as e:  # noqa: BLE001 - a failure costs this row only
            yield {"what": what, "ms": None, "error": f"{type(e).__name__}: {str(e)[-300:]}"}


JOBS = {"parity": parity_job, "timing": timing_job}


def child_main():
    if "--cpu" in sys.argv[1:]:
        _cpu_setup()
    elif "--first-config" in sys.argv[1:]:
        _first_config_only()
    import torch

    from bench.meta import versions

    from bench.fla_peer import serve

    serve(JOBS, torch.__version__, versions(("fla",))["fla"], traceback_to_stdout=True)


if __name__ == "__main__":
    child_main()
