"""Backends: how the bytes move. :func:`default_backend_name` picks one for a process group.

- ``torch_dist``: torch.distributed collectives (gloo on CPU, NCCL on GPU); the reference.
- ``nvlink``: Triton kernels over symmetric memory on one NVLink node (CUDA only).

``Buffer(..., backend=...)`` asks for one; ``EPCOMM_BACKEND=torch_dist|nvlink`` overrides both
that and the automatic choice (an operator's switch).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import EPError
from .base import Backend

BACKENDS = ("torch_dist", "nvlink")


def default_backend_name(group: dist.ProcessGroup, requested: Optional[str] = None) -> str:
    """The backend a Buffer on ``group`` uses: ``EPCOMM_BACKEND`` if set, else ``requested``, else
    the automatic choice. Raises EPError for an unknown name or one this group cannot run."""
    choice = os.environ.get("EPCOMM_BACKEND") or requested
    source = "EPCOMM_BACKEND" if os.environ.get("EPCOMM_BACKEND") else "backend"
    if choice:
        if choice not in BACKENDS:
            raise EPError(f"{source}={choice!r} is not one of {BACKENDS}")
        if choice == "nvlink" and (dist.get_backend(group) == "gloo" or not torch.cuda.is_available()):
            raise EPError(f"{source}=nvlink needs CUDA GPUs and an NCCL process group")
        return choice
    if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
        return "torch_dist"
    from .nvlink import nvlink_usable
    return "nvlink" if nvlink_usable(group) else "torch_dist"


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where a group's tensors live: CPU for gloo, the current CUDA device otherwise."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def create_backend(name: str, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int,
                   num_rdma_bytes: int, low_latency_mode: bool, timeout_s: float = 100.0) -> Backend:
    if name == "torch_dist":
        from .torch_dist import TorchDistBackend
        return TorchDistBackend(group, device, timeout_s)
    if name == "nvlink":
        if device.type != "cuda":
            raise EPError("the nvlink backend needs a CUDA (NCCL) process group")
        from .nvlink import NVLinkBackend
        return NVLinkBackend(group, device, num_nvl_bytes, num_rdma_bytes if low_latency_mode else 0, timeout_s)
    raise EPError(f"unknown backend {name!r}; choose one of {BACKENDS}")
