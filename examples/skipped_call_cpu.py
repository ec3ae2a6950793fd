"""A rank whose expert code raises skips a call its peers make: what every rank sees, on 4 CPU ranks.

A serving loop alternates a normal-mode round (dispatch, experts, combine) on one Buffer and a
low-latency round on a second Buffer of the same group. At step 0 rank 1's experts raise after the
dispatch, so rank 1 skips that combine. Every rank runs each step in ``try``, and drops a step that
raises ``epcomm.EPError`` (docs/ERRORS.md, the recovery rule). What the table shows: the errors name
``call`` (ranks in different calls) and come at once, not after the Buffer's timeout; no step
returns wrong data; the ranks pair again and the last steps are right everywhere.

Run: python examples/skipped_call_cpu.py   (no GPU needed; tests/test_readme_example.py runs it)
"""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epcomm

R, T, H, E, K = 4, 8, 128, 16, 2         # ranks, tokens per rank, hidden, experts (E % R == 0), top-k
TIMEOUT_S = 20.0                          # the Buffers' timeout: every error below comes long before it
STEPS = ["normal", "low-latency"] * 3


class ExpertFailure(RuntimeError):
    """Stands for an expert's own error: out of memory, a NaN check, a cancelled request."""


def rank_main(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=R)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)                 # bf16 [T, H]
    topk_idx = torch.rand(T, E, generator=g).topk(K).indices              # int64 [T, K]
    topk_weights = torch.rand(T, K, generator=g)                          # float32 [T, K]
    want = (x.float() * topk_weights.sum(dim=1, keepdim=True)).to(torch.bfloat16)

    normal = epcomm.Buffer(dist.group.WORLD, timeout=TIMEOUT_S)
    low_latency = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, timeout=TIMEOUT_S)

    def normal_round(fail: bool) -> torch.Tensor:
        per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, E)
        recv_x, _, recv_w, _, handle, _ = normal.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        if fail:
            raise ExpertFailure("an expert ran out of memory")               # the combine is skipped
        expert_out = (recv_x.float() * recv_w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
        return normal.combine(expert_out, handle)[0]

    def low_latency_round(fail: bool) -> torch.Tensor:
        recv_x, _, handle, _, _ = low_latency.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        # recv_x: bf16 [E / R, R * T, H]; the "experts" hand back their rows, the combine weights them
        return low_latency.low_latency_combine(recv_x, topk_idx, topk_weights, handle)[0]

    seen, first_error = [], None
    for step, kind in enumerate(STEPS):
        started = time.monotonic()
        try:
            combined = (normal_round if kind == "normal" else low_latency_round)(fail=step == 0 and rank == 1)
            assert torch.allclose(combined.float(), want.float(), rtol=2e-2, atol=2e-2), "wrong data"
            outcome = "ok"
        except ExpertFailure:
            outcome = "experts raised: combine skipped"
        except epcomm.EPError as err:                                         # drop the step, go on
            outcome = f"{type(err).__name__}({getattr(err, 'argument', '')}): step dropped"
            first_error = first_error or str(err)
            assert time.monotonic() - started < TIMEOUT_S / 2, "an error only after the timeout"
        seen.append(f"{kind:>11} {outcome} ({time.monotonic() - started:.1f} s)")
    assert all(line.split()[1] == "ok" for line in seen[-2:]), f"rank {rank} did not pair again: {seen}"

    lines = [None] * R
    dist.all_gather_object(lines, seen)
    if rank == 0:
        for step, kind in enumerate(STEPS):
            print(f"step {step}:")
            for peer in range(R):
                print(f"  rank {peer}: {lines[peer][step]}")
        print(f"rank 0's error: {first_error}")
        print("every rank ends paired with its peers; no step returned wrong data: OK")
    normal.destroy()
    low_latency.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(rank_main, args=(free_port,), nprocs=R)
