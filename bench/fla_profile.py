"""Per-kernel GPU time of fla's chunk_kda forward (PyTorch profiler), to see
where a peer spends its time. GPU only.

    python -m bench.fla_profile [B,T,H]
"""

import sys


def main():
    import torch
    from fla.ops.kda import chunk_kda
    from torch.profiler import ProfilerActivity, profile

    from bench.inputs import make

    b, t, h = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,8192,32").split(","))
    q, k, v, g, beta = make(b, t, h, 128, 128)
    q, k, v = (torch.tensor(a, device="cuda", dtype=torch.bfloat16) for a in (q, k, v))
    g, beta = (torch.tensor(a, device="cuda") for a in (g, beta))
    for _ in range(3):
        chunk_kda(q, k, v, g, beta)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            chunk_kda(q, k, v, g, beta)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
