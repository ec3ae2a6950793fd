"""Backends: how the bytes move. :func:`default_backend_name` picks one for a process group.

- ``torch_dist``: torch.distributed collectives (gloo on CPU, NCCL on GPU); the reference.
- ``nvlink``: Triton kernels over symmetric memory on one NVLink node (CUDA only).
- ``nvshmem``: across nodes — NVSHMEM puts between nodes, NVLink within one (CUDA, PyTorch with
  NVSHMEM); normal and low-latency mode. Chosen automatically when the group spans hosts and
  every rank can use NVSHMEM.

``Buffer(..., backend=...)`` asks for one; ``EPCOMM_BACKEND=torch_dist|nvlink|nvshmem`` overrides
both that and the automatic choice (an operator's switch, read where the Buffer is built).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..config import Tuning
from ..errors import EPError
from .base import Backend

BACKENDS = ("torch_dist", "nvlink", "nvshmem")
DEFAULT_NVSHMEM_BYTES = 1 << 30  # the nvshmem workspace of a Buffer made with num_rdma_bytes = num_nvl_bytes = 0


def default_backend_name(group: dist.ProcessGroup, requested: Optional[str] = None,
                         ranks_per_node: Optional[int] = None, device: Optional[torch.device] = None,
                         source: str = "backend") -> str:
    """The backend a Buffer on ``group`` uses: ``requested`` (the Buffer's ``backend``, or the
    ``EPCOMM_BACKEND`` that overrides it: ``source`` names which, for the errors), else the automatic choice (the same for both modes: every backend runs both): ``nvlink`` when the
    group is one node — on one host, and ``ranks_per_node`` (if given) spans the whole group —
    else ``nvshmem`` when every rank can use NVSHMEM, else ``torch_dist``. ``device`` is the
    Buffer's (:func:`group_device`; default: the group's). Raises EPError for an unknown name or
    one this group cannot run. Collective on CUDA (the automatic choice gathers every rank's host)."""
    choice = requested
    backend_string = dist.get_backend(group)
    device_type = device.type if device is not None else choose_device(backend_string, None, torch.cuda.is_available())
    on_gpu = device_type == "cuda"
    cpu_only_group = not _has_cuda_collectives(backend_string)
    if choice:
        if choice not in BACKENDS:
            raise EPError(f"{source}={choice!r} is not one of {BACKENDS}")
        if choice in ("nvlink", "nvshmem") and not on_gpu:
            raise EPError(f"{source}={choice} needs CUDA GPUs (the Buffer's device is the CPU: an NCCL "
                          f"group, or device='cuda')")
        if choice == "torch_dist" and on_gpu and cpu_only_group:
            raise EPError(f"{source}=torch_dist on CUDA tensors needs a group with CUDA collectives (NCCL); "
                          f"this group is {backend_string!r}: ask for device='cpu' for the CPU reference")
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
    if cpu_only_group:  # the reference would need CUDA collectives; moving the data to the CPU would crawl
        raise EPError(f"the group is {backend_string!r} (host exchanges only) and the Buffer's device is "
                      f"CUDA: that needs the nvlink backend (one NVLink node, a GPU per rank) or nvshmem "
                      f"(NVSHMEM on every rank), and neither is usable here; pass an NCCL group, or device='cpu'")
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


def _has_cuda_collectives(backend_string: str) -> bool:
    """True when a process group's backend string (``dist.get_backend``) runs collectives on CUDA
    tensors: ``"nccl"``, or a mixed ``"cpu:gloo,cuda:nccl"`` (also ``"cuda:gloo"``)."""
    return backend_string != "gloo" and backend_string not in ("cpu:gloo", "mpi")


def choose_device(backend_string: str, requested=None, cuda_available: bool = True) -> str:
    """``"cpu"`` or ``"cuda"``: where a Buffer's tensors live.

    ``requested`` (``"cpu"``, ``"cuda"``, a ``torch.device``, or None) wins; ``"cuda"`` on a
    machine without CUDA raises EPError. Otherwise a group with CUDA collectives (``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``) means CUDA and a host-only one (``"gloo"``)
    the CPU. A gloo group on CUDA ranks (vLLM passes one) gets the GPU backends with
    ``requested="cuda"``: the group then carries only host-side exchanges, as in DeepEP."""
    if requested is not None:
        kind = torch.device(requested).type if isinstance(requested, (str, torch.device)) else None
        if kind not in ("cpu", "cuda"):
            raise EPError(f"device must be 'cpu', 'cuda' or a torch.device of either, got {requested!r}")
        if kind == "cuda" and not cuda_available:
            raise EPError("device='cuda' but CUDA is not available in this process")
        return kind
    return "cuda" if _has_cuda_collectives(backend_string) and cuda_available else "cpu"


def group_device(group: dist.ProcessGroup, requested=None) -> torch.device:
    """The Buffer's device (:func:`choose_device`): the CPU, or the current CUDA device."""
    kind = choose_device(dist.get_backend(group), requested, torch.cuda.is_available())
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", torch.cuda.current_device())


def create_backend(name: str, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int,
                   num_rdma_bytes: int, low_latency_mode: bool, timeout_s: float = 100.0,
                   ranks_per_node: Optional[int] = None, allow_nvlink_for_low_latency_mode: bool = True,
                   enable_shrink: bool = False, tuning: Tuning = Tuning()) -> Backend:
    """The backend ``name`` for a Buffer. ``enable_shrink``: a low-latency wait that gives up
    masks the late rank (the call goes on without it); otherwise the next call raises
    EPTimeoutError naming it, and the rows the call knows are missing are NaN. ``tuning``: the
    kernels' settings (:class:`epcomm.config.Tuning`), each GPU backend taking its own."""
    if name == "torch_dist":
        from .torch_dist import TorchDistBackend
        return TorchDistBackend(group, device, timeout_s, num_rdma_bytes=num_rdma_bytes)
    if name == "nvlink":
        if device.type != "cuda":
            raise EPError("the nvlink backend needs CUDA tensors (an NCCL group, or device='cuda')")
        from .nvlink import NVLinkBackend
        return NVLinkBackend(group, device, num_nvl_bytes, num_rdma_bytes if low_latency_mode else 0, timeout_s,
                             ll_receive_programs=tuning.ll_receive_programs, shrink=enable_shrink,
                             ll_send_messages=tuning.ll_send_messages, ll_one_launch=tuning.ll_one_launch)
    if name == "nvshmem":
        if device.type != "cuda":
            raise EPError("the nvshmem backend needs CUDA tensors (an NCCL group, or device='cuda')")
        from .nvshmem.backend import NvshmemBackend
        # A low-latency Buffer's modes share num_rdma_bytes, as in DeepEP (NvshmemBackend.allocation_bytes).
        # Code written for one node passes only num_nvl_bytes (or nothing): the workspace takes that,
        # or DEFAULT_NVSHMEM_BYTES, so the same program runs across nodes (a batch too large for it
        # raises EPInputError naming num_rdma_bytes).
        ranks_per_node = ranks_per_node or dist.get_world_size(group)
        workspace_bytes = num_rdma_bytes or num_nvl_bytes or DEFAULT_NVSHMEM_BYTES
        return NvshmemBackend(group, device, workspace_bytes, ranks_per_node, timeout_s,
                              num_ll_bytes=num_rdma_bytes if low_latency_mode else 0,
                              ll_ranks_per_node=ranks_per_node if allow_nvlink_for_low_latency_mode else 1,
                              send_parts=tuning.nvshmem_send_parts, p2p=tuning.nvshmem_p2p,
                              ll_receive_programs=tuning.ll_receive_programs, shrink=enable_shrink,
                              ll_send_messages=tuning.ll_send_messages, ll_one_launch=tuning.ll_one_launch)
    raise EPError(f"unknown backend {name!r}; choose one of {BACKENDS}")
