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
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines()
            if line.split() and line.split()[0] in ("normal", "low-latency")}
    assert set(rows) == {"normal", "low-latency"}
    for mode, (_, backend, ranks, tokens_per_s, error, limit, result) in rows.items():
        assert backend == "torch_dist" and int(ranks) == 2 and float(tokens_per_s) > 0, rows[mode]
        assert float(error) <= float(limit) and result == "OK", rows[mode]


def _epcomm(*args, **env):
    return subprocess.run([sys.executable, "-m", "epcomm", *args], capture_output=True, text=True,
                          env=dict(ENV, **env), timeout=120)


def test_cli_usage_errors_are_one_line():
    for args, words in ((("demo", "--hidden", "100"), "multiple of 128"), (("demo", "--tokens", "0"), ">= 1"),
                        (("bench", "normal", "--reps", "x"), "whole number")):
        run = _epcomm(*args)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert words in run.stderr.splitlines()[-1], run.stderr


def test_cli_numeric_options_are_checked_in_one_line():
    """Every numeric option of every command: a bad value is a one-line usage error (exit 2)."""
    for args, words in ((("check", "--ranks", "-1"), "--ranks: must be >= 0"),
                        (("demo", "--ranks", "-3"), "--ranks: must be >= 0"),
                        (("bench", "normal", "--tokens", "-5"), "--tokens: must be >= 0"),
                        (("bench", "normal", "--ranks-per-node", "-1"), "--ranks-per-node: must be >= 0"),
                        (("bench", "normal", "--sms", "24,-2"), "--sms: must be >= 1"),
                        (("model", "--nic-gbps", "-2"), "--nic-gbps: must be a finite number > 0"),
                        (("model", "--latency-us", "nan"), "--latency-us: must be a finite number >= 0"),
                        (("model", "--ll-tokens", "-1"), "--ll-tokens: must be >= 0")):
        run = _epcomm(*args)
        assert run.returncode == 2 and "Traceback" not in run.stderr, (args, run.stderr)
        assert words in run.stderr.splitlines()[-1], (args, run.stderr)


def test_cli_model_without_a_usable_node_count_is_an_error():
    run = _epcomm("model", "--experts", "7")
    assert run.returncode == 2 and "--experts 7" in run.stderr.strip() and len(run.stderr.strip().splitlines()) == 1


def test_cli_list_defaults_print_as_typed():
    out = _epcomm("bench", "normal", "--help").stdout
    assert "(default: 24)" in out and "(default: 512)" in out and "[24]" not in out
    assert "2 or more CUDA GPUs" in _epcomm("bench", "--help").stdout
    low_latency = _epcomm("bench", "low-latency", "--help").stdout
    assert "Normal mode" in out and "Low-latency mode" in low_latency and "2 or more CUDA GPUs" in low_latency
    assert "(default: 2,4)" in _epcomm("model", "--help").stdout


def test_cli_help_shows_options_and_defaults():
    run = _epcomm("bench", "normal", "--help")
    assert run.returncode == 0 and "rest" not in run.stdout
    for option in ("--tokens", "--hidden", "--sms", "--peer", "--out", "(default: 7168)"):
        assert option in run.stdout, option
    assert "(default: 64)" in _epcomm("demo", "--help").stdout


def test_cli_info_rejects_nvlink_without_cuda():
    run = _epcomm("info", EPCOMM_BACKEND="nvlink")
    assert run.returncode == 2 and "no CUDA GPU" in run.stderr


def test_bench_needs_gpus(monkeypatch):
    import torch
    from epcomm.tools import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["normal"]) == 2
    assert bench.main(["low-latency"]) == 2


def test_bench_on_one_shared_gpu_needs_one_gpu_and_refuses_deep_eps_low_latency(monkeypatch, capsys, tmp_path):
    """--shared-gpu runs its ranks on GPU 0 (the bed's host-time comparison): one GPU is enough
    for it and not without it; DeepEP's low-latency kernels cannot run there (no NIC's QPs)."""
    import torch
    from epcomm.tools import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.main(["normal"]) == 2 and "at least 2 CUDA GPUs" in capsys.readouterr().err
    assert bench.main(["low-latency", "--shared-gpu", "--peer", "deep_ep"]) == 2
    assert "IBGDA" in capsys.readouterr().err
    ran = []
    monkeypatch.setattr("epcomm.testing.run_distributed", lambda fn, world, *a, backend, **k: ran.append(
        (world, backend)) or [{"ok": True}])
    monkeypatch.setattr(bench, "low_latency_table", lambda result: "table")
    assert bench.main(["low-latency", "--shared-gpu", "--out", str(tmp_path)]) == 0
    assert ran == [(2, "shared-gpu")] and "share GPU 0" in capsys.readouterr().out


