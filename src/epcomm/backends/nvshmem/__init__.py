"""The multi-node backend's transport: NVSHMEM through PyTorch (work in progress, issue 14).

What exists: :mod:`.device` (NVSHMEM's device functions for Triton kernels launched by epcomm's
launch layer). The plan the kernels will follow is :mod:`epcomm.hierarchy`, tested on CPU through
:mod:`epcomm.testing.two_level`; the kernel design is docs/MULTINODE.md.
"""
