"""epcomm: expert-parallel dispatch/combine for Mixture-of-Experts, in Python.

A DeepEP V1-compatible :class:`Buffer` over pluggable backends: torch.distributed collectives
(CPU/gloo and NCCL; the reference) and Triton kernels over NVLink symmetric memory.
"""
import torch

topk_idx_t = torch.int64
"""dtype of ``topk_idx`` tensors (DeepEP's ``topk_idx_t``)."""

from .buffer import Buffer  # noqa: E402
from .config import Config  # noqa: E402
from .errors import EPError, EPInputError, EPTimeoutError  # noqa: E402
from .events import EventOverlap  # noqa: E402
from .handle import DispatchHandle, LowLatencyHandle  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "EPError", "EPInputError", "EPTimeoutError",
           "DispatchHandle", "LowLatencyHandle", "topk_idx_t", "__version__"]
