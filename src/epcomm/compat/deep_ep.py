"""DeepEP V1's public names, backed by epcomm: what ``import deep_ep`` gives with the opt-in
``deep_ep`` package (``compat/deep_ep`` in the repository), or ``import epcomm.compat.deep_ep``.

Differences from :class:`epcomm.Buffer`, all to behave as DeepEP does for engines:

- the Buffer's tensors live on the current CUDA device whenever CUDA is available, whatever the
  group's backend: vLLM hands DeepEP a gloo (CPU) group on GPU ranks, which DeepEP uses only for
  host-side exchanges. Without CUDA (a CPU-only machine) it is the CPU reference backend, so
  engine code can be tested anywhere. ``device=`` still overrides.
- ``deep_ep.utils`` names: :class:`EventHandle` and :func:`check_nvlink_connections`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import __version__ as _epcomm_version
from ..buffer import Buffer as _EpcommBuffer
from ..config import Config
from ..errors import EPError
from ..events import EventHandle, EventOverlap
from ..types import topk_idx_t

__version__ = f"1.2.1+epcomm{_epcomm_version}"
"""DeepEP V1's version with epcomm's as the local part: ``deep_ep.__version__`` says what it is."""


class Buffer(_EpcommBuffer):
    """DeepEP V1's ``Buffer``, backed by :class:`epcomm.Buffer`: expert-parallel dispatch and combine
    (normal mode: intranode and internode; low-latency mode), with DeepEP's constructor, keyword
    for keyword and in order.

    Args:
        group: the ``torch.distributed`` process group of the expert-parallel ranks.
        num_nvl_bytes: bytes of intra-node communication memory (``Config.get_nvl_buffer_size_hint``).
        num_rdma_bytes: bytes of inter-node / low-latency communication memory
            (``Config.get_rdma_buffer_size_hint``, ``Buffer.get_low_latency_rdma_size_hint``).
        low_latency_mode: enable the low-latency (decode) calls.
        num_qps_per_rank: RDMA queue pairs per peer (accepted; epcomm's backends need none).
        allow_nvlink_for_low_latency_mode: low-latency traffic within a node may use NVLink.
        allow_mnnvl: allow multi-node NVLink (accepted).
        use_fabric: fabric-handle memory for multi-node NVLink (accepted, recorded, no effect).
        explicitly_destroy: if True, :meth:`destroy` must be called to release the resources.
        enable_shrink: enable the low-latency rank-mask calls (``low_latency_update_mask_buffer``,
            ``low_latency_query_mask_buffer``, ``low_latency_clean_mask_buffer``).

    Keyword-only, epcomm's (see :class:`epcomm.Buffer`): ``device`` (default here: the current
    CUDA device whenever CUDA is available, also for a gloo group, which then carries only
    host-side exchanges, as DeepEP uses vLLM's; the CPU reference backend without CUDA),
    ``timeout``, ``check_values``, ``backend``, ``ranks_per_node``.
    """

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 device=None, timeout: Optional[float] = None, check_values: Optional[bool] = None,
                 backend: Optional[str] = None, ranks_per_node: Optional[int] = None):
        if device is None and torch.cuda.is_available():
            device = "cuda"
        super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy,
                         enable_shrink, timeout=timeout, check_values=check_values, backend=backend,
                         ranks_per_node=ranks_per_node, device=device)


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """DeepEP checks that every pair of GPUs of ``group`` is NVLink-connected. epcomm picks its
    backend from what it finds (``Buffer.backend_name``) instead of asserting, so this checks only
    that the group is usable: an initialised process group (EPError otherwise)."""
    if not isinstance(group, dist.ProcessGroup):
        raise EPError(f"check_nvlink_connections needs a torch.distributed.ProcessGroup, got {type(group).__name__}")


__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "check_nvlink_connections", "topk_idx_t",
           "__version__"]
