"""Packing several per-row tensors into one byte matrix, so one collective moves them all."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

RowSpec = Tuple[torch.dtype, Tuple[int, ...]]


def spec_of(t: torch.Tensor) -> RowSpec:
    return t.dtype, tuple(t.shape[1:])


def _row_bytes(spec: RowSpec) -> int:
    dtype, shape = spec
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype, device="cpu").element_size()


def pack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N, ...]`` tensors (any dtypes) → ``[N, total_bytes]`` uint8."""
    num_rows = tensors[0].shape[0]
    parts = [t.contiguous().view(num_rows, -1).view(torch.uint8) if t.numel() else
             torch.empty(num_rows, _row_bytes(spec_of(t)), dtype=torch.uint8, device=t.device)
             for t in tensors]
    return torch.cat(parts, dim=1)


def unpack_rows(packed: torch.Tensor, specs: Sequence[RowSpec]) -> List[torch.Tensor]:
    """Inverse of :func:`pack_rows` given each part's ``(dtype, trailing shape)``."""
    num_rows = packed.shape[0]
    out, offset = [], 0
    for dtype, shape in specs:
        nbytes = _row_bytes((dtype, shape))
        # A fresh buffer, not .contiguous(): with one row that keeps the packed row stride (a
        # size-1 dimension counts as contiguous), and the dtype view below needs a dense row.
        part = torch.empty(num_rows, nbytes, dtype=torch.uint8, device=packed.device)
        part.copy_(packed[:, offset:offset + nbytes])
        out.append(part.view(dtype).view(num_rows, *shape) if num_rows else
                   torch.empty(0, *shape, dtype=dtype, device=packed.device))
        offset += nbytes
    return out
