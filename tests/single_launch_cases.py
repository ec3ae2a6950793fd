"""The one-node full dispatch's single launch of its count exchange and stage
(ep_dispatch_notify_stage), against the torch_dist reference, on every rank of a GPU WorkerPool
(tests/test_gpu.py, one rank per GPU: at 8 GPUs the R = 8 form users run) and of the shared-GPU
bed (tests/test_shared_gpu.py), where its grid caps would keep 8 ranks off it unless the bound
is raised."""
from __future__ import annotations

import torch

from epcomm.testing.sweeps import _buffers_on_gpu, assert_same_handle, make_routing, world


def gpu_single_launch_small_batches(waiting_programs_per_sm: int = 0, num_tokens: int = 16, hidden: int = 512,
                                    steps: int = 4) -> int:
    """``steps`` full dispatches of ``num_tokens`` tokens, each of another routing, and their
    combines, through ep_dispatch_notify_stage: the received rows, top-k ids and weights, the
    per-expert counts, the handle (rank_prefix_matrix: the launch's [R_P2, R_P2] prefix) and the
    combined rows equal the reference's. ``waiting_programs_per_sm`` > 0 raises NormalMode's
    bound on the launch's waiting programs (WAITING_PROGRAMS_PER_SM): 8 ranks sharing one GPU
    (num_sms 4 each: 8 notify + 8 list + 1 copy program = 17 > 16) then take it too, the one
    place on one GPU where its prefix runs at R_P2 = 8 with its 16 warps. Checks the launch was
    taken; returns ``steps``."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, k = 8 * R, min(8, 8 * R)
    fast, reference = _buffers_on_gpu(1 << 26)
    mode = fast._backend.normal
    if waiting_programs_per_sm:
        mode.waiting_programs_per_sm = waiting_programs_per_sm
    for step in range(steps):
        xs, topks, ws = make_routing(40 + step, "uniform", R, num_experts, k, num_tokens, hidden,
                                     fixed_tokens=num_tokens)
        x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
        results = []
        for buffer in (fast, reference):
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
            got = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w)
            results.append((got, buffer.combine(got[0], got[4], topk_weights=got[2])[0]))
        (got, combined), (want, want_combined) = results
        what = f"step {step}, rank {rank} of {R}"
        assert got[3] == want[3], f"{what}: counts per expert {got[3]} != {want[3]}"
        assert torch.equal(got[0], want[0]), f"{what}: recv_x"
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"{what}: top-k"
        assert_same_handle(got[4], want[4], what)
        torch.testing.assert_close(combined, want_combined, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")
    plans = [plan for plan in mode._dispatch_plans.values() if plan.notify_stage or plan.stage_lists]
    assert plans and all(plan.notify_stage and not plan.stage_lists for plan in plans), \
        f"rank {rank} of {R}: the count exchange went apart from the stage"
    fast.destroy()
    return steps
