"""The one-node full dispatch's host side (gpu/normal/one_node/mode.py) and the doorbell
(mailbox.py, HostMailbox.ring). By default round 0 is staged before the host's count wait and
pulled after it (in turn). With NormalMode.doorbell_dispatch, where this rank's batch fits one
launch, ep_dispatch goes before the wait and its pull waits for the doorbell; the host rings go
with the outputs' addresses when the group fits one launch too, and cancel otherwise (then pulls
in turn) or when anything raises between the launch and the ring. Checked with recording
stand-ins for the kernels and a real HostMailbox in unpinned memory, no GPU. Skipped without Triton."""
import dataclasses
import types

import pytest
import torch

pytest.importorskip("triton")

from epcomm.backends.gpu.mailbox import HostMailbox  # noqa: E402
from epcomm.errors import EPTimeoutError  # noqa: E402
from one_node_stand_ins import (BLOCK_R, DOORBELL_WORDS, E, HIDDEN, K, M, NUM_SMS, R, RANK,  # noqa: E402
                                ROUND_TOKENS, _args, _doorbell_arg, _Mailbox, _mode, _OrderedMailbox)


def test_by_default_a_full_dispatch_stages_before_the_wait_and_pulls_after_it(monkeypatch):
    """The count exchange and the stage go in one launch (ep_dispatch_notify_stage) before the wait; with
    notify_with_stage off (bench --variants notify-apart) in two."""
    launches = []
    mailbox = _Mailbox(counts=(40, 60))
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    result = mode.dispatch(_args(50))
    assert [name for name, _, _ in launches] == ["notify+stage", "pull"]
    assert mailbox.rings == [] and result.recv_x.shape == (40, HIDDEN)
    launches.clear()
    mode.notify_with_stage = False
    mode.dispatch(_args(50))
    assert [name for name, _, _ in launches] == ["notify", "stage", "pull"]


