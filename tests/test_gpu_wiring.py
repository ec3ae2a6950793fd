"""Both GPU backends hand the same calls on the same way (backends/gpu/wiring.py): the call board's
reports and resync, normal-mode and low-latency calls to their modes. Checked with recording
stand-ins, no GPU (importing the backends needs Triton, which the CPU CI does not install)."""
import types

import pytest

pytest.importorskip("triton")


class _Recorder:
    def __init__(self, calls, name):
        self._calls, self._name = calls, name

    def __getattr__(self, method):
        return lambda *args: self._calls.append((self._name, method, args)) or (self._name, method)


def _wired(cls, low_latency=True):
    calls = []
    backend = object.__new__(cls)
    board = types.SimpleNamespace(raise_pending=lambda b: calls.append(("board", "raise_pending", (b,))),
                                  resync=lambda device: calls.append(("board", "resync", (device,))),
                                  needs_resync=True, generation=7)
    backend.seat, backend.device = types.SimpleNamespace(board=board), "cuda:0"
    backend.normal = _Recorder(calls, "normal")
    backend.normal.written = backend.normal.host_epochs = False
    backend.low_latency = _Recorder(calls, "low_latency") if low_latency else None
    return backend, calls


@pytest.mark.parametrize("backend_name", ["nvlink", "nvshmem"])
def test_a_gpu_backend_hands_each_call_to_its_mode_and_the_board(backend_name):
    from epcomm.backends.nvlink.backend import NVLinkBackend
    from epcomm.backends.nvshmem.backend import NvshmemBackend
    cls = NVLinkBackend if backend_name == "nvlink" else NvshmemBackend
    assert not cls.__abstractmethods__
    backend, calls = _wired(cls)
    assert backend.dispatch("args") == ("normal", "dispatch")
    assert backend.combine("x", "handle", "w", (), "config") == ("normal", "combine")
    backend.check_dispatch("args")
    backend.check_combine("x", "handle", "w", ())
    assert backend.low_latency_dispatch("ll") == ("low_latency", "dispatch")
    assert backend.low_latency_combine("ll") == ("low_latency", "combine")
    backend.check_low_latency_dispatch("ll")
    backend.check_low_latency_combine("ll")
    backend.raise_pending()
    backend.resync()
    assert backend.needs_resync and backend.resync_generation == 7
    assert [(who, method) for who, method, _ in calls] == [
        ("normal", "dispatch"), ("normal", "combine"), ("normal", "check_dispatch"), ("normal", "check_combine"),
        ("low_latency", "dispatch"), ("low_latency", "combine"), ("low_latency", "check_dispatch"),
        ("low_latency", "check_combine"), ("board", "raise_pending"), ("board", "resync")]


@pytest.mark.parametrize("host_epochs", [False, True])
def test_a_captured_call_goes_to_the_mode_to_be_refused(monkeypatch, host_epochs):
    """GpuBackend.refuse_capture: a dispatch asks whether the stream is being captured (the answer
    returned, for DispatchArgs.capturing) and, captured, hands the call to its mode's
    refuse_capture; a combine asks only for a mode whose epochs live on the host (two-level)."""
    from epcomm.backends.gpu import wiring
    from epcomm.backends.nvlink.backend import NVLinkBackend
    backend, calls = _wired(NVLinkBackend)
    backend.normal.host_epochs = host_epochs
    for capturing in (True, False):
        monkeypatch.setattr(wiring, "stream_capturing", lambda: capturing)
        calls.clear()
        assert backend.refuse_capture("dispatch", None, 0) is capturing
        assert backend.refuse_capture("combine") is (capturing if host_epochs else None)
        refused = [("refuse_capture", ("dispatch", None, 0))] + \
            ([("refuse_capture", ("combine", None, 0))] if host_epochs else []) if capturing else []
        assert [(method, args) for _, method, args in calls] == refused


