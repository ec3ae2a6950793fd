"""The multi-node backend: NVSHMEM through PyTorch (docs/MULTINODE.md).

:mod:`.backend` wires the GPU layer together: normal mode's two-level kernels
(``backends/gpu/normal/two_level``), low-latency mode (``backends/gpu/low_latency``), and the
transports of ``backends/gpu/reach`` (NVSHMEM symmetric memory, or the loopback world of the
one-GPU tests). ``bytes_for_tokens`` sizes ``num_rdma_bytes`` for a batch.
"""
from ..gpu.normal.two_level.areas import bytes_for_tokens

__all__ = ["bytes_for_tokens"]
