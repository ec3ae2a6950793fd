"""Stand-ins for CUDA on a CPU-only host, for tests of the measuring code (tools/measure.py,
scripts/ll_host_split.py): a CUDA event read from the host clock (a host-bound call: the GPU keeps
pace)."""
import time


class HostClockEvent:
    """``torch.cuda.Event`` stood in for by the host clock."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end):  # milliseconds, as CUDA's
        return (end.at - self.at) * 1e3
