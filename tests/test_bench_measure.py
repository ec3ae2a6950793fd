"""``epcomm bench``'s measuring (tools/measure.py; the column order in tools/bench.py), with CUDA's
events and the group's barrier stood in for on the CPU: host and gpu are the least of BATCHES batches of back-to-back calls,
so a batch that a shared host slowed (one call stalled) does not set the figure; every rank makes
the same calls (the barriers pair up)."""
import time
import types

from epcomm.tools import bench, measure
from host_clock import HostClockEvent



def test_host_and_gpu_are_the_least_of_the_batches(monkeypatch):
    barriers = []
    monkeypatch.setattr(measure.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(measure.torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(measure, "dist", types.SimpleNamespace(barrier=lambda: barriers.append(1)))
    calls = []

    def call():
        calls.append(1)
        if len(calls) == 3 + 1:  # the first timed call of the first batch stalls (after 3 warm-up calls)
            time.sleep(0.05)

    flush = types.SimpleNamespace(zero_=lambda: None)
    result = measure.measure(call, reps=10, flush=flush, warmup=3, batches=3)
    assert len(calls) == 3 + 3 * 10 + 10  # warm-up, three batches, ten synced calls
    assert len(barriers) == 3 + 10  # one per batch, one per synced call: every rank alike
    assert result["host"] < 0.005 and result["gpu"] < 0.005  # not the stalled batch's 5 ms per call
    assert result["synced"] < 0.05


def test_back_to_back_hands_every_calls_own_host_time_to_each(monkeypatch):
    """``back_to_back(..., each=list)`` (scripts/ll_back_to_back.py's host p50 / p90): one entry per
    call of every batch, the stalled call among them, while host and gpu stay the least batch's."""
    monkeypatch.setattr(measure.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(measure.torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(measure, "dist", types.SimpleNamespace(barrier=lambda: None))
    calls = []

    def call():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.05)
    each = []
    host, gpu = measure.back_to_back(call, 10, batches=3, each=each)
    assert len(each) == 30 and max(each) >= 0.05 and sorted(each)[15] < 0.005
    assert host < 0.005 and gpu < 0.005


def test_every_column_is_measured_before_any_columns_kernels_are_profiled():
    """The low-latency bench profiles kernels (torch.profiler) only after every column and the NCCL
    baseline were timed: a profile can leave later launches slower on the host, and a column timed
    after another's profile would carry that (each column was profiled right after its own timing)."""
    events = []

    def column(name):
        def measure_it():
            events.append(("measure", name))
            return lambda: name
        return measure_it

    kernels = bench.profiled_last({"epcomm": column("epcomm"), "deep_ep": column("deep_ep")},
                                  lambda fn: events.append(("profile", fn())) or [fn()],
                                  then=lambda: events.append(("measure", "nccl")))
    assert events == [("measure", "epcomm"), ("measure", "deep_ep"), ("measure", "nccl"),
                      ("profile", "epcomm"), ("profile", "deep_ep")]
    assert kernels == {"epcomm": ["epcomm"], "deep_ep": ["deep_ep"]}
