"""A normal-mode call whose wait gave up returns no plausible data (DESIGN section 5): the rows it
knows are missing are NaN, and the error comes at the next call. Bodies run on every rank of a
WorkerPool (tests/test_shared_gpu.py: the nvlink backend's one-node kernels, or the nvshmem
backend's two-level ones)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm


def missing_rows_are_nan(call: str, timeout_s: float = 3.0) -> str:
    """Every rank makes a full dispatch; then the last rank stops. The others make one more ``call``
    ("cached dispatch", "combine", or "num_worst_tokens dispatch": on one node its count exchange,
    stage and pull in one launch, where the count exchange's wait gives up first): its wait gives
    up after ``timeout_s``, every output row is NaN (padding rows too), and their next call raises
    EPTimeoutError naming the stopped rank. Returns "nan, then raised" (with " (one launch)" where
    the num_worst_tokens dispatch took its count exchange into ep_dispatch), or "absent"."""
    R, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26, timeout=timeout_s)
    how = ""
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(64, 256, device=device, generator=g).to(torch.bfloat16)
    topk = torch.randn(64, 8 * R, device=device, generator=g).topk(2, dim=-1).indices
    weights = torch.rand(64, 2, device=device, generator=g)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 8 * R)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk,
                                                 topk_weights=weights)
    torch.cuda.synchronize()
    absent = R - 1
    if rank == absent:
        return "absent"
    if call == "cached dispatch":
        out = buffer.dispatch(x, handle=handle)[0]
    elif call == "num_worst_tokens dispatch":
        out = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
                              num_worst_tokens=R * 64)[0]
        assert out.shape[0] == R * 64, out.shape
        plans = getattr(getattr(buffer._backend, "normal", None), "_dispatch_plans", {})
        if any(notify for plan in plans.values() if plan.overlapped_full is not None
               for *_, notify in plan.overlapped_full):
            how = " (one launch)"
    else:
        out = buffer.combine(recv_x, handle)[0]
    torch.cuda.synchronize()
    assert out.numel() and bool(torch.isnan(out.float()).all()), f"{call}: {int(torch.isnan(out.float()).sum())} " \
                                                                  f"of {out.numel()} values NaN"
    try:
        buffer.dispatch(x, handle=handle)
        torch.cuda.synchronize()
    except epcomm.EPTimeoutError as err:
        assert absent in err.peers, err.peers
        return "nan, then raised" + how
    return "no error"


def count_exchange_never_released(timeout_s: float = 1.0) -> str:
    """A num_worst_tokens dispatch in one launch with its count exchange (one_node/dispatch.py,
    ep_dispatch with NOTIFY) whose stage and pull programs never see NOTIFIED: every rank's
    notify arrival counter is set to -1, so the arrivals read -1 .. R - 2 and none is the last
    (sync.arrive: R - 1), and none releases it. The stage and pull programs wait 3 x
    ``timeout_s``, report this rank late, stage and pull nothing; the pull programs set the index
    outputs to -1 and the received count to 0, mark the call given up and arrive, so the verdict
    NaNs every row (padding included). The next call raises EPTimeoutError; a new Buffer then
    dispatches correctly. (The path a launch whose notify programs never ran would take.) Returns "nan,
    then raised, then a new Buffer works", or "apart" where the one launch is not taken."""
    from epcomm.backends.gpu import sync
    R, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(64, 256, device=device, generator=g).to(torch.bfloat16)
    topk = torch.randn(64, 8 * R, device=device, generator=g).topk(2, dim=-1).indices
    weights = torch.rand(64, 2, device=device, generator=g)

    def dispatch(buffer, worst=R * 64):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 8 * R)
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
                               num_worst_tokens=worst)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26, timeout=timeout_s)
    dispatch(buffer)  # (compiled and the epochs under way before the counter is set)
    torch.cuda.synchronize()
    plans = buffer._backend.normal._dispatch_plans
    if not any(notify for plan in plans.values() if plan.overlapped_full is not None
               for *_, notify in plan.overlapped_full):
        buffer.destroy()
        return "apart"
    buffer._backend.state[sync.ARRIVE_NOTIFY] = -1  # (on the stream, before the launch; the last arrival reset it)
    out, recv_topk, _, _, handle, _ = dispatch(buffer)
    torch.cuda.synchronize()
    assert out.shape[0] == R * 64 and bool(torch.isnan(out.float()).all()), \
        f"{int(torch.isnan(out.float()).sum())} of {out.numel()} values NaN"
    assert int(handle.num_recv_tokens) == 0 and bool((handle.recv_src_idx == -1).all()) and \
        bool((recv_topk == -1).all()), "the index outputs of a call that gave up: none received, all -1"
    try:
        dispatch(buffer)
        torch.cuda.synchronize()
        return "no error"
    except epcomm.EPTimeoutError:
        buffer.destroy()
    fresh = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26, timeout=30.0)
    want = dispatch(fresh, worst=0)
    got = dispatch(fresh)
    rows = want[0].shape[0]
    assert torch.equal(got[0][:rows], want[0]) and int(got[4].num_recv_tokens) == rows, "a new Buffer after it"
    fresh.destroy()
    return "nan, then raised, then a new Buffer works"
