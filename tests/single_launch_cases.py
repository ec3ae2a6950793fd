"""The one-node full dispatch's single launch of its count exchange and stage
(ep_dispatch_notify_stage), and a num_worst_tokens dispatch's whole launch (ep_dispatch with
NOTIFY), against the torch_dist reference, on every rank of a GPU WorkerPool
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
    combined rows equal the reference's. Then the same batch with num_worst_tokens (R x
    num_tokens), in one launch with its count exchange: its first rows equal the reference's,
    its padding rows are marked (top-k -1), its count is the reference's rows, and its combine
    equals the reference's. ``waiting_programs_per_sm`` > 0 raises NormalMode's bound on the
    launches' waiting programs (WAITING_PROGRAMS_PER_SM): 8 ranks sharing one GPU (num_sms 4
    each: 8 notify + 8 list + 1 copy program = 17 > 16; with the num_worst_tokens pull, up to 21)
    then take them too, the one place on one GPU where their prefix runs at R_P2 = 8 with 16
    warps. Checks both launches were taken; returns ``steps``."""
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
        worst = fast.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w,
                              num_worst_tokens=R * num_tokens)
        rows = want[0].shape[0]
        what += ", num_worst_tokens"
        assert worst[0].shape[0] == R * num_tokens and worst[3] == [], f"{what}: padded rows, no counts"
        assert torch.equal(worst[0][:rows], want[0]) and torch.equal(worst[1][:rows], want[1]), f"{what}: rows"
        assert bool((worst[1][rows:] == -1).all()), f"{what}: padding rows' top-k"
        assert int(worst[4].num_recv_tokens) == rows, f"{what}: num_recv_tokens"
        assert torch.equal(worst[4].rank_prefix_matrix, want[4].rank_prefix_matrix), f"{what}: rank_prefix_matrix"
        combined = fast.combine(worst[0], worst[4], topk_weights=worst[2])[0]
        torch.testing.assert_close(combined, want_combined, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")
    plans = [plan for plan in mode._dispatch_plans.values() if plan.notify_stage or plan.stage_lists]
    assert plans and all(plan.notify_stage and not plan.stage_lists for plan in plans), \
        f"rank {rank} of {R}: the count exchange went apart from the stage"
    whole = [key for plan in plans if plan.overlapped_full is not None for key in plan.overlapped_full]
    assert whole and all(notify for *_, notify in whole), \
        f"rank {rank} of {R}: a num_worst_tokens dispatch's count exchange went apart: {whole}"
    fast.destroy()
    return steps
