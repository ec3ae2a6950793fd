"""The measuring scripts' own logic, checked before any GPU work: scripts/profile_host.py's
``--variants`` (the full and cached dispatch's host time per one-node variant) goes with
``--full-only`` and takes only names ``epcomm bench normal --variants`` knows, so a lease's
profile part fails at once, not after its processes started; scripts/ll_back_to_back.py groups a
round trip's kernels and refuses names it does not know."""
import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "profile_host.py"


def _script(path=SCRIPT):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,message", [
    (["--variants", "doorbell-dispatch"], "goes with --full-only"),
    (["--full-only", "--variants", "doorbell-dispatch,nope"], "unknown normal-mode variant"),
    (["--full-only", "--functions", "10"], "does not go with --full-only"),
    (["--full-only", "--variants", "pull-1x,pull-2x,pull-3x,pull-4x,stage-1x"], "at most 4"),
])
def test_profile_host_refuses_options_that_do_not_go_together(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        _script().main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_profile_timeline_refuses_an_unknown_variant_before_any_gpu_work(capsys, monkeypatch):
    """scripts/profile_timeline.py --variants (each variant's full dispatch on the timeline: which
    of its kernels run when) takes the bench's names, checked first."""
    import sys
    monkeypatch.setattr(sys, "argv", ["profile_timeline.py", "--variants", "full-one-launch,nope"])
    with pytest.raises(SystemExit) as exit_info:
        _script(SCRIPT.parent / "profile_timeline.py").main()
    assert exit_info.value.code == 2 and "unknown normal-mode variant" in capsys.readouterr().err


def test_trace_items_refuses_a_bad_count_and_a_missing_gpu_before_starting_ranks(capsys, monkeypatch):
    """scripts/trace_items.py (speed_run.sh's trace part): --tokens below 1 is a usage error, and
    without the GPUs it needs it says so and exits 2 — before any rank's process starts."""
    import sys
    import torch
    monkeypatch.setattr(sys, "argv", ["trace_items.py", "--tokens", "0"])
    with pytest.raises(SystemExit) as exit_info:
        _script(SCRIPT.parent / "trace_items.py").main()
    assert exit_info.value.code == 2 and "--tokens must be positive" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["trace_items.py", "--ranks", "4"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _script(SCRIPT.parent / "trace_items.py").main() == 2
    assert "needs 4 CUDA GPUs" in capsys.readouterr().err


def test_ll_back_to_back_groups_each_round_trips_kernels_and_reads_the_gaps_between_them():
    """scripts/ll_back_to_back.py: a round trip starts at a dispatch kernel that follows another
    kernel, whatever each call launches (epcomm's one or two per call, DeepEP's one, a torch kernel
    between); ``period`` is start to start, ``busy`` the kernels' durations, ``idle`` the rest."""
    script = _script(SCRIPT.parent / "ll_back_to_back.py")
    kernels, now = [], 0
    for _ in range(6):  # two dispatch launches, a torch kernel, two combine launches; 3 µs between
        for name, length in (("ep_ll_dispatch", 10), ("ep_ll_dispatch", 20), ("vectorized", 1),
                             ("ep_ll_combine", 10), ("ep_ll_combine", 15)):
            kernels.append((now * 1000, length * 1000, name))
            now += length + 3
    trips = script._round_trips(kernels, "ep_ll_dispatch")
    assert len(trips) == 6 and all(len(trip) == 5 for trip in trips)
    assert script._steady(trips, 1) == {"period": 71.0, "kernels": 5, "busy": 56.0, "idle": 15.0}
    one = [(i * 50_000, 20_000, name) for i, name in enumerate(["dispatch<true>", "combine<false>"] * 3)]
    assert [len(trip) for trip in script._round_trips(one, "dispatch<")] == [2, 2, 2]


def test_ll_back_to_back_refuses_an_unknown_name_before_any_gpu_work(capsys, monkeypatch):
    import sys
    script = _script(SCRIPT.parent / "ll_back_to_back.py")
    for order in ("epcomm,nope", "epcomm+later"):
        monkeypatch.setattr(sys, "argv", ["ll_back_to_back.py", "--order", order])
        with pytest.raises(SystemExit) as exit_info:
            script.main()
        assert exit_info.value.code == 2 and "unknown --order names" in capsys.readouterr().err


def test_the_cpu_front_end_profile_runs_against_the_backend_interface():
    """``profile_host.py --cpu-front`` times Buffer's front end over a stub backend; the stub takes
    the Backend base's defaults, so a new step Buffer asks of every backend (refuse_capture once
    broke it: AttributeError) does not break the tool unseen."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process; the tool makes its own")
    report = _script()._cpu_front(16, rounds=1, number=2)
    assert "dispatch, full (top-k)" in report and "dispatch, cached" in report
