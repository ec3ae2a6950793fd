"""Kernel configuration (DeepEP's ``Config``) and tuned defaults per world size."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from .errors import EPInputError


# DeepEP's names of the chunk settings, in DeepEP's positional order after num_sms; epcomm's own
# shorter names (the keys) stay accepted as keywords and readable as attributes.
_CHUNK_NAMES = {"nvl_chunked_send_tokens": "num_max_nvl_chunked_send_tokens",
                "nvl_chunked_recv_tokens": "num_max_nvl_chunked_recv_tokens",
                "rdma_chunked_send_tokens": "num_max_rdma_chunked_send_tokens",
                "rdma_chunked_recv_tokens": "num_max_rdma_chunked_recv_tokens"}
_CHUNK_DEFAULTS = {"num_max_nvl_chunked_send_tokens": 6, "num_max_nvl_chunked_recv_tokens": 256,
                   "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 256}
NUM_MAX_NVL_PEERS = 8  # DeepEP's ranks per node: the RDMA hint assumes nodes of this many ranks


def _deep_ep_name(name: str) -> str:
    return f"(DeepEP's {_CHUNK_NAMES[name]}) " if name in _CHUNK_NAMES else ""


@dataclass(frozen=True, init=False)
class Config:
    """Launch configuration of the normal-mode dispatch/combine kernels (DeepEP's ``Config``).

    ``Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
    num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)``: DeepEP's keyword
    names, defaults and positional order, so SGLang's ``Config(**json)`` of its ``--deepep-config``
    file works. epcomm's shorter names (``nvl_chunked_send_tokens``, ``nvl_chunked_recv_tokens``,
    ``rdma_chunked_send_tokens``, ``rdma_chunked_recv_tokens``) are accepted as keywords too (not
    both names of one setting: TypeError) and readable as attributes.

    Args:
        num_sms: the unit of the normal-mode kernels' grids; must be even, as each channel takes
            one sending and one receiving program (two-level backend: num_sms / 2 channels). Unlike
            DeepEP's, it is not a bound on the SMs a call occupies: the one-node (nvlink) kernels
            run a multiple of it per launch, each program a whole SM — the stage num_sms, the full
            dispatch's pull in turn 3 x, a one-launch dispatch up to 2 x plus one program per rank,
            the combine 4 x (2 x push, 2 x reduce) — where more programs, not the links, were
            measured to set the pace (docs/PERFORMANCE.md).
        num_max_nvl_chunked_send_tokens: tokens a sender moves per step into an NVLink queue.
        num_max_nvl_chunked_recv_tokens: capacity, in tokens, of one NVLink queue (per channel and peer).
        num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: the same for the
            inter-node hop.

    Backends without queues (``torch_dist``) accept and ignore the chunk sizes. An invalid value
    raises EPInputError naming the setting by epcomm's short name, DeepEP's in the message.
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: Optional[int] = None,
                 num_max_nvl_chunked_recv_tokens: Optional[int] = None,
                 num_max_rdma_chunked_send_tokens: Optional[int] = None,
                 num_max_rdma_chunked_recv_tokens: Optional[int] = None, **short_names: int):
        given = dict(num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                     num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                     num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                     num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for short, value in short_names.items():
            if short not in _CHUNK_NAMES:
                raise TypeError(f"Config() got an unexpected keyword argument {short!r}")
            if given[_CHUNK_NAMES[short]] is not None:
                raise TypeError(f"Config() got {short!r} and {_CHUNK_NAMES[short]!r}: one setting twice")
            given[_CHUNK_NAMES[short]] = value
        object.__setattr__(self, "num_sms", num_sms)
        for long, value in given.items():
            object.__setattr__(self, long, _CHUNK_DEFAULTS[long] if value is None else value)
        for name in ("num_sms",) + tuple(_CHUNK_NAMES):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise EPInputError(name, f"{_deep_ep_name(name)}must be a positive int, got {value!r}")
        if num_sms % 2:
            raise EPInputError("num_sms", f"must be even (one send and one receive program per channel), got {num_sms}")
        for hop in ("nvl", "rdma"):
            send, recv = f"{hop}_chunked_send_tokens", f"{hop}_chunked_recv_tokens"
            if getattr(self, send) > getattr(self, recv):
                raise EPInputError(send, f"{_deep_ep_name(send)}must not exceed {recv} ({getattr(self, recv)}), "
                                         f"got {getattr(self, send)}")

    # epcomm's short names, read-only
    nvl_chunked_send_tokens = property(lambda self: self.num_max_nvl_chunked_send_tokens)
    nvl_chunked_recv_tokens = property(lambda self: self.num_max_nvl_chunked_recv_tokens)
    rdma_chunked_send_tokens = property(lambda self: self.num_max_rdma_chunked_send_tokens)
    rdma_chunked_recv_tokens = property(lambda self: self.num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer these settings want for rows of ``hidden_bytes`` (DeepEP name)."""
        num_channels = self.num_sms // 2
        per_token = hidden_bytes + 1024  # payload plus scales, top-k and index metadata, rounded up
        return num_channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * per_token + (1 << 20)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *, num_tokens: Optional[int] = None,
                                  ranks_per_node: int = NUM_MAX_NVL_PEERS, num_topk: int = 32,
                                  num_experts: Optional[int] = None) -> int:
        """``num_rdma_bytes`` the nvshmem backend needs across nodes for rows of ``hidden_bytes``
        (BF16 rows: ``2 * hidden``) on ``num_ranks`` ranks (DeepEP name and first two arguments).

        0 when the ranks fit one node (DeepEP's rule, nodes of ``ranks_per_node`` = 8 ranks; the
        nvshmem backend then sizes its workspace from ``num_nvl_bytes``); otherwise the multi-node
        workspace (``epcomm.backends.nvshmem.bytes_for_tokens``) in which every rank dispatches
        ``num_tokens`` BF16 tokens of up to ``num_topk`` experts each and combines them.
        ``num_tokens`` defaults to what DeepEP's RDMA queues of this config hold at once,
        ``num_sms / 2 * num_max_rdma_chunked_recv_tokens``: a larger batch raises EPInputError
        naming ``num_rdma_bytes`` at dispatch, so pass the batch's size where it is larger.
        ``num_experts`` (default ``max(256, num_ranks)``) sizes only the count rows. The
        keyword-only arguments are epcomm's.
        """
        if num_ranks <= ranks_per_node:
            return 0
        if num_ranks % ranks_per_node:
            raise EPInputError("num_ranks", f"{num_ranks} ranks do not form nodes of {ranks_per_node} ranks")
        if num_tokens is None:
            num_tokens = self.num_sms // 2 * self.num_max_rdma_chunked_recv_tokens
        from .backends.gpu.normal.two_level.areas import bytes_for_tokens  # (plain Python: loads no kernels)
        return bytes_for_tokens(num_tokens, num_ranks, ranks_per_node, num_experts or max(256, num_ranks),
                                max(1, hidden_bytes // 2), num_topk)


@dataclass(frozen=True)
class Tuning:
    """Settings of the GPU kernels a Buffer fixes when it is built: ``Buffer(..., tuning=Tuning(...))``.

    The defaults are the measured choices (docs/GPU.md); the others exist to measure against them.
    ``torch_dist`` ignores them all, and each GPU backend reads only its own. An operator who cannot
    change the code that builds the Buffer (an engine) overrides a field with its variable, read
    where the Buffer is built: ``EPCOMM_LL_SEND_MESSAGES``, ``EPCOMM_LL_ONE_LAUNCH``,
    ``EPCOMM_LL_RECEIVE_PROGRAMS``, ``EPCOMM_NVSHMEM_SEND_PARTS``, ``EPCOMM_NVSHMEM_P2P``.

    Args:
        ll_send_messages: messages of one token a low-latency send item carries (0: all its top-k,
            one FP8 cast per token).
        ll_one_launch: how a low-latency call without a hook runs its send and receive phases.
            None (auto, the default): in one cooperative launch, except while the stream is captured
            into a CUDA graph, where they are two launches. Eagerly the host is what decode waits
            for, and one launch less is ~5 us less host time per call; a graph replays without the
            host, and there two launches are as fast or faster. True: always one launch; False:
            always two. For None the nvshmem backend and Triton's own launcher (no cooperative
            launch: ``launch_mode() == "jit"``) take two launches.
        ll_receive_programs: at most this many programs per low-latency receive phase (0: no cap).
            Ranks sharing one GPU get a cap anyway (backends/gpu/shared_grids.py); a smaller one here wins.
        nvshmem_send_parts: programs per (channel, node) of the nvshmem backend's puts between
            nodes, each moving a slice of the channel's rows.
        nvshmem_p2p: the nvshmem backend stores rows straight into a peer on another node whose
            memory this GPU maps (virtual nodes, one NVLink domain) instead of staging and putting
            them; peers it cannot map always take the put.
    """

    ll_send_messages: int = 0
    ll_one_launch: Optional[bool] = None
    ll_receive_programs: int = 0
    nvshmem_send_parts: int = 1
    nvshmem_p2p: bool = True

    def __post_init__(self):
        for name, lowest in (("ll_send_messages", 0), ("ll_receive_programs", 0), ("nvshmem_send_parts", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise EPInputError(f"tuning.{name}", f"must be an int >= {lowest}, got {value!r}")
        if not isinstance(self.nvshmem_p2p, bool):
            raise EPInputError("tuning.nvshmem_p2p", f"must be a bool, got {self.nvshmem_p2p!r}")
        if self.ll_one_launch is not None and not isinstance(self.ll_one_launch, bool):
            raise EPInputError("tuning.ll_one_launch", f"must be None (auto) or a bool, got {self.ll_one_launch!r}")


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
