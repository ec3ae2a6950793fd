"""The command line as a newcomer meets it: ``epcomm --version``, each subcommand's ``--help`` lists
only the options that subcommand reads, and counts read right in the singular ("1 GPU rank")."""
import argparse
import types

import pytest
from test_demo_cli import _epcomm

import epcomm
from epcomm.tools import bench
from epcomm.tools.args import counted

NORMAL_ONLY = ("--sms", "--extra-tokens", "--send-parts", "--p2p", "--variants", "--peer-configs",
               "--no-worst-tokens")


def test_version_prints_the_package_version():
    run = _epcomm("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"epcomm {epcomm.__version__}", run


@pytest.mark.parametrize("mode", ["normal", "low-latency"])
def test_each_bench_mode_lists_only_its_own_options(mode):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    modes = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    options = {option for action in modes.choices[mode]._actions for option in action.option_strings}
    listed = {option for option in NORMAL_ONLY if option in options}
    assert listed == (set(NORMAL_ONLY) if mode == "normal" else set()), (mode, listed)
    assert {"--tokens", "--hidden", "--reps", "--peer", "--ranks", "--ranks-per-node", "--out"} <= options


def test_low_latency_help_shows_its_own_default_token_count():
    out = _epcomm("bench", "low-latency", "--help").stdout
    assert "(0: 128)" in out and "4096" not in out and not any(option in out for option in NORMAL_ONLY), out


def test_counts_read_right_in_the_singular():
    assert counted(1, "GPU rank") == "1 GPU rank" and counted(4, "CPU rank") == "4 CPU ranks"
    assert counted(0, "case") == "0 cases"
    run = _epcomm("demo", "--ranks", "1", "--experts-per-rank", "1", "--topk", "2")
    assert run.returncode == 2 and "exceeds the 1 expert of 1 rank" in run.stderr, run.stderr


def test_bench_normal_variants_are_named_or_refused():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["normal", "--variants", "rank-order,pipelined-pull"])
    assert args.variants == ["rank-order", "pipelined-pull"]
    with pytest.raises(SystemExit):
        parser.parse_args(["normal", "--variants", "faster"])
    with pytest.raises(SystemExit):
        parser.parse_args(["normal", "--variants", "side-loads-after+faster"])


def test_a_bench_variant_joined_by_plus_sets_each_part_in_one_point():
    args = argparse.ArgumentParser()
    bench.add_arguments(args)
    assert args.parse_args(["normal", "--variants", "side-loads-after+gathered-index,pull-2x"]).variants == \
        ["side-loads-after+gathered-index", "pull-2x"]
    pytest.importorskip("triton")  # (the NormalMode's module holds the defaults)
    normal = types.SimpleNamespace()
    bench.use_normal_variants(normal, ["side-loads-after+gathered-index+pull-1x"])
    assert not normal.side_loads_first and normal.gathered_index and normal.pull_programs_per_sm == 1
    assert not normal.full_one_launch and normal.every_peer
    bench.use_normal_variants(normal, [])  # the defaults
    assert normal.side_loads_first and not normal.gathered_index and normal.pull_programs_per_sm == 3


