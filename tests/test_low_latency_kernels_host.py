"""The GPU low-latency mode's host side, checked on CPU with stand-ins for the workspace and the
kernels (no GPU; Triton must be importable, as for the compile tests): the Buffer's
``enable_shrink`` reaches every launch as the kernels' ``shrink`` flag, the send and receive grids
keep the caps of ranks sharing a GPU (gpu/shared_grids.py), an undersized workspace is named
``num_rdma_bytes``, and the combine kernel carries its NaN rows for contributions that did not land."""
import types

import pytest
import torch

pytest.importorskip("triton")

from epcomm.backends.base import LowLatencyCombineArgs, LowLatencyDispatchArgs  # noqa: E402
from epcomm.backends.gpu import low_latency as L  # noqa: E402
from epcomm.backends.gpu.low_latency import mode as mode_module  # noqa: E402
from epcomm.backends.gpu.workspace import LowLatencyLayout  # noqa: E402
from epcomm.errors import EPInputError  # noqa: E402

R, E, M, H, K = 4, 8, 16, 256, 2


class _Launches:
    """Stands in for a compiled specialisation: records each launch's grid and arguments."""

    def __init__(self, log, key):
        self.log, self.key = log, key

    def launch(self, grid_x, grid_y, stream, *args):
        self.log.append((self.key, grid_x, args))

    def resident_grid(self, items):
        return items

    def launch_resident(self, grid_x, stream, *args):
        self.log.append((self.key, grid_x, args))


def _mode(monkeypatch, fits=True, capturing=False, launcher="bound", **kwargs):
    """A LowLatencyMode over stand-ins, its launches recorded in ``log``; ``capturing``: what the
    mode is told of the current stream's CUDA graph capture; ``launcher``: launch.launch_mode()."""
    log = []
    monkeypatch.setattr(mode_module, "launch_mode", lambda: launcher)

    class Recording(dict):
        def __init__(self, spec, flags, num_warps, **fixed):
            super().__init__()
            self.spec = spec

        def __missing__(self, key):
            self[key] = _Launches(log, (self.spec.name, key))
            return self[key]

    monkeypatch.setattr(mode_module, "Specialisations", Recording)
    monkeypatch.setattr(mode_module, "current_stream", lambda index: 0)
    monkeypatch.setattr(mode_module, "stream_capturing", lambda: capturing)

    def ll_layout(E, M, hidden, K, use_fp8, use_ue8m0):
        if not fits:
            raise EPInputError("num_max_dispatch_tokens_per_rank", "low-latency mode needs num_rdma_bytes >= 1 ...")
        return LowLatencyLayout(2 * hidden, 0, 2 * hidden + 16, 0, 4096, 8192, 0)

    memory = torch.zeros(64, dtype=torch.int64)
    ws = types.SimpleNamespace(num_ranks=R, rank=1, spare_word=0, bases=memory, local_base=memory.data_ptr(),
                               fingerprint_set=lambda s: 0, ll_layout=ll_layout, ll_offset=0, ll_half=1 << 20)
    mode = mode_module.LowLatencyMode(ws, torch.zeros(16, dtype=torch.int64), types.SimpleNamespace(address=0),
                                      10 ** 9, torch.device("cpu"), num_sms=132, **kwargs)
    return mode, log


def _dispatch_args(tokens=M):
    x = torch.zeros(tokens, H, dtype=torch.bfloat16)
    topk = torch.arange(tokens * K, dtype=torch.int64).view(tokens, K) % E
    return LowLatencyDispatchArgs(x, topk, M, E, False, False, False, None, None, False,
                                  torch.zeros(R, dtype=torch.int32))


def _argument(spec, args, name):
    return args[list(spec.signature).index(name)]


