"""The overlapped calls' waits decide by program-wide votes (warps.py: cta_any / cta_all), compiled for
sm_90 without a GPU (Triton installed; PTX only).

Why: a reduction over a tensor of a few lanes runs within each warp — Triton gives every warp the
whole tensor — so a value read from memory that changes while the program reads it (a block flag
a peer is releasing, GAVE_UP, the clock) can differ between the warps of one program. The
overlapped pull and the combine's reduce branched on such values into waits whose cross-warp
reductions use bar.sync: one warp in the wait, another past it, and the barriers pair up wrongly
(garbage reports, a false timeout, or a hang). The first tests pin the premises, the others that
the kernels vote where it matters — program-wide, or, in the overlapped pull, within each warp
over an item loop that holds no barrier."""
import re

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from epcomm.backends.gpu.launch import KernelSpec  # noqa: E402
from epcomm.backends.gpu.normal import one_node as N  # noqa: E402
from epcomm.backends.gpu.sync import record_disagreement, record_elsewhere, report_late  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
COPY = dict(BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8)


@triton.jit
def _min_of_eight(words_ptr, out_ptr):
    lanes = tl.arange(0, 8)
    tl.store(out_ptr, tl.min(tl.load(words_ptr + lanes, volatile=True), axis=0))


def test_a_reduction_over_a_few_lanes_stays_within_each_warp():
    """The premise of the votes: with 16 warps, the minimum of 8 loaded lanes is shuffles only, no
    barrier — each warp reduces its own reading (so it cannot be trusted to be the program's)."""
    ptx = KernelSpec(_min_of_eight, ["*i64", "*i64"]).compile({}, 16, target=SM90).asm["ptx"]
    assert "shfl.sync" in ptx
    assert "bar.sync" not in ptx and "bar.red" not in ptx


@triton.jit
def _store_eight(out_ptr, value):
    lanes = tl.arange(0, 8)
    tl.store(out_ptr + lanes, lanes + value)


def test_a_store_of_a_few_lanes_is_issued_by_the_first_warp_only():
    """Why a wait cannot be left to each warp on its own (and so why a vote per item): Triton
    stores an element that every warp holds from one thread only, of the first warp — a branch
    that only other warps took would store nothing."""
    ptx = KernelSpec(_store_eight, ["*i32", "i32"]).compile({}, 16, target=SM90).asm["ptx"]
    assert "and.b32" in ptx and "%tid.x" in ptx
    stores = [line for line in ptx.splitlines() if "st.global" in line]
    assert len(stores) == 1 and stores[0].strip().startswith("@%p")  # predicated: not every thread


@triton.jit
def _report(mask_ptr, timeouts_ptr, agreement_ptr, flags_ptr, call_tag, fp0, MASK: tl.constexpr):
    peers = tl.arange(0, 8)
    late = tl.load(flags_ptr + peers, volatile=True) != 0
    report_late(late, peers, mask_ptr, timeouts_ptr, MASK)
    record_elsewhere(timeouts_ptr.to(tl.int64), peers, late, call_tag, fp0, agreement_ptr, 8)
    record_disagreement(agreement_ptr, peers, late, peers.to(tl.int64), peers.to(tl.int64), fp0, call_tag, 8)


@pytest.mark.parametrize("mask", [False, True], ids=["mailbox", "mask"])
def test_reports_of_a_wait_are_stored_from_every_warp(mask):
    """A wait's late, elsewhere and differing peers are each warp's reading: their reports must not
    be left to the first warp (which may have read the peer in time), or the host would not raise."""
    ptx = KernelSpec(_report, ["*i32", "*i64", "*i64", "*i32", "i64", "i64"]).compile({"MASK": mask}, 16, target=SM90).asm["ptx"]
    stores = [line for line in ptx.splitlines() if "st.global" in line]
    assert stores and all("%p_live" in line for line in stores), stores


BARRIER = re.compile(r"\b(bar|barrier)\.(sync|red|arrive)")


