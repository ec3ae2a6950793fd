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
    """:class:`epcomm.Buffer` with DeepEP's device rule: CUDA whenever it is available, also for a
    gloo group (the group then carries only host-side exchanges). Same arguments."""

    def __init__(self, group: dist.ProcessGroup, *args, device=None, **kwargs):
        if device is None and torch.cuda.is_available():
            device = "cuda"
        super().__init__(group, *args, device=device, **kwargs)


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """DeepEP checks that every pair of GPUs of ``group`` is NVLink-connected. epcomm picks its
    backend from what it finds (``Buffer.backend_name``) instead of asserting, so this checks only
    that the group is usable: an initialised process group (EPError otherwise)."""
    if not isinstance(group, dist.ProcessGroup):
        raise EPError(f"check_nvlink_connections needs a torch.distributed.ProcessGroup, got {type(group).__name__}")


__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "check_nvlink_connections", "topk_idx_t",
           "__version__"]
