"""The protocol every backend implements.

The public :class:`epcomm.Buffer` validates arguments, computes layouts and manages streams; a
backend only moves bytes. Every backend must produce exactly what the ``torch_dist`` reference
produces (bitwise for dispatch, within float32 reduction-order rounding for combine).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import Config
from ..handle import DispatchHandle, LowLatencyHandle
from ..types import Payload



@dataclass(slots=True)  # (built on every dispatch: Buffer passes the fields by position, which costs less)
class DispatchArgs:
    """A validated normal-mode dispatch. In cached mode ``handle`` is set and the routing fields are None."""

    x: Payload
    handle: Optional[DispatchHandle]
    num_tokens_per_rank: Optional[torch.Tensor]
    is_token_in_rank: Optional[torch.Tensor]
    num_tokens_per_expert: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    expert_alignment: int
    num_worst_tokens: int
    config: Config
    expert_major: bool = False  # rows grouped by local expert (expert_major.py), full or cached
    plan: object = None  # what the backend's check_dispatch worked out for this call (its own type)
    capturing: Optional[bool] = None  # whether the stream is being captured, where Backend.refuse_capture asked


@dataclass(slots=True)
class DispatchResult:
    recv_x: Payload
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[List[int]]
    handle: DispatchHandle


@dataclass(slots=True)  # (built on every call, as DispatchArgs)
class LowLatencyDispatchArgs:
    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    cumulative_local_expert_recv_stats: Optional[torch.Tensor]
    dispatch_wait_recv_cost_stats: Optional[torch.Tensor]
    return_recv_hook: bool
    rank_mask: torch.Tensor  # [R] int32, nonzero = rank is masked out
    plan: object = None  # what the backend's check worked out for this call (its own type)


@dataclass(slots=True)
class LowLatencyCombineArgs:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: LowLatencyHandle
    out: Optional[torch.Tensor]
    combine_wait_recv_cost_stats: Optional[torch.Tensor]
    return_recv_hook: bool
    rank_mask: torch.Tensor
    plan: object = None  # what the backend's check worked out for this call (its own type)


class Backend(abc.ABC):
    """Moves dispatch/combine payloads between the ranks of ``group``."""

    name: str = "?"
    agrees: bool = False  # True when agree() does something (Buffer skips building fingerprints otherwise)
    # True when dispatch/combine build the expert-major layout themselves (args.expert_major, the
    # handle's mapping); otherwise Buffer re-lays the plain rows with torch ops (expert_major.py).
    native_expert_major: bool = False
    # At most this many SMs (Config.num_sms) per normal-mode call, 0: no cap. The GPU backends set
    # it where ranks share a GPU (wiring.py, GpuBackend.share_gpu); Buffer applies it to every Config.
    max_num_sms: int = 0

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)

    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_node: int):
        """``(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank)``;
        ``num_tokens_per_rdma_rank`` (tokens per node) is None when all ranks form one node."""
        from ..layout import dispatch_layout
        return dispatch_layout(topk_idx, num_experts, self.num_ranks, ranks_per_node)

    def expand_expert_major(self, recv_x, mapping):
        """A plain dispatch's received rows (bf16 ``[N, H]`` or an FP8 pair) in the expert-major
        layout of ``mapping`` (:mod:`epcomm.expert_major`); Buffer calls it when the backend is not
        ``native_expert_major``. This default: torch ops."""
        from .. import expert_major
        return expert_major.expand(recv_x, mapping)

    def fold_expert_major(self, y: torch.Tensor, mapping):
        """Expert-major expert outputs bf16 ``[M, H]`` folded onto the plain rows bf16 ``[N, H]``
        (the weighted sum of each row's entries, float32); the mirror of :meth:`expand_expert_major`."""
        from .. import expert_major
        return expert_major.fold(y, mapping)

    def refuse_capture(self, kind: str, handle=None, num_worst_tokens: int = 0) -> Optional[bool]:
        """Buffer calls it first in a normal-mode ``kind`` call ("dispatch", "combine"): inside a
        CUDA graph capture, EPError for a call this backend could not replay (before anything else
        of the call runs: a resync, an abort or a stand-in would be captured, not run). Returns
        whether the stream is being captured, where asked (None: not asked; this backend asks nothing)."""
        return None

    def raise_pending(self) -> None:
        """Raise errors kernels reported since the last call (backends without any: nothing)."""

    @property
    def needs_resync(self) -> bool:
        """True after this rank raised EPInputError for a call whose signals left the ranks out of
        step (the GPU backends: a disagreement, an abort): Buffer calls :meth:`resync` at the next
        call. Backends that agree before exchanging anything never need it."""
        return False

    @property
    def resync_generation(self) -> int:
        """How many resyncs this Buffer's group has made (GPU backends: a resync covers every
        Buffer of the group, call_board.py); Buffer restarts its low-latency halves when it moves."""
        return 0

    def resync(self) -> None:
        """Collective among the ranks that raised: bring the ranks' signalling state back in step
        (bounded; EPTimeoutError names a rank that does not come)."""

    def agree(self, kind: str, fingerprint, error=None, rank_mask=None) -> None:
        """Collective agreement before a call exchanges anything: raise on every rank when ranks
        disagree on ``fingerprint`` (``(argument, value)`` pairs), when a rank rejected its own input
        (``error``), or when a rank does not arrive in time (see store_agreement.py, gpu/agreement.py). Default: nothing."""

    def stand_in(self, kind: str, error, rank_mask=None) -> None:
        """An abort for a call this rank skipped (Buffer's stand-in after a rejected layout), at its
        next exchanging call. Default: :meth:`agree` with the error."""
        self.agree(kind, None, error, rank_mask)

    def pass_given_up_calls(self) -> None:
        """This rank is about to skip a call (a rejected layout): pass the calls its peers already
        gave up for it (an earlier skipped call), so that its stand-in meets the call it skips now.
        Default: nothing (the GPU backends pair calls through the call board)."""

    # Backend-specific limits of one call (row sizes, buffer capacity, handles of another backend),
    # checked before anything is exchanged: Buffer calls these inside its argument validation, so a
    # rejection on one rank reaches every rank through agree(kind, None, error). Raise EPInputError
    # naming the argument. Default: no limits beyond Buffer's own checks.
    def check_dispatch(self, args: DispatchArgs) -> None:
        """Limits of a normal-mode dispatch."""

    def check_combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                      bias: Tuple[torch.Tensor, ...]) -> None:
        """Limits of a normal-mode combine."""

    def check_low_latency_dispatch(self, args: "LowLatencyDispatchArgs") -> None:
        """Limits of a low-latency dispatch."""

    def check_low_latency_combine(self, args: "LowLatencyCombineArgs") -> None:
        """Limits of a low-latency combine."""

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Normal-mode dispatch (full, or cached when ``args.handle`` is given)."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Tuple[torch.Tensor, ...], config: Config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Normal-mode combine: plain float32 sum over the ranks that received each token, plus biases."""

    @abc.abstractmethod
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs
                             ) -> Tuple[Payload, torch.Tensor, LowLatencyHandle, Optional[Callable[[], None]]]:
        """Returns ``(recv_x, recv_count, handle, hook)``; ``hook`` is set iff ``return_recv_hook``."""

    @abc.abstractmethod
    def low_latency_combine(self, args: LowLatencyCombineArgs) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
        """Returns ``(combined_x, hook)``; ``hook`` is set iff ``return_recv_hook``."""

    def local_buffer(self, use_rdma_buffer: bool) -> Optional[torch.Tensor]:
        """This rank's communication memory (uint8, 1-D) for ``Buffer.get_local_buffer_tensor``:
        the intra-node part, or with ``use_rdma_buffer`` the inter-node / low-latency part. None:
        the backend has no such memory (Buffer then hands out a byte buffer no call reads)."""
        return None

    def clean_low_latency(self) -> None:
        """Reset low-latency state (e.g. after a dispatch whose hook was never called)."""

    def destroy(self) -> None:
        """Free backend resources (symmetric memory, streams)."""