@pytest.mark.parametrize("shrink", [False, True])
def test_enable_shrink_reaches_every_low_latency_launch(monkeypatch, shrink):
    """Without enable_shrink the kernels report a late peer (the host raises EPTimeoutError at the
    next call) and the combine writes NaN rows for what did not land; with it they mask it. The
    flag is a run-time argument of both kernels, in every launch of a call."""
    mode, log = _mode(monkeypatch, shrink=shrink, one_launch=False)
    args = _dispatch_args()
    mode.check_dispatch(args)
    recv_x, _, handle, hook = mode.dispatch(args)
    combine = LowLatencyCombineArgs(torch.zeros(E // R, R * M, H, dtype=torch.bfloat16), args.topk_idx,
                                    torch.ones(M, K), handle, None, None, False, args.rank_mask)
    mode.check_combine(combine)
    mode.combine(combine)
    assert len(log) == 4, log  # send and receive phases of each call
    for (name, _), _, launch_args in log:
        spec = L.DISPATCH if name == "ep_ll_dispatch" else L.COMBINE
        assert _argument(spec, launch_args, "shrink") == int(shrink), name
        assert _argument(spec, launch_args, "timeout_ns") == 10 ** 9, name


def test_low_latency_grids_keep_the_caps_of_ranks_sharing_a_gpu(monkeypatch):
    """Send phases at most ``send_programs``, receive phases (and a one-launch call's grid) at most
    ``receive_programs``, whatever the call's size; without caps, one program per item."""
    for caps, want in (({}, (M * 1, E // R * R, R * E // R, M)), ({"send_programs": 3, "receive_programs": 2},
                                                                   (3, 2, 3, 2))):
        mode, log = _mode(monkeypatch, one_launch=False, **caps)
        args = _dispatch_args()
        mode.check_dispatch(args)
        _, _, handle, _ = mode.dispatch(args)
        combine = LowLatencyCombineArgs(torch.zeros(E // R, R * M, H, dtype=torch.bfloat16), args.topk_idx,
                                        torch.ones(M, K), handle, None, None, False, args.rank_mask)
        mode.check_combine(combine)
        mode.combine(combine)
        assert tuple(grid for _, grid, _ in log) == want, (caps, log and [(k, g) for k, g, _ in log])
    mode, log = _mode(monkeypatch, receive_programs=5)
    mode.one_launch = True
    args = _dispatch_args()
    mode.check_dispatch(args)
    mode.dispatch(args)
    assert [grid for _, grid, _ in log] == [5]


def _round_trip_launches(mode, log, hook=False):
    """The (kernel, (SEND, RECEIVE)) of each launch of one dispatch + combine (hooks called)."""
    del log[:]
    args = _dispatch_args()
    args.return_recv_hook = hook
    mode.check_dispatch(args)
    _, _, handle, receive = mode.dispatch(args)
    if receive is not None:
        receive()
    combine = LowLatencyCombineArgs(torch.zeros(E // R, R * M, H, dtype=torch.bfloat16), args.topk_idx,
                                    torch.ones(M, K), handle, None, None, hook, args.rank_mask)
    mode.check_combine(combine)
    _, receive = mode.combine(combine)
    if receive is not None:
        receive()
    return [(name, key[:2]) for (name, key), _, _ in log]


ONE = [("ep_ll_dispatch", (True, True)), ("ep_ll_combine", (True, True))]
TWO = [("ep_ll_dispatch", (True, False)), ("ep_ll_dispatch", (False, True)),
       ("ep_ll_combine", (True, False)), ("ep_ll_combine", (False, True))]


@pytest.mark.parametrize("one_launch, capturing, want", [
    (None, False, ONE), (None, True, TWO), (True, False, ONE), (True, True, ONE), (False, False, TWO),
    (False, True, TWO)])
def test_auto_launches_a_call_once_eagerly_and_twice_while_a_cuda_graph_is_captured(monkeypatch, one_launch,
                                                                                   capturing, want):
    """``one_launch=None`` (auto, Tuning's default): a call without a hook runs both phases in one
    cooperative launch, except while the stream is captured into a graph, where the phases are two
    launches (eager decode waits for the host, one launch less is host time saved; a graph replays
    without the host, and two launches replay as fast or faster). True and False force one way."""
    mode, log = _mode(monkeypatch, capturing=capturing, one_launch=one_launch)
    assert _round_trip_launches(mode, log) == want


def test_auto_takes_two_launches_where_the_launcher_cannot_launch_cooperatively(monkeypatch):
    """Triton's own launcher (launch.py's fallback, "jit") launches no cooperative grid: a one-launch
    call's programs would not be sure to run at once, so auto keeps the two launches there."""
    mode, log = _mode(monkeypatch, launcher="jit", one_launch=None)
    assert _round_trip_launches(mode, log) == TWO


@pytest.mark.parametrize("one_launch", [None, True, False])
def test_a_call_with_a_hook_takes_two_launches_whatever_the_setting(monkeypatch, one_launch):
    mode, log = _mode(monkeypatch, one_launch=one_launch)
    assert _round_trip_launches(mode, log, hook=True) == TWO


def test_auto_compiles_the_two_launches_of_a_captured_call_at_its_first_eager_call(monkeypatch):
    """Compiling and loading a kernel inside a CUDA graph capture is not safe: in auto mode the
    first eager call of a kind also binds the two specialisations a captured call of that kind
    launches, so a capture after an eager warm-up compiles nothing."""
    mode, log = _mode(monkeypatch, one_launch=None)
    _round_trip_launches(mode, log)
    dispatch_plan = next(iter(mode._dispatch_plans.values()))
    combine_plan = next(iter(mode._combine_plans.values()))
    bound = {(key[0], key[1]) for key in dispatch_plan.kernels}, {(key[0], key[1]) for key in combine_plan.kernels}
    assert bound == ({(True, True), (True, False), (False, True)},) * 2
    with monkeypatch.context() as patched:
        patched.setattr(mode_module, "stream_capturing", lambda: True)
        before = (dict(dispatch_plan.kernels), dict(combine_plan.kernels))
        assert _round_trip_launches(mode, log) == TWO
        assert (dict(dispatch_plan.kernels), dict(combine_plan.kernels)) == before  # nothing new bound


def test_auto_binds_the_combines_send_launch_for_each_alignment_of_x(monkeypatch):
    """The combine's one-launch key counts x's and out's alignment together, its send launch x's
    alone: an eager combine whose x is misaligned after one whose x was aligned (out misaligned in
    both, so the one-launch key is the same) still binds the send launch a capture would take."""
    mode, log = _mode(monkeypatch, one_launch=None)
    args = _dispatch_args()
    mode.check_dispatch(args)
    _, _, handle, _ = mode.dispatch(args)
    shape, n = (E // R, R * M, H), (E // R) * R * M * H

    def misaligned(count):  # 8 bytes past a 16-byte boundary: word copies, not 16-byte ones
        return torch.zeros(count + 4, dtype=torch.bfloat16)[4:]
    assert misaligned(8).data_ptr() % 16 == 8
    for x in (torch.zeros(shape, dtype=torch.bfloat16), misaligned(n).view(shape)):
        combine = LowLatencyCombineArgs(x, args.topk_idx, torch.ones(M, K), handle, misaligned(M * H).view(M, H), None,
                                        False, args.rank_mask)
        mode.check_combine(combine)
        mode.combine(combine)
    plan = next(iter(mode._combine_plans.values()))
    assert {key for key in plan.kernels if key[:2] == (True, False)} == {(True, False, False, True),
                                                                        (True, False, False, False)}


def test_an_undersized_low_latency_workspace_is_named_num_rdma_bytes(monkeypatch):
    mode, _ = _mode(monkeypatch, fits=False)
    with pytest.raises(EPInputError) as raised:
        mode.check_dispatch(_dispatch_args())
    assert raised.value.argument == "num_rdma_bytes" and "num_rdma_bytes >=" in str(raised.value)


def test_create_backend_hands_enable_shrink_to_both_gpu_backends(monkeypatch):
    from epcomm import backends
    from epcomm.backends.nvlink import backend as nvlink_backend
    from epcomm.backends.nvshmem import backend as nvshmem_backend
    made = {}

    def recorder(name):
        return lambda *args, **kwargs: made.setdefault(name, kwargs)
    monkeypatch.setattr(nvlink_backend, "NVLinkBackend", recorder("nvlink"))
    monkeypatch.setattr(nvshmem_backend, "NvshmemBackend", recorder("nvshmem"))
    for name in ("nvlink", "nvshmem"):
        backends.create_backend(name, None, torch.device("cuda"), 1 << 20, 1 << 20, True, 1.0, 2, True, True)
        assert made[name]["shrink"] is True, (name, made[name])


def test_the_combine_kernel_writes_nan_rows_for_lost_contributions():
    """The receive phase's reduction has a NaN path (a token with an entry on a rank that was late
    without shrink, in another call, or with another fingerprint); the send phase has none."""
    from triton.backends.compiler import GPUTarget
    flags = dict(HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8, BLOCK_C=1024, R_P2=8, ALIGNED=False, REMOTE=0)
    receive = L.COMBINE.compile(dict(SEND=False, RECEIVE=True, **flags), 8, target=GPUTarget("cuda", 90, 32))
    send = L.COMBINE.compile(dict(SEND=True, RECEIVE=False, **flags), 8, target=GPUTarget("cuda", 90, 32))
    assert "0x7FC00000" in receive.asm["ttir"] and "0x7FC00000" not in send.asm["ttir"]
    for spec in (L.DISPATCH, L.COMBINE):
        assert spec.signature["shrink"] == "i32"


@pytest.mark.parametrize("capturing", [False, True])
def test_a_call_asks_the_capture_state_once_and_its_board_tag_follows_it(monkeypatch, capturing):
    """The capture query costs about 0.7 µs on a GPU host: each low-latency call asks it once, for
    both its launches and its call board tag (0, nothing posted, in a capture: call_board.Seat)."""
    from epcomm.backends.gpu.call_board import Seat
    mode, log = _mode(monkeypatch, one_launch=None)
    asked = []
    monkeypatch.setattr(mode_module, "stream_capturing", lambda: asked.append(1) or capturing)
    board = types.SimpleNamespace(number=0, era=0, bases_address=0)
    mode.board = Seat(board, slot=1)
    mode.board._capturing = lambda: pytest.fail("the seat asked again")
    launches = _round_trip_launches(mode, log)
    assert len(asked) == 2  # one dispatch, one combine
    assert launches == (TWO if capturing else ONE)
    assert board.number == (0 if capturing else 2)
