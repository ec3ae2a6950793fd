"""Rank body of tests/test_engine_megatron.py: Megatron-Core's fused all-to-all
(megatron/core/transformer/moe/fused_a2a.py) as it calls DeepEP — ``get_hidden_bytes``,
``get_buffer`` sized by both configs' NVLink and RDMA hints and kept across calls,
``FusedDispatch`` / ``FusedCombine`` with ``EventOverlap(EventHandle())``, ``async_finish`` and
``allocate_on_comm_stream``, ``set_deepep_num_sms`` — through ``from deep_ep import Buffer``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine_cases import _close, _deep_ep, _device
from epcomm.testing.sweeps import make_routing, world

_buffer = None


def get_hidden_bytes(x: torch.Tensor) -> int:
    return x.size(1) * max(x.element_size(), 2)


def get_buffer(group, hidden_bytes: int):
    from deep_ep import Buffer
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def _previous(async_finish: bool):
    from deep_ep.utils import EventHandle, EventOverlap
    return EventOverlap(EventHandle()) if async_finish else None


class FusedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        buffer = get_buffer(group, get_hidden_bytes(x))
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         event) = buffer.get_dispatch_layout(token_indices, num_experts, previous_event=_previous(async_finish),
                                             async_finish=async_finish,
                                             allocate_on_comm_stream=allocate_on_comm_stream)
        (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
         after_event_overlap) = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event_overlap.current_stream_wait()
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
        grad_x, grad_token_probs, after_event = buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(),
            previous_event=_previous(ctx.async_finish), async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        buffer = get_buffer(group, get_hidden_bytes(x))
        combined_x, _, after_event = buffer.combine(x, handle=handle, async_finish=async_finish,
                                                    previous_event=_previous(async_finish),
                                                    allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        ctx.handle, ctx.group = handle, group
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
        grad_x, _, _, _, _, after_event = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                         previous_event=_previous(ctx.async_finish),
                                                         async_finish=ctx.async_finish,
                                                         allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, None, None, None


def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                   allocate_on_comm_stream=False):
    return FusedDispatch.apply(x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
                               allocate_on_comm_stream)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    return FusedCombine.apply(x, group, handle, async_finish, allocate_on_comm_stream)


def set_deepep_num_sms(num_sms):
    from deep_ep import Buffer
    Buffer.set_num_sms(num_sms)


def fused_layer(async_finish: bool, hidden: int = 128, steps: int = 2):
    """Two training steps of an MoE layer on the fused all-to-all (the Buffer made once and kept):
    output and the gradients of input and probs match the same layer computed densely in float64."""
    deep_ep = _deep_ep()
    global _buffer
    _buffer = None
    R, rank = world()
    dev = _device()
    group = dist.group.WORLD
    caller_num_sms = deep_ep.Buffer.num_sms
    set_deepep_num_sms(8)
    try:
        num_experts = 4 * R
        num_local = num_experts // R
        scale = torch.arange(1, num_experts + 1, dtype=torch.float32) / 8  # expert e multiplies by (e + 1) / 8
        made = None
        for step in range(steps):
            xs, topks, weights = make_routing(1000 + step, "holes", R, num_experts, 3, 10, hidden, fixed_tokens=10)
            x = xs[rank].to(dev).clone().requires_grad_(True)
            probs = weights[rank].to(dev).clone().requires_grad_(True)
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1100 + rank)).to(torch.bfloat16)
            recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_dispatch(
                x, topks[rank].to(dev), probs, num_experts, group, async_finish, async_finish)
            assert tokens_per_expert.sum().item() == int((recv_idx >= 0).sum())
            local_scale = torch.where(recv_idx >= 0, scale.to(dev)[(recv_idx + rank * num_local).clamp_min(0)],
                                      torch.zeros((), device=dev))
            y = ((recv_probs * local_scale).sum(1, keepdim=True) * recv_x.float()).to(torch.bfloat16)
            combined, _ = fused_combine(y, group, handle, async_finish, async_finish)
            (combined.float() * grad_out.to(dev).float()).sum().backward()
            made = _buffer if made is None else made
            assert _buffer is made, "get_buffer keeps its Buffer across calls of one size"
            x64 = xs[rank].double().requires_grad_(True)
            p64 = weights[rank].double().requires_grad_(True)
            per_token = torch.where(topks[rank] >= 0, scale.double()[topks[rank].clamp_min(0)],
                                    torch.zeros((), dtype=torch.float64))
            dense = (p64 * per_token).sum(1, keepdim=True) * x64
            (dense * grad_out.double()).sum().backward()
            _close(combined, dense.detach(), f"step {step} forward")
            _close(x.grad, x64.grad, f"step {step} input gradient")
            _close(probs.grad, p64.grad, f"step {step} probs gradient")
        return True
    finally:
        deep_ep.Buffer.set_num_sms(caller_num_sms)
        _buffer = None
