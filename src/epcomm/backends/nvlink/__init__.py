"""NVLink backend: Triton kernels over symmetric memory, one node."""
from __future__ import annotations

import torch.distributed as dist


def nvlink_usable(group: dist.ProcessGroup) -> bool:
    """True when every rank of ``group`` runs on this host (one NVLink domain) with CUDA, and
    Triton is importable. Collective: every rank of ``group`` must call it (Buffer construction)."""
    import socket

    import torch
    try:
        import triton  # noqa: F401
        from .backend import NVLinkBackend  # noqa: F401
        triton_ok = True
    except ImportError:
        triton_ok = False
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return triton_ok and torch.cuda.is_available() and len(set(hosts)) == 1


def __getattr__(name):
    if name == "NVLinkBackend":
        from .backend import NVLinkBackend
        return NVLinkBackend
    raise AttributeError(name)
