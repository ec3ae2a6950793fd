"""NVLink backend: Triton kernels over symmetric memory, one node."""
from __future__ import annotations

import os

import torch.distributed as dist


def nvlink_usable(group: dist.ProcessGroup) -> bool:
    """True when every rank of ``group`` runs on this host (one NVLink domain) on a GPU of its own,
    with CUDA and Triton. Ranks sharing a GPU (CUDA MPS) cannot take the nvlink backend:
    PyTorch's CUDA symmetric memory refuses two allocations on one device. Collective: every rank
    of ``group`` must call it (Buffer construction)."""
    import socket

    import torch
    try:
        import triton  # noqa: F401
        from .backend import NVLinkBackend  # noqa: F401
        triton_ok = True
    except ImportError:
        triton_ok = False
    places = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, (socket.gethostname(), _gpu_identity()), group=group)
    return triton_ok and torch.cuda.is_available() and one_host_one_gpu_each(places)


def one_host_one_gpu_each(places) -> bool:
    """``places``: every rank's ``(host name, GPU identity)``. True when all are on one host and no
    two ranks share a GPU — what the nvlink backend's symmetric memory needs."""
    hosts = {host for host, _ in places}
    gpus = [gpu for _, gpu in places]
    return len(hosts) == 1 and len(set(gpus)) == len(gpus)


def _gpu_identity() -> str:
    """This process's current GPU, the same string in every process that uses it (its UUID)."""
    import torch
    if not torch.cuda.is_available():
        return ""
    device = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"{os.getpid()}:{device}"


def __getattr__(name):
    if name == "NVLinkBackend":
        from .backend import NVLinkBackend
        return NVLinkBackend
    raise AttributeError(name)
