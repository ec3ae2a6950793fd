"""Types shared by the public API and the backends (one home, so nothing imports back up into
the package's ``__init__``)."""
from typing import Tuple, Union

import torch

topk_idx_t = torch.int64
"""dtype of ``topk_idx`` tensors (DeepEP's ``topk_idx_t``)."""

Payload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
"""A bf16 ``[T, H]`` tensor, or an FP8 pair ``(e4m3 [T, H], float32 scales [T, H/128])``."""
