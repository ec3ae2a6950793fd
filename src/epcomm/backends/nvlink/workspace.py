"""The symmetric-memory workspace of the NVLink backend: one allocation per rank, fixed for the
Buffer's life, carved into regions at the same offsets on every rank.

    [0, FLAGS)            int64 barrier flags [3][R]         (normal, LL dispatch, LL combine sets)
    [FLAGS, COUNTS)       int32 count matrix [R, row_cap]    (notify: row i written by rank i)
    [COUNTS, LISTS)       int32 token lists [R, list_cap]+1  (dispatch: tokens this rank sends to j)
    [LISTS, +nvl)         payload                            (dispatch staging / combine slots)
    [+nvl, size)          low-latency area, two halves       (counts, receive slots, combine slots)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import EPError

FLAGS_BYTES = 64 * 1024
COUNTS_BYTES = 1 << 20
LISTS_BYTES = 8 << 20
META_BYTES = FLAGS_BYTES + COUNTS_BYTES + LISTS_BYTES
ALIGN = 256


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Workspace:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_bytes: int, num_ll_bytes: int = 0):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        if self.num_ranks * 8 > FLAGS_BYTES:
            raise EPError(f"the nvlink backend supports at most {FLAGS_BYTES // 8} ranks")
        size = align(max(num_bytes, 0)) + META_BYTES
        self.ll_offset = size
        self.ll_half_bytes = align(max(num_ll_bytes, 0) // 2 - ALIGN) if num_ll_bytes >= 4 * ALIGN else 0
        size += 2 * self.ll_half_bytes
        self.size = size
        self.buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.bases = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self._tables = {}
        self.row_cap = COUNTS_BYTES // (4 * self.num_ranks)
        self.list_cap = (LISTS_BYTES - 4) // (4 * self.num_ranks)
        self.payload_offset = META_BYTES
        self.payload_bytes = self.ll_offset - META_BYTES
        # Flags start at zero everywhere before anyone signals; the barrier makes that so.
        self.buffer[:FLAGS_BYTES].zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    # Per-rank address tables (int64 byte addresses), for the kernels; cached, as the same
    # offsets recur every call and each new table would cost a kernel launch.
    def region_bases(self, offset: int) -> torch.Tensor:
        table = self._tables.get(offset)
        if table is None:
            table = self.bases + offset
            self._tables[offset] = table
        return table

    def local(self, offset: int, num_bytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """A typed view of this rank's own workspace."""
        return self.buffer[offset:offset + num_bytes].view(dtype).view(shape)

    def flags_bases(self, flag_set: int = 0) -> torch.Tensor:
        """Flag arrays: set 0 for normal-mode barriers, 1 for LL dispatch, 2 for LL combine."""
        return self.region_bases(flag_set * self.num_ranks * 8)

    def counts_view(self, row_len: int) -> torch.Tensor:
        if row_len > self.row_cap:
            raise EPError(f"too many experts for the notify area ({row_len} > {self.row_cap} entries per rank)")
        return self.local(FLAGS_BYTES, self.num_ranks * row_len * 4, torch.int32, (self.num_ranks, row_len))

    def counts_bases(self) -> torch.Tensor:
        return self.region_bases(FLAGS_BYTES)

    def lists_view(self) -> torch.Tensor:
        """Flat int32 [R * list_cap + 1]; the last entry is a write sink for non-members."""
        return self.local(FLAGS_BYTES + COUNTS_BYTES, (self.num_ranks * self.list_cap + 1) * 4, torch.int32, (-1,))

    def lists_bases_for(self, rank: int) -> torch.Tensor:
        """Address of each rank's token list for destination ``rank``."""
        return self.region_bases(FLAGS_BYTES + COUNTS_BYTES + rank * self.list_cap * 4)