def test_the_one_node_mode_refuses_only_a_captured_full_dispatch_without_num_worst_tokens():
    """A full dispatch waits on the host for its counts, which a capture never computes: EPError
    naming num_worst_tokens (not EPInputError, whose abort would be captured); with
    num_worst_tokens, a handle, or a combine the call replays (tests/graph_cases.py on a GPU)."""
    from epcomm.backends.gpu.normal.one_node.mode import NormalMode
    from epcomm.errors import EPError, EPInputError
    mode = object.__new__(NormalMode)
    with pytest.raises(EPError, match="num_worst_tokens") as raised:
        mode.refuse_capture("dispatch", None, 0)
    assert not isinstance(raised.value, EPInputError) and not mode.host_epochs
    mode.refuse_capture("dispatch", None, 64)
    mode.refuse_capture("dispatch", "handle", 0)
    mode.refuse_capture("combine", None, 0)


def test_the_two_level_mode_refuses_every_captured_call():
    """Its step barrier counts epochs on the host and even its num_worst_tokens dispatch reads the
    counts there: no dispatch or combine of it replays, so inside a capture each raises EPError."""
    from epcomm.backends.gpu.normal.two_level.mode import TwoLevelMode
    from epcomm.errors import EPError, EPInputError
    mode = object.__new__(TwoLevelMode)
    mode.backend_name = "nvshmem"
    assert mode.host_epochs
    for kind, handle, worst in (("dispatch", None, 64), ("dispatch", "handle", 0), ("combine", None, 0)):
        with pytest.raises(EPError, match=f"a {kind} of the nvshmem backend.*cannot be captured") as raised:
            mode.refuse_capture(kind, handle, worst)
        assert not isinstance(raised.value, EPInputError)


def test_the_nvshmem_backend_without_a_low_latency_workspace_says_so():
    from epcomm.backends.nvshmem.backend import NvshmemBackend
    from epcomm.errors import EPError
    backend, _ = _wired(NvshmemBackend, low_latency=False)
    with pytest.raises(EPError, match="no low-latency workspace"):
        backend.low_latency_dispatch("ll")


def test_nvlink_with_ranks_sharing_a_gpu_says_why_where_nvshmem_is_missing():
    """Ranks sharing a GPU take the nvlink backend's memory from NVSHMEM (nvlink/backend.py); a
    process without NVSHMEM gets an EPError naming both reasons, not PyTorch's refusal."""
    from epcomm.backends.gpu.reach.nvshmem import nvshmem_available
    from epcomm.backends.nvlink.backend import NVLinkBackend
    from epcomm.errors import EPError
    if nvshmem_available()[0]:
        pytest.skip("NVSHMEM is usable here")
    backend = object.__new__(NVLinkBackend)
    backend.memory_kind, backend.group, backend.device = "nvshmem", None, "cuda:0"
    with pytest.raises(EPError, match="share a GPU.*NVSHMEM is not usable"):
        backend._symmetric(64)


@pytest.mark.parametrize("memory", ["nvshmem", "cuda"])
def test_nvlink_destroy_gives_nvshmem_memory_back_to_the_ledger_at_once(memory):
    """Where ranks share a GPU the nvlink backend's workspace is NVSHMEM's, through the ledger
    (reach/symmetric_heap.py): destroy() must hand it back then, as the nvshmem backend does, not
    when the last reference to the Buffer dies. The bed's lifetime check at 8 x 8 found a destroyed
    nvlink Buffer's workspace held on every rank while a caller still had a name for the Buffer."""
    from epcomm.backends.nvlink.backend import NVLinkBackend

    class LedgerMemory:
        released = False

        def release(self):
            self.released = True

    backend = object.__new__(NVLinkBackend)
    ledger_memory = LedgerMemory() if memory == "nvshmem" else None
    backend._ledger_memory = ledger_memory
    backend.ws = backend.normal = backend.low_latency = object()  # (each holds the workspace)
    backend.destroy()
    assert backend.released and backend.ws is None and backend.normal is None and backend.low_latency is None
    assert ledger_memory is None or ledger_memory.released