def test_a_full_dispatch_that_fits_one_launch_goes_before_the_wait_and_rings_go_with_its_outputs(monkeypatch):
    launches = []
    mailbox = _Mailbox(counts=(40, 60))
    mode = _mode(monkeypatch, launches, mailbox)
    result = mode.dispatch(_args(50))
    assert [name for name, _, _ in launches] == ["notify", "ep_dispatch"]  # nothing after the wait
    _, grid, args = launches[1]
    assert grid == R + min(NUM_SMS, -(-50 // BLOCK_R)) + NUM_SMS  # list, copy, then num_sms pull programs
    assert _doorbell_arg(args) == 1  # the notify's sequence number
    (tag, words), = mailbox.rings
    recv_x, recv_topk, recv_weights, handle = result.recv_x, result.recv_topk_idx, result.recv_topk_weights, \
        result.handle
    assert tag == 2 * 1 + 1  # go
    assert words == [40, recv_x.data_ptr(), recv_x.data_ptr(), recv_topk.data_ptr(), recv_weights.data_ptr(),
                     handle.recv_src_idx.data_ptr()]
    assert recv_x.shape == (40, HIDDEN) and recv_topk.shape == (40, K) and handle.num_recv_rows == 40


def test_a_group_that_needs_rounds_cancels_the_doorbell_and_pulls_in_turn(monkeypatch):
    """This rank's 50 tokens fit one round; another rank's 250 do not: the launch's pull stands
    down, round 0 (already staged by it) is pulled in turn, rounds 1 and 2 are staged and pulled."""
    launches = []
    mailbox = _Mailbox(counts=(40, 250))
    mode = _mode(monkeypatch, launches, mailbox)
    mode.dispatch(_args(50))
    assert [name for name, _, _ in launches] == ["notify", "ep_dispatch", "pull", "stage", "pull", "stage", "pull"]
    (tag, _), = mailbox.rings
    assert tag == 2 * 1  # cancel


def test_a_batch_too_large_for_one_launch_stages_in_turn_without_a_doorbell(monkeypatch):
    launches = []
    mailbox = _Mailbox(counts=(40, 150))
    mode = _mode(monkeypatch, launches, mailbox)
    mode.dispatch(_args(150))
    assert [name for name, _, _ in launches] == ["notify+stage", "pull", "stage", "pull"]
    assert mailbox.rings == []


def _dispatch_failing_at(monkeypatch, launches, where):
    """A full dispatch of 50 tokens whose host fails at ``where`` (a peer late in the count wait, or
    an allocation after it), checked to raise; returns its mailbox."""
    mailbox = _Mailbox(counts=(40, 60), fail=EPTimeoutError("late", [2]) if where == "the count wait" else None)
    mode = _mode(monkeypatch, launches, mailbox)
    if where == "an allocation":
        def no_memory(*args, **kwargs):
            raise torch.cuda.OutOfMemoryError("no memory")
        monkeypatch.setattr(M, "dispatch_outputs", no_memory)
    with pytest.raises((EPTimeoutError, torch.cuda.OutOfMemoryError)):
        mode.dispatch(_args(50))
    return mailbox


@pytest.mark.parametrize("where", ["the count wait", "an allocation"])
def test_a_host_error_after_the_launch_rings_cancel_and_raises(monkeypatch, where):
    """The launch is already waiting for the doorbell: an error between it and the ring (a peer late
    in the count exchange, a failed allocation) must stand its pull down, or it would wait out its
    timeout and the next call's launches would queue behind it."""
    launches = []
    mailbox = _dispatch_failing_at(monkeypatch, launches, where)
    (tag, _), = mailbox.rings
    assert tag == 2 * 1  # cancel
    assert [name for name, _, _ in launches] == ["notify", "ep_dispatch"]


@pytest.mark.parametrize("num_worst_tokens", [0, 80])
def test_the_handles_int32_words_come_from_one_allocation_at_16_byte_boundaries(monkeypatch, num_worst_tokens):
    """rank_prefix_matrix (and, with num_worst_tokens, recv_src_idx: its size is known before the
    launch) are views of the notify's allocation (PullState.index_words) after the list index and
    recv_info, from 16-byte boundaries: one allocation instead of three on the host's path. The
    notify's prefix and recv_info arguments are their addresses; num_recv_tokens is recv_info's
    first word, made on the first read."""
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=(40, 60)), doorbell=False)
    num_tokens = 50
    handle = mode.dispatch(_args(num_tokens, num_worst_tokens=num_worst_tokens)).handle
    words = handle.backend_state.index_words
    base, prefix, src_idx = words.data_ptr(), handle.rank_prefix_matrix, handle.recv_src_idx
    assert words.dtype == torch.int32 and prefix.shape == (R, R) and prefix.is_contiguous()
    prefix_at = (prefix.data_ptr() - base) // 4
    assert prefix.data_ptr() % 16 == 0 and prefix_at >= num_tokens * R + 2
    (_, _, notify), = [launch for launch in launches if launch[0].startswith("notify")]
    assert prefix.data_ptr() in notify and base + 4 * num_tokens * R in notify  # (prefix_ptr, recv_info_ptr)
    if num_worst_tokens:
        assert src_idx.shape == (num_worst_tokens,) and src_idx.untyped_storage().data_ptr() == base
        assert src_idx.data_ptr() % 16 == 0 and (src_idx.data_ptr() - base) // 4 >= prefix_at + R * R
        assert words.numel() == (src_idx.data_ptr() - base) // 4 + num_worst_tokens
        words[num_tokens * R] = 33  # (the notify's received count)
        assert handle.num_recv_tokens.dim() == 0 and int(handle.num_recv_tokens) == 33
    else:
        assert src_idx.shape == (40,) and src_idx.untyped_storage().data_ptr() != base
        assert handle.num_recv_tokens == 40


