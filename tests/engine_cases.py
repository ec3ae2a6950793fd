"""Rank bodies that drive ``import deep_ep`` the way engines do (tests/test_engines.py).

Each follows one engine's documented call sequence, written here from their public descriptions:
vLLM's high-throughput and low-latency prepare/finalize, SGLang's normal and low-latency
dispatchers on one buffer, Megatron-Core's fused dispatch/combine autograd functions. The group is
what the engine passes (vLLM: a gloo group, also on GPU ranks). Tensors live where DeepEP puts its
buffer: the current CUDA device when there is one, else the CPU (CI). Results are compared on the
CPU with the single-process reference.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

import epcomm
from epcomm import fp8
from epcomm.errors import EPInputError
from epcomm.testing import reference_combine, reference_dispatch, reference_low_latency_combine, \
    reference_low_latency_dispatch
from epcomm.testing.sweeps import (_ll_rows, _to_cpu, cuda_graph_replays, expert_fn, make_routing, rank_fn,
                                    routing_loader, world)


def _deep_ep():
    """``import deep_ep`` as the engines do, checking that it is epcomm's package."""
    assert importlib.util.find_spec("deep_ep") is not None  # vLLM's "is DeepEP installed" test
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap  # noqa: F401  (Megatron-Core / torchtitan)
    assert "epcomm" in deep_ep.__version__, deep_ep.__version__
    return deep_ep


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _close(got, want, what, tol=2e-2):
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------- vLLM
def vllm_high_throughput(hidden: int = 256):
    """vLLM's DeepEP high-throughput prepare/finalize on its CPU (gloo) group: a Buffer with 1 GiB of
    NVLink bytes, configs from ``get_dispatch_config``/``get_combine_config``, layout + dispatch with
    ``expert_alignment`` and ``num_worst_tokens``, BF16 and FP8 inputs, a handle kept per batch shape
    and reused by a cached dispatch, combine, explicit destroy."""
    deep_ep = _deep_ep()
    R, rank = world()
    dev = _device()
    cpu_group = dist.new_group(list(range(R)), backend="gloo")
    buffer = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=1 << 30, num_rdma_bytes=0, low_latency_mode=False,
                            num_qps_per_rank=1, explicitly_destroy=True)
    assert buffer.device == dev and buffer.group is cpu_group
    # vLLM sets the process-wide SM count; the case gives the caller's back when it ends, so a
    # later case in the same process runs with its own (in the one-GPU bed, 20 programs per rank
    # at 16 ranks starved the next case's kernels: docs/notes/multinode-log.md, finding 11)
    caller_num_sms = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(20)
    try:
        return _vllm_high_throughput_steps(deep_ep, buffer, cpu_group, R, rank, dev, hidden)
    finally:
        deep_ep.Buffer.set_num_sms(caller_num_sms)


def _vllm_high_throughput_steps(deep_ep, buffer, cpu_group, R, rank, dev, hidden):
    dispatch_config, combine_config = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
    num_experts, alignment = 4 * R, 16
    handles = {}
    for step, (num_tokens, use_fp8) in enumerate(((12, False), (7, True), (12, True))):
        xs, topks, weights = make_routing(300 + step, "uniform", R, num_experts, 3, num_tokens, hidden,
                                          fixed_tokens=num_tokens)
        x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            topk, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False)
        worst = R * num_tokens if step else 0  # vLLM passes num_worst_tokens where it needs fixed shapes
        payload = fp8.per_token_cast_to_fp8(x) if use_fp8 else x
        recv_x, recv_topk, recv_w, per_expert_list, handle, event = buffer.dispatch(
            payload, topk_idx=topk, topk_weights=w, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=alignment,
            num_worst_tokens=worst, config=dispatch_config, previous_event=None, async_finish=False,
            allocate_on_comm_stream=False)
        # every rank's payload cast where the senders cast it (this device), so the bits compare
        sent = [_to_cpu(fp8.per_token_cast_to_fp8(x.to(dev))) for x in xs] if use_fp8 else xs
        want = reference_dispatch(sent, topks, weights, num_experts, alignment)[rank]
        plain = reference_dispatch(xs, topks, weights, num_experts, alignment)[rank]["recv_x"]
        received = plain.shape[0]
        if use_fp8:
            assert torch.equal(recv_x[0].cpu()[:received].view(torch.uint8), want["recv_x"][0].view(torch.uint8))
            assert torch.equal(recv_x[1].cpu()[:received], want["recv_x"][1])
            rows = fp8.per_token_cast_back(*_to_cpu(recv_x), torch.bfloat16)
        else:
            rows = recv_x.cpu()
            assert torch.equal(rows[:received], plain)
        assert torch.equal(recv_topk.cpu()[:received], want["recv_topk_idx"])
        if worst:
            assert rows.shape[0] == worst and per_expert_list == [], "num_worst_tokens pads the rows, no count list"
        else:
            assert per_expert_list == want["num_recv_tokens_per_expert_list"]
        handles[(num_tokens, use_fp8)] = handle
        expert_out = rank_fn(rank, rows.to(dev))
        combined, _, event = buffer.combine(expert_out, handle, topk_weights=None, config=combine_config,
                                            previous_event=None, async_finish=False, allocate_on_comm_stream=False)
        home = fp8.per_token_cast_back(*sent[rank], torch.bfloat16) if use_fp8 else xs[rank]  # as the experts saw it
        _close(combined, reference_combine(home, topks[rank], num_experts, R, rank_fn), f"combine step {step}")
        # the handle kept for this shape serves a cached dispatch of new activations
        again, *_ = buffer.dispatch(x * 2, handle=handle, config=dispatch_config)
        assert torch.equal(again.cpu()[:received], plain * 2)
    buffer.destroy()
    dist.destroy_process_group(cpu_group)
    return len(handles)


