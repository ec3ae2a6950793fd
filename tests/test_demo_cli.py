"""The demo (the main job) and the CLI."""
import os
import subprocess
import sys

from epcomm.tools import demo

ENV = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"), EPCOMM_DEMO_CPU="1")


def test_demo_passes_on_two_cpu_ranks(capsys):
    assert demo.run_demo(2, demo.DemoSettings(tokens=16, hidden=256, iters=1)) == 0
    out = capsys.readouterr().out
    assert "normal" in out and "low-latency" in out and "MISMATCH" not in out


def test_demo_reports_mismatch(monkeypatch, capsys):
    monkeypatch.setattr(demo, "TOLERANCE", {"normal": 0.0, "low-latency": 0.0})
    assert demo.run_demo(2, demo.DemoSettings(tokens=8, hidden=128, iters=1)) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_cli_info_and_demo():
    info = subprocess.run([sys.executable, "-m", "epcomm", "info"], capture_output=True, text=True, env=ENV)
    assert info.returncode == 0 and "torch" in info.stdout and "backend" in info.stdout
    run = subprocess.run([sys.executable, "-m", "epcomm", "demo", "--ranks", "2", "--tokens", "8", "--hidden", "128",
                          "--iters", "1"], capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK" in run.stdout


def test_bench_needs_gpus(monkeypatch):
    import torch
    from epcomm.tools import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["normal"]) == 2
    assert bench.main(["low-latency"]) == 2


def test_cli_check_on_cpu_ranks():
    run = subprocess.run([sys.executable, "-m", "epcomm", "check", "--ranks", "2", "--cases", "6"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "normal mode" in run.stdout and "low-latency" in run.stdout and "OK" in run.stdout
