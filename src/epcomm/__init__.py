"""epcomm: expert-parallel dispatch/combine for Mixture-of-Experts, in Python.

A DeepEP V1-compatible :class:`Buffer` over pluggable backends: torch.distributed collectives
(CPU/gloo and NCCL; the reference) and Triton kernels over NVLink symmetric memory.
"""
from .buffer import Buffer
from .config import Config, Tuning
from .errors import EPError, EPInputError, EPTimeoutError
from .events import EventOverlap
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from .handle import DispatchHandle, LowLatencyHandle
from .types import Payload, topk_idx_t

__version__ = "0.1.0"

_SUBMODULES = ("autograd", "nn", "expert_major", "testing")


def __getattr__(name):
    """``epcomm.autograd``, ``epcomm.nn``, ... after a plain ``import epcomm`` (as the README writes
    them), imported on first use: they pull in more of torch than the Buffer needs."""
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'epcomm' has no attribute {name!r}")

__all__ = ["Buffer", "Config", "Tuning", "EventOverlap", "EPError", "EPInputError", "EPTimeoutError",
           "DispatchHandle", "LowLatencyHandle", "Payload", "topk_idx_t", "per_token_cast_to_fp8",
           "per_token_cast_back", "__version__"]
