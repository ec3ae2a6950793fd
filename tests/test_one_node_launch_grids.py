"""The one-node normal mode's launches on the host (gpu/normal/one_node/mode.py): how many programs
each launch runs (the stage's and the pull's per Config.num_sms), and where the count exchange goes
in one launch with the stage, or with a num_worst_tokens dispatch's whole stage and pull (every
program of it waits: notify_stage_fits' bound). Checked with the recording stand-ins of
tests/one_node_stand_ins.py, no GPU. Skipped without Triton."""
import dataclasses

import pytest

pytest.importorskip("triton")

from one_node_stand_ins import (BLOCK_R, E, HIDDEN, NUM_SMS, R, ROUND_TOKENS, _args, _doorbell_arg,  # noqa: E402
                                _Mailbox, _mode)


def test_num_worst_tokens_is_one_launch_with_its_count_exchange_and_no_doorbell(monkeypatch):
    """A num_worst_tokens dispatch waits on nothing on the host, so its count exchange goes in the
    one launch too (ep_dispatch with NOTIFY: R more programs first; the mailbox's sequence word is
    the notify's): one launch per call. Where those programs would not fit notify_stage_fits'
    bound, or with notify_with_stage off (bench --variants notify-apart), the notify goes alone
    first, as before."""
    launches = []
    mailbox = _Mailbox(counts=None, fail=AssertionError("no count wait with num_worst_tokens"))
    mode = _mode(monkeypatch, launches, mailbox)
    result = mode.dispatch(_args(50, num_worst_tokens=80))
    assert [name for name, _, _ in launches] == ["notify+ep_dispatch"]
    _, grid, args = launches[0]
    assert grid == R + (R + min(NUM_SMS, -(-50 // BLOCK_R))) + min(NUM_SMS, -(-80 // BLOCK_R))  # notify, stage, pull
    assert _doorbell_arg(args) == mailbox.sequence and mailbox.rings == []
    assert result.recv_x.shape == (80, HIDDEN)
    from epcomm.backends.gpu.normal.one_node.dispatch import STAGE_PULL
    names = [n for n, t in STAGE_PULL.signature.items() if t != "constexpr"]
    words = dict(zip(names, args[2:]))
    index_words = result.handle.backend_state.index_words.data_ptr()
    assert (words["prefix_ptr"], words["recv_info_ptr"]) == (result.handle.rank_prefix_matrix.data_ptr(),
                                                             index_words + 4 * 50 * R)  # (the notify's outputs)
    assert (words["num_local"], words["expert_alignment"], words["counts_offset"]) == (E // R, 1, mode.ws.counts_offset)
    assert words["src_idx_ptr"] == result.handle.recv_src_idx.data_ptr() and words["num_rows"] == 80
    for choice, value in (("notify_with_stage", False), ("waiting_programs_per_sm", 1)):  # (1: too few for all)
        with monkeypatch.context() as apart:
            apart.setattr(mode, choice, value)
            launches.clear()
            mode.dispatch(_args(50, num_worst_tokens=80))
        assert [name for name, _, _ in launches] == ["notify", "ep_dispatch"], choice
        assert _doorbell_arg(launches[1][2]) == 0


@pytest.mark.parametrize("num_tokens, launches_seen", [(32, ["notify+ep_dispatch"]), (40, ["notify", "ep_dispatch"])])
def test_a_num_worst_tokens_dispatch_takes_its_count_exchange_in_where_all_its_programs_fit(monkeypatch, num_tokens,
                                                                                             launches_seen):
    """At the bound: R notify + R list + copy + pull programs, every one of them waiting, at most
    waiting_programs_per_sm x num_sms (here 3 x 6 = 18: 4 + 4 + 4 + 6 fits, one copy program more
    does not, and the notify goes apart)."""
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=None, fail=AssertionError("no count wait")))
    monkeypatch.setattr(mode, "waiting_programs_per_sm", 3)
    mode.dispatch(_args(num_tokens, num_worst_tokens=48))
    assert [name for name, _, _ in launches] == launches_seen
    if len(launches_seen) == 1:
        assert launches[0][1] == 3 * NUM_SMS  # (the grid: exactly the bound)


@pytest.mark.parametrize("per_sm", [1, 2, 4])
def test_the_pull_in_turn_runs_pull_programs_per_sm_times_num_sms(monkeypatch, per_sm):
    launches = []
    mailbox = _Mailbox(counts=(400, 60))
    mode = _mode(monkeypatch, launches, mailbox, doorbell=False)
    mode.pull_programs_per_sm = per_sm
    mode.dispatch(_args(50))
    (name, grid, _), = [launch for launch in launches if launch[0] == "pull"]
    assert grid == per_sm * NUM_SMS  # (400 rows: 50 blocks, more than 4 x num_sms)


@pytest.mark.parametrize("per_sm", [1, 3])
def test_the_stage_in_turn_runs_stage_programs_per_sm_times_num_sms_copy_programs(monkeypatch, per_sm):
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=(40, 150)), doorbell=False)
    mode.stage_programs_per_sm = per_sm
    mode.dispatch(_args(150))  # (150 tokens: 19 blocks of 8, one round of 100 then 50)
    stages = [grid for name, grid, _ in launches if name.endswith("stage")]
    assert stages == [R + R + min(per_sm * NUM_SMS, -(-ROUND_TOKENS // BLOCK_R)),  # (with the R notify programs)
                      min(per_sm * NUM_SMS, -(-50 // BLOCK_R))]


def test_a_full_dispatch_stages_on_r_list_programs_and_stage_programs_per_sm_copy_programs_by_default(monkeypatch):
    """The default stage in turn: R list programs, then STAGE_PROGRAMS_PER_SM x num_sms copy programs
    (its copies' rate per program set its pace); in one launch the stage keeps num_sms copy programs
    beside the pull's."""
    from epcomm.backends.gpu.normal.one_node import choices
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=(40, 60)), doorbell=False)
    assert mode.stage_programs_per_sm == choices.STAGE_PROGRAMS_PER_SM == 2
    mode.dispatch(_args(100))  # (100 tokens: 13 blocks of 8, more than num_sms)
    (stage_grid,) = [grid for name, grid, _ in launches if name == "notify+stage"]
    assert stage_grid == R + R + min(2 * NUM_SMS, -(-100 // BLOCK_R))  # (the R notify programs first)
    launches.clear()
    mode.full_one_launch = True
    mode.dispatch(_args(100))
    assert launches[1][0] == "ep_dispatch"
    pull_programs = min(mode.pull_programs_per_sm * NUM_SMS, -(-40 // BLOCK_R))  # (40 rows received)
    assert launches[1][1] == R + min(NUM_SMS, -(-100 // BLOCK_R)) + pull_programs


@pytest.mark.parametrize("per_sm", [0, 5])
def test_programs_per_sm_outside_1_to_4_are_refused(monkeypatch, per_sm):
    mode = _mode(monkeypatch, [], _Mailbox(counts=(40, 60)), doorbell=False)
    with pytest.raises(ValueError, match="1 to 4"):
        mode.pull_programs_per_sm = per_sm
    with pytest.raises(ValueError, match="1 to 4"):
        mode.stage_programs_per_sm = per_sm


@pytest.mark.parametrize("num_sms, num_tokens, together", [
    (6, 50, True), (2, 50, False),
    (4, 64, True), (4, 65, False),  # (the bound: 4 + 4 + 8 copies = 16 = 4 x num_sms; 9 copies: 17)
    (2, 150, False)])


def test_notify_and_stage_launch_together_only_where_their_waiting_programs_fit(
        monkeypatch, num_sms, num_tokens, together):
    """In ep_dispatch_notify_stage every program waits (the notify's for the peers, the stage's for the
    notify): it goes only where its grid (R notify + R list + copy programs) is within 4 x num_sms.
    Where ranks share a GPU that is the waiting programs shared_grids.py counts per rank (a rank
    whose peers' programs found no room would wait out the timeout); on a GPU of its own it keeps
    the wait's spinning programs off the SMs a compute stream beside the call uses (a review: at
    R = 8 the expert-major stage's position programs alone would hold every SM). Else two launches."""
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=(40, 60)), doorbell=False)
    mode.stage_programs_per_sm = 4
    call = _args(num_tokens)
    call.config.num_sms = num_sms
    mode.dispatch(call)
    copies = min(4 * num_sms, -(-min(num_tokens, ROUND_TOKENS) // BLOCK_R))
    assert (R + R + copies <= 4 * num_sms) == together
    if together:
        assert [(name, grid) for name, grid, _ in launches][:1] == [("notify+stage", R + R + copies)]
    else:
        assert [(name, grid) for name, grid, _ in launches][:2] == [("notify", R), ("stage", R + copies)]


def test_a_raised_waiting_bound_takes_the_single_launch_where_the_default_would_not(monkeypatch):
    """NormalMode.waiting_programs_per_sm (WAITING_PROGRAMS_PER_SM by default) is the bound the fit
    rule applies: the shared-GPU bed raises it to run the single launch at 8 ranks."""
    for per_sm, first in ((4, "notify"), (5, "notify+stage")):  # (4 + 4 + 9 copies = 17: > 16, <= 20)
        launches = []
        mode = _mode(monkeypatch, launches, _Mailbox(counts=(40, 60)), doorbell=False)
        mode.stage_programs_per_sm = 4
        mode.waiting_programs_per_sm = per_sm
        call = _args(65)
        call.config.num_sms = 4
        mode.dispatch(call)
        assert launches[0][0] == first


@pytest.mark.parametrize("expert_major", [False, True])
def test_the_fit_rule_counts_the_expert_major_position_programs(monkeypatch, expert_major):
    """The expert-major stage runs position programs beside its list and copy programs, and they
    wait in ep_dispatch_notify_stage too: counted, they take this grid past 4 x num_sms."""
    from epcomm.backends.gpu.normal.one_node.expert_major_rows import POSITION_TOKENS
    launches = []
    mode = _mode(monkeypatch, launches, _Mailbox(counts=(40, 60)), doorbell=False)
    plan = dataclasses.replace(mode._dispatch_plan_of(None), expert_major=expert_major)
    mode._dispatch_plan_of = lambda args: plan
    call = _args(50)
    call.config.num_sms = 4
    mode.dispatch(call)
    copies, positions = min(2 * 4, -(-50 // BLOCK_R)), -(-50 // POSITION_TOKENS) if expert_major else 0
    assert R + R + copies <= 4 * 4 < R + R + copies + positions or not expert_major  # (the case this test needs)
    names = [name for name, _, _ in launches]
    assert names[:2] == (["notify", "stage"] if expert_major else ["notify+stage", "pull"])
