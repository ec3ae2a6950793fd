"""Synchronisation of the GPU layer: flags, epochs, bounded waits, fingerprint checks (device side).

The memory-ordering contract (every kernel of this backend follows it)
----------------------------------------------------------------------
Data crosses GPUs by plain stores or loads on peers' symmetric memory (NVLink). A hand-off is
always the same four steps, and each site in the kernels names its step:

1. The producers write the data (plain stores; local or to a peer).
2. **Arrive**: each producing program runs a CTA barrier (so every thread's stores precede what
   follows) and then one ``atom.add.acq_rel.gpu`` on a local arrival counter. The program that
   arrives last has acquired every other program's stores. GPU scope suffices here: all the
   programs run on this GPU, and causality order is transitive across scopes in the PTX memory
   model, so the system-scope release of step 3 covers these stores too (DeepEP's kernels rely on
   the same chain: GPU-scope counters, then a system-scope release). A system-scope arrival costs
   a full NVLink round trip per program, serialised on one address: 80 µs for 1024 programs.
3. **Release**: the last program's threads each run ``fence.acq_rel.sys`` and then store the new
   epoch (or an epoch-tagged count) into the peers' words with ``st.relaxed.sys`` — the PTX
   release pattern (:func:`publish`). Plain stores, not read-modify-writes: a release-exchange per
   word costs an NVLink round trip and a fence each (30 µs for 256 count words). Release is cumulative: it
   covers every store the releasing thread has observed — the other programs' stores of step 1
   (through step 2), and also stores of *earlier kernels on the same stream*, which completed
   before this kernel started. That is why a signal at the end of one launch publishes the
   payload written by an earlier launch.
4. **Acquire**: the consumer polls its own flag word with ``ld.acquire.sys`` until it holds at
   least the expected epoch (bounded by a deadline on ``%globaltimer``), then reads the data.

Warps. A wait's lanes are polled by some threads; every warp holds a small lane tensor whole and
reduces its own reading. So what a program decides on a polled value (go on, wait, give up) is a
vote (warps.py: ``cta_any``, ``cta_all``, ``bar.red``), whose barrier also orders the polling threads'
acquires before every thread's loads of the data. What it reports (late peers, another call)
is stored from every warp (warps.py: ``store_from_every_warp``), since each reported what it read.
Where nothing the decision guards meets the other warps, the vote may be the warp's alone
(``warp_all``, ``warp_any``; ``WARP`` below): the overlapped pull's warps run their items apart.

Epochs. Every flag set (normal mode, low-latency combine) has a device-side epoch counter: the
signalling kernel computes ``epoch = counter + 1`` and stores it back in its last program (the
count exchange and stage in one launch, one_node/notify.py, store only the stage's, the later). All
ranks make the same sequence of calls, so their counters agree; a wait compares ``>=`` because a
peer can run at most one call ahead (it cannot start call n+2 before this rank signals n+1).
Counters live in device memory, not on the host, so launches replay correctly in CUDA graphs.

Double buffering instead of clean-up barriers. Data written before barrier ``e`` and read after it
lives in half ``e % 2`` of its region. A rank writes half ``e % 2`` again only at barrier ``e + 2``,
after it has waited at ``e + 1`` for every peer — and each peer signals ``e + 1`` only after its
reads of barrier ``e`` finished (stream order)::

    rank A:  write h0 | signal e | wait e | read h0 | write h1 | signal e+1 | wait e+1 | write h0 ...
    rank B:  write h0 | signal e | wait e | read h0 ----------> | signal e+1 | ...
                                            (B's reads of h0 end before A may write h0 again)

Fingerprints. Every release also covers the two fingerprint words of the call that sends it
(:func:`post_fingerprint_to_peers`, plain stores by program 0 at the kernel's start, carried to the
releasing program by the arrivals), and every acquire is followed by a comparison of the senders'
words with the receiver's own (:func:`check_fingerprints`; agreement.check_rows where an abort's
stamp may cover the call): ranks in different calls, or with different arguments, move no data
and raise instead (agreement.py).

Host mailbox. Kernels report to the host through pinned, device-mapped host memory (under unified
addressing a ``cudaHostAlloc`` pointer is valid on the device too): the notify kernel writes the
receive counts and then a sequence number with ``st.release.sys``; the host polls that word
instead of synchronising the stream. Waits that give up, and dropped invalid input, raise flags
there that the host checks at the start of every call — no extra synchronisation.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import call_board
from .warps import cta_all, cta_any, store_from_every_warp, store_one_from_every_warp, vote_all, vote_any, warp_any
from .workspace import FLAGS_LL_COMBINE, FLAGS_NORMAL, NUM_FLAG_SETS  # noqa: F401 (used by the kernels)
from .workspace import FP_LL_COMBINE, FP_LL_DISPATCH, FP_NORMAL, FP_ROW_BYTES  # noqa: F401 (used by the kernels)

NORMAL_FLAG_SET = tl.constexpr(FLAGS_NORMAL)  # (kernels read module globals only as constexprs)

FP_ROW = tl.constexpr(FP_ROW_BYTES)
# An epoch above any a wait can expect: a rank that rejected its input releases it (agreement.py).
ABORT_EPOCH = tl.constexpr(1 << 30)
# A wait that checks its senders' fingerprint rows (poll_epochs_or_other_call) looks this often.
ROW_CHECK_NS = tl.constexpr(20_000)
# A call board word (call_board.py): (call number << 8) | (Buffer slot << 4) | call kind.
BOARD_NUMBER_SHIFT = tl.constexpr(call_board.NUMBER_SHIFT)
BOARD_BUFFER_SHIFT = tl.constexpr(call_board.BUFFER_SHIFT)
BOARD_BUFFER_MASK = tl.constexpr(call_board.NUM_SLOTS)
BOARD_KIND_MASK = tl.constexpr(call_board.KIND_MASK)
FP_BUFFER_SHIFT = tl.constexpr(call_board.FP_BUFFER_SHIFT)
BOARD_RING = tl.constexpr(call_board.RING)
RESYNC_TAG = tl.constexpr(call_board.RESYNC_TAG)  # (its board word is RESYNC_TAG too: all bits set)
BOARD_ABORT_KIND = tl.constexpr(call_board.ABORT_KIND)

# Device-side state words (int64, one small tensor per backend): epochs and arrival counters.
EPOCH_NORMAL = 0
EPOCH_LL_DISPATCH = 1
EPOCH_LL_COMBINE = 2
LL_DISPATCH_HALF_EPOCH = 3  # [2]: the epoch each low-latency dispatch half was last sent with
LL_COMBINE_HALF_EPOCH = 5  # [2]: the same for combine
CALL_FAILED = 7  # two-level normal mode: the epoch of a call whose step barrier found another call or a late rank
ARRIVE = 8  # arrival counters, one per kernel kind (below)
ARRIVE_NOTIFY, ARRIVE_STAGE, ARRIVE_PUSH, ARRIVE_LL_SEND, ARRIVE_LL_PUSH, ARRIVE_LAYOUT = range(ARRIVE, ARRIVE + 6)
COUNT_ERROR = 14  # abort code of the counts the staging kernel found inconsistent (agreement.py)
SPARE = 15  # a scratch word: the target of masked-off lanes of publish()
ARRIVE_RECEIVE = 16  # arrival counter of the receiving programs of one launch: the overlapped combine's
# reduce, the overlapped dispatch's pull, the gathered index's barrier of a pull in turn (one_node/combine.py,
# dispatch.py, receive_index.py; never two at once: stream order)
GAVE_UP = tl.constexpr(17)  # the epoch of an overlapped call whose receiving program gave up a wait (the others stop)
DOORBELL = tl.constexpr(18)  # (epoch << 2) | the answer to an overlapped dispatch's doorbell (await_doorbell),
# then the doorbell's words 1 .. DOORBELL_WORDS - 2 (the outputs' addresses), copied from the host
INDEX_GATHERED = tl.constexpr(26)  # the epoch of the last pull in turn whose programs all gathered its receive
# index, or minus the epoch of one whose program found the call failed (one_node/receive_index.py; after the
# doorbell's DOORBELL_WORDS words 18..25, which a doorbell's wait reads whole)
NOTIFIED = tl.constexpr(27)  # the epoch of the last count exchange of ep_dispatch_notify_stage (one_node/notify.py)
# or of ep_dispatch with NOTIFY (one_node/dispatch.py), released by its last notify program to the launch's
# stage programs (and pull programs, which read rank_prefix_matrix) once it has read the count rows
NUM_STATE_WORDS = 28

# The doorbell (mailbox.py, HostMailbox.ring): word 0 = 2 * sequence + 1 (go: the outputs' addresses
# follow in words 1..DOORBELL_WORDS - 2) or 2 * sequence (cancel); the last word is the device's:
# the sequence of a launch that stopped waiting. The answers a launch's pull programs agree on:
RING_GO = tl.constexpr(1)
RING_CANCEL = tl.constexpr(2)  # the host rang cancel, or (the host told: HostMailbox.ring) stopped waiting
DOORBELL_WORDS = tl.constexpr(8)



# ---------------------------------------------------------------------- device helpers
@triton.jit
def abort_covers(epochs, epoch):
    """Lanes whose signal word, of epoch field ``epochs``, is an abort's stamp that covers the call
    of ``epoch``: the sender's last real signal through that word was for an earlier call (a stamp
    of ABORT_EPOCH itself — nothing sent before — covers every call). A stamp over this call's own
    epoch does not: the call was sent, and the stamp's release covers its data too. (The stamp and
    why: agreement.py, above ep_abort; re-exported there.)"""
    return (epochs >= ABORT_EPOCH) & (epoch > epochs - ABORT_EPOCH)


@triton.jit
def call_failed(failed_ptr, epoch):
    """Two-level normal mode: True when the step barrier of the call of ``epoch`` failed (``failed_ptr``: the
    state word CALL_FAILED; gpu/normal/two_level/step.py), and the kernel must return without waiting or moving
    anything. The step kernel stored the word earlier on the same stream: a plain load sees it."""
    return tl.load(failed_ptr) == epoch


@triton.jit
def now_ns():
    """%globaltimer: a nanosecond clock shared by all SMs (used only to bound waits)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def uniform_now(lanes):
    """:func:`now_ns` as one value for the lanes of a wait: the latest of the threads' readings,
    through a reduction over ``lanes`` (any tensor of the caller's lane shape). Where those lanes
    span the warps, one value in the program; where every warp holds them whole (a few lanes), one
    per warp — which is why a wait's loop holds no barrier and its callers vote on its outcome."""
    return tl.max(tl.zeros_like(lanes).to(tl.int64) + now_ns(), axis=0)