def vllm_low_latency(hidden: int = 512, num_max_tokens: int = 8):
    """vLLM's low-latency prepare/finalize: a Buffer sized by the hint with one QP per local expert
    and ``enable_shrink``; FP8 dispatch with ``round_scale``/``use_ue8m0`` and the receive hook;
    combine with ``zero_copy=False``, the hook and ``out=``; the mask calls,
    ``get_local_buffer_tensor``; NVFP4 with a bad global scale refused by name on every rank, then NVFP4."""
    deep_ep = _deep_ep()
    R, rank = world()
    dev = _device()
    cpu_group = dist.new_group(list(range(R)), backend="gloo")
    num_experts = 2 * R
    M = num_max_tokens
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
    buffer = deep_ep.Buffer(cpu_group, num_nvl_bytes=0, num_rdma_bytes=size, low_latency_mode=True,
                            num_qps_per_rank=num_experts // R, allow_nvlink_for_low_latency_mode=True,
                            allow_mnnvl=False, enable_shrink=True, explicitly_destroy=True)
    mask = torch.ones(R, dtype=torch.int32, device=dev)
    buffer.low_latency_query_mask_buffer(mask)
    assert mask.sum().item() == 0
    raw = buffer.get_local_buffer_tensor(torch.int32, None, 0, True)
    assert raw.dtype == torch.int32 and raw.device == dev and raw.numel() > 0
    for step, (use_fp8, round_scale) in enumerate(((True, True), (True, False), (False, False))):
        use_ue8m0 = round_scale
        xs, topks, weights = make_routing(400 + step, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M - step)
        x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            x, topk, M, num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            async_finish=False, return_recv_hook=True)
        hook()
        want = reference_low_latency_dispatch(xs, topks, num_experts, use_fp8, round_scale)[rank]
        cpu_handle = handle._replace(recv_src_info=handle.recv_src_info.cpu(),
                                     recv_layout_range=handle.recv_layout_range.cpu())
        expert_out = torch.zeros(num_experts // R, R * M, hidden, dtype=torch.bfloat16)
        for e in range(num_experts // R):
            rows, _, _ = _ll_rows(_to_cpu(recv_x), recv_count.cpu(), cpu_handle, e, use_fp8)
            assert rows.shape[0] == want[e]["rows"].shape[0], f"step {step} expert {e}: count"
            expert_out[e, :rows.shape[0]] = expert_fn(torch.full((rows.shape[0],), rank * (num_experts // R) + e),
                                                      rows).to(torch.bfloat16)
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
        combined, _, hook = buffer.low_latency_combine(expert_out.to(dev), topk, w, handle, zero_copy=False,
                                                       async_finish=False, return_recv_hook=True, out=out)
        hook()
        assert combined.data_ptr() == out.data_ptr()
        _close(out, reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8,
                                                  round_scale), f"low-latency round trip {step}")
    # NVFP4 dispatch with a global scale that is not one float32 value: refused by name on every rank
    # (each rank checks its own), and the Buffer stays usable; then NVFP4 as vLLM passes it
    xs, topks, _ = make_routing(499, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    try:
        buffer.low_latency_dispatch(xs[rank].to(dev), topks[rank].to(dev), M, num_experts, use_fp8=False,
                                    use_nvfp4=True, x_global_scale=torch.ones((), dtype=torch.float64, device=dev))
        raise AssertionError("a float64 x_global_scale was not refused")
    except EPInputError as err:
        assert err.argument == "x_global_scale", err
    recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
        xs[rank].to(dev), topks[rank].to(dev), M, num_experts, use_fp8=False, use_nvfp4=True,
        x_global_scale=torch.ones(1, device=dev), return_recv_hook=True)
    hook()
    assert recv_x[0].dtype == torch.uint8 and recv_x[0].shape == (R * M, hidden // 2, num_experts // R)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(xs[rank].to(dev), topks[rank].to(dev), M,
                                                                   num_experts, use_fp8=False)
    want = reference_low_latency_dispatch(xs, topks, num_experts, False)[rank]
    assert [int(c) for c in recv_count.cpu()] == [entry["rows"].shape[0] for entry in want]
    buffer.low_latency_clean_mask_buffer()
    buffer.clean_low_latency_buffer(M, hidden, num_experts)
    buffer.destroy()
    dist.destroy_process_group(cpu_group)
    return True


# -------------------------------------------------------------------------------------------- SGLang
def sglang_dispatchers(hidden: int = 512):
    """SGLang's two DeepEP dispatchers on one Buffer (``from deep_ep import Buffer, Config``): sized
    from the configs' NVLink hints and the low-latency hint, ``allow_mnnvl=True``; a normal dispatch
    with ``expert_alignment=128`` and combine, then (after ``clean_low_latency_buffer``) a
    low-latency round trip, then normal mode again."""
    _deep_ep()
    from deep_ep import Buffer, Config
    R, rank = world()
    dev = _device()
    group = dist.group.WORLD
    num_experts, M = 2 * R, 16
    hidden_bytes = hidden * 2
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, R)
                        for config in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)))
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_experts // R,
                    allow_mnnvl=True)
    assert isinstance(Buffer.get_dispatch_config(R), Config)
    for step in range(2):
        xs, topks, weights = make_routing(500 + step, "skewed", R, num_experts, 2, M, hidden)
        x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        recv_x, recv_topk, recv_w, per_expert_list, handle, _ = buffer.dispatch(
            x, topk_idx=topk, topk_weights=w, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=128)
        want = reference_dispatch(xs, topks, weights, num_experts, 128)[rank]
        assert torch.equal(recv_x.cpu(), want["recv_x"]) and per_expert_list == want["num_recv_tokens_per_expert_list"]
        assert all(count % 128 == 0 for count in per_expert_list)
        combined, _, _ = buffer.combine(rank_fn(rank, recv_x), handle)
        _close(combined, reference_combine(xs[rank], topks[rank], num_experts, R, rank_fn), "normal combine")
        buffer.clean_low_latency_buffer(M, hidden, num_experts)  # normal mode wrote over the shared bytes
        xs, topks, weights = make_routing(550 + step, "uniform", R, num_experts, 2, M, hidden)
        recv_x, recv_count, ll_handle, _, hook = buffer.low_latency_dispatch(
            xs[rank].to(dev), topks[rank].to(dev), M, num_experts, use_fp8=False, return_recv_hook=False)
        expert_out = recv_x * 2  # every expert doubles its rows
        combined, _, _ = buffer.low_latency_combine(expert_out, topks[rank].to(dev), weights[rank].to(dev), ll_handle)
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], lambda e, rows: rows * 2, False)
        _close(combined, want, "low-latency combine")
    return True


