"""``import deep_ep`` answered by epcomm (EPCOMM_DEEP_EP_PACKAGE: the marker install_check.py reads).

Opt-in: installed with ``pip install ./compat/deep_ep`` from an epcomm checkout, it gives engines
that ``import deep_ep`` (vLLM, SGLang, Megatron-Core, torchtitan) epcomm's Buffer with DeepEP V1's
API. ``deep_ep.__version__`` names epcomm; with logging at INFO for ``deep_ep``, rank 0 says so once
at import. What differs from DeepEP: docs/ENGINES.md and docs/API.md.
"""
import logging as _logging

from epcomm.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap, __version__, topk_idx_t

from . import utils  # noqa: F401  (deep_ep.utils, as DeepEP has it)


def _say_what_this_is() -> None:
    import torch.distributed as dist
    logger = _logging.getLogger(__name__)
    if logger.isEnabledFor(_logging.INFO) and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info("deep_ep %s is epcomm (pure Python, DeepEP V1's API), not DeepEP", __version__)


_say_what_this_is()

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "__version__"]
