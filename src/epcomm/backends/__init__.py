"""Backends: how the bytes move. :func:`default_backend_name` picks one for a process group.

- ``torch_dist``: torch.distributed collectives (gloo on CPU, NCCL on GPU); the reference.
- ``nvlink``: Triton kernels over symmetric memory on one NVLink node (CUDA only).
- ``nvshmem``: across nodes — NVSHMEM puts between nodes, NVLink within one (CUDA, PyTorch with
  NVSHMEM); normal and low-latency mode. Chosen automatically when the group spans hosts and
  every rank can use NVSHMEM.

``Buffer(..., backend=...)`` asks for one; ``EPCOMM_BACKEND=torch_dist|nvlink|nvshmem`` overrides
both that and the automatic choice (an operator's switch).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import EPError
from .base import Backend

BACKENDS = ("torch_dist", "nvlink", "nvshmem")
DEFAULT_NVSHMEM_BYTES = 1 << 30  # the nvshmem workspace of a Buffer made with num_rdma_bytes = num_nvl_bytes = 0


def default_backend_name(group: dist.ProcessGroup, requested: Optional[str] = None,
                         ranks_per_node: Optional[int] = None) -> str:
    """The backend a Buffer on ``group`` uses: ``EPCOMM_BACKEND`` if set, else ``requested``, else
    the automatic choice (the same for both modes: every backend runs both): ``nvlink`` when the
    group is one node — on one host, and ``ranks_per_node`` (if given) spans the whole group —
    else ``nvshmem`` when every rank can use NVSHMEM, else ``torch_dist``. Raises EPError for an
    unknown name or one this group cannot run. Collective on CUDA groups (the automatic choice
    gathers every rank's host)."""
    choice = os.environ.get("EPCOMM_BACKEND") or requested
    source = "EPCOMM_BACKEND" if os.environ.get("EPCOMM_BACKEND") else "backend"
    on_gpu = dist.get_backend(group) != "gloo" and torch.cuda.is_available()
    if choice:
        if choice not in BACKENDS:
            raise EPError(f"{source}={choice!r} is not one of {BACKENDS}")
        if choice in ("nvlink", "nvshmem") and not on_gpu:
            raise EPError(f"{source}={choice} needs CUDA GPUs and an NCCL process group")
        if choice == "nvshmem":
            from .gpu.reach.nvshmem import nvshmem_available
            usable, why = nvshmem_available()
            if not usable:
                raise EPError(f"{source}=nvshmem: NVSHMEM is not usable in this process ({why})")
        return choice
    if not on_gpu:
        return "torch_dist"
    from .nvlink import nvlink_usable
    one_node = ranks_per_node is None or ranks_per_node >= dist.get_world_size(group)
    if nvlink_usable(group) and one_node:  # (collective: every rank calls nvlink_usable)
        return "nvlink"
    if _everyone_has_nvshmem(group):
        return "nvshmem"
    return "torch_dist"


def _everyone_has_nvshmem(group: dist.ProcessGroup) -> bool:
    """Collective: NVSHMEM is usable on every rank (so all ranks choose alike)."""
    from .gpu.reach.nvshmem import nvshmem_available
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, nvshmem_available()[0], group=group)
    return all(flags)


def ranks_per_host(group: dist.ProcessGroup) -> int:
    """Collective: how many consecutive ranks share each host. Raises EPError unless every host
    holds the same number of consecutive ranks (then pass ``ranks_per_node`` explicitly)."""
    import socket
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return ranks_per_block(hosts)


def ranks_per_block(hosts) -> int:
    """The length of the equal blocks of consecutive equal names in ``hosts`` (EPError if none)."""
    size = 1
    while size < len(hosts) and hosts[size] == hosts[0]:
        size += 1
    blocks = [hosts[i:i + size] for i in range(0, len(hosts), size)]
    names = [block[0] for block in blocks]
    if len(hosts) % size or any(len(set(block)) != 1 for block in blocks) or len(set(names)) != len(names):
        raise EPError(f"the ranks do not form equal blocks of consecutive ranks per host ({hosts}); the nvshmem "
                      f"backend needs nodes of consecutive ranks: pass ranks_per_node (or EPCOMM_RANKS_PER_NODE)")
    return size


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where a group's tensors live: CPU for gloo, the current CUDA device otherwise."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def create_backend(name: str, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int,
                   num_rdma_bytes: int, low_latency_mode: bool, timeout_s: float = 100.0,
                   ranks_per_node: Optional[int] = None, allow_nvlink_for_low_latency_mode: bool = True) -> Backend:
    if name == "torch_dist":
        from .torch_dist import TorchDistBackend
        return TorchDistBackend(group, device, timeout_s)
    if name == "nvlink":
        if device.type != "cuda":
            raise EPError("the nvlink backend needs a CUDA (NCCL) process group")
        from .nvlink import NVLinkBackend
        return NVLinkBackend(group, device, num_nvl_bytes, num_rdma_bytes if low_latency_mode else 0, timeout_s)
    if name == "nvshmem":
        if device.type != "cuda":
            raise EPError("the nvshmem backend needs a CUDA (NCCL) process group")
        from .nvshmem.backend import NvshmemBackend
        # A low-latency Buffer's modes share num_rdma_bytes, as in DeepEP (NvshmemBackend.allocation_bytes).
        # Code written for one node passes only num_nvl_bytes (or nothing): the workspace takes that,
        # or DEFAULT_NVSHMEM_BYTES, so the same program runs across nodes (a batch too large for it
        # raises EPInputError naming num_rdma_bytes).
        ranks_per_node = ranks_per_node or dist.get_world_size(group)
        workspace_bytes = num_rdma_bytes or num_nvl_bytes or DEFAULT_NVSHMEM_BYTES
        return NvshmemBackend(group, device, workspace_bytes, ranks_per_node, timeout_s,
                              num_ll_bytes=num_rdma_bytes if low_latency_mode else 0,
                              ll_ranks_per_node=ranks_per_node if allow_nvlink_for_low_latency_mode else 1)
    raise EPError(f"unknown backend {name!r}; choose one of {BACKENDS}")
