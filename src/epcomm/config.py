"""Kernel configuration (DeepEP's ``Config``) and tuned defaults per world size."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import EPInputError


@dataclass(frozen=True)
class Config:
    """Launch configuration of the normal-mode dispatch/combine kernels.

    Args:
        num_sms: streaming multiprocessors (GPU programs) the kernels may use; must be even, as
            each channel takes one sending and one receiving program.
        nvl_chunked_send_tokens: tokens a sender moves per step into an NVLink queue.
        nvl_chunked_recv_tokens: capacity, in tokens, of one NVLink queue (per channel and peer).
        rdma_chunked_send_tokens / rdma_chunked_recv_tokens: the same for the inter-node hop.

    Backends without queues (``torch_dist``) accept and ignore the chunk sizes.
    """

    num_sms: int = 20
    nvl_chunked_send_tokens: int = 6
    nvl_chunked_recv_tokens: int = 256
    rdma_chunked_send_tokens: int = 6
    rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for name in ("num_sms", "nvl_chunked_send_tokens", "nvl_chunked_recv_tokens",
                     "rdma_chunked_send_tokens", "rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EPInputError(name, f"must be a positive int, got {value!r}")
        if self.num_sms % 2:
            raise EPInputError("num_sms", f"must be even (one send and one receive program per channel), got {self.num_sms}")
        if self.nvl_chunked_send_tokens > self.nvl_chunked_recv_tokens:
            raise EPInputError("nvl_chunked_send_tokens", "must not exceed nvl_chunked_recv_tokens")
        if self.rdma_chunked_send_tokens > self.rdma_chunked_recv_tokens:
            raise EPInputError("rdma_chunked_send_tokens", "must not exceed rdma_chunked_recv_tokens")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer these settings want for rows of ``hidden_bytes`` (DeepEP name)."""
        num_channels = self.num_sms // 2
        per_token = hidden_bytes + 1024  # payload plus scales, top-k and index metadata, rounded up
        return num_channels * num_ranks * self.nvl_chunked_recv_tokens * per_token + (1 << 20)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer these settings want (0 on one node)."""
        return 0


# Default SM count for new configs; Buffer.set_num_sms changes it.
_default_num_sms = 20


def set_default_num_sms(num_sms: int) -> None:
    global _default_num_sms
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms <= 0 or num_sms % 2:
        raise EPInputError("new_num_sms", f"must be a positive even int, got {num_sms!r}")
    _default_num_sms = num_sms


def default_num_sms() -> int:
    return _default_num_sms


def _check_num_ranks(num_ranks: int) -> None:
    if not isinstance(num_ranks, int) or num_ranks <= 0:
        raise EPInputError("num_ranks", f"must be a positive int, got {num_ranks!r}")


def dispatch_config(num_ranks: int) -> Config:
    """Tuned dispatch defaults for ``num_ranks`` ranks (queue sizes grow with fan-out)."""
    _check_num_ranks(num_ranks)
    return _default_config("dispatch", num_ranks, _default_num_sms)


def combine_config(num_ranks: int) -> Config:
    """Tuned combine defaults for ``num_ranks`` ranks."""
    _check_num_ranks(num_ranks)
    return _default_config("combine", num_ranks, _default_num_sms)


@functools.lru_cache(maxsize=64)
def _default_config(kind: str, num_ranks: int, num_sms: int) -> Config:
    """One Config per setting (frozen, so shared): a call without ``config`` resolves its default
    on the host path of every call, where building and validating one costs about a microsecond."""
    if kind == "dispatch":
        return Config(num_sms, 6 if num_ranks <= 4 else 8, 256 if num_ranks <= 4 else 288)
    return Config(num_sms, 6 if num_ranks <= 4 else 4, 256)
