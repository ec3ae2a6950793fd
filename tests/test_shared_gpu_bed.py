"""The CPU-checkable parts of the many-ranks-on-one-GPU bed (tests/test_shared_gpu.py): the
group-limited routing DeepEP's internode tests use, the automatic backend's choice where ranks
share a GPU, and whose memory the nvlink backend takes there."""
import os
import re
import subprocess

import pytest
import torch

from epcomm.backends.nvlink import one_host_one_gpu_each, workspace_memory
from epcomm.errors import EPError
from epcomm.testing import group_limited_topk


def test_group_limited_routing_stays_within_the_best_groups():
    g = torch.Generator().manual_seed(3)
    topk = group_limited_topk(500, 256, 8, num_groups=8, topk_groups=2, generator=g)
    assert topk.shape == (500, 8) and topk.dtype == torch.int64
    assert bool(((topk >= 0) & (topk < 256)).all())
    groups = topk // 32
    assert all(len(set(row)) <= 2 for row in groups.tolist()), "a token reached more than 2 node groups"
    assert all(len(set(row)) == 8 for row in topk.tolist()), "experts repeat within a token"


def test_group_limited_routing_with_fewer_groups_than_asked():
    topk = group_limited_topk(10, 32, 4, num_groups=1, topk_groups=2, generator=torch.Generator().manual_seed(0))
    assert topk.shape == (10, 4) and bool(((topk >= 0) & (topk < 32)).all())


def test_nvlink_needs_one_host_and_a_gpu_per_rank():
    assert one_host_one_gpu_each([("a", "GPU-0"), ("a", "GPU-1")])
    assert not one_host_one_gpu_each([("a", "GPU-0"), ("a", "GPU-0")]), "two ranks on one GPU (MPS)"
    assert not one_host_one_gpu_each([("a", "GPU-0"), ("b", "GPU-1")]), "two hosts"


def test_nvlink_takes_nvshmem_memory_where_ranks_share_a_gpu():
    """PyTorch's CUDA symmetric memory maps one allocation per GPU and refuses a second, so ranks
    sharing a GPU (CUDA MPS) get NVSHMEM's mapping; ranks on several hosts are refused by name."""
    assert workspace_memory([("a", "GPU-0"), ("a", "GPU-1")]) == "cuda"
    assert workspace_memory([("a", "GPU-0")] * 8) == "nvshmem"
    assert workspace_memory([("a", "GPU-0"), ("a", "GPU-0"), ("a", "GPU-1"), ("a", "GPU-1")]) == "nvshmem"
    with pytest.raises(EPError, match="one host.*spans 2 .*nvshmem backend"):
        workspace_memory([("a", "GPU-0"), ("b", "GPU-0")])