# ------------------------------------------------------------------------------------- Megatron-Core
def megatron_fused(hidden: int = 128, async_finish: bool = False):
    """Megatron-Core's fused all-to-all: a dispatch autograd function (layout + dispatch forward,
    combine with the probs' gradient as ``topk_weights`` backward, using the combined weights it
    returns) and a combine one (combine forward, cached dispatch backward), with
    ``previous_event=EventOverlap(EventHandle())``, ``async_finish`` and ``allocate_on_comm_stream``.
    Output and the gradients of input and probs match the same layer computed densely."""
    _deep_ep()
    from deep_ep import Buffer
    from deep_ep.utils import EventHandle, EventOverlap
    R, rank = world()
    dev = _device()
    group = dist.group.WORLD
    config = Buffer.get_dispatch_config(R)
    buffer = Buffer(group, config.get_nvl_buffer_size_hint(hidden * 2, R), config.get_rdma_buffer_size_hint(hidden * 2, R))
    assert buffer.group is group and buffer.num_nvl_bytes >= 0 and buffer.num_rdma_bytes >= 0

    def previous():
        return EventOverlap(EventHandle()) if async_finish else None

    class FusedDispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, topk_idx, probs, num_experts):
            per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
                topk_idx, num_experts, previous_event=previous(), async_finish=async_finish,
                allocate_on_comm_stream=async_finish)
            recv_x, recv_idx, recv_probs, per_expert_list, handle, after = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=probs, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                previous_event=event, async_finish=async_finish, allocate_on_comm_stream=async_finish)
            if async_finish:
                after.current_stream_wait()
            ctx.handle = handle
            return recv_x, recv_idx, recv_probs, torch.tensor(per_expert_list), handle

        @staticmethod
        def backward(ctx, grad_recv_x, _grad_idx, grad_recv_probs, _grad_counts, _grad_handle):
            grad_x, grad_probs, after = buffer.combine(
                grad_recv_x.contiguous(), ctx.handle, topk_weights=grad_recv_probs.float(),
                previous_event=previous(), async_finish=async_finish, allocate_on_comm_stream=async_finish)
            if async_finish:
                after.current_stream_wait()
            return grad_x, None, grad_probs, None

    class FusedCombine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, handle):
            combined, _, after = buffer.combine(y, handle=handle, previous_event=previous(), async_finish=async_finish,
                                                allocate_on_comm_stream=async_finish)
            if async_finish:
                after.current_stream_wait()
            ctx.handle = handle
            return combined

        @staticmethod
        def backward(ctx, grad_combined):
            grad_y, _, _, _, _, after = buffer.dispatch(grad_combined.contiguous(), handle=ctx.handle,
                                                       previous_event=previous(), async_finish=async_finish,
                                                       allocate_on_comm_stream=async_finish)
            if async_finish:
                after.current_stream_wait()
            return grad_y, None

    num_experts = 2 * R
    num_local = num_experts // R
    scale = torch.arange(1, num_experts + 1, dtype=torch.float32) / 8  # expert e multiplies by (e + 1) / 8
    xs, topks, weights = make_routing(600, "uniform", R, num_experts, 2, 10, hidden, fixed_tokens=10)
    x = xs[rank].to(dev).clone().requires_grad_(True)
    probs = weights[rank].to(dev).clone().requires_grad_(True)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(610 + rank)).to(torch.bfloat16)
    recv_x, recv_idx, recv_probs, _, handle = FusedDispatch.apply(x, topks[rank].to(dev), probs, num_experts)
    local_scale = torch.where(recv_idx >= 0, scale.to(dev)[(recv_idx + rank * num_local).clamp_min(0)],
                              torch.zeros((), device=dev))
    y = ((recv_probs * local_scale).sum(1, keepdim=True) * recv_x.float()).to(torch.bfloat16)
    combined = FusedCombine.apply(y, handle)
    (combined.float() * grad_out.to(dev).float()).sum().backward()
    # the same layer in one process, float64
    x64 = xs[rank].double().requires_grad_(True)
    p64 = weights[rank].double().requires_grad_(True)
    per_token = torch.where(topks[rank] >= 0, scale.double()[topks[rank].clamp_min(0)], torch.zeros((), dtype=torch.float64))
    dense = (p64 * per_token).sum(1, keepdim=True) * x64
    (dense * grad_out.double()).sum().backward()
    _close(combined, dense.detach(), "forward")
    _close(x.grad, x64.grad, "input gradient")
    _close(probs.grad, p64.grad, "probs gradient")
    return True


