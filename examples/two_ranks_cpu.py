"""epcomm on 2 CPU ranks (gloo): one MoE layer's dispatch and combine, checked against one process.

Run: python examples/two_ranks_cpu.py   (no GPU needed; tests/test_readme_example.py runs it)
"""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epcomm

R, T, H, E, K = 2, 6, 128, 4, 2          # ranks, tokens per rank, hidden, experts (E % R == 0), top-k


def rank_main(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=R)   # gloo: the CPU reference backend
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).contiguous()   # bf16 [T, H], contiguous
    topk_idx = torch.rand(T, E, generator=g).topk(K).indices              # int64 [T, K], -1 = none
    topk_weights = torch.rand(T, K, generator=g)                          # float32 [T, K]

    buffer = epcomm.Buffer(dist.group.WORLD)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    # the "experts": each received row, weighted by this rank's experts' weights (recv_idx >= 0 are local)
    expert_out = (recv_x.float() * recv_w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined, _, _ = buffer.combine(expert_out, handle)                   # bf16 [T, H], summed at home

    want = (x.float() * topk_weights.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.allclose(combined.float(), want.float(), rtol=2e-2, atol=2e-2), "combine differs"
    if rank == 0:
        print(f"rank 0: received {recv_x.shape[0]} rows, per local expert {counts}; combine matches: OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(rank_main, args=(free_port,), nprocs=R)