def test_cli_check_on_cpu_ranks():
    run = subprocess.run([sys.executable, "-m", "epcomm", "check", "--ranks", "4", "--cases", "6"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "normal mode" in run.stdout and "low-latency" in run.stdout and "OK" in run.stdout
    assert "[c10d]" not in run.stderr and "waitForInput" not in run.stderr, run.stderr[-2000:]


def test_bench_tables_show_each_sms_setting_and_the_decode_loop():
    """`--sms` takes a list (one table per setting) and the low-latency table has a
    decode-loop row (median and p99 of barrier; dispatch + combine; sync)."""
    import argparse
    from epcomm.tools import bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["normal", "--sms", "24,8"]).sms == [24, 8]
    t = {"host": 1e-5, "gpu": 2e-5, "synced": 3e-5}
    rows = [{"call": "dispatch, full, BF16", "epcomm": t, "nccl": t}]
    points = [{"tokens": 4096, "sms": sms, "recv_tokens": 10, "rows": rows, "checks": {}} for sms in (24, 8)]
    result = {"world": 2, "device": "GPU", "backend": "nvlink", "peer": None, "points": points,
              "settings": {"hidden": 7168, "num_topk": 8, "num_experts": 256, "sms": 24}}
    table = bench.normal_table(result)
    assert "Config(24, 8, 256)" in table and "Config(8, 8, 256)" in table
    ll = {"world": 2, "device": "GPU", "backend": "nvlink", "peer": "deep_ep", "rows": [], "checks": {},
          "kernels_us_per_round_trip": {}, "settings": {"tokens": 128, "hidden": 7168, "num_topk": 8,
                                                         "num_experts": 256, "decode_pairs": 100},
          "decode_loop": {"epcomm": {"median": 80e-6, "p99": 120e-6}, "deep_ep": {"median": 72e-6, "p99": 90e-6}}}
    lines = bench.low_latency_table(ll)
    assert "epcomm median 80.0 p99 120.0" in lines and "decode loop epcomm / deep_ep (median): 1.11x" in lines


def test_bench_transport_settings_of_the_nvshmem_backend():
    """`--send-parts` and `--p2p` (0/1 lists) need virtual nodes, and each point's
    table says which transport setting it ran."""
    import argparse
    from epcomm.tools import bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["normal", "--p2p", "1,0"]).p2p == [1, 0]
    run = _epcomm("bench", "normal", "--p2p", "2")
    assert run.returncode == 2 and "0 or 1" in run.stderr.splitlines()[-1], run.stderr
    t = {"host": 1e-5, "gpu": 2e-5, "synced": 3e-5}
    rows = [{"call": "dispatch, full, BF16", "epcomm": t, "nccl": t}]
    points = [{"tokens": 4096, "sms": 24, "recv_tokens": 10, "rows": rows, "checks": {}, "send_parts": parts, "p2p": p2p}
              for parts, p2p in ((1, True), (4, False))]
    result = {"world": 2, "device": "GPU", "backend": "nvshmem", "peer": None, "points": points,
              "settings": {"hidden": 7168, "num_topk": 8, "num_experts": 256, "sms": 24}}
    table = bench.normal_table(result)
    assert "send_parts 1, p2p 1" in table and "send_parts 4, p2p 0" in table


def test_bench_normal_shows_every_ranks_figure_and_marks_the_slowest():
    """A collective call runs at its slowest rank's pace, which need not be rank 0: the table adds
    each call's gpu and synced µs on every rank (from each rank's own result), the slowest marked."""
    from epcomm.tools import bench_tables

    def rank_result(gpu_us):
        t = {"host": 1e-5, "gpu": gpu_us * 1e-6, "synced": 2 * gpu_us * 1e-6}
        rows = [{"call": "dispatch, full, BF16", "epcomm": t}, {"call": "combine, BF16", "epcomm": t,
                                                                 "deep_ep": dict(t, gpu=5e-4)}]
        return {"world": 3, "device": "GPU", "backend": "nvlink", "peer": "deep_ep",
                "points": [{"tokens": 4096, "sms": 24, "recv_tokens": 10, "rows": rows, "checks": {}}],
                "settings": {"hidden": 7168, "num_topk": 8, "num_experts": 256, "sms": 24}}
    result = bench_tables.with_every_rank([rank_result(us) for us in (500, 620, 510)])
    assert result["points"][0]["every_rank"]["combine, BF16"]["epcomm"] == [[500, 620, 510], [1000, 1240, 1020]]
    line = next(line for line in bench_tables.normal_table(result).splitlines()
                if line.startswith("combine, BF16") and "|" in line and "*" in line)
    assert "epcomm 500 620* 510 | 1000 1240* 1020" in line, line