def device_cuda_without_cuda():
    """On a machine without CUDA, ``device="cuda"`` is an EPInputError naming ``device``; the
    deep_ep Buffer there is the CPU reference; a torch_dist Buffer hands out spare bytes."""
    deep_ep = _deep_ep()
    if torch.cuda.is_available():
        return True
    try:
        epcomm.Buffer(dist.group.WORLD, device="cuda")
        raise AssertionError("device='cuda' was accepted without CUDA")
    except EPInputError as err:
        assert err.argument == "device", err
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=256)
    assert buffer.backend_name == "torch_dist" and buffer.device.type == "cpu"
    view = buffer.get_local_buffer_tensor(torch.int32, torch.Size([8, 8]))
    assert view.shape == (8, 8) and buffer.get_local_buffer_tensor(torch.int32).data_ptr() == view.data_ptr()
    return True


def vllm_low_latency_graph(replays: int = 3, hidden: int = 2048, num_max_tokens: int = 32):
    """vLLM's decode step under a CUDA graph, on its gloo group: low-latency dispatch (FP8, power-of-
    two scales, ``return_recv_hook``) → hook → experts → combine (``return_recv_hook``, ``out=``) →
    hook, captured once; each replay on new inputs (copied into the captured tensors) matches the
    reference. GPU only (returns True without CUDA)."""
    if not torch.cuda.is_available():
        return True
    deep_ep = _deep_ep()
    R, rank = world()
    dev = _device()
    cpu_group = dist.new_group(list(range(R)), backend="gloo")
    num_experts, M, K = 4 * R, num_max_tokens, 4
    buffer = deep_ep.Buffer(cpu_group, num_nvl_bytes=0,
                            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts),
                            low_latency_mode=True, num_qps_per_rank=num_experts // R,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True)
    x = torch.zeros(M, hidden, dtype=torch.bfloat16, device=dev)
    topk = torch.zeros(M, K, dtype=torch.int64, device=dev)
    weights = torch.zeros(M, K, dtype=torch.float32, device=dev)
    out = torch.empty(M, hidden, dtype=torch.bfloat16, device=dev)
    scale = ((rank * (num_experts // R) + torch.arange(num_experts // R, device=dev)).float() + 1) / 8

    def step():
        recv, _, handle, _, hook = buffer.low_latency_dispatch(x, topk, M, num_experts, use_fp8=True, round_scale=True,
                                                               use_ue8m0=False, async_finish=False, return_recv_hook=True)
        hook()
        expert_out = (fp8.per_token_cast_back(recv[0], recv[1], torch.float32) * scale[:, None, None]).to(torch.bfloat16)
        _, _, hook = buffer.low_latency_combine(expert_out, topk, weights, handle, zero_copy=False, async_finish=False,
                                                return_recv_hook=True, out=out)
        hook()

    load = routing_loader((x, topk, weights), num_experts, K, M, hidden)
    seeds = [0] + [900 + replay for replay in range(replays)]
    for replay, ((xs, topks, ws), _) in enumerate(cuda_graph_replays(step, load, seeds, cpu_group)):
        want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, True, True)
        _close(out, want, f"graph replay {replay}")
    buffer.destroy()
    dist.destroy_process_group(cpu_group)
    return True


# ---------------------------------------------------------------------- the drop-in and backend choice
def deep_ep_dropin(hidden: int = 512):
    """What vLLM and SGLang call on deep_ep.Buffer, run unchanged on epcomm.compat.deep_ep."""
    import epcomm.compat.deep_ep as deep_ep
    dev = _device()
    if dev.type == "cuda":  # (this case's tensors are the CPU's; the GPU suite runs the engine cases above)
        return True
    R, rank = world()
    # DeepEP V1's whole constructor: positionally, and keyword for keyword
    positional = deep_ep.Buffer(dist.group.WORLD, 0, 0, False, 24, True, False, False, False, False)
    assert not positional.use_fabric and not positional.enable_shrink
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(8, hidden, R, 4 * R)
    ll = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=0, num_rdma_bytes=size, low_latency_mode=True,
                        num_qps_per_rank=4, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                        use_fabric=True, explicitly_destroy=True, enable_shrink=True)
    assert (ll.rank, ll.group_size, ll.num_nvl_bytes, ll.num_rdma_bytes, ll.low_latency_mode) == \
        (rank, R, 0, size, True)
    assert isinstance(deep_ep.Buffer.num_sms, int) and deep_ep.topk_idx_t == torch.int64
    # configs as vLLM asks for them, and SGLang's Config(**json) + size hints
    for n in range(2, 161):
        assert deep_ep.Buffer.get_dispatch_config(n).num_sms > 0 and deep_ep.Buffer.get_combine_config(n).num_sms > 0
    config = deep_ep.Config(**{"num_sms": 24, "nvl_chunked_send_tokens": 8, "nvl_chunked_recv_tokens": 256,
                               "rdma_chunked_send_tokens": 6, "rdma_chunked_recv_tokens": 256})
    normal = deep_ep.Buffer(dist.group.WORLD, config.get_nvl_buffer_size_hint(hidden * 2, R),
                            config.get_rdma_buffer_size_hint(hidden * 2, R))
    # normal mode, vLLM's keywords
    num_experts = 4 * R
    xs, topks, weights = make_routing(77, "uniform", R, num_experts, 2, 12, hidden)
    event = normal.capture()
    per_rank, per_rdma, per_expert, in_rank, event = normal.get_dispatch_layout(
        topks[rank], num_experts, previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, counts, handle, event = normal.dispatch(
        xs[rank], topk_idx=topks[rank], topk_weights=weights[rank], num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        expert_alignment=128, config=config, previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    ref = reference_dispatch(xs, topks, weights, num_experts, 128)[rank]
    assert torch.equal(recv_x, ref["recv_x"]) and counts == ref["num_recv_tokens_per_expert_list"]
    combined, _, event = normal.combine(rank_fn(rank, recv_x), handle, config=config, previous_event=event,
                                        async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    torch.testing.assert_close(combined, reference_combine(xs[rank], topks[rank], num_experts, R, rank_fn),
                               rtol=1e-2, atol=1e-2)
    # low-latency mode, vLLM's keywords: hooks, FP8 with UE8M0 scales, zero-copy combine into out=
    M = 8
    xs, topks, weights = make_routing(78, "uniform", R, num_experts, 2, M, hidden, fixed_tokens=M)
    recv, count, ll_handle, _, hook = ll.low_latency_dispatch(xs[rank], topks[rank], M, num_experts, use_fp8=True,
                                                              round_scale=True, use_ue8m0=True, async_finish=False,
                                                              return_recv_hook=True)
    hook()
    want = reference_low_latency_dispatch(xs, topks, num_experts, True, True)[rank]
    assert [int(c) for c in count] == [w["rows"].shape[0] for w in want]
    buf = ll.get_next_low_latency_combine_buffer(ll_handle)
    buf.copy_(torch.ones_like(buf))  # every expert outputs ones
    out = torch.empty(M, hidden, dtype=torch.bfloat16)
    combined, _, hook = ll.low_latency_combine(torch.zeros_like(buf), topks[rank], weights[rank], ll_handle,
                                               zero_copy=True, return_recv_hook=True, out=out)
    hook()
    assert combined.data_ptr() == out.data_ptr()
    # every valid (token, k) contributes weight * 1.0
    torch.testing.assert_close(out.float(), weights[rank].sum(1, keepdim=True).expand(M, hidden), rtol=1e-2, atol=1e-2)
    ll.clean_low_latency_buffer(M, hidden, num_experts)
    ll.destroy()
    return True


def backend_argument():
    """backend= picks the backend; nvlink on a CPU group is an error (not a claim); the
    EPCOMM_BACKEND override wins over the argument."""
    import os
    assert epcomm.Buffer(dist.group.WORLD, backend="torch_dist").backend_name == "torch_dist"
    try:
        epcomm.Buffer(dist.group.WORLD, backend="nvlink")
        raise AssertionError("nvlink accepted on a gloo group")
    except epcomm.EPError as err:
        assert "nvlink needs CUDA" in str(err)
    try:
        epcomm.Buffer(dist.group.WORLD, backend="nvshmem", num_rdma_bytes=1 << 20)
        raise AssertionError("nvshmem accepted on a gloo group")
    except epcomm.EPError as err:
        assert "nvshmem needs CUDA" in str(err)
    for name in ("nvlink", "nvshmem"):
        os.environ["EPCOMM_BACKEND"] = name
        try:
            epcomm.Buffer(dist.group.WORLD, backend="torch_dist")
            raise AssertionError(f"EPCOMM_BACKEND={name} accepted on a gloo group")
        except epcomm.EPError as err:
            assert f"EPCOMM_BACKEND={name}" in str(err)
        finally:
            os.environ.pop("EPCOMM_BACKEND")
    # virtual nodes on torch_dist stay the reference's business; one node by default
    assert epcomm.Buffer(dist.group.WORLD).num_nodes == 1
    return True


def leaves_num_sms_as_found(case_name: str, caller_num_sms: int = 6):
    """Runs one case with the process-wide SM count at ``caller_num_sms`` and returns the count it
    left: a case that changes it (vLLM's sets 20) must give the caller's back, or every later case
    in the process runs with it."""
    epcomm.Buffer.set_num_sms(caller_num_sms)
    try:
        globals()[case_name]()
        return epcomm.Buffer.num_sms, epcomm.config.default_num_sms()
    finally:
        epcomm.Buffer.set_num_sms(20)
