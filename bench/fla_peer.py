"""Times fla's chunk_kda (PyTorch) on the benchmark's inputs, in its own process.

fla and torch's Triton run beside JAX and jax-triton badly in one process (seen
on the H200: torch's Triton lost its cache directory once jax-triton had
compiled), so bench.forward starts this module and reads its stdout: one JSON
line per row as soon as it is timed ({"row": i, "ms": ...}; fla's first call
per shape autotunes for minutes, and a sweep cut by a time limit keeps the
rows done), then one line with the versions.

    python -m bench.fla_peer '[[B, T, H, K, V, cu_or_null], ...]' [forward|backward]

"backward" times the forward plus PyTorch autograd's backward (bench.backward).
"""

import json
import sys


def main():
    import torch
    from fla.ops.kda import chunk_kda

    from bench.inputs import make
    from bench.timing import time_torch

    rows = json.loads(sys.argv[1])
    backward = len(sys.argv) > 2 and sys.argv[2] == "backward"
    for i, (b, t, h, kd, vd, cu) in enumerate(rows):
        q, k, v, g, beta = make(b, t, h, kd, vd)
        q, k, v = (torch.tensor(a, device="cuda", dtype=torch.bfloat16) for a in (q, k, v))
        g, beta = (torch.tensor(a, device="cuda") for a in (g, beta))
        kw = {}
        if cu is not None:
            kw = dict(cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.long),
                      cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long))
        if backward:
            for a in (q, k, v, g, beta):
                a.requires_grad_(True)
            do = torch.randn(b, t, h, vd, device="cuda", dtype=torch.bfloat16)

            def step():
                for a in (q, k, v, g, beta):
                    a.grad = None  # no accumulation into earlier gradients
                o = chunk_kda(q, k, v, g, beta, **kw)[0]
                torch.autograd.backward(o, do)

            ms = time_torch(step)
        else:
            ms = time_torch(lambda: chunk_kda(q, k, v, g, beta, **kw))
        print(json.dumps({"row": i, "ms": ms}), flush=True)
    print(json.dumps({"torch": torch.__version__,
                      "fla": getattr(__import__("fla"), "__version__", "?")}), flush=True)


if __name__ == "__main__":
    main()
