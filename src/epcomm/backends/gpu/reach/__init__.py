"""How a kernel reaches a peer: the one place that knows the transports.

    modes.py      the ``REMOTE`` constexpr every kernel that reaches peers takes: a peer of this
                  node by plain stores (PEERS_BY_STORES), a far one by NVSHMEM (FAR_BY_NVSHMEM) or
                  by the loopback copies (FAR_BY_LOOPBACK), lane by lane; ``far_deliver``,
                  ``far_send_bytes``, ``far_complete`` (what the kernels call for far peers) and
                  ``FAR_LIBRARY`` (their KernelSpecs' library); the kernels import nothing else here
    nvshmem.py    NVSHMEM's device functions (put with signal, signal, quiet) as Triton externs, and
                  ``deliver``: a put with signal, or with ``LOOPBACK`` the same hand-off by stores
    transport.py  the host side: NVSHMEM symmetric memory through PyTorch, or the loopback world
                  (every rank a thread of one process over one GPU)
    symmetric_heap.py  the ledger of NVSHMEM allocations: freed (a barrier over every process) only
                  at agreed points, whenever each rank's Buffers end
"""