def test_bench_low_latency_shows_the_two_launch_column_beside_the_default_and_deep_ep():
    """`epcomm bench low-latency --two-launch` runs every call in two launches as a further epcomm
    column in the same run; the ratio column stays the default's against DeepEP's."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["low-latency", "--two-launch"]).two_launch
    with pytest.raises(SystemExit):
        parser.parse_args(["normal", "--two-launch"])
    t, two = {"host": 2e-5, "gpu": 4e-5, "synced": 5e-5}, {"host": 1e-5, "gpu": 2e-5, "synced": 2e-5}
    peer = {"host": 2e-5, "gpu": 3e-5, "synced": 4e-5}
    result = {"world": 2, "device": "GPU", "backend": "nvlink", "peer": "deep_ep", "checks": {}, "decode_loop": {},
              "rows": [{"call": "low_latency_combine", "epcomm": t, "epcomm two-launch": two, "deep_ep": peer}],
              "kernels_us_per_round_trip": {"epcomm": [], "epcomm two-launch": [], "deep_ep": []},
              "settings": {"tokens": 128, "hidden": 7168, "num_topk": 8, "num_experts": 256}}
    table = bench.low_latency_table(result)
    header, row = table.splitlines()[2:4]
    assert "epcomm two-launch h/g/s" in header and header.index("epcomm two-launch") < header.index("deep_ep h/g/s")
    assert row.split()[-5:] == ["1.00", "/", "1.33", "/", "1.25"]  # epcomm ÷ deep_ep
    # any experiment's column shows, in the run's order (2026-11-28f: one was in the JSON only)
    result["rows"][0]["epcomm other"] = two
    result["kernels_us_per_round_trip"]["epcomm other"] = []
    header = bench.low_latency_table(result).splitlines()[2]
    assert header.index("epcomm two-launch") < header.index("epcomm other") < header.index("deep_ep h/g/s")


def test_bench_normal_can_run_deep_ep_on_its_own_recommended_configs():
    """`--peer-configs recommended`: the peer's dispatch and combine take its own
    get_dispatch_config / get_combine_config for the group's size (DeepEP's chunk sizes differ by
    size and call: 24 / 10 tokens at 2 ranks, 6 / 4 at 8) on the same SMs as epcomm; "same" (the
    default) gives both Config(sms, 8, 256). The combine gets its own config and the title says so."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["normal"]).peer_configs == "same"
    assert parser.parse_args(["normal", "--peer-configs", "recommended"]).peer_configs == "recommended"
    with pytest.raises(SystemExit):
        parser.parse_args(["low-latency", "--peer-configs", "recommended"])
    calls = []

    class Peer:
        Config = staticmethod(lambda *fields: ("Config",) + fields)

        class Buffer:
            sms = 20

            @classmethod
            def set_num_sms(cls, sms):
                cls.sms = sms

            @classmethod
            def get_dispatch_config(cls, num_ranks):
                return ("dispatch", cls.sms, num_ranks)

            @classmethod
            def get_combine_config(cls, num_ranks):
                return ("combine", cls.sms, num_ranks)
    assert bench._peer_configs(Peer, "same", 24, 8) == (("Config", 24, 8, 256),) * 2
    assert bench._peer_configs(Peer, "recommended", 24, 8) == (("dispatch", 24, 8), ("combine", 24, 8))

    class Recording:
        def get_dispatch_layout(self, topk_idx, num_experts):
            return None, None, None, None, None

        def dispatch(self, x, **kwargs):
            calls.append(("dispatch", kwargs.get("config")))
            return x, None, None, None, "handle", None

        def combine(self, x, handle, config=None):
            calls.append(("combine", config))
    closures = bench._normal_calls(Recording(), "D", "C", "x", "x8", None, None, 8)[0]
    closures["combine, BF16"]()
    closures["dispatch, cached, BF16"]()
    assert calls[-2:] == [("combine", "C"), ("dispatch", "D")]
    settings = dict(hidden=7168, num_topk=8, num_experts=256, sms=24, peer_configs="recommended")
    t = {"host": 1e-5, "gpu": 2e-5, "synced": 3e-5}
    point = {"tokens": 4096, "sms": 24, "recv_tokens": 1, "checks": {},
             "rows": [{"call": "dispatch, full, BF16", "epcomm": t, "deep_ep": t, "nccl": t}]}
    result = {"world": 2, "device": "GPU", "backend": "nvlink", "peer": "deep_ep", "settings": settings,
              "points": [point]}
    assert "deep_ep: its recommended configs" in bench.normal_table(result).splitlines()[0]


def test_bench_normal_runs_the_num_worst_rows_unless_told_not_to():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["normal"]).no_worst_tokens is False and bench.NormalBenchSettings().worst_tokens
    assert parser.parse_args(["normal", "--no-worst-tokens"]).no_worst_tokens is True
