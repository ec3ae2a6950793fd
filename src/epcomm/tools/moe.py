"""A reference expert-parallel MoE layer: router → dispatch → per-expert MLP → combine.

Used by ``epcomm demo`` and the tests as the job users actually run. Every rank builds the same
weights from a seed and owns experts ``[rank * E_local, (rank + 1) * E_local)``; the dense,
single-process forward (:meth:`MoEWeights.dense_forward`) is the oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import fp8
from ..nn import expert_mlp, route


@dataclass
class MoEWeights:
    router: torch.Tensor  # [H, E] float32
    w_in: torch.Tensor  # [E, H, F] bf16
    w_out: torch.Tensor  # [E, F, H] bf16
    num_topk: int

    @staticmethod
    def create(hidden: int, num_experts: int, ffn: int, num_topk: int, seed: int = 0,
               device: torch.device = torch.device("cpu")) -> "MoEWeights":
        g = torch.Generator().manual_seed(seed)
        router = torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5
        w_in = (torch.randn(num_experts, hidden, ffn, generator=g) / hidden ** 0.5).to(torch.bfloat16)
        w_out = (torch.randn(num_experts, ffn, hidden, generator=g) / ffn ** 0.5).to(torch.bfloat16)
        return MoEWeights(router.to(device), w_in.to(device), w_out.to(device), num_topk)

    @property
    def num_experts(self) -> int:
        return self.router.shape[1]

    def route(self, x: torch.Tensor):
        """``(topk_idx [T, K] int64, topk_weights [T, K] float32)``: softmax over the top-k logits."""
        return route(x, self.router, self.num_topk)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s MLP on ``rows [N, H]``, computed in float32."""
        return expert_mlp(rows, self.w_in[e], self.w_out[e])

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer in one process, float32 throughout; bf16 ``[T, H]`` result."""
        topk_idx, topk_weights = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in topk_idx.unique().tolist():
            token, k = (topk_idx == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.expert(e, x[token]) * topk_weights[token, k].unsqueeze(1))
        return out.to(torch.bfloat16)


def ep_forward_normal(buffer, weights: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """Normal-mode EP forward on the expert-major layout: each local expert's rows arrive as one
    contiguous group (a grouped GEMM's input); combine applies the top-k weights at home."""
    topk_idx, topk_weights = weights.route(x)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, weights.num_experts)
    rows, _, _, group_sizes, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, expert_major=True)
    num_local = weights.num_experts // buffer.group_size
    y = torch.zeros(rows.shape, dtype=torch.bfloat16, device=x.device)
    start = 0
    for local, size in enumerate(group_sizes):
        if size:
            y[start:start + size] = weights.expert(buffer.rank * num_local + local, rows[start:start + size])
        start += size
    combined, _, _ = buffer.combine(y, handle)
    return combined


def ep_forward_low_latency(buffer, weights: MoEWeights, x: torch.Tensor, max_tokens: int, use_fp8: bool = True) -> torch.Tensor:
    """Low-latency EP forward: FP8 (or bf16) dispatch, experts on packed rows, weighted combine."""
    topk_idx, topk_weights = weights.route(x)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, weights.num_experts,
                                                                  use_fp8=use_fp8)
    num_local = weights.num_experts // buffer.group_size
    counts = recv_count.tolist()
    y = buffer.get_next_low_latency_combine_buffer(handle)
    for local in range(num_local):
        n = counts[local]
        if n:
            rows = fp8.per_token_cast_back(recv_x[0][local, :n], recv_x[1][local, :n], torch.float32) if use_fp8 \
                else recv_x[local, :n]
            y[local, :n] = weights.expert(buffer.rank * num_local + local, rows).to(torch.bfloat16)
    combined, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)
    return combined


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` in float64."""
    want64 = want.double()
    return float((got.double() - want64).norm() / want64.norm().clamp_min(1e-30))
