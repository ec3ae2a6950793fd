"""NVLink backend: Triton kernels over symmetric memory, one node."""
from __future__ import annotations

import torch.distributed as dist

from ...errors import EPError


def nvlink_usable(group: dist.ProcessGroup) -> bool:
    """True when every rank of ``group`` runs on this host (one NVLink domain) on a GPU of its own,
    with CUDA and Triton: the automatic choice. Ranks sharing a GPU (CUDA MPS) are left to the
    nvshmem backend; asked for by name, the nvlink backend takes NVSHMEM's mapping there
    (:func:`workspace_memory`; its grids must then fit the shared GPU together: backend.py).
    Collective: every rank of ``group`` must call it (Buffer construction)."""
    import torch
    try:
        import triton  # noqa: F401
        from .backend import NVLinkBackend  # noqa: F401
        triton_ok = True
    except ImportError:
        triton_ok = False
    places = gpu_places(group)
    return triton_ok and torch.cuda.is_available() and one_host_one_gpu_each(places)


def one_host_one_gpu_each(places) -> bool:
    """``places``: every rank's ``(host name, GPU identity)``. True when all are on one host and no
    two ranks share a GPU — what the nvlink backend's symmetric memory needs."""
    hosts = {host for host, _ in places}
    gpus = [gpu for _, gpu in places]
    return len(hosts) == 1 and len(set(gpus)) == len(gpus)


def gpu_places(group: dist.ProcessGroup) -> list:
    """Collective: every rank's ``(host name, GPU identity)``, in rank order."""
    import socket
    places = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, (socket.gethostname(), _gpu_identity()), group=group)
    return places


def workspace_memory(places) -> str:
    """Whose symmetric memory the nvlink backend's workspace is, given every rank's ``(host, GPU)``:
    ``"cuda"`` (PyTorch's CUDA symmetric memory) when each rank has a GPU of its own, ``"nvshmem"``
    when ranks share one (CUDA MPS: PyTorch's CUDA symmetric memory maps one allocation per device
    and refuses a second; NVSHMEM maps every process's, and the kernels store through the same kind
    of pointers). EPError when the ranks span hosts: that is the nvshmem backend's work."""
    hosts = sorted({host for host, _ in places})
    if len(hosts) > 1:
        raise EPError(f"the nvlink backend needs every rank on one host; this group spans {len(hosts)} "
                      f"({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}): use the nvshmem backend")
    return "cuda" if one_host_one_gpu_each(places) else "nvshmem"


def _gpu_identity() -> str:
    """This process's current GPU, the same string in every process that uses it (its UUID)."""
    from ..gpu.shared_grids import gpu_identity
    return gpu_identity()


def __getattr__(name):
    if name == "NVLinkBackend":
        from .backend import NVLinkBackend
        return NVLinkBackend
    raise AttributeError(name)
