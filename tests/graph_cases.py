"""CUDA-graph cases that run on every rank of a GPU WorkerPool (tests/test_gpu.py, the shared-GPU
bed): low-latency round trips and a normal-mode num_worst_tokens step replayed from one graph
against the reference, and a full dispatch refused inside a capture."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm
from epcomm import fp8
from epcomm.testing import reference_low_latency_combine
from epcomm.testing.sweeps import _buffers_on_gpu, cuda_graph_replays, expert_fn, make_routing, routing_loader, world


def gpu_low_latency_graph(replays: int = 4, hidden: int = 2048, backend=None, ranks_per_node=None):
    """Dispatch + stand-in expert + combine captured in one CUDA graph; each replay on fresh inputs
    (copied into the captured tensors) matches the reference."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, M, K = 8 * R, 64, 4
    size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
    buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, backend=backend,
                           ranks_per_node=ranks_per_node)
    x = torch.zeros(M, hidden, dtype=torch.bfloat16, device=dev)
    topk = torch.zeros(M, K, dtype=torch.int64, device=dev)
    weights = torch.zeros(M, K, dtype=torch.float32, device=dev)

    def step():
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=True)
        rows = fp8.per_token_cast_back(recv[0], recv[1], torch.float32)
        scale = ((rank * (num_experts // R) + torch.arange(num_experts // R, device=dev)).float() + 1) / 8
        expert_out = (rows * scale[:, None, None]).to(torch.bfloat16)
        return buffer.low_latency_combine(expert_out, topk, weights, handle)[0]

    load = routing_loader((x, topk, weights), num_experts, K, M, hidden)
    seeds = [0] + [100 + replay for replay in range(replays)]
    for replay, ((xs, topks, ws), out) in enumerate(cuda_graph_replays(step, load, seeds)):
        want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=True)
        torch.testing.assert_close(out.cpu(), want, rtol=2e-2, atol=2e-2, msg=lambda m: f"replay {replay}: {m}")
    return replays


def gpu_normal_worst_graph(replays: int = 4, hidden: int = 2048, variant: str = "", num_tokens: int = 256):
    """A normal-mode step captured in one CUDA graph: two num_worst_tokens dispatches of different
    tokens and routings with no combine between them, a cached dispatch of the first's handle, a
    stand-in expert on the second's rows and its combine. ``replays`` replays on fresh inputs, each
    checked against the torch_dist reference run eagerly on the same inputs; then as many queued
    back to back (inputs staged on the device first, so nothing waits between them), the last
    checked. ``variant`` (bench.NORMAL_VARIANTS names, set on every rank) picks the one-node path:
    "serial-dispatch" is the dispatch in turn, whose count exchange and stage go in one launch
    (ep_dispatch_notify_stage) that must wait on device epochs only: a wait on the host's notify
    number would pass at once in a replay."""
    from epcomm.backends.gpu.normal.one_node.mode import NormalMode
    from epcomm.tools.bench import use_normal_variants
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, k = 8 * R, min(8, 8 * R)
    fast, reference = _buffers_on_gpu(1 << 28)
    assert isinstance(fast._backend.normal, NormalMode), fast.backend_name
    use_normal_variants(fast._backend.normal, [variant] if variant else [])
    inputs = [(torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device=dev),
               torch.zeros(num_tokens, k, dtype=torch.int64, device=dev),
               torch.zeros(num_tokens, k, dtype=torch.float32, device=dev)) for _ in range(2)]
    worst = R * num_tokens

    def dispatch(buffer, x, topk, weights):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
                               num_worst_tokens=worst)

    def step(buffer=fast):
        first, second = (dispatch(buffer, *tensors) for tensors in inputs)
        cached = buffer.dispatch(inputs[0][0], handle=first[4])
        expert_out = (second[0].float() * (rank + 1) * 0.5).to(torch.bfloat16)
        return first, second, cached, buffer.combine(expert_out, second[4], topk_weights=second[2])

    def staged(seed):  # both dispatches' inputs of a seed, on the device
        return [tuple(t[rank].to(dev) for t in make_routing(seed + 1000 * i, "uniform", R, num_experts, k, num_tokens,
                                                             hidden, fixed_tokens=num_tokens)) for i in range(2)]

    def load(seed, ready=None):
        for tensors, values in zip(inputs, (ready or {}).get(seed) or staged(seed)):
            for tensor, value in zip(tensors, values):
                tensor.copy_(value)  # (device to device: in stream order, nothing waits)

    def check(outputs, what):
        want = step(reference)
        for index in (0, 1):
            got, expected = outputs[index], want[index]
            n = int(expected[4].num_recv_tokens)
            assert int(got[4].num_recv_tokens) == n, what
            assert torch.equal(got[0][:n], expected[0][:n]), f"{what}: recv_x of dispatch {index}"
            assert torch.equal(got[1][:n], expected[1][:n]) and torch.equal(got[2][:n], expected[2][:n]), \
                f"{what}: top-k of dispatch {index}"
        n = int(want[0][4].num_recv_tokens)
        assert torch.equal(outputs[2][0][:n], want[0][0][:n]), f"{what}: the cached dispatch"
        torch.testing.assert_close(outputs[3][0], want[3][0], rtol=1e-2, atol=1e-2,
                                   msg=lambda m: f"{what}: combine {m}")

    what = variant or "defaults"
    if variant == "serial-dispatch":  # the launch the dispatch in turn took (one that does not fit goes apart)
        load(0)
        step()
        mode = fast._backend.normal
        full_plans = [plan for plan in mode._dispatch_plans.values() if plan.notify_stage or plan.stage_lists]
        single = any(plan.notify_stage for plan in full_plans)
        apart = any(plan.stage_lists for plan in full_plans)
        # The launch NormalMode's rule picks for this batch (its waiting programs within 4 x num_sms:
        # on one H200, 1 rank and 4 ranks sharing it fit; 8 sharing it do not).
        num_sms = fast._resolve_config(None, epcomm.Buffer.get_dispatch_config).num_sms
        rows = min(num_tokens, full_plans[0].round_tokens)
        stage_programs = max(1, min(num_sms * mode.stage_programs_per_sm, -(-rows // full_plans[0].block_r))) + R
        expected = mode.notify_stage_fits(stage_programs, num_sms)
        assert len(full_plans) == 1 and single != apart and single == expected, (what, single, apart, expected)
        what += " (one launch)" if single else " (notify apart: the shared GPU's grid caps)"
    seeds = [0] + [200 + replay for replay in range(replays)]
    for replay, (_, outputs) in enumerate(cuda_graph_replays(step, load, seeds)):
        check(outputs, f"replay {replay} ({what})")
    seeds = [0] + [300 + replay for replay in range(replays)]
    ready = {seed: staged(seed) for seed in seeds}
    for _, outputs in cuda_graph_replays(step, lambda seed: load(seed, ready), seeds, back_to_back=True):
        check(outputs, f"{replays} replays back to back ({what})")
    fast.destroy()
    return replays


def gpu_captured_calls_refused(ranks_per_node: int = 0, hidden: int = 512, num_tokens: int = 64):
    """Normal-mode calls that would wait on the host, made inside a CUDA graph capture, raise EPError
    at once, before anything else of the call runs (Backend.refuse_capture): on nvlink
    (``ranks_per_node`` 0) a full dispatch without num_worst_tokens, the message naming it; on
    nvshmem (virtual nodes of ``ranks_per_node`` ranks; host-side epochs) every dispatch and
    combine, num_worst_tokens or not. The Buffer then dispatches and combines eagerly as before,
    equal to the reference. Returns "raised"."""
    from epcomm.errors import EPError
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts, k = 8 * R, min(8, 8 * R)
    fast, reference = _buffers_on_gpu(1 << 26, ranks_per_node, num_tokens, hidden)
    xs, topks, ws = make_routing(5, "uniform", R, num_experts, k, num_tokens, hidden, fixed_tokens=num_tokens)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    layouts = {}

    def dispatch(buffer, **extra):
        if buffer not in layouts:  # (outside any capture)
            layouts[buffer] = buffer.get_dispatch_layout(topk, num_experts)
        per_rank, _, per_expert, in_rank, _ = layouts[buffer]
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, **extra)

    first = dispatch(fast)  # (compiled outside the capture; its handle for the combine below)
    torch.cuda.synchronize()
    refused = [("num_worst_tokens", lambda: dispatch(fast))]
    if ranks_per_node:
        refused = [("cannot be captured", call) for call in (
            lambda: dispatch(fast), lambda: dispatch(fast, num_worst_tokens=R * num_tokens),
            lambda: fast.combine(first[0], first[4]))]
    for text, call in refused:
        raised = None
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                call()
        except EPError as err:
            raised = err
        assert raised is not None and text in str(raised), raised
    got, want = dispatch(fast), dispatch(reference)
    combined, want_combined = fast.combine(got[0], got[4])[0], reference.combine(want[0], want[4])[0]
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and got[3] == want[3], "the eager dispatch after the refused captures"
    torch.testing.assert_close(combined, want_combined, rtol=1e-2, atol=1e-2)
    fast.destroy()
    return "raised"
