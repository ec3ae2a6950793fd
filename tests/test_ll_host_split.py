"""scripts/ll_host_split.py's bookkeeping, on the CPU: what it stamps per call and how it sums the
stamps (a wrong part here would send the next lease after the wrong cost)."""
import importlib.util
import pathlib
import time

import pytest
from host_clock import HostClockEvent

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "ll_host_split.py"


@pytest.fixture(scope="module")
def split():
    spec = importlib.util.spec_from_file_location("ll_host_split_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stamp_counts_its_time_inclusive_even_when_the_call_raises(split):
    """A launch inside the backend's method counts in both ("launch" is inside "mode"), a part
    inside itself once, and a call that raises is stamped too."""
    stamps = split._Stamps()

    def failing():
        raise RuntimeError("refused")
    launch = stamps.wrap("launch", lambda: sum(range(2000)))
    mode = stamps.wrap("mode", lambda: launch())
    mode()
    assert stamps.spent["mode"] >= stamps.spent["launch"] > 0
    inner = stamps.wrap("launch", lambda: sum(range(2000)))
    outer = stamps.wrap("launch", lambda: inner())  # (launch_resident falling back to launch)
    before = stamps.spent["launch"]
    started = time.perf_counter_ns()
    outer()
    assert stamps.spent["launch"] - before <= time.perf_counter_ns() - started  # counted once
    spent = stamps.spent["alloc"]
    with pytest.raises(RuntimeError):
        stamps.wrap("alloc", failing)()
    assert stamps.spent["alloc"] > spent


def test_the_summary_gives_median_p90_max_and_the_slow_calls_excess_by_part(split):
    """Calls over 1.5 x the median call are the slow ones; each part's excess is their mean over
    that part's own median: here the slow calls' extra time is all in the launch."""
    fast = [dict(call=20.0, front=5.0, launch=5.0, alloc=5.0, rest=5.0)] * 9
    slow = [dict(call=60.0, front=5.0, launch=45.0, alloc=5.0, rest=5.0)]
    stats, num_slow, excess = split._summary(fast + slow)
    assert stats["call"] == (20.0, 20.0, 60.0)
    assert stats["launch"][0] == 5.0 and stats["launch"][2] == 45.0
    assert num_slow == 1
    assert excess == pytest.approx(dict(call=40.0, front=0.0, launch=40.0, alloc=0.0, rest=0.0))
    assert split.PARTS == ("call", "front", "launch", "alloc", "rest")



class _Backend:
    """Stands in for the patched backend method and launch of one library."""

    def method(self, carried):
        return self.launch(carried)

    def launch(self, carried):
        return carried


def test_libraries_are_timed_unstamped_in_turn_and_only_epcomm_then_stamped(split, monkeypatch):
    """Whole calls of every library first, unstamped, A B A B; then epcomm's calls with the parts
    stamped, the patches restored after (also the stamps see only the stamped pass)."""
    monkeypatch.setattr(split.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(split.torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(split, "dist", type("D", (), {"barrier": staticmethod(lambda: None)}))
    order, backend = [], _Backend()
    original, original_launch = _Backend.method, _Backend.launch

    def calls(name):
        return {"dispatch": lambda carried: order.append((name, _Backend.method is original)) or backend.method(7),
                "combine": lambda handle: backend.method(handle)}
    stamps = split._Stamps()
    rows = split._measure({"epcomm": calls("epcomm"), "deep_ep": calls("deep_ep")}, stamps,
                          {(_Backend, "method"): "mode", (_Backend, "launch"): "launch"}, round_trips=3, batches=2)
    runs = [name for name, _ in order]
    assert runs == ["epcomm"] * 6 + ["deep_ep"] * 6 + ["epcomm"] * 6 + ["deep_ep"] * 6 + ["epcomm"] * 6
    assert all(unpatched for _, unpatched in order[:24]) and not any(unpatched for _, unpatched in order[24:])
    assert _Backend.method is original and _Backend.launch is original_launch  # restored
    assert set(rows) == {"epcomm", "deep_ep"} and "stamped" not in rows["deep_ep"]
    assert set(rows["epcomm"]["unstamped"]) == set(rows["epcomm"]["stamped"]) == {"dispatch", "combine"}
    stats, _, _ = rows["epcomm"]["stamped"]["dispatch"]
    assert stats["launch"][0] > 0 and stats["rest"][0] >= 0  # (the launch inside the method: stamped)
    stats, _, _ = rows["deep_ep"]["unstamped"]["dispatch"]
    assert stats["launch"] == (0.0, 0.0, 0.0) and stats["front"] == stats["call"]
    assert rows["epcomm"]["gpu"] > 0


def test_the_report_prints_both_passes_and_the_gpu_line_per_library_and_rank(split, monkeypatch, capsys):
    """One line per call and pass (stamped ones marked *), one gpu line per library, two header lines:
    speed_run.sh's ll-host part keeps the last 8 x ranks + 2 lines (epcomm 2 + 2 + 1, DeepEP 2 + 1)."""
    monkeypatch.setattr(split.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(split.torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(split, "dist", type("D", (), {"barrier": staticmethod(lambda: None)}))
    backend = _Backend()
    calls = {"dispatch": lambda carried: backend.method(7), "combine": lambda handle: backend.method(handle)}
    rows = split._measure({"epcomm": calls, "deep_ep": dict(calls)}, split._Stamps(),
                          {(_Backend, "launch"): "launch"}, round_trips=2, batches=1)
    rows["epcomm"]["backend"] = "nvlink"  # (rank_main adds the Buffer's: on the bed, the automatic one is nvshmem)
    split._report([rows, rows], tokens=128, round_trips=2, batches=1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 * 2 + 2 and "epcomm on nvlink" in lines[0]
    assert sum("dispatch *" in line for line in lines) == 2 and sum("gpu per round trip" in line for line in lines) == 4


def test_on_a_shared_gpu_the_peer_is_refused_before_any_rank_starts(split, monkeypatch, capsys):
    """--shared-gpu --peer deep_ep: DeepEP's low-latency kernels assert without a NIC's queue pairs
    and the process dies (2026-11-29e), so the script refuses it with that reason."""
    monkeypatch.setattr(split.sys, "argv", ["ll_host_split.py", "--shared-gpu", "--peer", "deep_ep"])
    monkeypatch.setattr(split.torch.cuda, "device_count", lambda: 1)
    assert split.main() == 2 and "queue pairs" in capsys.readouterr().err