@triton.jit
def gave_up_here(state_ptr, epoch, lanes, WARP: tl.constexpr):
    """1 when a program of this launch gave up a wait of the call of ``epoch`` (state word GAVE_UP),
    else 0 — the same in every thread (a vote: the word may change between the warps' reads); with
    ``WARP``, in every thread of each warp (warps.warp_any: the caller's region needs no more).
    ``lanes``: any tensor of the caller's lane shape."""
    seen = tl.max((tl.load(state_ptr + GAVE_UP + tl.zeros_like(lanes).to(tl.int32), volatile=True) == epoch).to(tl.int32),
                  axis=0)
    return vote_any(seen, WARP)


@triton.jit
def store_release_sys(address, value):
    """``st.release.sys`` of an int64 to a byte address (host-mapped memory: no atomics there)."""
    tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l", [address, value],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish(addresses, values, live, spare_address):
    """Step 3: RELEASE ``values`` into the int64 words at byte ``addresses`` (lanes where ``live``):
    one ``fence.acq_rel.sys`` per thread, then ``st.relaxed.sys`` stores. Dead lanes store into
    ``spare_address`` (a scratch word of this rank) instead, since inline asm cannot be masked."""
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise("st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                              [tl.where(live, addresses, spare_address), values], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def publish_from_one_thread(address, value):
    """Step 3 for one word, by one thread: thread 0 runs ``fence.acq_rel.sys`` and stores ``value``
    (int64) at byte ``address`` with ``st.relaxed.sys``. The CTA barrier first carries every
    thread's earlier stores to thread 0 (causality order is transitive across scopes), so the
    release covers the whole program's stores, and only one warp waits for the fence — where
    :func:`publish` fences in every thread (a once-per-kernel signal can afford that, a
    per-block one cannot)."""
    tl.debug_barrier()
    tl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .b32 tid; mov.u32 tid, %tid.x; setp.eq.u32 first, tid, 0; "
        "@first fence.acq_rel.sys; @first st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,l", [address, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish_to_peers_from_one_thread(bases_ptr, word_offset, num_ranks, value):
    """:func:`publish_from_one_thread` into the same word of every rank's workspace (``bases_ptr``:
    [R] int64 byte address of each rank's workspace; ``word_offset``: bytes from it): one CTA
    barrier and one ``fence.acq_rel.sys`` by thread 0, then its ``st.relaxed.sys`` to each rank."""
    tl.debug_barrier()
    tl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .b32 tid; mov.u32 tid, %tid.x; setp.eq.u32 first, tid, 0; "
        "@first fence.acq_rel.sys; mov.u32 $0, 0; }", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    for peer in range(0, num_ranks):  # (thread 0's stores follow its fence in program order)
        tl.inline_asm_elementwise(
            "{ .reg .pred first; .reg .b32 tid; mov.u32 tid, %tid.x; setp.eq.u32 first, tid, 0; "
            "@first st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l", [tl.load(bases_ptr + peer) + word_offset, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def arrive(counter_ptr, num_programs):
    """Step 2 of the contract. True in the program that arrives last; it also resets the counter
    (nobody else touches it again in this launch)."""
    tl.debug_barrier()  # every thread's stores of this program precede the arrival
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_programs - 1
    if last:
        tl.store(counter_ptr, 0)
    tl.debug_barrier()  # the acquire (one thread) precedes the other threads' reads
    return last


@triton.jit
def live_peers(mask_ptr, num_ranks, HAS_MASK: tl.constexpr, R_P2: tl.constexpr):
    """``(peers, live)``: the [R_P2] lanes and which of them are ranks that are not masked."""
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    if HAS_MASK:
        live &= tl.load(mask_ptr + peers, mask=live, other=1) == 0
    return peers, live


@triton.jit
def signal_peers(flag_bases_ptr, flag_offset, rank, num_ranks, epoch, mask_ptr, spare_address,
                 HAS_MASK: tl.constexpr, R_P2: tl.constexpr):
    """Step 3: RELEASE ``epoch`` into word ``rank`` of every live peer's flag set (self included).
    ``flag_bases_ptr``: [R] int64 byte address of each rank's workspace; ``flag_offset``: bytes
    from it to the flag set. The release also covers the fingerprint the kernel posted."""
    peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK, R_P2)
    word = tl.load(flag_bases_ptr + peers, mask=live, other=0) + flag_offset + rank * 8
    publish(word, tl.zeros([R_P2], tl.int64) + epoch, live, spare_address)


@triton.jit
def post_fingerprint_to_peers(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch,
                              HAS_MASK: tl.constexpr, R_P2: tl.constexpr):
    """Post the call's fingerprint into row ``rank`` of every live peer (``fp_rows``: bytes from a
    workspace to the set's half). Kernels do it in program 0 at their start, off the critical
    path: the rows of this half were last read two signals ago (sync.py's double-buffer argument,
    as for the payload), and the arrivals carry program 0's stores to the releasing program."""
    peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK, R_P2)
    post_fingerprint(tl.load(bases_ptr + peers, mask=live, other=0) + fp_rows, rank, live, fp0, fp1, epoch)


@triton.jit
def fingerprint_half(fp_offset, half, num_ranks):
    """Bytes from a workspace to row 0 of ``half`` of the fingerprint set at ``fp_offset``."""
    return fp_offset + (half * num_ranks * FP_ROW).to(tl.int64)


@triton.jit
def post_fingerprint(receivers, rank, live, fp0, fp1, epoch):
    """Store the call's fingerprint words and the signal's epoch into row ``rank`` on the
    receivers (``receivers``: byte address of the set's half on each, one lane per receiver, where
    ``live``): plain stores, covered by the release that follows."""
    words = (receivers + rank * FP_ROW).to(tl.pointer_type(tl.int64))
    tl.store(words, tl.zeros_like(receivers) + fp0, mask=live)
    tl.store(words + 1, tl.zeros_like(receivers) + fp1, mask=live)
    tl.store(words + 2, tl.zeros_like(receivers) + epoch, mask=live)
    tl.debug_barrier()  # every thread's stores precede the release (each thread fences there)


@triton.jit
def fingerprints_settled(my_half_address, senders, live, fp0, fp1, epoch):
    """Before the ACQUIRE (plain loads, off the critical path: senders post at the start of their
    kernels): the lanes whose row already holds ``epoch`` and this call's words. Such a row is
    final — a row changes only two epochs later — so :func:`check_fingerprints` skips it."""
    rows = my_half_address.to(tl.pointer_type(tl.int64)) + senders * (FP_ROW // 8)
    posted_epoch = tl.load(rows + 2, mask=live, other=-1)
    return (posted_epoch == epoch) & (tl.load(rows, mask=live, other=0) == fp0) & \
        (tl.load(rows + 1, mask=live, other=0) == fp1)


@triton.jit
def check_fingerprints(my_half_address, senders, live, settled, fp0, fp1, epoch, agreement_ptr, num_ranks):
    """After the ACQUIRE: compare the rows the live ``senders`` posted for ``epoch`` (or an
    abort of ABORT_EPOCH: two-level's step rows, ml_abort; the one-node and low-latency kernels
    use agreement.check_rows, which reads an abort's stamp) with this call's words
    (``my_half_address``: this rank's rows of the set's half), except lanes already ``settled``
    (:func:`fingerprints_settled`; usually all, so no load waits here). A row of an older epoch
    is not compared (a sender that timed out). Returns the mismatching lanes; any mismatch is
    recorded in the mailbox (:func:`mailbox_words`): the senders' words, this rank's own, and the
    pending word. The caller then moves no data from those senders.
    (Lane-wise, without a reduction or branch: this sits on the receivers' critical path.)"""
    tl.debug_barrier()  # the acquiring threads' polls precede the other threads' loads
    rows = my_half_address.to(tl.pointer_type(tl.int64)) + senders * (FP_ROW // 8)
    live &= settled == 0
    posted0 = tl.load(rows, mask=live, other=0)
    posted1 = tl.load(rows + 1, mask=live, other=0)
    posted_epoch = tl.load(rows + 2, mask=live, other=0)
    current = (posted_epoch == epoch) | (posted_epoch == ABORT_EPOCH)
    differ = live & current & ((posted0 != fp0) | (posted1 != fp1))
    record_disagreement(agreement_ptr, senders, differ, posted0, posted1, fp0, fp1, num_ranks)
    return differ


@triton.jit
def record_disagreement(agreement_ptr, senders, differ, words0, words1, fp0, fp1, num_ranks):
    """Record in the mailbox the lanes that ``differ``: the senders' words, this rank's own, and
    the pending word (the host raises naming the fields: agreement.py). From every warp: each
    records what it read (:func:`report_late`)."""
    store_from_every_warp((agreement_ptr + senders * 2).to(tl.int64), words0, differ, WIDE=True)
    store_from_every_warp((agreement_ptr + senders * 2 + 1).to(tl.int64), words1, differ, WIDE=True)
    zeros = tl.zeros_like(senders)
    store_from_every_warp((agreement_ptr + num_ranks * 2 + zeros).to(tl.int64), zeros.to(tl.int64) + fp0, differ,
                          WIDE=True)
    store_from_every_warp((agreement_ptr + num_ranks * 2 + 1 + zeros).to(tl.int64), zeros.to(tl.int64) + fp1, differ,
                          WIDE=True)
    store_one_from_every_warp((agreement_ptr - (num_ranks + 2) + zeros).to(tl.int64), differ, WIDE=True)  # "pending"


@triton.jit
def report_dropped(mailbox_address, num_ranks, dropped):
    """Count ``dropped`` (> 0) expert ids outside [-1, num_experts) in the mailbox; the host raises
    EPInputError naming topk_idx (the kernels skip those entries)."""
    _, dropped_ptr, _, _ = mailbox_words(mailbox_address, num_ranks)
    tl.atomic_add(dropped_ptr, dropped.to(tl.int64), sem="relaxed", scope="sys")
    tl.store(dropped_ptr - (num_ranks + 1), 1)  # the mailbox's "pending" word


@triton.jit
def mailbox_words(mailbox_address, num_ranks):
    """int64 pointers to the mailbox's (timeouts, dropped-input count, agreement, notify) words
    (layout: mailbox.py :class:`HostMailbox`)."""
    words = mailbox_address.to(tl.pointer_type(tl.int64))
    return words + 1, words + num_ranks + 1, words + num_ranks + 2, words + 3 * num_ranks + 4


@triton.jit
def all_landed(word_ptrs, live, targets, WARP: tl.constexpr):
    """The fast path of a bounded wait: one ``ld.acquire.sys`` of each lane's int64 word; 1 when
    every live lane holds at least ``targets`` in every warp's reading — the ACQUIRE is then done,
    and the vote's barrier (warps.cta_all) orders every thread's later loads after it, so the
    caller skips the wait's clock, its row and board checks and its reports (a reduction each) —
    else 0 in every thread, and the caller waits. With ``WARP`` the same within each warp
    (warps.warp_all), for a caller whose region holds no barrier: the warps go on apart. Dead
    lanes are read too: mapped addresses."""
    words = load_acquire_sys(word_ptrs.to(tl.int64))
    return vote_all(tl.min(((words >= targets) | (live == 0)).to(tl.int32), axis=0), WARP)


@triton.jit
def await_doorbell(doorbell_address, sequence, epoch, state_ptr, timeout_ns, answers, mailbox_address, rank):
    """A pull program of a full dispatch launched before the host's count wait (one_node/dispatch.py,
    ep_dispatch with DOORBELL) waits for the host to ring the doorbell of ``sequence`` (host memory
    at byte ``doorbell_address``; layout above, HostMailbox.ring). Returns ``(answer, words)``:
    RING_GO or RING_CANCEL, the same in every program of the launch, and the doorbell's words
    ([DOORBELL_WORDS] int64, lane i = word i), read after the ACQUIRE.

    - One program answers for the launch (``answers``: the first pull program; the others start
      after it): it polls the tag over PCIe, copies the words into the state words after DOORBELL
      and RELEASEs ``(epoch << 2) | answer`` into DOORBELL (gpu scope); the others ACQUIRE that
      word (L2, not PCIe). Programs that answered on their own could split the launch between
      pulling and standing down.
    - It gives up after ``timeout_ns`` (the host thread stalled; in practice the caching allocator
      synchronising the device to free memory, which waits for this very launch): it writes
      ``sequence`` into the doorbell's last word, runs ``fence.sc.sys`` and reads the tag once more.
      The host writes the tag, then reads that word (HostMailbox.ring), so at least one side sees
      the other's store: a host that rang go after the launch stood down raises.
    - Another program's wait (3 x ``timeout_ns``) ends only if the answering program never ran: it
      stands down, GAVE_UP = ``epoch`` (the verdict NaNs the rows others pulled), and the mailbox
      gets a timeout for this rank (``mailbox_address``, ``rank``: the host raises at its next call)."""
    lanes = tl.arange(0, DOORBELL_WORDS)
    if answers:
        host_words = doorbell_address.to(tl.pointer_type(tl.int64)) + lanes
        target = sequence * 2
        start = uniform_now(lanes)
        # (each warp reads the tag on its own: the loop may end at different turns in different
        # warps, and the decisions after it are votes)
        tag = tl.max(tl.load(host_words, mask=lanes == 0, other=0, volatile=True), axis=0)
        now = start
        while (tag < target) & (now - start < timeout_ns):
            tag = tl.max(tl.load(host_words, mask=lanes == 0, other=0, volatile=True), axis=0)
            now = uniform_now(lanes)
        if cta_any(tag < target) != 0:  # give up: say so where the host looks after ringing, and look once more
            publish_from_one_thread(doorbell_address + (DOORBELL_WORDS - 1) * 8, sequence)
            tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            tag = tl.max(tl.load(host_words, mask=lanes == 0, other=0, volatile=True), axis=0)
        # go only where every warp read it (a warp that did not stands the launch down; the host,
        # which rang go before the give-up word it reads, raises)
        answer = tl.where(cta_all(tag == target + 1) != 0, RING_GO, RING_CANCEL).to(tl.int64)
        # ACQUIRE: the tag's relaxed read, then a fence: the words the host wrote before it
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        words = tl.load(host_words, volatile=True)
        tl.store(state_ptr + DOORBELL + lanes, words, mask=(lanes > 0) & (lanes < DOORBELL_WORDS - 1))
        tl.debug_barrier()  # every thread's stores of the words precede the release
        tl.atomic_xchg(state_ptr + DOORBELL, (epoch.to(tl.int64) << 2) | answer, sem="release", scope="gpu")
    else:
        seen, _waited, late = poll_epochs(state_ptr + DOORBELL + lanes * 0, lanes == 0, epoch, 3 * timeout_ns,
                                          EPOCH_SHIFT=2)  # ACQUIRE: the answer and the words
        # (a vote, whose barrier also orders the acquiring threads' polls before every thread's loads)
        late_here = cta_any(tl.max(late.to(tl.int32), axis=0)) != 0
        answer = tl.where(late_here, RING_CANCEL, tl.max(tl.where(lanes == 0, seen, 0), axis=0) & 3)
        if late_here:  # (the answering program never ran): the host raises at its next call
            tl.store(state_ptr + GAVE_UP, epoch)
            report_late((lanes == 0) & late_here, rank + lanes * 0, state_ptr,
                        mailbox_address.to(tl.pointer_type(tl.int64)) + 1,  # the timeouts (mailbox_words)
                        MASK_ON_TIMEOUT=False)
        words = tl.load(state_ptr + DOORBELL + lanes, volatile=True)
    return answer, words


@triton.jit
def load_acquire_sys(addresses):
    """``ld.acquire.sys`` of int64 words at byte ``addresses`` (a plain load, not a read-modify-write:
    polling with atomics would contend with the peers' stores to the same lines)."""
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [addresses], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def poll_epochs(word_ptrs, live, epoch, timeout_ns, EPOCH_SHIFT: tl.constexpr):
    """Step 4, the ACQUIRE: poll int64 words (one per lane) until ``word >> EPOCH_SHIFT >= epoch``
    in every live lane, or the deadline passes. Returns ``(words, waited_ns, late)``. Every lane's
    address must be mapped memory (dead lanes are read too, and ignored): callers index their own
    workspace, whose flag and count areas are larger than the lanes they use."""
    words, waited, late, _ = poll_epochs_or_other_call(word_ptrs, live, epoch, timeout_ns, word_ptrs, word_ptrs, 0, 0,
                                                       0, 0, EPOCH_SHIFT=EPOCH_SHIFT, CHECK_ROWS=False,
                                                       CHECK_BOARD=False)
    return words, waited, late


@triton.jit
def poll_epochs_or_other_call(word_ptrs, live, epoch, timeout_ns, row_ptrs, other_rows, fp0, fp1, board_address,
                              call_tag, EPOCH_SHIFT: tl.constexpr, CHECK_ROWS: tl.constexpr,
                              CHECK_BOARD: tl.constexpr):
    """:func:`poll_from_senders` where lane ``i`` is sender ``i`` (one word per peer)."""
    return poll_from_senders(word_ptrs, live, tl.arange(0, word_ptrs.shape[0]), epoch, epoch, timeout_ns, row_ptrs,
                             other_rows, fp0, fp1, board_address, call_tag, EPOCH_SHIFT, CHECK_ROWS, CHECK_BOARD)


@triton.jit
def poll_from_senders(word_ptrs, live, senders, targets, epoch, timeout_ns, row_ptrs, other_rows, fp0, fp1,
                      board_address, call_tag, EPOCH_SHIFT: tl.constexpr, CHECK_ROWS: tl.constexpr,
                      CHECK_BOARD: tl.constexpr):
    """:func:`poll_epochs`, where a lane (written by rank ``senders[lane]``; several lanes may share a
    sender, as the overlapped dispatch's rows of one source do) waits until ``word >> EPOCH_SHIFT >=
    targets`` (the call's ``epoch``, or a count tagged with it: ``(epoch << 32) | count``, words that
    only grow), and may also stop waiting because its sender is in another call (``epoch``: the
    call's, for these checks):

    - ``CHECK_ROWS``: its sender's fingerprint row (``row_ptrs``: int64 pointer to each lane's row
      in this call's half) holds this epoch with other words than ``(fp0, fp1)`` — a call of this
      Buffer whose signals may go elsewhere (a low-latency dispatch with another expert count
      writes other count words) — or that row or the sender's row in the set's other half
      (``other_rows``; ``row_ptrs`` again where only this half is looked at) is an abort's row
      whose stamp covers this call (:func:`abort_covers`: the sender rejected a call at or before
      this one, and goes into the half without its last row: agreement.ep_abort). The caller's
      row check afterwards (agreement.check_rows) records the mismatch or the abort.
    - ``CHECK_BOARD``: its sender's word on this rank's call board (``board_address``: byte address
      of word 0; gpu/call_board.py) says the sender's call of this call's number is another one —
      on another Buffer of the group, or another kind (a rank that skipped a call). Such lanes
      are returned as ``elsewhere``; the caller records them (:func:`record_elsewhere`).

    Waiting for such a sender would last the whole timeout. The rows and the board are looked at
    only after ``ROW_CHECK_NS`` of waiting, and then every ``ROW_CHECK_NS``: a wait that ends in
    time costs nothing more. Returns ``(words, waited_ns, late, elsewhere)``; neither kind of
    lane is late.

    The clock is read through a reduction over the lanes (:func:`uniform_now`), so that the lanes
    that decide the loop's end agree on the deadline. Where each warp holds the lanes whole, the
    loop's reductions run within each warp (no barrier) and the warps may leave it at different
    turns; where the lanes span the warps, the reductions are the program's. Either way, callers
    vote (warps.cta_any; warps.warp_any where the region after holds no barrier) before anything
    that branches on the outcome."""
    addresses = word_ptrs.to(tl.int64)
    start = uniform_now(addresses)
    deadline = start + timeout_ns
    words = load_acquire_sys(addresses)
    ready = ((words >> EPOCH_SHIFT) >= targets) | (live == 0)
    waited = tl.zeros_like(words)
    elsewhere = ready & (ready == 0)
    now = start
    check_at = start + ROW_CHECK_NS
    # (the loop's test is a warp vote: a warp's threads leave it together, whichever lanes they hold)
    while warp_any((tl.min(ready.to(tl.int32), axis=0) == 0) & (now < deadline)) != 0:
        fresh = load_acquire_sys(addresses)
        now = uniform_now(addresses)
        arrived = ((fresh >> EPOCH_SHIFT) >= targets) & (ready == 0)
        words = tl.where(arrived, fresh, words)
        waited = tl.where(arrived, now - start, waited)
        ready |= arrived
        look = now >= check_at  # the rows and the board are posted at the senders' kernel starts
        if CHECK_ROWS:
            if look:
                rows = row_ptrs.to(tl.int64)
                posted_epoch = load_acquire_sys(rows + 16)  # this call's, or a peer's abort (agreement.py)
                other_epoch = load_acquire_sys(other_rows.to(tl.int64) + 16)
                # (an abort's epoch field alone ends the wait: the abort stores it before the row's
                # words, which may still be landing; normal mode's verdict reads them only after
                # acquiring the stamped flag word, whose release covers the row: acquire_and_agree)
                other = (ready == 0) & row_ends_wait(load_acquire_sys(rows), load_acquire_sys(rows + 8), posted_epoch,
                                                     other_epoch, fp0, fp1, epoch)
                waited = tl.where(other, now - start, waited)
                ready |= other
        if CHECK_BOARD:
            if look & (call_tag != 0):
                other = (ready == 0) & posted_elsewhere(board_address, senders, call_tag, fp0)
                waited = tl.where(other, now - start, waited)
                elsewhere |= other
                ready |= other
        check_at = tl.where(look, now + ROW_CHECK_NS, check_at)
    late = ready == 0
    return words, tl.where(late, now - start, waited), late, elsewhere


@triton.jit
def row_ends_wait(own0, own1, own_epoch, other_epoch, fp0, fp1, epoch):
    """The row check of :func:`poll_epochs_or_other_call` (no loads: tests run it in Triton's
    interpreter): the sender's row in this call's half (``own*``: words, epoch field) holds this
    epoch with other words than ``(fp0, fp1)``, or it or the row in the other half (epoch field
    ``other_epoch``) is an abort's whose stamp covers this call. An abort row that does not cover
    it (the sender signalled this call, then aborted a later one) leaves the wait to the signal."""
    return abort_covers(own_epoch, epoch) | abort_covers(other_epoch, epoch) | \
        ((own_epoch == epoch) & ((own0 != fp0) | (own1 != fp1)))


# ---------------------------------------------------------------------- the call board (gpu/call_board.py)
@triton.jit
def board_word(call_tag, fp0):
    """What this call posts on its peers' call boards: its tag (call number and Buffer, host-made:
    call_board.py) and its kind (the fingerprint's ``call`` field)."""
    return call_tag | (fp0 & BOARD_KIND_MASK)


@triton.jit
def board_slot(call_tag):
    """The word of a rank's row that holds its call of this number (call_board.py: the ring)."""
    return ((call_tag >> BOARD_NUMBER_SHIFT) % BOARD_RING).to(tl.int64)


@triton.jit
def post_call_to_peers(board_bases_ptr, rank, num_ranks, call_tag, fp0, live, R_P2: tl.constexpr):
    """Post this call on the call board of every ``live`` peer (self included): word
    :func:`board_slot` of row ``rank`` := :func:`board_word` (``board_bases_ptr``: [R] int64 byte
    address of each rank's board; RESYNC_TAG: every word of the row). Plain stores at the kernel's
    start: the board only tells a waiting peer which call this rank is in, it publishes nothing (a
    reader that sees it late looks again). Nothing is posted for a tag of 0 (a call captured in a
    CUDA graph: call_board.py)."""
    if call_tag != 0:
        peers = tl.arange(0, R_P2)
        live &= peers < num_ranks
        row = tl.load(board_bases_ptr + peers, mask=live, other=0) + rank * BOARD_RING * 8
        word = tl.zeros([R_P2], tl.int64) + board_word(call_tag, fp0)
        first = tl.where(call_tag == RESYNC_TAG, 0, board_slot(call_tag))
        for slot in range(first, first + tl.where(call_tag == RESYNC_TAG, BOARD_RING, 1)):
            tl.store((row + slot * 8).to(tl.pointer_type(tl.int64)), word, mask=live)


@triton.jit
def posted_elsewhere(board_address, senders, call_tag, fp0):
    """Lanes whose sender's word for this call's number, on this rank's board, names another Buffer
    or kind — the sender's call of this number is another call — or says the sender resyncs. (A
    sender behind has not posted this number yet: that is not taken for a skip. An abort on this
    Buffer is not either: its own signals end the wait, naming the argument it rejected.)
    call_board.posted_elsewhere is the same test on the host (its tests walk the cases)."""
    posted = load_acquire_sys(board_address + (senders.to(tl.int64) * BOARD_RING + board_slot(call_tag)) * 8)
    same_number = (posted >> BOARD_NUMBER_SHIFT) == (call_tag >> BOARD_NUMBER_SHIFT)
    buffer_bits = BOARD_BUFFER_MASK << BOARD_BUFFER_SHIFT
    abort_here = ((posted & BOARD_KIND_MASK) == BOARD_ABORT_KIND) & ((posted & buffer_bits) == (call_tag & buffer_bits))
    return (posted == RESYNC_TAG) | (same_number & (posted != board_word(call_tag, fp0)) & (abort_here == 0))


@triton.jit
def record_elsewhere(board_address, senders, elsewhere, call_tag, fp0, agreement_ptr, num_ranks):
    """Record senders found in another call (:func:`posted_elsewhere`) in the host mailbox as a
    disagreement on the ``call`` and ``buffer`` fields: the senders' board words and this call's,
    as fingerprint words (agreement.py decodes them: ranks in different calls)."""
    if tl.max(elsewhere.to(tl.int32), axis=0) != 0:
        posted = tl.load(board_address.to(tl.pointer_type(tl.int64)) + senders * BOARD_RING + board_slot(call_tag),
                         mask=elsewhere, other=0)
        # (from every warp: each reports what it read, report_late says why)
        store_from_every_warp((agreement_ptr + senders * 2).to(tl.int64), _board_fingerprint(posted), elsewhere,
                              WIDE=True)
        store_from_every_warp((agreement_ptr + senders * 2 + 1).to(tl.int64), tl.zeros_like(posted), elsewhere,
                              WIDE=True)
        zeros = tl.zeros_like(senders)
        own = _board_fingerprint(tl.zeros_like(posted) + board_word(call_tag, fp0))
        store_from_every_warp((agreement_ptr + num_ranks * 2 + zeros).to(tl.int64), own, elsewhere, WIDE=True)
        store_from_every_warp((agreement_ptr + num_ranks * 2 + 1 + zeros).to(tl.int64), zeros, elsewhere, WIDE=True)
        store_one_from_every_warp((agreement_ptr - (num_ranks + 2) + zeros).to(tl.int64), elsewhere,
                                  WIDE=True)  # "pending"


@triton.jit
def _board_fingerprint(word):
    """A board word as fingerprint word 0: its kind in ``call``, its Buffer in ``buffer``."""
    return (word & BOARD_KIND_MASK) | (((word >> BOARD_BUFFER_SHIFT) & BOARD_BUFFER_MASK) << FP_BUFFER_SHIFT)


@triton.jit
def wait_peers(my_flags_ptr, num_ranks, epoch, mask_ptr, timeouts_ptr, timeout_ns, board_address, call_tag, fp0,
               agreement_ptr, HAS_MASK: tl.constexpr, MASK_ON_TIMEOUT: tl.constexpr, CHECK_BOARD: tl.constexpr,
               R_P2: tl.constexpr):
    """Wait until every live peer's word in this rank's flag set is >= ``epoch``. A peer that
    times out is masked (``MASK_ON_TIMEOUT``, low-latency mode: the call goes on without it) or
    flagged in the host mailbox (``timeouts_ptr[p]``; the next call raises EPTimeoutError). With
    ``CHECK_BOARD``, a peer whose call board word says it is in another call stops the wait for it
    and is recorded (``agreement_ptr``: the mailbox's agreement words; the host raises naming the
    calls). Returns ``(words, waited, late, elsewhere)``: the flag words acquired (an abort's stamp,
    agreement.py, ends the wait too: it is above every epoch; the caller reads from it which calls
    it covers), each peer's wait in ns ([R_P2] int64), the peers whose wait gave up, and the peers
    found in another call."""
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    if HAS_MASK:
        live &= tl.load(mask_ptr + peers, mask=live, other=1) == 0
    words, waited, late, elsewhere = poll_epochs_or_other_call(my_flags_ptr + peers, live, epoch, timeout_ns,
                                                               my_flags_ptr, my_flags_ptr, fp0, 0, board_address,
                                                               call_tag, EPOCH_SHIFT=0, CHECK_ROWS=False,
                                                               CHECK_BOARD=CHECK_BOARD)
    report_late(late, peers, mask_ptr, timeouts_ptr, MASK_ON_TIMEOUT)
    if CHECK_BOARD:
        record_elsewhere(board_address, peers, elsewhere, call_tag, fp0, agreement_ptr, num_ranks)
    return words, waited, late, elsewhere


@triton.jit
def report_late(late, peers, mask_ptr, timeouts_ptr, MASK_ON_TIMEOUT: tl.constexpr):
    """Mask the late peers (low-latency mode) or flag them in the host mailbox (normal mode). Each
    warp reports what it read (a wait's lanes may end differently in different warps at the
    deadline), so the stores come from every warp (warps.py)."""
    if tl.max(late.to(tl.int32), axis=0) != 0:
        if MASK_ON_TIMEOUT:
            store_one_from_every_warp((mask_ptr + peers).to(tl.int64), late, WIDE=False)
        else:
            store_one_from_every_warp((timeouts_ptr + peers).to(tl.int64), late, WIDE=True)
            store_one_from_every_warp((timeouts_ptr - 1 + tl.zeros_like(peers)).to(tl.int64), late,
                                      WIDE=True)  # the mailbox's "pending" word


def device_state(device: torch.device) -> torch.Tensor:
    """Zeroed int64 state words (epochs, arrival counters) for one backend."""
    return torch.zeros(NUM_STATE_WORDS, dtype=torch.int64, device=device)
