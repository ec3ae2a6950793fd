"""Low-latency rank masking (``enable_shrink=True``), as in DeepEP: a part of :class:`epcomm.Buffer`.

A masked rank is skipped by low-latency dispatch and combine: its peers neither send to it nor wait
for it, and its slots of the results stay empty. With ``enable_shrink`` a rank that times out in
low-latency mode is masked and the calls go on without it; these calls let the caller read and
change the mask. Without ``enable_shrink`` nothing is masked: a late rank is an EPTimeoutError.
"""
from __future__ import annotations

import torch

from . import checks
from .errors import EPError, EPInputError


class RankMasking:
    """The rank-mask calls; expects the Buffer's ``_rank_mask`` (``[R]`` int32 on its device),
    ``group_size``, ``device``, ``enable_shrink`` and ``_check_low_latency``."""

    def _check_shrink(self) -> None:
        self._check_low_latency()
        if not self.enable_shrink:
            raise EPError("the rank-mask calls need a Buffer constructed with enable_shrink=True (as in DeepEP)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mark ``rank_to_mask`` as dead (``mask=True``) or alive again; masked ranks are skipped.
        Needs ``enable_shrink=True``. After unmasking, call :meth:`clean_low_latency_buffer` on every
        rank before the next low-latency call, so the ranks' call counts agree again."""
        self._check_shrink()
        checks.check_int("rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise EPInputError("rank_to_mask", f"must be < {self.group_size}, got {rank_to_mask}")
        self._rank_mask[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask (``[R]`` int32, 1 = masked) into ``mask_status``. Needs ``enable_shrink=True``."""
        self._check_shrink()
        checks.check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,), device=self.device)
        mask_status.copy_(self._rank_mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank. Needs ``enable_shrink=True``."""
        self._check_shrink()
        self._rank_mask.zero_()
