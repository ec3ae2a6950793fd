"""Differentiable dispatch and combine (normal mode), for training.

    recv_x, recv_topk_idx, recv_topk_weights, handle = epcomm.autograd.dispatch(buffer, x, topk_idx,
                                                                                topk_weights, num_experts)
    ... experts: out[r] = Σ_k recv_topk_weights[r, k] · expert_k(recv_x[r])  (weights are yours to apply)
    combined = epcomm.autograd.combine(buffer, out, handle)

Backward passes are the mirror calls, as in DeepEP-based training code:

- dispatch's backward is a combine: each token's gradient is the sum of its received rows'
  gradients over the ranks it went to, and the gradient of ``topk_weights[t, k]`` comes back from
  the one rank that hosts expert k (the others hold weight 0 there and add nothing);
- combine's backward is a cached dispatch of the output gradient with the same handle (the
  gradient of a plain sum reaches every summand unchanged).

Shapes and dtypes: ``x`` bf16 ``[T, H]`` (FP8 inputs are not differentiable), ``topk_idx`` int64
``[T, K]``, ``topk_weights`` float32 ``[T, K]``; ``y`` bf16 ``[Trecv, H]`` in dispatch's row order.
Both calls are collective; backward is collective too, so every rank must run it (as for the
forward). Work runs on the current stream, like the synchronous forward calls.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .handle import DispatchHandle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, x, topk_idx, topk_weights, num_experts, handle_out):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        ctx.buffer, ctx.handle, ctx.hidden = buffer, handle, x.shape[1]
        ctx.mark_non_differentiable(recv_topk_idx)
        handle_out.append(handle)
        return recv_x, recv_topk_idx, recv_topk_weights

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_recv_topk_idx, grad_recv_topk_weights):
        handle = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_recv_rows, ctx.hidden, dtype=torch.bfloat16,
                                      device=handle.recv_src_idx.device)
        grad_x, grad_topk_weights, _ = ctx.buffer.combine(grad_recv_x.to(torch.bfloat16).contiguous(), handle,
                                                          topk_weights=None if grad_recv_topk_weights is None
                                                          else grad_recv_topk_weights.float().contiguous())
        return None, grad_x, None, grad_topk_weights, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, y, handle):
        ctx.buffer, ctx.handle = buffer, handle
        return buffer.combine(y, handle)[0]

    @staticmethod
    def backward(ctx, grad_out):
        grad_y = ctx.buffer.dispatch(grad_out.to(torch.bfloat16).contiguous(), handle=ctx.handle)[0]
        return None, grad_y, None


def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Layout + dispatch, differentiable in ``x`` and ``topk_weights``. Returns ``(recv_x,
    recv_topk_idx, recv_topk_weights, handle)`` as :meth:`epcomm.Buffer.dispatch` does."""
    handle_out = []
    recv_x, recv_topk_idx, recv_topk_weights = _Dispatch.apply(buffer, x, topk_idx, topk_weights, num_experts,
                                                               handle_out)
    return recv_x, recv_topk_idx, recv_topk_weights, handle_out[0]


def combine(buffer, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Plain-sum combine (as :meth:`epcomm.Buffer.combine`), differentiable in ``y``."""
    return _Combine.apply(buffer, y, handle)
