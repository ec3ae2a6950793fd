"""Collective agreement on the GPU layer: every call's fingerprint travels with its signals.

The ``torch_dist`` backend agrees through the store before exchanging (../agreement.py); here that
would cost a host round trip per call, so the fingerprint rides on the signals the kernels send
anyway, and is checked where they are received:

- **Post.** Program 0 of each signalling kernel stores this call's two fingerprint words and the
  signal's epoch into row ``rank`` of each receiver's fingerprint area, at the kernel's start (off
  the critical path) — plain stores that the kernel's release (sync.py, step 3) covers, like the
  payload. (The staging kernel posts again before its release when its count check failed.)
- **Check.** After its acquire (step 4), each receiving program compares the rows of the live
  senders with its own call's words; rows it already read with this epoch and these words before
  the acquire are not loaded again (a row changes only two epochs later). On a mismatch it moves
  no data from that sender and records the sender's words (and its own) in the host mailbox. Every
  rank sees the mismatch (the comparison is symmetric), so every rank raises :class:`EPInputError`
  naming the field and the ranks: at the next point where the host reads the mailbox anyway (the
  count wait of a full dispatch), otherwise at the next call once the GPU has run the failing one.
  (The early read is not ordered by the release: in principle it could pair a row's new epoch with
  its previous words and miss a mismatch on this rank — the sender's own check still sees it.)
- **Abort.** The words have an ``abort`` field naming an argument. The kernels set it when the
  counts a caller passed do not summarise the routing (``num_tokens_per_rank`` against
  ``is_token_in_rank``, ``num_tokens_per_expert`` against ``topk_idx``; checked on device in the
  staging kernel). A rank whose host validation rejects its input does not make the call; it
  launches :func:`ep_abort` instead: abort words into the peers' rows and, into every flag and
  count word it owns on its peers, an epoch no wait can be ahead of — so the peers' waits end at
  once and they raise for that argument too. That epoch is a *stamp* (two-level mode aside) that
  keeps the epoch the word carried before, so the abort fails only the calls this rank never
  signalled: a peer still in the call this rank finished just before is not failed (the block
  comment above :func:`ep_abort`).

After such an error the ranks' signals are out of step: every rank that raised resynchronises
at its next call (the backends' ``resync``: a bounded host rendezvous, then every flag, epoch,
fingerprint and count word back to zero), and that call pairs again.

Fingerprint area (in the workspace's flag region): int64 ``[set][half][R][4]`` rows of (word 0,
word 1, epoch, 0); half = the signal's
epoch parity (normal mode) or the buffer half (low-latency mode), so a peer one call ahead never
overwrites a row that is still being checked (the double-buffer argument of sync.py).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import triton
import triton.language as tl

from ...errors import EPInputError
from . import call_board, sync, warps
from .launch import KernelSpec
from .reach.modes import FAR_LIBRARY, far_complete, post_call_any, release_words, same_node, set_row_epoch_first
from .sync import FP_ROW, fingerprint_half
from .workspace import FLAGS_LL_COMBINE, FLAGS_NORMAL, FP_LL_COMBINE, FP_LL_DISPATCH, FP_NORMAL

# The fields of the two words, low bits first: (name, bits). Names are the arguments they describe.
FIELDS = (
    (("call", 4), ("hidden", 24), ("x", 2), ("num_topk", 8), ("num_experts", 22), ("buffer", 3)),
    (("abort", 8), ("handle", 28), ("num_worst_tokens", 1), ("num_max_dispatch_tokens_per_rank", 20),
     ("use_fp8", 1), ("round_scale", 1), ("use_ue8m0", 1), ("expert_major", 1), ("pushed_lists", 1)),
)
CALLS = ("", "dispatch", "dispatch (cached)", "combine", "low_latency_dispatch", "low_latency_combine")
CALL_DISPATCH, CALL_CACHED, CALL_COMBINE, CALL_LL_DISPATCH, CALL_LL_COMBINE = range(1, 6)
CALL_ABORT = 15
X_FORMATS = ("", "bf16", "fp8")

# Arguments an abort can name (code = index + 1; the last code stands for any other).
ARGUMENTS = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "x", "topk_idx", "topk_weights",
             "handle", "num_experts", "num_max_dispatch_tokens_per_rank", "num_worst_tokens", "expert_alignment",
             "use_fp8", "round_scale", "use_ue8m0", "bias", "out", "config", "previous_event", "expert_major",
             "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "combine_wait_recv_cost_stats",
             "zero_copy", "num_tokens_per_rdma_rank",
             # fingerprint fields: a rank that learns of a disagreement at its next call aborts that
             # call naming the field (Buffer._start_call)
             "hidden", "num_topk", "call")
ABORT_NUM_TOKENS_PER_RANK = 1  # set on device by the staging kernel
ABORT_NUM_TOKENS_PER_EXPERT = 2
ABORT_OTHER = 255


def _layout() -> List[Dict[str, Tuple[int, int]]]:
    out = []
    for word in FIELDS:
        shift, fields = 0, {}
        for name, bits in word:
            fields[name] = (shift, bits)
            shift += bits
        assert shift <= 63, word
        out.append(fields)
    return out


_LAYOUT = _layout()
assert _LAYOUT[1]["abort"] == (0, 8)  # kernels OR an abort code into word 1 as is
# The call board's words carry the call field and a Buffer slot (call_board.py).
assert _LAYOUT[0]["call"] == (0, call_board.KIND_MASK.bit_length())
assert _LAYOUT[0]["buffer"] == (call_board.FP_BUFFER_SHIFT, call_board.NUM_SLOTS.bit_length())
assert CALL_ABORT == call_board.ABORT_KIND


def field(name: str) -> Tuple[int, int, int]:
    """``(word, shift, mask)`` of a field, for hot paths that add one value to precomputed words:
    ``words[word] | ((value & mask) << shift)``."""
    for index, fields in enumerate(_LAYOUT):
        if name in fields:
            shift, bits = fields[name]
            return index, shift, (1 << bits) - 1
    raise KeyError(name)


_, HANDLE_SHIFT, HANDLE_MASK = field("handle")  # word 1
_, EXPERTS_SHIFT, EXPERTS_MASK = field("num_experts")  # word 0
_, WORST_SHIFT, _ = field("num_worst_tokens")  # word 1


def pack(**values: int) -> Tuple[int, int]:
    """The two fingerprint words of a call; absent fields are 0, values wrap at their width."""
    words = [0, 0]
    for index, fields in enumerate(_LAYOUT):
        for name, (shift, bits) in fields.items():
            words[index] |= (int(values.pop(name, 0)) & ((1 << bits) - 1)) << shift
    if values:
        raise KeyError(f"no fingerprint fields {sorted(values)}")
    return words[0], words[1]


def unpack(words: Tuple[int, int]) -> Dict[str, int]:
    return {name: (int(words[index]) >> shift) & ((1 << bits) - 1)
            for index, fields in enumerate(_LAYOUT) for name, (shift, bits) in fields.items()}


def abort_code(argument: str) -> int:
    return ARGUMENTS.index(argument) + 1 if argument in ARGUMENTS else ABORT_OTHER


def abort_words(argument: str) -> Tuple[int, int]:
    return pack(call=CALL_ABORT, abort=abort_code(argument))


def _show(name: str, value: int) -> str:
    if name == "call":
        return "abort" if value == CALL_ABORT else CALLS[value] if value < len(CALLS) else str(value)
    if name == "x":
        return X_FORMATS[value] if value < len(X_FORMATS) else str(value)
    return str(value)


def raise_disagreement(posted: Dict[int, Tuple[int, int]], own: Tuple[int, int], num_ranks: int) -> None:
    """Raise EPInputError for what the kernels recorded: ``posted`` holds the words of the ranks
    whose rows differed from ``own`` (this rank's call), this rank's own row included when the
    kernels set its abort field."""
    fields = {r: unpack(words) for r, words in posted.items()}
    mine = unpack(own)
    everyone = {r: fields.get(r, mine) for r in range(num_ranks)}
    aborts = {r: f["abort"] for r, f in everyone.items() if f["abort"]}
    if aborts:
        first, code = min(aborts.items())
        argument = ARGUMENTS[code - 1] if code <= len(ARGUMENTS) else "an argument"
        if code in (ABORT_NUM_TOKENS_PER_RANK, ABORT_NUM_TOKENS_PER_EXPERT):
            summarised = "is_token_in_rank" if code == ABORT_NUM_TOKENS_PER_RANK else "topk_idx"
            why = f"rank {first}'s {argument} does not match its {summarised} (checked on device)"
        else:
            why = f"rank {first} rejected its input"
        raise EPInputError(argument, f"{why}; every rank raises (ranks {sorted(aborts)}). The ranks re-pair at "
                                     f"their next call")
    if any(f["buffer"] for f in everyone.values()):  # the call board's record (sync.record_elsewhere)
        calls = {r: f"{_show('call', f['call'])} on Buffer {f['buffer']}" for r, f in everyone.items()}
        groups: Dict[str, list] = {}
        for r, value in sorted(calls.items()):
            groups.setdefault(value, []).append(r)
        shown = "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())
        raise EPInputError("call", f"ranks are in different calls (a rank skipped a call its peers made, on this "
                                   f"Buffer or another of the group): {shown} (Buffers numbered from 1 in the order "
                                   f"they were made, modulo 7). Every Buffer of the group re-pairs at the next call")
    for name in [n for word in FIELDS for n, _ in word if n != "abort"]:
        values = {r: _show(name, f[name]) for r, f in everyone.items()}
        if len(set(values.values())) > 1:
            if name == "num_topk" and mine["call"] == CALL_COMBINE:
                name = "topk_weights"  # a combine's top-k width is that of its topk_weights argument
            groups: Dict[str, list] = {}
            for r, value in sorted(values.items()):
                groups.setdefault(value, []).append(r)
            shown = "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())
            raise EPInputError(name, f"ranks disagree in {_show('call', mine['call'])}: {shown}. The ranks re-pair "
                                     f"at their next call")
    raise EPInputError("call", f"ranks disagree on a call (fingerprints {posted} against {own})")




# ---------------------------------------------------------------------- a rank that rejected its input
# What an abort must leave alone (issue 50). A peer can still be in the last call of a kind this
# rank made — it checks this rank's row of that call after its acquire — while this rank has
# finished that call and rejects its next one. An abort that overwrote that row, or whose signal
# said "aborted" to every call alike, turned the finished call into a failed one on that peer (NaN
# rows: seen on the one-GPU bed, ll_one_bad). Nor can the abort post to "the half of my next call"
# only (tried in 7aa8827, reverted): a peer whose calls are two ahead of this rank's (its host
# queued them before the GPU reported the first one), or one call apart (a rank that skipped a
# call), waits on the other half, and such a wait then ends only at this rank's resync or the
# timeout (the call board leaves an abort on the waiter's own Buffer to that Buffer's signals) — or
# passes on the flag and finds no abort row at all.
#
# So, in low-latency mode, every signal word the abort releases carries the boundary itself, per
# word — the abort's *stamp*: ABORT_EPOCH + the epoch that word last carried (the epoch field: the
# whole word of a combine flag, bits 32.. of a dispatch count word, whose message count stays). Only
# this rank writes these words, so it reads them back (near peers) and stamps what it finds. A
# receiver in the call of epoch E reads "sent for calls up to X, aborted after": its call is aborted
# iff E > X (abort_covers) — exactly the calls this rank never signalled, whichever call the
# receiver is in, behind, ahead or one call off. A receiver still in call X gets X's real count and
# X's data (the stamp's release covers them too). The rows only name the argument: the abort row
# (the abort's words, the stamp as epoch) goes into the half of each set that does *not* hold this
# rank's last row (which a peer behind may still be checking), and a receiver that a stamp covers
# finds it in either half (check_rows). Far peers (gpu/reach: no loads across nodes) get stamps
# made from this rank's own epochs, and no stamp on the count words of the half of its last
# dispatch (a receiver behind may still read that count): a wait two calls ahead there ends at this
# rank's resync (the board's RESYNC) instead — as does a wait on the count words of an expert count
# this rank never used (they are not known here; the row's stamp is not sync's ABORT_EPOCH, which
# the wait also looks for, unless this rank made no dispatch before).
#
# Normal mode (one node) the same way: the flag word each normal kernel releases (notify, stage,
# push: sync.FLAGS_NORMAL, word = the epoch, which the state word EPOCH_NORMAL holds after the
# kernel) gets the stamp of EPOCH_NORMAL, and the abort row goes into the half (EPOCH_NORMAL + 1) % 2
# (a normal call's half is its epoch's parity, graph replays included). Receivers acquire the flags
# (sync.wait_peers: a stamp is above every epoch, so it ends the wait) and check with check_rows,
# stamped = abort_covers(flag, epoch) (acquire_and_agree, the notify). The overlapped combine's
# reduce waits on per-block flags, which the abort leaves alone: its row check ends such a wait for
# an abort row covering the call in either half (sync.poll_epochs_or_other_call), and its last
# program's acquire_and_agree gives the verdict. Two-level mode (normal/two_level/step.py) has rows
# and signals of its own (ml_abort, ABORT_EPOCH): not stamped.
ABORT_EPOCH = sync.ABORT_EPOCH
SET_NORMAL = tl.constexpr(FP_NORMAL)  # (kernels read module globals only as constexprs)
SET_LL_DISPATCH = tl.constexpr(FP_LL_DISPATCH)
SET_LL_COMBINE = tl.constexpr(FP_LL_COMBINE)
FLAG_SET_NORMAL = tl.constexpr(FLAGS_NORMAL)
FLAG_SET_LL_COMBINE = tl.constexpr(FLAGS_LL_COMBINE)
# What a receiver records for a stamp without an abort row in either half (a count word of another
# rank that the stamps for another expert count reached: the shapes' words overlap): "an argument".
ANY_ABORT0, ANY_ABORT1 = (tl.constexpr(word) for word in abort_words("an argument"))


@triton.jit
def stamp(epochs):
    """The abort's stamp on signal words whose epoch field is ``epochs``: ABORT_EPOCH + that epoch.
    A word already stamped keeps its stamp (a second abort before the resync changes nothing)."""
    return tl.where(epochs >= ABORT_EPOCH, epochs, epochs + ABORT_EPOCH)


@triton.jit
def stamp_word(words, SHIFT: tl.constexpr):
    """Signal ``words`` with their epoch field (``word >> SHIFT``) stamped and the bits below it kept
    (a count word's messages: a receiver still in the call the word carried reads its count)."""
    return (stamp(words >> SHIFT) << SHIFT) | (words & ((1 << SHIFT) - 1))


# abort_covers(epochs, epoch): lanes whose signal word, of epoch field ``epochs``, is a stamp that
# covers the call of ``epoch`` (E > X). It lives in sync.py (its waits' row check reads it too).
abort_covers = sync.abort_covers


@triton.jit
def row_verdict(own0, own1, own_epoch, other0, other1, other_epoch, stamped, fp0, fp1, epoch):
    """A receiver's verdict on a sender's rows (no loads: tests run it in Triton's interpreter).
    ``own*``: the sender's row in this call's half (words, epoch field); ``other*``: its row in the
    other half; ``stamped``: the sender's signal word for this call was an abort's stamp covering
    it. Returns ``(differ, words0, words1)``: this call moves nothing from the sender — its row
    holds this epoch with other words, or an abort covers the call (by the signal's stamp, or by an
    abort row in this half) — and the words to record: the abort row's, from whichever half holds
    it. A row of another epoch is not compared (older: a sender that timed out; an abort row whose
    stamp does not cover this call: a peer that ran ahead by a hook's receive, say)."""
    own_abort = own_epoch >= ABORT_EPOCH
    aborted = stamped | abort_covers(own_epoch, epoch)
    mismatch = (own_epoch == epoch) & ((own0 != fp0) | (own1 != fp1))
    from_other = aborted & (own_abort == 0) & (other_epoch >= ABORT_EPOCH)
    missing = aborted & (own_abort == 0) & (other_epoch < ABORT_EPOCH)
    words0 = tl.where(from_other, other0, tl.where(missing, ANY_ABORT0, own0))
    words1 = tl.where(from_other, other1, tl.where(missing, ANY_ABORT1, own1))
    return aborted | mismatch, words0, words1


@triton.jit
def check_rows(set_address, half, senders, live, settled, stamped, fp0, fp1, epoch, agreement_ptr, num_ranks):
    """sync.check_fingerprints for the low-latency and one-node normal calls, which also take an
    abort from their signal words: ``stamped`` lanes are senders whose count word or flag for this
    call was an abort's stamp covering it (:func:`abort_covers`). ``set_address``: this rank's
    fingerprint set (both halves; ``half``: this call's). Compares the live senders' rows not already
    ``settled`` (sync.fingerprints_settled) — and every stamped one — by :func:`row_verdict`,
    records the differing ones in the mailbox as sync.check_fingerprints does, and returns them."""
    tl.debug_barrier()  # the acquiring threads' polls precede the other threads' loads
    half_bytes = (num_ranks * FP_ROW).to(tl.int64)
    own = (set_address + half * half_bytes).to(tl.pointer_type(tl.int64)) + senders * (FP_ROW // 8)
    other = (set_address + (1 - half) * half_bytes).to(tl.pointer_type(tl.int64)) + senders * (FP_ROW // 8)
    look = live & ((settled == 0) | stamped)
    own0 = tl.load(own, mask=look, other=0)
    own1 = tl.load(own + 1, mask=look, other=0)
    own_epoch = tl.load(own + 2, mask=look, other=0)
    aborts = look & (stamped | (own_epoch >= ABORT_EPOCH))  # (only after an abort: the other half)
    other0 = tl.load(other, mask=aborts, other=0)
    other1 = tl.load(other + 1, mask=aborts, other=0)
    other_epoch = tl.load(other + 2, mask=aborts, other=0)
    differ, words0, words1 = row_verdict(own0, own1, own_epoch, other0, other1, other_epoch, stamped, fp0, fp1,
                                         epoch)
    differ &= look
    # A second look where this call's own row seemed to hold other words: the loads above are not
    # ordered among themselves, and an abort may be writing that half (a receiver that runs a
    # hook's receive a call late reads the half of the sender's next call). The abort stores a
    # row's epoch field before its words, with a release between (ep_abort); these loads ACQUIRE
    # the words first, so words of the abort come with its epoch field, and the verdict is taken
    # again on what they show. (Never on the path of a call that agrees.)
    suspect = differ & (stamped == 0) & (own_epoch == epoch)
    if tl.max(suspect.to(tl.int32), axis=0) != 0:
        address = tl.where(suspect, own.to(tl.int64), set_address)
        again0 = sync.load_acquire_sys(address)
        again1 = sync.load_acquire_sys(address + 8)
        again_epoch = sync.load_acquire_sys(address + 16)
        still, again0, again1 = row_verdict(again0, again1, again_epoch, other0, other1, other_epoch, stamped,
                                            fp0, fp1, epoch)
        differ = tl.where(suspect, still, differ)
        words0 = tl.where(suspect, again0, words0)
        words1 = tl.where(suspect, again1, words1)
    sync.record_disagreement(agreement_ptr, senders, differ, words0, words1, fp0, fp1, num_ranks)
    return differ


@triton.jit
def acquire_and_agree(flag_bases_ptr, state_ptr, mailbox_address, epoch, rank, num_ranks, timeout_ns, fp_offset,
                      fp0, fp1, num_items, board_address, call_tag, R_P2: tl.constexpr):
    """Step 4 for the normal mode's receivers: ACQUIRE every rank's signal of ``epoch`` (a timeout is
    flagged in the mailbox; a rank the call board shows in another call is recorded), then check
    the fingerprints they carried (:func:`check_rows`: a flag an abort stamped covering this call
    is a difference; one stamped over this call's epoch is not — the rank signalled this call
    before it aborted its next, and the stamp's release covers the call's data as the signal's
    did). Returns ``num_items``, or 0 when a rank's wait gave up or its call differs (the same in
    every thread of the program: a vote, which every thread must reach): the caller
    then moves nothing (and marks its outputs missing), and the host raises at the next call
    (the mailbox's timeout words, the agreement words decoded above)."""
    my_base = tl.load(flag_bases_ptr + rank)
    my_flags = (my_base + FLAG_SET_NORMAL * num_ranks * 8).to(tl.pointer_type(tl.int64))
    timeouts, _, agreement, _ = sync.mailbox_words(mailbox_address, num_ranks)
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    half = epoch % 2
    settled = sync.fingerprints_settled(my_base + fingerprint_half(fp_offset, half, num_ranks), peers, live, fp0, fp1,
                                        epoch)
    flags, _, late, elsewhere = sync.wait_peers(my_flags, num_ranks, epoch, state_ptr, timeouts, timeout_ns,
                                                board_address, call_tag, fp0, agreement, HAS_MASK=False,
                                                MASK_ON_TIMEOUT=False, CHECK_BOARD=True, R_P2=R_P2)  # ACQUIRE
    differ = check_rows(my_base + fp_offset, half, peers, live, settled, live & abort_covers(flags, epoch), fp0, fp1,
                        epoch, agreement, num_ranks)
    # (a vote: at a deadline the warps' readings may differ, and the callers branch on the result)
    failed = warps.cta_any(tl.max((differ | late | elsewhere).to(tl.int32), axis=0))
    return tl.where(failed == 0, num_items, 0)


@triton.jit
def _post_abort_row(bases_ptr, bases, my_base, rows_offset, peers, near, far, fp0, fp1, epoch_field, spare, rank,
                    spare_word, R_P2: tl.constexpr, REMOTE: tl.constexpr):
    """Row ``rank`` at ``rows_offset`` (bytes from a workspace) on every ``near`` and ``far`` peer
    (``bases``: the near peers' workspaces) := the abort's words, with ``epoch_field``. The epoch
    field first, then a release fence and the words (strong stores): a receiver that ACQUIRES the
    abort's words reads this epoch field too (check_rows' second look). The release of the signal
    words afterwards covers the whole row."""
    rows = bases + rows_offset + rank * FP_ROW
    zeros = tl.zeros([R_P2], tl.int64)
    tl.store((rows + 16).to(tl.pointer_type(tl.int64)), zeros + epoch_field, mask=near)
    tl.debug_barrier()  # every thread's epoch-field stores precede the fences below
    sync.publish(rows, zeros + fp0, near, spare)  # fence.acq_rel.sys, then st.relaxed.sys
    sync.publish(rows + 8, zeros + fp1, near, spare)
    if REMOTE:  # far peers: SET by signals, the epoch field completed first
        set_row_epoch_first(my_base + rows_offset, peers, far, fp0, fp1, epoch_field, bases_ptr, rank, spare_word,
                            R_P2, REMOTE)


@triton.jit
def _stamp_words(bases_ptr, offsets, receivers, lanes, far_epochs, spare, rank, ranks_per_node, spare_word,
                 SHIFT: tl.constexpr, REMOTE: tl.constexpr):
    """RELEASE the abort's stamp (:func:`stamp`) into the int64 signal words at byte ``offsets`` of
    each receiver's workspace (where ``lanes``). A near receiver's word is read back first — only
    this rank writes it, and its earlier kernels have finished (stream order) — and stamped in its
    epoch field (``word >> SHIFT``), the bits below kept (a count word's messages). A far receiver
    (no loads across nodes) gets ``stamp(far_epochs) << SHIFT``."""
    near = same_node(receivers, rank, ranks_per_node, REMOTE)
    addresses = tl.load(bases_ptr + receivers, mask=lanes & near, other=0) + offsets
    old = sync.load_acquire_sys(tl.where(lanes & near, addresses, spare))
    far_stamp = stamp(tl.zeros_like(old) + far_epochs) << SHIFT
    release_words(bases_ptr, offsets, receivers, tl.where(near, stamp_word(old, SHIFT), far_stamp), lanes, spare,
                  rank, ranks_per_node, spare_word, REMOTE)


@triton.jit
def ep_abort(bases_ptr: "*i64",  # [R] int64: each rank's workspace
             state_ptr: "*i64",  # [16] int64 local: this rank's epochs (sync.py), a spare word for masked-off lanes
             fingerprints_offset: "i64",  # bytes from a workspace to its fingerprint area
             ll_counts_ptr: "*i64",  # [num_shapes, 3] int64: (counts offset of half 0, of half 1, experts per rank)
             num_shapes: "i32", fp0: "i64", fp1: "i64", rank: "i32", num_ranks: "i32",
             ranks_per_node: "i32", spare_word: "i64",  # (REMOTE only: gpu/reach/)
             board_bases_ptr: "*i64",  # [R] int64: each rank's call board (gpu/call_board.py)
             call_tag: "i64",  # the aborted call's number and Buffer (0: not posted)
             R_P2: tl.constexpr, BLOCK_L: tl.constexpr, REMOTE: tl.constexpr):
    # On every peer (self included), after every earlier kernel of this rank (stream order):
    #   1. the abort on the call board: peers waiting in another Buffer's call of the same number
    #      (this rank skipped theirs: a rejected layout's stand-in) stop waiting for it;
    #   2. the abort rows (plain and strong stores): each set's half that does not hold this rank's
    #      last row, with the stamp of this rank's last epoch of that kind (far peers: SET,
    #      completed before step 3);
    #   3. RELEASE the stamp (the block comment above) into this rank's normal-mode flag word, its
    #      low-latency combine flag and every dispatch count word of the expert counts used so
    #      far. The release is cumulative: it covers the rows of step 2, and the data of every
    #      call this rank made (earlier kernels). The receivers ACQUIRE these words in their
    #      waits, which then end at once for a call the abort covers; the row check after the
    #      wait finds the abort words and names the argument.
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    far = live & (same_node(peers, rank, ranks_per_node, REMOTE) == 0)
    near = live & (far == 0)
    bases = tl.load(bases_ptr + peers, mask=near, other=0)
    my_base = tl.load(bases_ptr + rank)
    spare = (state_ptr + sync.SPARE).to(tl.int64)
    post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, ranks_per_node, R_P2, REMOTE)
    # Normal mode: the last call's half is its epoch's parity (the kernels' half = epoch % 2).
    last_n = tl.load(state_ptr + sync.EPOCH_NORMAL)
    _post_abort_row(bases_ptr, bases, my_base,
                    fingerprint_half(fingerprints_offset, SET_NORMAL * 2 + (last_n + 1) % 2, num_ranks),
                    peers, near, far, fp0, fp1, stamp(last_n), spare, rank, spare_word, R_P2, REMOTE)
    # Low latency: the epoch each half was last sent with (the kernels store it with the release),
    # so the half of this rank's last row is the one with the larger (graph replays included).
    sent_d0 = tl.load(state_ptr + sync.LL_DISPATCH_HALF_EPOCH)
    sent_d1 = tl.load(state_ptr + sync.LL_DISPATCH_HALF_EPOCH + 1)
    sent_c0 = tl.load(state_ptr + sync.LL_COMBINE_HALF_EPOCH)
    sent_c1 = tl.load(state_ptr + sync.LL_COMBINE_HALF_EPOCH + 1)
    last_d = tl.load(state_ptr + sync.EPOCH_LL_DISPATCH)
    last_c = tl.load(state_ptr + sync.EPOCH_LL_COMBINE)
    _post_abort_row(bases_ptr, bases, my_base,
                    fingerprint_half(fingerprints_offset, SET_LL_DISPATCH * 2 + (sent_d1 < sent_d0).to(tl.int32),
                                     num_ranks),
                    peers, near, far, fp0, fp1, stamp(last_d), spare, rank, spare_word, R_P2, REMOTE)
    _post_abort_row(bases_ptr, bases, my_base,
                    fingerprint_half(fingerprints_offset, SET_LL_COMBINE * 2 + (sent_c1 < sent_c0).to(tl.int32),
                                     num_ranks),
                    peers, near, far, fp0, fp1, stamp(last_c), spare, rank, spare_word, R_P2, REMOTE)
    if REMOTE:
        far_complete(REMOTE)  # the rows land before the signal words
    tl.debug_barrier()  # every thread's row stores precede the releases (each thread fences there)
    _stamp_words(bases_ptr, ((FLAG_SET_NORMAL * num_ranks + rank) * 8 + tl.zeros([R_P2], tl.int32)).to(tl.int64),
                 peers, live, last_n, spare, rank, ranks_per_node, spare_word, 0, REMOTE)
    _stamp_words(bases_ptr, ((FLAG_SET_LL_COMBINE * num_ranks + rank) * 8 + tl.zeros([R_P2], tl.int32)).to(tl.int64),
                 peers, live, last_c, spare, rank, ranks_per_node, spare_word, 0, REMOTE)
    experts = tl.arange(0, BLOCK_L)
    receivers = peers[:, None] + tl.zeros([R_P2, BLOCK_L], tl.int32)
    last_sent = tl.maximum(sent_d0, sent_d1)
    for shape in range(0, num_shapes * 2):  # (expert count, half) pairs
        half = shape % 2
        sent = tl.where(half == 0, sent_d0, sent_d1)
        # far receivers: not the half of this rank's last dispatch (its count may be still unread)
        far_too = (sent < last_sent) | (sent == 0)
        counts_offset = tl.load(ll_counts_ptr + (shape // 2) * 3 + half)
        num_local = tl.load(ll_counts_ptr + (shape // 2) * 3 + 2)
        for first in range(0, num_local, BLOCK_L):
            local = first + experts
            offsets = counts_offset + ((rank * num_local + local) * 8).to(tl.int64)[None, :] + \
                tl.zeros([R_P2, BLOCK_L], tl.int64)
            lanes = live[:, None] & (local < num_local)[None, :] & ((far[:, None] == 0) | far_too)
            _stamp_words(bases_ptr, offsets, receivers, lanes, sent, spare, rank, ranks_per_node, spare_word, 32,
                         REMOTE)
    if REMOTE:
        far_complete(REMOTE)  # every SET has landed when the kernel ends: none can land after a resync zeroed


ABORT = KernelSpec(ep_abort, **FAR_LIBRARY)


def bind_abort(num_ranks: int, remote: int = 0):
    """The abort kernel's launcher for ``num_ranks`` ranks (compiled on first use)."""
    return ABORT.bind(num_warps=4, R_P2=1 << (num_ranks - 1).bit_length(), BLOCK_L=128, REMOTE=remote)


def launch_abort(ws, state, experts_seen, argument: str, device, remote: int = 0, ranks_per_node: int = 0,
                 board: Tuple[int, int] = (0, 0)) -> None:
    """Launch :func:`ep_abort` on the current stream over workspace ``ws`` (workspace.py) for a
    rejected ``argument``: the abort rows, and the stamps of the normal-mode flag word, the
    low-latency combine flag and count words (of the expert counts ``experts_seen`` used so far)
    this rank owns, on every peer; ``state``: this rank's epochs (read on device, after the calls
    before). ``remote`` and ``ranks_per_node``: how far peers are reached (gpu/reach/); ``board``:
    the call board's bases address and the aborted call's tag (call_board.py)."""
    import torch

    from .launch import current_stream
    from .workspace import FINGERPRINTS_OFFSET
    R = ws.num_ranks
    ll_shapes = [(ws.ll_half_offset(0), ws.ll_half_offset(1), experts // R)
                 for experts in sorted(experts_seen)] if ws.ll_half else []
    shapes = torch.tensor(ll_shapes or [(0, 0, 0)], dtype=torch.int64).to(device, non_blocking=True)
    fp0, fp1 = abort_words(argument)
    bind_abort(R, remote).launch(
        1, 1, current_stream(device.index), ws.bases, state, FINGERPRINTS_OFFSET, shapes, len(ll_shapes), fp0, fp1,
        ws.rank, R, ranks_per_node or R, ws.spare_word, *board)


# ---------------------------------------------------------------------- a rank that resyncs
@triton.jit
def ep_post_resync(board_bases_ptr: "*i64",  # [R] int64: each rank's call board (gpu/call_board.py)
                   rank: "i32", num_ranks: "i32", ranks_per_node: "i32",
                   R_P2: tl.constexpr, REMOTE: tl.constexpr):
    # RESYNC into every word of this rank's row on every rank's board: a wait for this rank that a
    # peer's queued kernel is still in ends at once (sync.posted_elsewhere), this rank's host being
    # in the resync and no longer making calls.
    resync = tl.full([], sync.RESYNC_TAG, tl.int64)
    post_call_any(board_bases_ptr, rank, num_ranks, resync, resync, ranks_per_node, R_P2, REMOTE)
    if REMOTE:
        far_complete(REMOTE)  # landed before the resync's rendezvous (the peers zero their boards after it)


POST_RESYNC = KernelSpec(ep_post_resync, **FAR_LIBRARY)


def resync_poster(board_bases_address: int, rank: int, num_ranks: int, device, remote: int = 0,
                  ranks_per_node: int = 0):
    """A callable that posts RESYNC for this rank (call_board.CallBoard.resync) on a stream of its
    own — this rank's stream may hold a kernel waiting for a peer that only the post ends — and
    waits for that stream. The kernel is compiled here, not in the error path."""
    import torch
    from .launch import p2
    kernel = POST_RESYNC.bind(num_warps=1, R_P2=p2(num_ranks), REMOTE=remote)
    stream = torch.cuda.Stream(device)

    def post() -> None:
        kernel.launch(1, 1, stream.cuda_stream, board_bases_address, rank, num_ranks, ranks_per_node or num_ranks)
        stream.synchronize()
    return post
