"""The GPU layer both GPU backends share: Triton kernels over symmetric memory.

    workspace.py     the symmetric-memory layout (the only owner of offsets and sizes)
    sync.py          device side of the memory-ordering contract: flags, epochs, bounded waits,
                     call fingerprints checked after every acquire
    mailbox.py       the host mailbox: what kernels report to the host, without a stream sync
    agreement.py     what a fingerprint holds, the errors it raises, the abort of a rejected call
    call_board.py    which call each rank is in, across every Buffer of a group (a skipped call)
    wiring.py        GpuBackend: what both backends hand on the same way (calls, board, resync)
    launch.py        kernels compiled once per specialisation, launched without Triton's binder
    compile_lock.py  one process per host compiles a specialisation at a time
    copy.py          row copies with 16-byte accesses where the alignment allows
    expert_major_kernels.py  the expert-major re-layout as kernels, for a backend that receives plain rows
    reach/           how a kernel reaches a peer — NVLink stores, NVSHMEM puts and signals, the
                     loopback copies of the one-GPU tests; no other module knows the difference
    normal/          normal mode: the layout kernel; one_node/ (every peer by stores: count
                     exchange, dispatch, combine; NormalMode) and two_level/ (DeepEP's internode
                     shape: the plan in hierarchy.py, the step barrier, two-hop dispatch and combine)
    low_latency/     low-latency mode: dispatch and combine kernels; LowLatencyMode

The backends are GpuBackend classes over this layer: ``backends/nvlink`` (one node: normal/one_node, and
low_latency/ by stores) and ``backends/nvshmem`` (nodes: normal/two_level, and low_latency/ with
far peers reached by NVSHMEM).
"""
