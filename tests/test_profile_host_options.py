"""scripts/profile_host.py's options are checked before any GPU work: ``--variants`` (the full and
cached dispatch's host time per one-node variant) goes with ``--full-only`` and takes only names
``epcomm bench normal --variants`` knows, so a lease's profile part fails at once, not after its
processes started."""
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
