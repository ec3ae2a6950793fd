"""The multi-node backend: NVSHMEM through PyTorch (work in progress, issue 14).

What exists: :mod:`.device` (NVSHMEM's device functions for Triton kernels launched by epcomm's
launch layer), :mod:`.rows` and :mod:`.workspace` (what each row and area holds), :mod:`.normal`
(count exchange and dispatch kernels) and :mod:`.combine` (combine kernels) — compiled, not yet run.
The plan the kernels follow is :mod:`epcomm.hierarchy`, tested on CPU through
:mod:`epcomm.testing.two_level`; the design is docs/MULTINODE.md.
"""