@pytest.mark.parametrize("num_worst_tokens, allocations", [(0, 5), (80, 4)])
def test_a_full_dispatch_allocates_its_outputs_and_one_block_of_handle_words(monkeypatch, num_worst_tokens,
                                                                              allocations):
    """Host time per call (each allocation costs 2-4 µs on the GPU hosts, a view 1.3-1.5): the
    handle's int32 words and the notify's outputs are one allocation, then recv_x, recv_topk_idx and
    recv_topk_weights; a full dispatch allocates recv_src_idx after its count wait, a
    num_worst_tokens one views it in the first. Counted at the dispatcher, so a new allocation on
    this path fails here, not only in a GPU profile."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))
    mailbox = _Mailbox(counts=(40, 60))
    per_expert = torch.zeros(E // R, dtype=torch.int64).numpy()  # (the stand-in's answer, made outside the count)
    mailbox.wait_notify = lambda sequence, rank, timeout_s: (40, 60, per_expert)
    mode = _mode(monkeypatch, [], mailbox, doorbell=False)
    args = _args(50, num_worst_tokens=num_worst_tokens)
    with Allocations() as seen:
        mode.dispatch(args)
    made = [op for op in seen.ops if op in ("empty", "new_empty", "empty_strided", "new_empty_strided", "zeros",
                                            "new_zeros", "full", "clone")]
    assert len(made) == allocations and seen.ops.count("as_strided") == 1 + bool(num_worst_tokens), seen.ops


@pytest.mark.parametrize("capturing", [None, False, True])
def test_the_call_board_tag_gets_the_capture_answer_the_buffer_kept(monkeypatch, capturing):
    """Buffer.dispatch asks its backend (Backend.refuse_capture) whether the stream is being
    captured and keeps the answer in the arguments; the dispatch hands it to its call-board tag,
    which then asks no more (None: not asked, the tag asks)."""
    launches, asked = [], []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=(400, 60)))
    mode.seat = types.SimpleNamespace(bases_address=0, tag=lambda capturing=None: asked.append(capturing) or 0)
    args = _args(50, num_worst_tokens=80 if capturing else 0)
    args.capturing = capturing
    mode.dispatch(args)
    assert asked == [capturing]


def test_num_worst_tokens_in_turn_takes_the_single_launch(monkeypatch):
    """A num_worst_tokens dispatch waits on nothing on the host, so a CUDA graph may capture it;
    ep_dispatch_notify_stage waits on device epochs only (notify.py), so a replay waits as the first
    run did and the dispatch in turn (here: overlapped_dispatch off) takes it as any other; with
    notify_with_stage off the notify goes alone."""
    launches = []
    mailbox = _Mailbox(counts=None, fail=AssertionError("no count wait with num_worst_tokens"))
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    mode.overlapped_dispatch = False
    result = mode.dispatch(_args(50, num_worst_tokens=80))
    assert [name for name, _, _ in launches] == ["notify+stage", "pull"]
    assert result.recv_x.shape == (80, HIDDEN)
    launches.clear()
    mode.notify_with_stage = False
    mode.dispatch(_args(50, num_worst_tokens=80))
    assert [name for name, _, _ in launches] == ["notify", "stage", "pull"]


def test_full_one_launch_launches_stage_and_pull_together_after_the_wait(monkeypatch):
    """NormalMode.full_one_launch (bench --variants full-one-launch): nothing staged before the
    count wait; after it, one ep_dispatch (lists, copy and pull programs, the pull on
    pull_programs_per_sm x num_sms) with no doorbell."""
    launches = []
    mailbox = _Mailbox(counts=(400, 60))  # (400 rows: 50 blocks, more than 4 x num_sms)
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    mode.full_one_launch = True
    result = mode.dispatch(_args(50))
    assert [name for name, _, _ in launches] == ["notify", "ep_dispatch"]
    _, grid, args = launches[1]
    assert grid == R + min(NUM_SMS, -(-50 // BLOCK_R)) + 3 * NUM_SMS  # (the default pull_programs_per_sm)
    assert _doorbell_arg(args) == 0 and mailbox.rings == [] and result.recv_x.shape == (400, HIDDEN)
    launches.clear()
    mode.pull_programs_per_sm = 1
    mode.dispatch(_args(50))
    assert launches[1][1] == R + min(NUM_SMS, -(-50 // BLOCK_R)) + NUM_SMS


def test_full_one_launch_stages_after_the_wait_where_the_group_needs_rounds(monkeypatch):
    launches = []
    mailbox = _Mailbox(counts=(40, 250))
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    mode.full_one_launch = True
    mode.dispatch(_args(50))
    assert [name for name, _, _ in launches] == ["notify", "stage", "pull", "stage", "pull", "stage", "pull"]


def test_ranks_that_disagree_on_pushed_lists_raise_naming_it(monkeypatch):
    """NormalMode.pushed_lists moves the lists (receive_index.list_of): ranks that disagree would
    read lists where none were written, so it is a field of the full dispatch's fingerprint (the
    pull compares them before it reads) and only the kernels with lists compile with it."""
    from epcomm.backends.gpu import agreement
    from epcomm.errors import EPInputError
    monkeypatch.setattr(M, "PULL", types.SimpleNamespace(bind=lambda **constexprs: constexprs))
    mode = _mode(monkeypatch, [], _Mailbox(counts=(40, 60)), doorbell=False)
    mode.ws.dispatch_round_tokens = lambda row_bytes: ((0,) * len(row_bytes), ROUND_TOKENS)
    mode.b.name = "nvlink"
    assert mode.pushed_lists  # (the default: choices.PUSHED_LISTS)
    pushed = M.NormalMode._dispatch_plan(mode, 2 * HIDDEN, 0, K, 0)
    mode.pushed_lists = False  # (bench --variants pulled-lists)
    plain = M.NormalMode._dispatch_plan(mode, 2 * HIDDEN, 0, K, 0)
    assert pushed.fingerprint_cached == plain.fingerprint_cached and pushed.fingerprint_full != plain.fingerprint_full
    assert pushed.pull_index["PUSHED_LISTS"] and not pushed.pull["PUSHED_LISTS"]
    assert pushed.stage_lists.fixed["PUSHED_LISTS"] and not pushed.stage.fixed["PUSHED_LISTS"]
    assert pushed.overlapped_full.fixed["PUSHED_LISTS"] and not pushed.overlapped_cached.fixed["PUSHED_LISTS"]
    with pytest.raises(EPInputError) as err:
        agreement.raise_disagreement({0: plain.fingerprint_full}, pushed.fingerprint_full, 2)
    assert err.value.argument == "pushed_lists"
    with pytest.raises(EPInputError) as err:
        agreement.raise_disagreement({0: pushed.fingerprint_full}, plain.fingerprint_full, 2)
    assert err.value.argument == "pushed_lists"


def test_the_doorbell_words_land_before_the_tag_and_a_go_after_the_device_stood_down_raises():
    box = HostMailbox(R, 2, pinned=False)
    index = box._doorbell
    assert box.doorbell_address == box.address + 8 * index and box.words.numel() == index + DOORBELL_WORDS
    box.ring(5, RANK, 1.0, 12, (101, 102, 103, 104, 105))
    assert box.view[index:index + 7].tolist() == [11, 12, 101, 102, 103, 104, 105]
    box.ring(6, RANK, 1.0)  # cancel: the tag alone
    assert box.view[index] == 12
    box.view[index + DOORBELL_WORDS - 1] = 7  # the launch of sequence 7 stopped waiting before the tag
    with pytest.raises(EPTimeoutError, match="allocate its outputs"):
        box.ring(7, RANK, 1.0, 12, (101, 102, 103, 104, 105))
    box.ring(8, RANK, 1.0, 12, (101, 102, 103, 104, 105))  # (a later call's go is not affected)


def test_the_stage_and_pull_arguments_sit_where_their_kernels_name_them(monkeypatch):
    """The fixed segments (DispatchPlan.stage_fixed / pull_fixed, unpacked per call) keep every
    argument at its kernel parameter's position: each launch's count and the workspace, host and
    identity words read by the parameters' names."""
    from epcomm.backends.gpu.normal.one_node.dispatch import PULL
    from epcomm.backends.gpu.normal.one_node.notify import NOTIFY, NOTIFY_STAGE
    from epcomm.backends.gpu.normal.one_node.stage import STAGE
    launches = []
    mailbox = _Mailbox(counts=(40, 60))
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    mode.rank, mode.bases, mode.state, mode.fingerprints, mode.trace_address = RANK, 4096, 8192, 24, 4096
    mode.ws = types.SimpleNamespace(**dict(vars(mode.ws), normal_half_bytes=1 << 20, lists_offset=512, list_cap=77,
                                           counts_offset=640, block_flags_offset=1 << 16, block_flag_cap=1029))
    mode.b.timeout_ns = 123_456
    plan = mode._dispatch_plan_of(None)
    plan = dataclasses.replace(plan, offsets=(16, 32, 48), **M.NormalMode._fixed_arguments(mode, (16, 32, 48), 32))
    mode._dispatch_plan_of = lambda args: plan
    call = _args(50)
    call.expert_alignment = 3
    fused = mode.dispatch(call)
    mode.notify_with_stage = False  # (the stage alone too; a choice set drops the plans: the stand-in stays)
    mode.dispatch(call)
    named = {name: dict(zip([n for n, t in spec.signature.items() if t != "constexpr"], args[2:]))
             for name, spec in (("stage", STAGE), ("pull", PULL), ("notify+stage", NOTIFY_STAGE))
             for launch, _, args in launches if launch == name
             if len(args) == 2 + sum(t != "constexpr" for t in spec.signature.values())}
    # (the grid's y and the stream first, then every parameter)
    assert set(named) == {"stage", "pull", "notify+stage"}
    for kernel in ("stage", "pull", "notify+stage"):
        words = named[kernel]
        assert (words["rank"], words["num_ranks"], words["normal_bases_ptr"], words["state_ptr"]) == (RANK, R, 4096, 8192)
        assert (words["half_bytes"], words["lists_offset"], words["list_cap"]) == (1 << 20, 512, 77)
        assert (words["x_offset"], words["scales_offset"], words["topk_offset"], words["topk_row_bytes"]) == \
            (16, 32, 48, 32)
        assert words["fp_offset"] == 24
    assert (named["pull"]["mailbox_address"], named["pull"]["timeout_ns"]) == (mailbox.address, 123_456)
    # ep_dispatch_notify_stage: the stage's words, then the notify's, each as the kernel alone gets it (the
    # second call's own allocations and notify number apart)
    both = named["notify+stage"]
    per_call = ("list_index_ptr", "prefix_ptr", "recv_info_ptr", "table_ptr", "sequence")
    assert {name: value for name, value in both.items() if name in named["stage"] and name not in per_call} == \
        {name: value for name, value in named["stage"].items() if name not in per_call}
    notify, = [args for launch, _, args in launches if launch == "notify"]
    alone = dict(zip([n for n, t in NOTIFY.signature.items() if t != "constexpr"], notify[2:]))
    assert len(notify) == 2 + len(alone) and set(alone) <= set(both)
    assert {name: both[name] for name in alone if name not in per_call} == \
        {name: value for name, value in alone.items() if name not in per_call}
    assert (both["sequence"], alone["sequence"]) == (1, 2) and both["timeout_ns"] == 123_456
    assert (both["mailbox_address"], both["counts_offset"], both["num_experts"]) == (mailbox.address, 640, E)
    assert (both["expert_alignment"], both["write_table"]) == (3, 0)  # (the plain layout: no table)
    prefix = fused.handle.rank_prefix_matrix.data_ptr()
    index_words = fused.handle.backend_state.index_words.data_ptr()
    assert (both["prefix_ptr"], both["table_ptr"]) == (prefix, prefix)  # (no table: prefix's address)
    assert (both["list_index_ptr"], both["recv_info_ptr"]) == (index_words, index_words + 4 * 50 * R)
    assert named["pull"]["trace_ptr"] == 4096 and named["pull"]["num_rows"] == 40
    # the one launch (DispatchPlan.overlapped_fixed), here after the count wait (full_one_launch)
    from epcomm.backends.gpu.normal.one_node.dispatch import STAGE_PULL
    launches.clear()
    vars(mode)["full_one_launch"] = True
    mode.dispatch(_args(50))
    (_, _, args), = [launch for launch in launches if launch[0] == "ep_dispatch"]
    names = [n for n, t in STAGE_PULL.signature.items() if t != "constexpr"]
    assert len(args) == 2 + len(names)
    words = dict(zip(names, args[2:]))
    assert (words["rank"], words["num_ranks"], words["normal_bases_ptr"], words["state_ptr"]) == (RANK, R, 4096, 8192)
    assert (words["half_bytes"], words["lists_offset"], words["list_cap"], words["topk_row_bytes"]) == \
        (1 << 20, 512, 77, 32)
    assert (words["block_flags_offset"], words["block_flag_cap"], words["counts_offset"]) == (1 << 16, 1029, 640)
    assert (words["mailbox_address"], words["timeout_ns"], words["doorbell_address"]) == \
        (mailbox.address, 123_456, mailbox.doorbell_address)
    assert words["sequence"] == 0 and words["fp_offset"] == 24 and words["trace_ptr"] == 4096
    # the num_worst_tokens dispatch's one launch with its count exchange: the notify's words as
    # ep_dispatch_notify_stage got them above, by the same names
    launches.clear()
    vars(mode).update(full_one_launch=False, notify_with_stage=True)  # (the defaults; the stand-in plan stays)
    worst = _args(50, num_worst_tokens=96)
    worst.expert_alignment = 3
    result = mode.dispatch(worst)
    (_, grid, args), = [launch for launch in launches if launch[0] == "notify+ep_dispatch"]
    assert len(args) == 2 + len(names)
    words = dict(zip(names, args[2:]))
    assert (words["rank"], words["num_ranks"], words["normal_bases_ptr"], words["state_ptr"]) == (RANK, R, 4096, 8192)
    assert (words["half_bytes"], words["counts_offset"], words["block_flags_offset"]) == (1 << 20, 640, 1 << 16)
    assert (words["mailbox_address"], words["timeout_ns"], words["sequence"]) == (mailbox.address, 123_456, 4)
    assert (words["num_local"], words["expert_alignment"], words["num_rows"], words["num_tokens"]) == (E // R, 3, 96, 50)
    index_words = result.handle.backend_state.index_words.data_ptr()
    assert (words["list_index_ptr"], words["recv_info_ptr"]) == (index_words, index_words + 4 * 50 * R)
    assert (words["prefix_ptr"], words["src_idx_ptr"]) == (result.handle.rank_prefix_matrix.data_ptr(),
                                                           result.handle.recv_src_idx.data_ptr())
    assert words["fp_offset"] == 24 and words["trace_ptr"] == 4096
    assert grid == R + words["num_stage"] + min(NUM_SMS, -(-96 // BLOCK_R)) and words["num_stage"] == R + NUM_SMS


@pytest.mark.parametrize("num_tokens,max_tokens,launched", [
    (50, 60, ["notify", "wait", "ep_dispatch"]),  # every batch within the bound: one launch
    (50, 61, ["notify", "wait", "stage", "pull"]),  # another rank's is not: in turn, staged after the wait
    (61, 61, ["notify+stage", "wait", "pull"]),  # this one is not: staged during the wait, as by default
])


def test_one_launch_tokens_splits_full_one_launch_so_every_rank_picks_alike(monkeypatch, num_tokens, max_tokens,
                                                                           launched):
    """NormalMode.one_launch_tokens (bench --variants small-one-launch): a batch above the bound
    stages during the wait; the group takes one launch only where its largest batch (max_tokens,
    the same on every rank) is within the bound — then no rank staged — else all pull in turn."""
    launches = []
    mode = _mode(monkeypatch, launches, _OrderedMailbox((40, max_tokens), launches), doorbell=False)
    mode.full_one_launch, mode.one_launch_tokens = True, 60
    mode.dispatch(_args(num_tokens))
    assert [name for name, _, _ in launches] == launched


def test_small_one_launch_sets_full_one_launch_and_its_bound(monkeypatch):
    from epcomm.backends.gpu.normal.one_node import choices
    from epcomm.tools.bench import use_normal_variants
    mode = _mode(monkeypatch, [], _Mailbox(counts=(40, 60)), doorbell=False)
    use_normal_variants(mode, ["small-one-launch"])
    assert mode.full_one_launch and mode.one_launch_tokens == choices.SMALL_ONE_LAUNCH_TOKENS
    use_normal_variants(mode, ["full-one-launch"])
    assert mode.full_one_launch and mode.one_launch_tokens == 0
    with pytest.raises(ValueError, match="0 \\(no bound\\) or more"):
        mode.one_launch_tokens = -1


def test_every_choice_has_a_default(monkeypatch):
    """A Choice has no __get__ (choices.py): one without a default would read as the Choice object
    itself, which is truthy, instead of raising. _default_choices must store every one."""
    from epcomm.backends.gpu.normal.one_node.choices import Choice, KernelChoices
    mode = _mode(monkeypatch, [], _Mailbox(counts=(40, 60)), doorbell=False)
    names = {name for name, value in vars(KernelChoices).items() if isinstance(value, Choice)}
    assert names and names <= set(vars(mode))
    assert all(not isinstance(getattr(mode, name), Choice) for name in names)


@pytest.mark.parametrize("doorbell, full_one_launch, num_tokens, counts", [
    (False, False, 50, (40, 60)), (False, False, 150, (40, 150)), (True, False, 50, (40, 60)),
    (False, True, 50, (40, 60))])


def test_every_launch_of_a_full_dispatch_takes_pointers_as_addresses(monkeypatch, doorbell, full_one_launch,
                                                                      num_tokens, counts):
    """A tensor handed to a launch makes Triton's launcher call its data_ptr() and ask the driver
    about the pointer (cuPointerGetAttribute), on every call's host path: the notify took two."""
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=counts), doorbell=doorbell)
    mode.full_one_launch = full_one_launch
    mode.dispatch(_args(num_tokens))
    assert launches
    for name, _, args in launches:
        tensors = [i for i, value in enumerate(args) if isinstance(value, torch.Tensor)]
        assert not tensors, f"{name} got tensors at arguments {tensors}"


def _full_dispatch_receiving(mode, launches, mailbox, num_rows):
    """A full dispatch receiving ``num_rows`` rows: ``(recv_x, recv_topk, handle, the recv_x address the
    pull in turn got)``."""
    mailbox.counts = (num_rows, 60)
    launches.clear()
    result = mode.dispatch(_args(50))
    pull_args = next((args for name, _, args in launches if name == "pull"), None)  # (the doorbell's: none)
    # (the pull's arguments: 1, stream, prefix, src_idx, recv_x, ...)
    return result.recv_x, result.recv_topk_idx, result.handle, pull_args and pull_args[4]


def test_a_full_dispatchs_outputs_hold_exactly_its_rows_and_the_pull_writes_them(monkeypatch):
    """A full dispatch allocates its outputs after the count wait at the rows it receives (no
    larger allocation kept behind a view: 2026-11-29e measured allocating before the wait slower),
    and the pull in turn writes recv_x where it starts."""
    launches = []
    mailbox = _Mailbox(counts=(40, 60))
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    for rows in (40, 30, 45):
        recv_x, recv_topk, handle, address = _full_dispatch_receiving(mode, launches, mailbox, rows)
        assert recv_x.shape == (rows, HIDDEN) and recv_topk.shape == (rows, K) and handle.recv_src_idx.shape == (rows,)
        assert recv_x.untyped_storage().nbytes() == rows * HIDDEN * 2 and address == recv_x.data_ptr()
        assert recv_topk.untyped_storage().nbytes() == rows * K * 8
        assert handle.recv_src_idx.untyped_storage().nbytes() == rows * 4
