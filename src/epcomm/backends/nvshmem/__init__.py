"""The multi-node backend: NVSHMEM through PyTorch (docs/MULTINODE.md).

:mod:`.backend` wires it together over the GPU layer (backends/gpu: its transport, the loopback
test transport, and the low-latency mode come from there): :mod:`.workspace` and :mod:`.rows`
(what each area and row holds), :mod:`.step` (the barrier every call starts with), :mod:`.normal`
(count exchange, dispatch) and :mod:`.combine` — the multi-node normal-mode kernels. The plan the kernels follow is :mod:`epcomm.hierarchy`, tested on CPU through
:mod:`epcomm.testing.two_level`; the kernels run against it on one GPU through
:mod:`epcomm.testing.loopback`.
"""
