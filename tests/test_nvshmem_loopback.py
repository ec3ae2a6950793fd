"""The multi-node (nvshmem) backend's kernels on one GPU, every rank a thread of one process
(loopback transport): the send layout; dispatch, cached dispatch and combine; low-latency rounds,
a dead rank, both modes on one backend — against the references, per topology
(tests/loopback_suite.py; it runs in a child process with eager module loading and the
stream-ordered allocator, which its docstring explains). Skipped without CUDA. The NVSHMEM puts themselves need one GPU per process:
tests/test_gpu.py runs the backend on virtual nodes where two GPUs are lent.
"""
import os
import subprocess
import sys

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
try:
    from loopback_suite import TOPOLOGIES
except ImportError:  # no Triton (the CPU CI): nothing here can run
    TOPOLOGIES = [(2, 1)]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("ranks,per_node", TOPOLOGIES)
def test_loopback_cases_against_references(ranks, per_node):
    from loopback_suite import loopback_environment
    env = loopback_environment(os.environ)
    suite = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loopback_suite.py")
    run = subprocess.run([sys.executable, suite, "--topology", f"{ranks},{per_node}"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
