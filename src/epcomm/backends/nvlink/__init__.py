"""NVLink backend: Triton kernels over symmetric memory, one node."""
from __future__ import annotations

import torch.distributed as dist


def nvlink_usable(group: dist.ProcessGroup) -> bool:
    """True when every rank of ``group`` is a CUDA device on this node and Triton is importable."""
    try:
        import triton  # noqa: F401
        from .backend import NVLinkBackend  # noqa: F401
    except ImportError:
        return False
    import torch
    return torch.cuda.is_available() and dist.get_world_size(group) <= torch.cuda.device_count()


def __getattr__(name):
    if name == "NVLinkBackend":
        from .backend import NVLinkBackend
        return NVLinkBackend
    raise AttributeError(name)
