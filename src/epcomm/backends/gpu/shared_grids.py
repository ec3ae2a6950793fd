"""Grids that fit one GPU shared by several ranks (CUDA MPS): the caps a GPU backend applies.

On a real machine each rank has a GPU of its own. Where several ranks share one (the one-GPU test
bed, or a deployment under MPS), their kernels share its SMs, and a kernel that waits for peers
spins on an SM until they arrive. If every rank's waiting programs together hold every SM, a rank
whose sender starts late never gets one and every wait runs into the timeout (docs/GPU.md;
docs/notes/multinode-log.md, finding 14). So each call's grids are capped, whatever ``Config`` the
caller passes (a smaller value the caller asks for wins):

- normal mode, ``Config.num_sms`` (Buffer applies the cap where it resolves the config): the
  one-node kernels run 16 warps, a whole SM each, and the combine's reduce runs 4 x num_sms
  programs that all wait (in one launch with the push: 2 x num_sms push and 2 x num_sms reduce
  programs; the full dispatch's pull in turn waits in 3 x num_sms: choices.PULL_PROGRAMS_PER_SM),
  so ranks x 4 x num_sms stays below the SMs; the two-level kernels wait
  in fewer programs (C = num_sms / 2 channels of forwarders per node): about SMs / (2 x ranks);
- low-latency receive phases (they spin): together about three quarters of the SMs;
- low-latency send phases (they do not spin, but a late rank's sender must find room beside every
  other rank's spinning receivers): together about a quarter.

The arithmetic is the one-GPU bed's (tests: ``bed_num_sms`` and a receive-program cap before it
moved here), measured on an H100 at 4, 8 and 16 ranks; ``scripts/kernel_resources.py`` gives the
programs per SM of each kernel.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence, Tuple


@dataclass(frozen=True)
class GridCaps:
    """At most this many programs per call; 0: no cap."""

    num_sms: int = 0  # normal mode's Config.num_sms (even)
    ll_send_programs: int = 0  # each low-latency send phase
    ll_receive_programs: int = 0  # each low-latency receive phase (and a one-launch call's grid)


def grid_caps(device_sms: int, ranks_on_gpu: int, backend: str, receive_programs: int = 0) -> GridCaps:
    """The caps for ``ranks_on_gpu`` ranks sharing a GPU of ``device_sms`` SMs on ``backend``
    (``"nvlink"``: the one-node kernels; otherwise the two-level ones). ``receive_programs``: an
    explicit low-latency receive cap (``Tuning.ll_receive_programs``; 0: none), which
    wins where it is smaller. One rank per GPU: no caps but that one."""
    if ranks_on_gpu <= 1:
        return GridCaps(0, 0, max(receive_programs, 0))
    n = ranks_on_gpu
    if backend == "nvlink":
        num_sms = max(2, device_sms // (4 * n) // 2 * 2)
    else:
        num_sms = max(2, min(24, device_sms // (2 * n) // 2 * 2))
    receive = max(2, device_sms * 3 // (4 * n))
    if receive_programs > 0:
        receive = min(receive, receive_programs)
    return GridCaps(num_sms, max(1, device_sms // (4 * n)), receive)


def sharing(places: Sequence[Tuple[str, str, int]]) -> Tuple[int, int]:
    """``places``: every rank's ``(host, GPU identity, SMs)``. Returns ``(the most ranks any one
    GPU holds, the fewest SMs of any rank's GPU)``: the same on every rank, so every rank caps its
    grids alike (the two-level kernels need the same channel count on every rank)."""
    held = Counter((host, gpu) for host, gpu, _ in places)
    return max(held.values()), min(sms for _, _, sms in places)


def gpu_places(group) -> list:
    """Collective over ``group``: every rank's ``(host, GPU identity, SMs of its GPU)``, in rank
    order."""
    import socket

    import torch
    import torch.distributed as dist
    device = torch.cuda.current_device()
    mine = (socket.gethostname(), gpu_identity(), torch.cuda.get_device_properties(device).multi_processor_count)
    places = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, mine, group=group)
    return places


def gpu_identity() -> str:
    """This process's current GPU, the same string in every process that uses it (its UUID)."""
    import os

    import torch
    if not torch.cuda.is_available():
        return ""
    device = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"{os.getpid()}:{device}"
