"""The one-node combine's host side (gpu/normal/one_node/mode.py) picks its launches: the push and
reduce in one launch (ep_combine) where the call fits one round in the plain layout, in turn
otherwise — checked with recording stand-ins for the kernels, no GPU. Skipped without Triton."""
import dataclasses
import types
from collections import defaultdict

import pytest
import torch

pytest.importorskip("triton")

from epcomm.backends.gpu.normal.one_node import choices, mode as M  # noqa: E402

R, RANK, HIDDEN, NUM_SMS, BLOCK_R, ROUND_TOKENS = 4, 1, 64, 6, 8, 100


class _Kernel:
    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def launch(self, grid, *args):
        self.launches.append((self.name, grid, args))


def _plan(launches, mode, expert_major=False):
    def kernels(name):
        return defaultdict(lambda: _Kernel(launches, name))
    return M.CombinePlan(slots_x=0, slots_w=0, round_tokens=ROUND_TOKENS, block_r=BLOCK_R, rows_aligned=True,
                         expert_major=expert_major, push=kernels("push"), reduce=kernels("reduce"),
                         overlapped=None if expert_major else kernels("overlapped"), fingerprint=(0, 0),
                         overlapped_fixed=M.NormalMode._combine_fixed_arguments(mode, 0, 0))


def _mode(monkeypatch, launches, expert_major=False):
    monkeypatch.setattr(M, "current_stream", lambda index: 0)
    mode = object.__new__(M.NormalMode)
    mode.b = types.SimpleNamespace(mailbox=types.SimpleNamespace(address=0), timeout_ns=1)
    mode.R, mode.rank, mode.device, mode.dev_index = R, RANK, torch.device("cpu"), 0
    mode.expert_major_programs = 132
    mode.ws = types.SimpleNamespace(normal_half_bytes=0, block_flag_cap=1024, block_flags_offset=0)
    mode.bases = mode.state = mode.fingerprints = mode.trace_address = 0
    mode.seat = types.SimpleNamespace(bases_address=0, tag=lambda: 0)
    mode._default_choices()
    plan = _plan(launches, mode, expert_major)
    mode._combine_plan_of = lambda *args: plan
    return mode


def _handle(num_tokens, max_tokens, expert_major=False):
    state = M.PullState(torch.zeros(2, dtype=torch.int32), max_tokens, 3)
    state.addresses = tuple(range(1, 8))
    mapping = types.SimpleNamespace(dest=torch.zeros(0, 2, dtype=torch.int32), row_weights=torch.zeros(0)) \
        if expert_major else None
    return types.SimpleNamespace(backend_state=state, is_token_in_rank=torch.zeros(num_tokens, R, dtype=torch.bool),
                                 num_recv_rows=40, expert_major=mapping)


def _combine(mode, handle):
    x = torch.zeros(handle.num_recv_rows, HIDDEN, dtype=torch.bfloat16)
    return mode.combine(x, handle, None, (), types.SimpleNamespace(num_sms=NUM_SMS))