def _loop_bodies(ptx):
    """The lines of each loop in ``ptx``: from a label to a branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\w+):", line.strip()))}
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            yield lines[labels[m.group(1)]:i]


def _loops_with_a_barrier(ptx, also=""):
    """The loops whose body holds a CTA barrier (and, given, a line containing ``also``)."""
    return [body for body in _loop_bodies(ptx)
            if any(BARRIER.search(line) for line in body) and (not also or any(also in line for line in body))]


def _loops_with_a_barrier_and_an_acquire(ptx):
    """Loops holding both an ``ld.acquire`` (a wait, or a flag's fast path) and a CTA barrier."""
    return _loops_with_a_barrier(ptx, also="ld.acquire")


def _pull_ptx(full, scales, block_r, side_first=False, pushed_lists=False, notify=False):
    return N.STAGE_PULL.compile(dict(INDEX=full, WRITE_LISTS=full, HAS_SCALES=scales, HAS_TOPK=full, LIST_BLOCK=1024,
                                     L_P2=128 if full else 1, ALIGNED=True, OUT_ALIGNED=True, EVERY_PEER=True,
                                     TRACE=False, DOORBELL=False, SIDE_FIRST=side_first, PUSHED_LISTS=pushed_lists,
                                     NOTIFY=notify, NOTIFY_BLOCK=256,
                                     **dict(COPY, BLOCK_R=block_r, BLOCK_W=16384 // block_r)),
                                16, target=SM90).asm["ptx"]


# (full dispatch, FP8 scales, rows per item): H=7168 in BF16 (8 rows) and FP8 (16); 32 rows, the most
# that one warp's lanes hold (hidden sizes down to 2048 in BF16)
@pytest.mark.parametrize("full,scales,block_r,side_first,pushed_lists,notify",
                         [(True, False, 8, False, False, False), (False, False, 8, False, False, False),
                          (False, True, 16, False, False, False), (True, False, 32, False, False, False),
                          (True, False, 8, True, False, False), (False, True, 16, True, False, False),
                          (True, False, 8, True, True, False), (True, False, 8, True, True, True)],
                         ids=["full dispatch", "cached dispatch", "cached FP8", "full dispatch, 32 rows",
                              "full dispatch, side loads first", "cached FP8, side loads first",
                              "full dispatch, lists pushed, count check split",
                              "num_worst_tokens, its count exchange in the launch"])
def test_the_overlapped_pull_runs_its_items_without_meeting_the_other_warps(full, scales, block_r, side_first,
                                                                           pushed_lists, notify):
    """Each warp decides its waits alone (warps.warp_all / warp_any), so the item loop — its waits
    included — must hold no barrier: a warp in a wait while another copies would pair its barrier
    with an unrelated one (a hang, or garbage). A barrier per item cost the cached dispatch ~18 % on
    one H200 (97 against 79 µs): every warp waited for the slowest one's loads."""
    ptx = _pull_ptx(full, scales, block_r, side_first, pushed_lists, notify)
    assert _loops_with_a_barrier_and_an_acquire(ptx) == []
    assert "vote.sync.all.pred" in ptx and "vote.sync.any.pred" in ptx  # the flags, the stage's end; giving up


def test_the_overlapped_pull_votes_program_wide_where_its_rows_span_the_warps():
    """Rows of small hidden sizes come 64 or more to an item: its lanes span the warps, their
    reductions meet through shared memory, and a warp deciding alone would pair those barriers
    wrongly (seen as an illegal instruction in the 8 x 8 fuzz). There the decisions stay the
    program's votes."""
    ptx = _pull_ptx(False, False, 64)
    assert _loops_with_a_barrier_and_an_acquire(ptx)
    assert "bar.red.and.pred" in ptx and "bar.red.or.pred" in ptx


def test_the_barrier_check_sees_a_wait_that_meets_the_other_warps():
    """The check above finds a loop whose wait votes program-wide (the combine's reduce, which
    still does)."""
    compiled = N.PUSH_REDUCE.compile(dict(HAS_WEIGHTS=True, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8, ALIGNED=True,
                                          EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=False, NUM_BIAS=0, BLOCK_C=2048,
                                          OUT_ALIGNED=True, RANK_LOOP=False,
                                          WARPS_APART=False), 16, target=SM90)
    assert _loops_with_a_barrier_and_an_acquire(compiled.asm["ptx"])


def test_the_overlapped_combine_votes_on_its_flags_and_on_giving_up():
    compiled = N.PUSH_REDUCE.compile(dict(HAS_WEIGHTS=True, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8, ALIGNED=True,
                                          EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=False, NUM_BIAS=0, BLOCK_C=2048,
                                          OUT_ALIGNED=True, RANK_LOOP=False,
                                          WARPS_APART=False), 16, target=SM90)
    ptx = compiled.asm["ptx"]
    assert "bar.red.and.pred" in ptx and "bar.red.or.pred" in ptx


def test_the_doorbell_answer_is_a_vote():
    """The answering program's go / cancel, and the others' stand-down, are votes: a warp that did
    not read go must not pull while another does."""
    compiled = N.STAGE_PULL.compile(dict(INDEX=True, WRITE_LISTS=True, HAS_SCALES=False, HAS_TOPK=True,
                                         LIST_BLOCK=1024, L_P2=128, ALIGNED=True, OUT_ALIGNED=True, EVERY_PEER=True,
                                         TRACE=False, DOORBELL=True, SIDE_FIRST=False, PUSHED_LISTS=False,
                                         NOTIFY=False, NOTIFY_BLOCK=256, **COPY),
                                    16, target=SM90)
    ptx = compiled.asm["ptx"]
    assert ptx.count("bar.red.and.pred") >= 1 and ptx.count("bar.red.or.pred") >= 1  # go; the others' stand-down
    assert ptx.count("bar.red") >= 3  # (on top of the verdict's two, which every full dispatch has)


def test_the_low_latency_reduce_votes_on_a_rank_gone():
    """Whether any rank is gone (in another call, or differing) is each warp's reading of its
    lanes; the reduce then compares every entry's rank with them ([K, R]: a reduction that may meet
    the other warps), so the branch into that comparison is a program-wide vote."""
    from epcomm.backends.gpu import low_latency as L
    from epcomm.backends.gpu.reach.modes import PEERS_BY_STORES
    compiled = L.COMBINE.compile(dict(SEND=False, RECEIVE=True, HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8,
                                      BLOCK_C=1024, R_P2=8, ALIGNED=False, REMOTE=PEERS_BY_STORES), 8,
                                 target=SM90)
    assert "bar.red.or.pred" in compiled.asm["ptx"]


def test_the_step_barrier_votes_before_it_fails_the_call():
    """The two-level step barrier's failure word is one scalar store, issued by the first warp only;
    a late or differing rank that only other warps saw at the deadline must still fail the call,
    or its later kernels would wait for rows that never come."""
    from epcomm.backends.gpu.normal.two_level import step as S
    from epcomm.backends.gpu.reach.modes import FAR_BY_LOOPBACK
    compiled = S.STEP.compile(dict(REMOTE=FAR_BY_LOOPBACK, R_P2=16), 4, target=SM90)
    assert "bar.red.or.pred" in compiled.asm["ptx"]


@pytest.mark.parametrize("rank_loop", [False, True], ids=["tile", "rank loop"])
def test_the_rank_loop_reduce_sums_a_token_without_meeting_the_other_warps(rank_loop):
    """At 8 ranks (R_P2 = 8, BLOCK_C = 2048) a token's [8, 2048] tile splits its ranks over two warps:
    its sum, store and weights' sum meet through shared memory, barriers per token. RANK_LOOP
    (NormalMode.rank_loop_reduce) sums one [2048] row per rank: the in-turn reduce's token loop
    then holds no barrier."""
    compiled = N.REDUCE.compile(dict(NUM_BIAS=1, HAS_WEIGHTS=True, R_P2=8, BLOCK_C=2048, K_P2=8, ALIGNED=True,
                                     RANK_LOOP=rank_loop), 16, target=SM90)
    assert bool(_loops_with_a_barrier(compiled.asm["ptx"])) != rank_loop


def test_the_low_latency_reduce_sums_a_column_block_without_meeting_the_other_warps():
    """The low-latency combine's receive sums a token's K = 8 rows per column block one [1024] row
    per entry, each warp its own columns: the column loop holds no barrier (an [8, 1024] tile split
    its entries over the 8 warps and met them through shared memory, 5 barriers a block, 7 blocks a
    7168 row: 6–7 µs more per round trip in a CUDA graph, 2026-11-28h)."""
    from epcomm.backends.gpu import low_latency as L
    from epcomm.backends.gpu.reach.modes import PEERS_BY_STORES
    ptx = L.COMBINE.compile(dict(SEND=False, RECEIVE=True, HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8, BLOCK_C=1024,
                                 R_P2=8, ALIGNED=True, REMOTE=PEERS_BY_STORES), 8,
                            target=SM90).asm["ptx"]
    column_loop = min((body for body in _loop_bodies(ptx)
                       if sum("ld.global" in line for line in body) >= 8 and any("st.global" in line for line in body)),
                      key=len)
    assert not any(BARRIER.search(line) for line in column_loop)


def _push_reduce_ptx(rank_loop, warps_apart, block_r=8, r_p2=8):
    return N.PUSH_REDUCE.compile(dict(HAS_WEIGHTS=True, BLOCK_R=block_r, BLOCK_W=16384 // block_r, K_P2=8, R_P2=r_p2,
                                      ALIGNED=True, EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=False, NUM_BIAS=1,
                                      BLOCK_C=8192, OUT_ALIGNED=True, RANK_LOOP=rank_loop, WARPS_APART=warps_apart),
                                 16, target=SM90).asm["ptx"]


@pytest.mark.parametrize("block_r,r_p2", [(8, 8), (16, 4), (32, 2)], ids=["8 rows, 8 ranks", "16 x 4", "32 x 2"])
def test_the_combine_reduce_with_warps_apart_runs_its_chunks_without_meeting_the_other_warps(block_r, r_p2):
    """WARPS_APART (NormalMode.reduce_warps_apart) with the rank loop: each warp decides its chunks'
    waits alone, so no loop holding an ld.acquire (the chunk loop, its waits included) may hold a
    barrier — a warp in a wait while another sums would pair its barrier with an unrelated one."""
    ptx = _push_reduce_ptx(True, True, block_r, r_p2)
    assert _loops_with_a_barrier_and_an_acquire(ptx) == []
    assert "vote.sync.all.pred" in ptx and "vote.sync.any.pred" in ptx


@pytest.mark.parametrize("rank_loop,block_r", [(False, 8), (True, 16)], ids=["tile sums", "128 chunk lanes"])
def test_the_combine_reduce_keeps_program_votes_where_its_lanes_meet(rank_loop, block_r):
    """Where the sums meet the other warps (the tile form) or the chunk head may span them (more
    than 64 [token, rank] lanes), WARPS_APART falls back to the program's votes."""
    ptx = _push_reduce_ptx(rank_loop, True, block_r, 8)
    assert _loops_with_a_barrier_and_an_acquire(ptx)
    assert "bar.red.and.pred" in ptx and "bar.red.or.pred" in ptx
