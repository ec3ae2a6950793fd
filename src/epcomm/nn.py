"""A trainable expert-parallel MoE layer on :mod:`epcomm.autograd`.

``MoE(buffer, hidden, ffn, num_experts, num_topk)``: router (replicated on every rank) → top-k
softmax weights → differentiable dispatch → this rank's experts, held as grouped weights
``w_in [E_local, H, F]`` and ``w_out [E_local, F, H]`` (SiLU MLP) → weighted per top-k entry →
differentiable combine. Gradients reach the input, the router (through the top-k weights) and the
expert weights; :meth:`MoE.dense_reference` is the same layer in one process, for tests.

Every rank builds the same full weights from ``seed`` and keeps its slice of experts
``[rank * E_local, (rank + 1) * E_local)``. Replicated parameters (the router) receive only the
local gradient; all-reduce them as for any data-parallel parameter.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from . import autograd


def _full_weights(hidden: int, ffn: int, num_experts: int, seed: int) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5
    w_in = torch.randn(num_experts, hidden, ffn, generator=g) / hidden ** 0.5
    w_out = torch.randn(num_experts, ffn, hidden, generator=g) / ffn ** 0.5
    return router, w_in, w_out


def route(x: torch.Tensor, router: torch.Tensor, num_topk: int):
    """``(topk_idx [T, K] int64, topk_weights [T, K] float32)``: softmax over the top-k logits."""
    values, topk_idx = (x.float() @ router).topk(num_topk, dim=-1)
    return topk_idx, torch.softmax(values, dim=-1)


def expert_mlp(rows: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One expert: ``silu(rows @ w_in) @ w_out`` in float32."""
    return F.silu(rows.float() @ w_in.float()) @ w_out.float()


class MoE(torch.nn.Module):
    """Router → dispatch → this rank's experts → combine, differentiable end to end.

    Args:
        buffer: an :class:`epcomm.Buffer` over the expert-parallel group (normal mode).
        hidden, ffn: model and expert MLP widths; num_experts: E (a multiple of the group size);
        num_topk: experts per token; seed: builds identical weights on every rank.

    ``forward(x)``: bf16 ``[T, H]`` → bf16 ``[T, H]``. Collective (forward and backward).
    """

    def __init__(self, buffer, hidden: int, ffn: int, num_experts: int, num_topk: int, seed: int = 0):
        super().__init__()
        self.buffer = buffer
        self.num_experts, self.num_topk = num_experts, num_topk
        self.num_local = num_experts // buffer.group_size
        first = buffer.rank * self.num_local
        router, w_in, w_out = _full_weights(hidden, ffn, num_experts, seed)
        device = buffer.device
        self.router = torch.nn.Parameter(router.to(device))
        self.w_in = torch.nn.Parameter(w_in[first:first + self.num_local].to(device).contiguous())
        self.w_out = torch.nn.Parameter(w_out[first:first + self.num_local].to(device).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weights = route(x, self.router, self.num_topk)
        recv_x, recv_topk_idx, recv_topk_weights, handle = autograd.dispatch(self.buffer, x, topk_idx, topk_weights,
                                                                             self.num_experts)
        y = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for local in range(self.num_local):
            row, k = (recv_topk_idx == local).nonzero(as_tuple=True)
            if row.numel():
                out = expert_mlp(recv_x[row], self.w_in[local], self.w_out[local])
                y = y.index_add(0, row, out * recv_topk_weights[row, k].unsqueeze(1))
        return autograd.combine(self.buffer, y.to(torch.bfloat16), handle)

    @staticmethod
    def dense_reference(x: torch.Tensor, hidden: int, ffn: int, num_experts: int, num_topk: int, seed: int = 0):
        """The same layer in one process, float32, with all experts: ``(out [T, H], (router, w_in,
        w_out))``, the weights as leaf tensors that require gradients."""
        router, w_in, w_out = (w.requires_grad_(True) for w in _full_weights(hidden, ffn, num_experts, seed))
        topk_idx, topk_weights = route(x, router, num_topk)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(num_experts):
            token, k = (topk_idx == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert_mlp(x[token], w_in[e], w_out[e]) * topk_weights[token, k].unsqueeze(1))
        return out, (router, w_in, w_out)
