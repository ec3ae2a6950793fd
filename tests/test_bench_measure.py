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


class _WorstBuffer:
    """Records each dispatch's keywords; returns DeepEP's six outputs, recv_x a marker of the call."""

    def __init__(self):
        self.calls = []

    def dispatch(self, x, **kwargs):
        self.calls.append(kwargs)
        return (f"rows of call {len(self.calls)}", "top-k ids", "weights", None, None, None)


def test_the_num_worst_rows_dispatch_eagerly_and_replay_one_captured_graph():
    """``epcomm bench normal``'s num_worst_tokens rows: the full dispatch's own keywords plus
    num_worst_tokens, eagerly and as one CUDA graph of that call, replayed once before its rows
    are checked (a graph's output holds what its last replay wrote)."""
    buffer, replays = _WorstBuffer(), []
    graph = types.SimpleNamespace(replay=lambda: replays.append(1))

    def capture(fn):
        return graph, fn()
    calls, received, failure = bench._num_worst_calls(buffer, "x", {"topk_idx": "t", "config": "c"}, 4096,
                                                      capture=capture)
    assert failure is None and list(calls) == [bench.WORST_EAGER, bench.WORST_GRAPH]
    assert buffer.calls == [{"num_worst_tokens": 4096, "topk_idx": "t", "config": "c"}] * 2
    assert received == {bench.WORST_EAGER: ("rows of call 1", "top-k ids", "weights"),
                        bench.WORST_GRAPH: ("rows of call 2", "top-k ids", "weights")}
    assert replays == [1] and calls[bench.WORST_GRAPH] is graph.replay


def test_a_capture_that_raises_leaves_the_eager_row_and_names_the_error():
    def capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")
    calls, received, failure = bench._num_worst_calls(_WorstBuffer(), "x", {}, 8, capture=capture)
    assert list(calls) == [bench.WORST_EAGER] and list(received) == [bench.WORST_EAGER]
    assert failure == "RuntimeError: operation not permitted when stream is capturing"
    no_graph = bench._num_worst_calls(_WorstBuffer(), "x", {}, 8, graph=False, capture=capture)
    assert list(no_graph[0]) == [bench.WORST_EAGER] and no_graph[2] is None


def test_a_library_without_num_worst_tokens_gets_no_rows_and_a_named_failure():
    def refuse(x, **kwargs):
        raise TypeError("dispatch() got an unexpected keyword argument 'num_worst_tokens'")
    older = types.SimpleNamespace(dispatch=refuse)
    calls, received, failure = bench._num_worst_calls(older, "x", {}, 8)
    assert calls == {} and received == {} and failure.startswith("TypeError: dispatch() got an unexpected")


class _Capture:
    """Stand-ins for torch.cuda's streams and graphs; ``fail`` makes the capture raise."""

    def __init__(self, monkeypatch, fail):
        import contextlib
        cuda = bench.torch.cuda

        @contextlib.contextmanager
        def graph(g):
            yield
            if fail:
                raise RuntimeError("operation not permitted when stream is capturing")
        stream = types.SimpleNamespace(wait_stream=lambda other: None)
        for attr, value in (("Stream", lambda: stream), ("stream", lambda s: contextlib.nullcontext()),
                            ("current_stream", lambda: stream), ("synchronize", lambda: None),
                            ("CUDAGraph", lambda: "graph"), ("graph", graph)):
            monkeypatch.setattr(cuda, attr, value)
        monkeypatch.setattr(bench, "dist", types.SimpleNamespace(barrier=lambda: None))


def test_a_capture_failing_on_any_rank_raises_on_every_rank_after_they_agree(monkeypatch):
    """bench._capture: every rank reaches the agreement (one all-reduce) whether its capture worked
    or not, then raises where any rank's failed, so no rank replays a graph its peers lack and the
    ranks' later calls still pair up."""
    import pytest
    agreed = []

    def on_every_rank(flag, peers_ok=True):
        agreed.append(flag)
        return flag and peers_ok
    _Capture(monkeypatch, fail=False)
    monkeypatch.setattr(bench, "_on_every_rank", on_every_rank)
    assert bench._capture(lambda: "out") == ("graph", "out") and agreed == [True]
    monkeypatch.setattr(bench, "_on_every_rank", lambda flag: on_every_rank(flag, peers_ok=False))
    with pytest.raises(RuntimeError, match="failed on another rank"):  # this rank's worked, a peer's did not
        bench._capture(lambda: "out")
    _Capture(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="not permitted"):  # its own error, after the agreement
        bench._capture(lambda: "out")
    assert agreed == [True, True, False]


