"""The multi-node backend: NVSHMEM through PyTorch (issue 14; docs/MULTINODE.md).

:mod:`.backend` wires it together: :mod:`.transport` (NVSHMEM symmetric memory, or the loopback
test transport), :mod:`.workspace` and :mod:`.rows` (what each area and row holds), :mod:`.step`
(the barrier every call starts with), :mod:`.normal` (count exchange, dispatch) and
:mod:`.combine`. The plan the kernels follow is :mod:`epcomm.hierarchy`, tested on CPU through
:mod:`epcomm.testing.two_level`; the kernels run against it on one GPU through
:mod:`epcomm.testing.loopback`.
"""