def test_ranks_sharing_a_gpu_get_grids_that_leave_a_late_sender_an_sm():
    """Ranks sharing one GPU: every rank's waiting programs together stay below the SMs, so a rank
    whose sender kernel starts late still gets one (finding 14: at 24 and at 8 programs per rank
    the nvlink backend's waits ran into the timeout at 8 x 8 and 4 x 4). The caps are the Buffer's
    own now (gpu/shared_grids.py), not the bed's; one rank per GPU is not capped."""
    from epcomm.backends.gpu.shared_grids import GridCaps, grid_caps
    for sms in (132, 78):  # H100 SXM / a smaller part
        for ranks in (2, 4, 8, 16):
            nvlink = grid_caps(sms, ranks, "nvlink")
            assert nvlink.num_sms % 2 == 0 and nvlink.num_sms >= 2
            if 4 * 2 * ranks < sms:  # (the floor of 2 programs cannot shrink further)
                assert ranks * 4 * nvlink.num_sms < sms, (sms, ranks, nvlink)  # the combine reduce: 4 x num_sms each
            nvshmem = grid_caps(sms, ranks, "nvshmem")
            assert 2 <= nvshmem.num_sms <= 24 and ranks * nvshmem.num_sms <= max(sms // 2, 2 * ranks)
            for caps in (nvlink, nvshmem):  # spinning receivers leave a quarter; senders fit in it
                assert ranks * caps.ll_receive_programs <= max(3 * sms // 4, 2 * ranks), (sms, ranks, caps)
                assert 1 <= ranks * caps.ll_send_programs <= max(sms // 4, ranks), (sms, ranks, caps)
    assert grid_caps(132, 8, "nvlink").num_sms == 4 and grid_caps(132, 16, "nvshmem").num_sms == 4
    assert grid_caps(132, 8, "nvshmem").ll_receive_programs == 12  # (the bed's EPCOMM_LL_RECEIVE_PROGRAMS was 96 // 8)
    assert grid_caps(132, 1, "nvlink") == GridCaps() and grid_caps(132, 1, "nvlink", 7) == GridCaps(0, 0, 7)
    assert grid_caps(132, 8, "nvlink", 5).ll_receive_programs == 5  # a smaller explicit cap wins
    assert grid_caps(132, 8, "nvlink", 500).ll_receive_programs == 12


def test_grids_are_capped_alike_on_every_rank():
    """The caps come from the whole group's places (the most ranks on any one GPU, the fewest SMs),
    so every rank caps alike: the two-level kernels need the same channel count everywhere."""
    from epcomm.backends.gpu.shared_grids import sharing
    places = [("a", "GPU-0", 132)] * 3 + [("a", "GPU-1", 132), ("b", "GPU-0", 78)]
    assert sharing(places) == (3, 78)
    assert sharing([("a", f"GPU-{i}", 132) for i in range(8)]) == (1, 132)


SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "shared_gpu.sh")
PRESETS = ["scale", "scale16x2", "small", "graphs", "fuzz", "faults", "sequence", "engines", "nvlink",
           "nvlink-faults"]


def _dry_run(part, **env):
    done = subprocess.run(["bash", SCRIPT, part], env=dict(os.environ, DRY_RUN="1", **env), capture_output=True,
                          text=True, timeout=30)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("part", PRESETS)
def test_every_preset_names_whole_nodes_and_tests_that_exist(part):
    """Each preset's shapes are ranks x ranks per node with whole nodes, and its -k words match
    tests of tests/test_shared_gpu.py (a renamed test would otherwise select nothing, silently)."""
    rc, out = _dry_run(part)
    assert rc == 0, out
    shapes = re.search(r"shapes=(\S+)", out).group(1).split(",")
    for shape in shapes:
        ranks, per_node = (int(v) for v in shape.split("x"))
        assert ranks % per_node == 0 and ranks >= 2, shape
        if "backend=nvlink" in out:  # the nvlink backend runs one node
            assert ranks == per_node, shape
    words = [w for w in re.search(r"tests=\[(.*)\]", out).group(1).split() if w not in ("or", "and", "not")]
    source = open(os.path.join(os.path.dirname(__file__), "test_shared_gpu.py")).read()
    names = re.findall(r"^def (test_\w+)", source, flags=re.M) + re.findall(r'"(\w+)"', source)
    for word in words:
        assert any(word in name for name in names), f"{part}: '{word}' selects no test"


def test_shapes_override_a_preset_and_an_unknown_part_is_refused():
    rc, out = _dry_run("sequence", SHAPES="16x8")
    assert rc == 0 and "shapes=16x8 " in out
    rc, out = _dry_run("nvlink")
    assert rc == 0 and "backend=nvlink " in out
    rc, out = _dry_run("graphs")
    assert rc == 0 and "backend=nvshmem " in out
    rc, out = _dry_run("nonsense")
    assert rc == 2 and "unknown part" in out


def test_the_script_part_runs_a_tool_under_the_beds_mps_and_needs_its_command():
    """SCRIPT="python3 scripts/ll_host_split.py --shared-gpu" scripts/shared_gpu.sh script: a tool's
    ranks on the bed (host-time comparisons beside DeepEP on one GPU), no pytest selection."""
    command = "python3 scripts/ll_host_split.py --shared-gpu --ranks 2"
    rc, out = _dry_run("script", SCRIPT=command)
    assert rc == 0 and f"part=script command=[{command}]" in out, out
    env = {k: v for k, v in os.environ.items() if k != "SCRIPT"}
    done = subprocess.run(["bash", SCRIPT, "script"], env=dict(env, DRY_RUN="1"), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0 and "SCRIPT=" in done.stderr


def test_the_host_part_runs_the_bench_at_each_group_size_beside_deep_ep_where_carried(monkeypatch):
    """scripts/shared_gpu.sh host: ``epcomm bench normal --shared-gpu`` on the nvlink backend at each
    of RANKS (default 2, 4, 8; Config(8) past 4 ranks, where DeepEP's programs must all fit one GPU),
    with --peer deep_ep only where use_peer found the wheel."""
    for name in ("RANKS", "TOKENS"):  # (names speed_run.sh uses too: the defaults are tested here)
        monkeypatch.delenv(name, raising=False)
    rc, out = _dry_run("host")
    assert rc == 0 and "for R in 2 4 8;" in out and "--shared-gpu" in out and "EPCOMM_BACKEND=nvlink" in out, out
    assert "${EPCOMM_PEER_CARRIED:+--peer deep_ep}" in out and "--tokens 512 " in out
    rc, out = _dry_run("host", RANKS="2 4", TOKENS="256")
    assert rc == 0 and "for R in 2 4;" in out and "--tokens 256 " in out


def test_the_bed_runs_a_one_node_variant_in_every_normal_mode_its_workers_make(monkeypatch):
    """VARIANT=tile-reduce scripts/shared_gpu.sh nvlink runs the bed's tests on an experiment's
    kernels: each worker sets, through bed_choices, every NormalMode it makes from then on as
    ``bench --variants`` sets it (the other diagnostics at their defaults); a misspelt name is
    refused instead of running the defaults under the variant's name."""
    import bed_choices
    from epcomm.backends.gpu.normal.one_node.mode import NormalMode
    rc, out = _dry_run("nvlink", VARIANT="tile-reduce")
    assert rc == 0 and "backend=nvlink variant=tile-reduce " in out
    rc, out = _dry_run("graphs", VARIANT="tile-reduce")  # (nvshmem: it would test its defaults under the name)
    assert rc == 2 and "needs the nvlink backend" in out

    def made_without_a_gpu(self):  # (the diagnostics' bookkeeping only, as NormalMode.__init__ sets it)
        self.bases, self._dispatch_plans, self._combine_plans = 4096, {}, {}
        vars(self).update(trace=None, every_peer=True, pipelined_pull=False, overlapped_combine=True,
                          overlapped_dispatch=True, doorbell_dispatch=False, rank_loop_reduce=True)
    monkeypatch.setattr(NormalMode, "__init__", made_without_a_gpu)
    with pytest.raises(ValueError, match="tile-reduce"):
        bed_choices.use_normal_variant_from_now("tile_reduce")
    bed_choices.use_normal_variant_from_now("serial-combine")
    bed_choices.use_normal_variant_from_now("tile-reduce")  # (the later one replaces the earlier)
    assert NormalMode.__init__.made is made_without_a_gpu  # (not stacked on the serial-combine one)
    mode = NormalMode()
    assert not mode.rank_loop_reduce and mode.overlapped_combine and mode.every_peer and not mode.doorbell_dispatch
    bed_choices.use_normal_variant_from_now("serial-combine,reduce-warps-apart")  # (a comma list: both at once)
    mode = NormalMode()
    assert not mode.overlapped_combine and mode.reduce_warps_apart and mode.rank_loop_reduce


def test_both_gpu_backends_cap_their_grids_the_same_way():
    """The bed capped each low-latency receive phase with a receive-program cap of its own and normal
    mode's SMs with Buffer.set_num_sms; the nvlink backend ignored the first, and at 8 x 8 its 448
    waiting receivers held every SM (finding 14). Both backends now cap every grid themselves
    through GpuBackend.share_gpu (normal mode's SMs through the Buffer's config, low-latency send
    and receive programs); an explicit receive cap (the Buffer's Tuning.ll_receive_programs) wins
    where smaller."""
    from epcomm.backends.gpu.wiring import GpuBackend
    backend = object.__new__(GpuBackend)
    caps = backend.share_gpu([("a", "GPU-0", 132)] * 8, "nvlink", 3)
    assert backend.max_num_sms == caps.num_sms == 4 and caps.ll_receive_programs == 3 and caps.ll_send_programs == 4
    caps = backend.share_gpu([("a", f"GPU-{i}", 132) for i in range(8)], "nvshmem")
    assert backend.max_num_sms == 0 and caps.ll_receive_programs == 0 and caps.ll_send_programs == 0
    root = os.path.join(os.path.dirname(__file__), "..", "src", "epcomm", "backends")
    for backend_name in ("nvlink", "nvshmem"):
        source = open(os.path.join(root, backend_name, "backend.py")).read()
        assert 'self.share_gpu(' in source and f'"{backend_name}", ll_receive_programs)' in source, backend_name
        assert "receive_programs=caps.ll_receive_programs" in source, backend_name
        assert "send_programs=caps.ll_send_programs" in source, backend_name


def test_programs_per_sm_from_registers_warps_and_shared_memory():
    """scripts/kernel_resources.py's occupancy arithmetic (sm_90): the one-node kernels at 16 warps
    and about 128 registers hold a whole SM each — what bed_num_sms budgets for."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "kernel_resources.py")
    spec = importlib.util.spec_from_file_location("kernel_resources", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.programs_per_sm(128, 16, 0) == 1  # ep_dispatch_pull, ep_combine_push
    assert tool.programs_per_sm(74, 16, 0) == 1  # ep_combine_reduce, 16 warps (74 -> 80 a thread)
    assert tool.programs_per_sm(74, 4, 0) == 6
    assert tool.programs_per_sm(48, 4, 1024) == 10  # ep_notify_dispatch
    assert tool.programs_per_sm(8, 1, 0) == 32  # the per-SM program limit
    assert tool.programs_per_sm(32, 4, 100 * 1024) == 2  # shared memory bounds it


def test_the_peer_case_looks_past_epcomms_own_deep_ep_and_puts_it_back(tmp_path, monkeypatch):
    """peer_cases.deep_ep_itself: inside, ``import deep_ep`` finds DeepEP (here a stand-in on the
    path), not compat/'s package that conftest.py puts first; after, the engine tests' import gets
    compat/'s again, the same module object."""
    import sys
    import deep_ep as compat_module
    import peer_cases
    stand_in = tmp_path / "deep_ep"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("__version__ = '1.2.1'\n")
    (stand_in / "buffer.py").write_text("WHOSE = 'deep_ep'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "compat", "deep_ep"))
    import deep_ep.buffer as compat_buffer
    with peer_cases.deep_ep_itself() as peer:
        assert not isinstance(peer, str) and peer.__version__ == "1.2.1", peer
        assert sys.modules["deep_ep"] is peer and peer_cases._no_peer(peer) == ""
        import deep_ep.buffer
        assert deep_ep.buffer.WHOSE == "deep_ep"
    import deep_ep
    import deep_ep.buffer
    assert deep_ep is compat_module and "epcomm" in deep_ep.__version__ and deep_ep.buffer is compat_buffer
    assert peer_cases._no_peer(deep_ep).startswith(peer_cases.NO_PEER)
    with pytest.raises(RuntimeError):  # an error inside: the path and the modules come back all the same
        with peer_cases.deep_ep_itself():
            raise RuntimeError("inside")
    import deep_ep
    assert deep_ep is compat_module and sys.modules["deep_ep.buffer"] is compat_buffer


def test_the_case_beside_deep_ep_compares_every_output_on_cpu_ranks():
    """peer_cases.outputs_and_handles_beside_the_peer's own code (FP8 and bf16 cases, alignments,
    handle fields, cached dispatch, combine), run against compat/'s deep_ep on 4 CPU ranks: every
    check runs and none differs (the GPU bed runs it against DeepEP itself)."""
    import peer_cases
    from epcomm.testing import WorkerPool
    with WorkerPool(4) as pool:
        results = pool.run(peer_cases.outputs_and_handles_beside_the_peer, 3, 40, 256, 4, 4, 8, True, timeout_s=300)
    for rank, result in enumerate(results):
        differed = result["differed"]
        assert len(differed) == 8 + len(peer_cases.COMPARED_FIELDS), (rank, sorted(differed))
        assert not any(differed.values()) and not result["details"], (rank, result)


def test_the_peer_case_tells_outputs_apart():
    """peer_cases._same, the comparison under the case beside DeepEP: a differing value, shape or
    dtype anywhere in a tuple or list is a difference; FP8 bit for bit; counts as ints; None only
    against None."""
    import peer_cases
    same = peer_cases._same
    a = torch.arange(6, dtype=torch.int32).view(2, 3)
    assert same(a, a.clone()) and same((a, [1, 2]), (a.clone(), [1, 2])) and same(None, None)
    assert not same(a, a + (a == 5).int()) and not same(a, a.view(3, 2)) and not same(a, a.long())
    assert not same((a, [1, 2]), (a, [1, 3])) and not same(a, None) and not same([a], [a, a])
    fp8 = torch.tensor([0.5, -0.0], dtype=torch.float8_e4m3fn)
    assert same(fp8, fp8.clone()) and not same(fp8, torch.tensor([0.5, 0.0], dtype=torch.float8_e4m3fn))