def test_the_num_worst_check_compares_rows_and_top_k_with_the_full_dispatch(monkeypatch):
    """A num_worst_tokens form passes its check only where its first rows equal epcomm's full
    dispatch and its top-k ids and weights equal the library's own full dispatch's."""
    import torch
    full = (torch.arange(6.).view(3, 2), torch.tensor([[0], [1], [-1]]), torch.tensor([[.5], [.25], [0.]]))
    padded = [torch.cat([t, torch.full_like(t[:1], 7)]) for t in full]  # one padding row past the received
    for wrong, passes in ((None, True), (1, False), (2, False)):
        outputs = [t.clone() for t in padded]
        if wrong is not None:
            outputs[wrong][0] += 1
        # (a two-level Buffer's: no graph row, so no capture on this CPU)
        buffer = types.SimpleNamespace(dispatch=lambda x, **kwargs: (*outputs, None, None, None),
                                       backend_name="nvshmem")
        monkeypatch.setattr(bench, "measure", lambda fn, reps, flush: {"host": 1, "gpu": 1, "synced": 1})
        results, checks = {}, {}
        bench._measure_num_worst("epcomm", buffer, "x", {}, 4, full[0], full, results, checks, 3, None, set())
        assert checks == {"epcomm num_worst == full": passes}, (wrong, checks)
        assert list(results) == [bench.WORST_EAGER] and results[bench.WORST_EAGER]["epcomm"]["gpu"] == 1


def test_a_library_whose_capture_failed_is_not_captured_again_in_the_run(monkeypatch):
    """A failed capture may leave a library's state behind: the run's later points time that
    library's eager num_worst_tokens row only."""
    captures = []

    def capture(fn):
        captures.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(bench, "_capture", capture)
    monkeypatch.setattr(bench, "measure", lambda fn, reps, flush: {"host": 1, "gpu": 1, "synced": 1})
    import torch
    full = (torch.zeros(2, 2), torch.zeros(2, 1), torch.zeros(2, 1))
    buffer = types.SimpleNamespace(dispatch=lambda x, **kwargs: (*full, None, None, None))
    no_graph = set()
    for point in range(2):
        results, checks = {}, {}
        bench._measure_num_worst("deep_ep", buffer, "x", {}, 2, full[0], full, results, checks, 3, None, no_graph)
        assert list(results) == [bench.WORST_EAGER] and checks["deep_ep num_worst == full"]
        assert any("graph capture" in name for name in checks) == (point == 0)
    assert captures == [1] and no_graph == {"deep_ep"}


def test_the_peers_buffers_are_destroyed_explicitly_after_a_barrier(monkeypatch):
    """DeepEP's Buffer is made with explicitly_destroy (its destructor's release may hang Python's
    exception handling) and destroyed after a barrier, every rank done with its kernels."""
    events = []

    class PeerBuffer:
        def __init__(self, group, **kwargs):
            self.kwargs = kwargs

        def destroy(self):
            events.append(("destroy", self))
    monkeypatch.setattr(measure, "dist", types.SimpleNamespace(barrier=lambda: events.append("barrier")))
    peer = types.SimpleNamespace(Buffer=PeerBuffer)
    first = measure.peer_buffer(peer, None, num_nvl_bytes=1 << 20)
    second = measure.peer_buffer(peer, None, low_latency_mode=True)
    assert first.kwargs == {"explicitly_destroy": True, "num_nvl_bytes": 1 << 20}
    assert second.kwargs["explicitly_destroy"] and second.kwargs["low_latency_mode"]
    measure.release_peer_buffers(first, second)
    assert events == ["barrier", ("destroy", first), ("destroy", second)]
