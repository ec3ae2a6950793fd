"""One process per host compiles a kernel specialisation at a time (``launch.py``).

The ranks of a node all compile the same kernels at the same call, and a kernel linked with
a device library (gpu/reach) takes seconds: eight or sixteen compiles at once on a node's cores made
one call outlast its peers' timeout (16 ranks on one H100, 2026-11-24). With this lock one process
compiles each specialisation while the others wait, then find it in Triton's on-disk cache.
Pure Python (no Triton), so the CPU tests check it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from typing import Optional


@contextlib.contextmanager
def compile_lock(key: str, folder: Optional[str] = None):
    """Hold a host-wide exclusive lock named by ``key`` (an flock on a file in ``folder``, default
    ``<tmp>/epcomm-compile-locks-<uid>``). Where no lock file can be made (a read-only temporary
    folder), run without it: the compile is still right, only not serialised."""
    import fcntl
    if folder is None:
        folder = os.path.join(tempfile.gettempdir(), f"epcomm-compile-locks-{os.getuid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        handle = open(os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32]), "w")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