def test_a_one_round_combine_is_one_launch_whose_push_takes_every_home_token(monkeypatch):
    """One launch of push + reduce programs within the 4 x num_sms the grid caps count; the push's
    token bound is the round's, not this rank's own batch (a home may send more tokens than this
    rank has: the bed's fuzz caught rows dropped that way)."""
    launches = []
    mode = _mode(monkeypatch, launches)
    combined, _ = _combine(mode, _handle(num_tokens=30, max_tokens=90))
    assert [name for name, _, _ in launches] == ["overlapped"]
    _, grid, args = launches[0]
    num_push = -(-40 // BLOCK_R)  # min(2 x num_sms, row blocks)
    num_reduce = -(-30 // BLOCK_R)  # min(2 x num_sms, token chunks)
    assert grid == num_push + num_reduce <= 4 * NUM_SMS
    sizes = args[13:20]  # after the stream and the 11 tensors: num_rows, round_tokens, num_tokens, ...
    assert sizes == (40, ROUND_TOKENS, 30, HIDDEN // 4, HIDDEN, 0, num_push)
    assert combined.shape == (30, HIDDEN)


@pytest.mark.parametrize("variants,push,reduce", [([], 2, 2), (["single-push"], 1, 3)], ids=["default", "single-push"])
def test_the_one_launch_combine_splits_four_times_num_sms_between_push_and_reduce(monkeypatch, variants, push,
                                                                                  reduce):
    """By default half the one-launch grid pushes (2 x num_sms; with num_sms alone the push's rate
    per program set the pace across GPUs: 646 against 547 µs at 4 ranks) and half reduces; bench
    --variants single-push keeps the old 1 + 3 split. Either way 4 x num_sms in all, what the grid
    caps of ranks sharing a GPU count (shared_grids.py); the combine in turn keeps num_sms pushes."""
    from epcomm.tools.bench import use_normal_variants
    for overlapped in (True, False):
        launches = []
        mode = _mode(monkeypatch, launches)
        mode._choice_changed = lambda: None
        use_normal_variants(mode, variants)
        vars(mode)["overlapped_combine"] = overlapped
        handle = _handle(num_tokens=40 * NUM_SMS * BLOCK_R, max_tokens=90)
        handle.num_recv_rows = 40 * NUM_SMS * BLOCK_R
        _combine(mode, handle)
        if overlapped:
            (_, grid, args), = launches
            assert args[19] == push * NUM_SMS and grid == (push + reduce) * NUM_SMS == 4 * NUM_SMS
        else:
            (_, push_grid, _), (_, reduce_grid, _) = launches
            assert (push_grid, reduce_grid) == (NUM_SMS, 4 * NUM_SMS)


@pytest.mark.parametrize("split", [(3, 2), (0, 4), (2, 0)])
def test_a_combine_split_past_the_grid_caps_is_refused(monkeypatch, split):
    """More than 4 x num_sms programs in the one launch would pass the caps of ranks sharing a GPU
    (a waiting program could hold the SM a late sender needs): refused where it is set, naming it."""
    mode = _mode(monkeypatch, [])
    mode._choice_changed = lambda: None
    with pytest.raises(ValueError, match="combine_split"):
        mode.combine_split = split
    assert mode.combine_split == (choices.PUSH_PROGRAMS_PER_SM, choices.REDUCE_PROGRAMS_PER_SM)


@pytest.mark.parametrize("case", ["in turn asked", "several rounds", "expert-major", "flags too few"])
def test_other_combines_push_and_reduce_in_turn(monkeypatch, case):
    launches = []
    mode = _mode(monkeypatch, launches, expert_major=case == "expert-major")
    if case == "in turn asked":
        vars(mode)["overlapped_combine"] = False
    if case == "flags too few":
        mode.ws.block_flag_cap = 2
    handle = _handle(num_tokens=30, max_tokens=250 if case == "several rounds" else 90,
                     expert_major=case == "expert-major")
    _combine(mode, handle)
    rounds = 3 if case == "several rounds" else 1
    assert [name for name, _, _ in launches] == ["push", "reduce"] * rounds


@pytest.mark.parametrize("lanes,rank_loop,block_c,warps",
                         [(8, True, 8192, 16), (4, True, 8192, 16), (1, True, 8192, 16), (8, False, 2048, 16),
                          (4, False, 4096, 16)],
                         ids=["8 ranks", "4 ranks", "1 rank", "8 ranks, tile", "4 ranks, tile"])
def test_the_reduce_sums_ranks_row_by_row_a_whole_7168_row_a_step(lanes, rank_loop, block_c, warps):
    """By default (NormalMode.rank_loop_reduce) a token's ranks are summed one [BLOCK_C] row at a
    time, and a 7168-wide row is one step at any rank count: the [8, 2048] tile met the other warps
    about 8 times per token (697 against 146 µs on one H100 at 8 ranks' lanes), and 2048 columns a
    step left the one-launch reduce trailing the push (188 against 118). The tile keeps 16384 / R_P2."""
    mode = object.__new__(M.NormalMode)
    mode.b = types.SimpleNamespace(name="nvlink", mailbox=types.SimpleNamespace(address=0), timeout_ns=1)
    mode.ws = types.SimpleNamespace(combine_round_tokens=lambda row_bytes: ((0, 0), ROUND_TOKENS), normal_half_bytes=0,
                                    block_flags_offset=0, block_flag_cap=1024)
    mode.R_P2, mode.R, mode.rank, mode.bases, mode.state, mode.fingerprints = lanes, lanes, 0, 0, 0, 0
    vars(mode).update(every_peer=True, trace=None, rank_loop_reduce=rank_loop, reduce_warps_apart=False)
    plan = mode._combine_plan(7168, 8, 0, 0)
    for kernels in (plan.reduce, plan.overlapped):
        assert kernels.fixed["RANK_LOOP"] is rank_loop and kernels.fixed["BLOCK_C"] == block_c
    assert plan.reduce.num_warps == warps


def test_the_one_launch_combines_arguments_sit_where_ep_combine_names_them(monkeypatch):
    """CombinePlan.overlapped_fixed (unpacked per call) keeps every argument of ep_combine at its
    parameter's position: the count, and the workspace, block-flag, host and identity words by name."""
    from epcomm.backends.gpu.normal.one_node.combine import PUSH_REDUCE
    launches = []
    mode = _mode(monkeypatch, launches)
    mode.rank, mode.bases, mode.state, mode.fingerprints, mode.trace_address = RANK, 4096, 8192, 24, 4096
    mode.ws = types.SimpleNamespace(normal_half_bytes=1 << 20, block_flag_cap=77, block_flags_offset=512)
    mode.b = types.SimpleNamespace(mailbox=types.SimpleNamespace(address=999), timeout_ns=123_456)
    plan = dataclasses.replace(_plan(launches, mode), slots_x=16, slots_w=32,
                               overlapped_fixed=M.NormalMode._combine_fixed_arguments(mode, 16, 32))
    mode._combine_plan_of = lambda *args: plan
    _combine(mode, _handle(num_tokens=30, max_tokens=90))
    (_, _, args), = [launch for launch in launches if launch[0] == "overlapped"]
    names = [n for n, t in PUSH_REDUCE.signature.items() if t != "constexpr"]
    assert len(args) == 2 + len(names)
    words = dict(zip(names, args[2:]))
    assert (words["rank"], words["num_ranks"], words["normal_bases_ptr"], words["state_ptr"]) == (RANK, R, 4096, 8192)
    assert (words["half_bytes"], words["slots_x_offset"], words["slots_w_offset"]) == (1 << 20, 16, 32)
    assert (words["block_flags_offset"], words["block_flag_cap"]) == (512, 77)
    assert (words["mailbox_address"], words["timeout_ns"], words["fp_offset"]) == (999, 123_456, 24)
    assert words["trace_ptr"] == 4096 and words["num_tokens"] == 30
