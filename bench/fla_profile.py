"""Per-kernel GPU time of fla's chunk_kda forward (PyTorch profiler), to see
where a peer spends its time. GPU only.

    python -m bench.fla_profile [B,T,H]
    python -m bench.fla_profile --decode N

--decode N: instead, three dense decode steps of fla's fused_recurrent_kda (N
one-token sequences, H = 32, K = V = 128, initial and final state, as
bench.serving times it), for Nsight Compute to compare with kda_jax's
(bench.profile_once --decode N).
"""

import sys


def main():
    import torch
    from fla.ops.kda import chunk_kda
    from torch.profiler import ProfilerActivity, profile

    from bench.inputs import make

    if sys.argv[1:2] == ["--decode"]:
        from fla.ops.kda import fused_recurrent_kda

        n = int(sys.argv[2])
        arrays = make(1, n, 32, 128, 128, 1)
        q, k, v = (torch.tensor(a, device="cuda", dtype=torch.bfloat16).reshape(n, 1, 32, 128)
                   for a in arrays[:3])
        g, beta = (torch.tensor(a, device="cuda").reshape((n, 1) + a.shape[2:])
                   for a in arrays[3:])
        h0 = torch.zeros((n, 32, 128, 128), device="cuda")
        for _ in range(3):
            fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        torch.cuda.synchronize()
        return
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
