"""The count exchange of a full dispatch: ``ep_notify_dispatch`` puts each rank's counts into
every peer's workspace and publishes the receive counts to the host mailbox (the host's one wait of
a full dispatch polls that word: mailbox.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import sync
from ...agreement import abort_covers, check_rows
from ...launch import KernelSpec
from ..layout_kernel import expert_receive_counts
from ...sync import (arrive, fingerprint_half, fingerprints_settled, load_acquire_sys, mailbox_words, now_ns,
                    post_call_to_peers, post_fingerprint, report_late, store_release_sys, wait_peers)
from ...warps import cta_any
from .stage import _stage


# ====================================================================== notify (count exchange)
# ep_notify_dispatch: a full dispatch's counts to every rank; grid = R programs, program p for peer p.
#
#   epoch = EPOCH_NORMAL + 1;  half = epoch % 2
#   program p:  p.half.counts[rank] <- [num_tokens_per_rank (R), num_tokens_per_expert (E), num_tokens]
#               p.fingerprints[rank] <- this call's fingerprint;  post the board word on p
#               RELEASE p.flags[rank] = epoch                     (the row and fingerprint first)
#               ACQUIRE my.flags[p] == epoch (a timeout, or p elsewhere on the board -> mailbox),
#               then compare p's fingerprint with this call's  (a difference, or p's flag an
#               abort stamped covering this call: agreement.ep_abort -> mailbox)
#   last to arrive (owns the whole count matrix):
#               rank_prefix_matrix = cumsum over sources;  recv_info = [rows received, most tokens]
#               mailbox: receive sizes, per-expert counts (padded to expert_alignment);
#               write_table: the expert-major group table
#               RELEASE mailbox.sequence = sequence         (the host's one wait polls it, then raises
#                                                            any disagreement the mailbox holds)
@triton.jit
def ep_notify_dispatch(
        # the call's counts, and what this kernel computes from every rank's
        per_rank_ptr: "*i32", per_expert_ptr: "*i32",  # this rank's [R] / [E] int32 send counts
        prefix_ptr: "*i32",  # out [R, R] int32 rank_prefix_matrix
        recv_info_ptr: "*i32",  # out [2] int32 (device): rows received, most tokens any rank sends
        table_ptr: "*i32",  # out [R + 2, L] int32 (write_table): the expert-major group table, below
        # sizes
        num_tokens: "i32", num_experts: "i32", expert_alignment: "i32", write_table: "i32",
        # this rank and the workspaces (offsets are from a workspace base)
        rank: "i32", num_ranks: "i32",
        normal_bases_ptr: "*i64",  # [R] int64: each rank's workspace base
        flag_bases_ptr: "*i64",  # [R] int64: each rank's flag region
        state_ptr: "*i64",  # [NUM_STATE_WORDS] int64 local: epochs and arrival counters (sync.py)
        half_bytes: "i64", counts_offset: "i64",
        # the host: its mailbox (sync.py), the sequence number it polls for, the timeout of a wait
        mailbox_address: "i64", sequence: "i64", timeout_ns: "i64",
        # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
        fp_offset: "i64", fp0: "i64", fp1: "i64",
        board_bases_ptr: "*i64",  # [R] int64: each rank's call board
        call_tag: "i64",  # this call's number and Buffer on the board (0: not posted, not checked)
        # meta-parameters
        R_P2: tl.constexpr, BLOCK: tl.constexpr):
    _notify(tl.program_id(0), per_rank_ptr, per_expert_ptr, prefix_ptr, recv_info_ptr, table_ptr, num_tokens,
            num_experts, expert_alignment, write_table, rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr,
            half_bytes, counts_offset, mailbox_address, sequence, timeout_ns, fp_offset, fp0, fp1, board_bases_ptr,
            call_tag, R_P2, BLOCK, WITH_STAGE=False)


@triton.jit(noinline=True)
def _notify(peer, per_rank_ptr, per_expert_ptr, prefix_ptr, recv_info_ptr, table_ptr, num_tokens, num_experts,
            expert_alignment, write_table, rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr, half_bytes,
            counts_offset, mailbox_address, sequence, timeout_ns, fp_offset, fp0, fp1, board_bases_ptr, call_tag,
            R_P2: tl.constexpr, BLOCK: tl.constexpr, WITH_STAGE: tl.constexpr):
    """Program ``peer`` of the count exchange (the outline above); WITH_STAGE: the first R programs
    of ep_dispatch_notify_stage or of ep_dispatch with NOTIFY, whose last program also RELEASEs
    NOTIFIED to the programs after them (once it has read the count rows) and leaves EPOCH_NORMAL
    to them (the stage's last arrival; ep_dispatch's last pull program). A called function, not
    inlined: inlined, it took registers that ep_dispatch's pull then spilled in its item loop
    (tests/test_kernels_compile.py, test_the_count_exchange_in_ep_dispatch_leaves_...)."""
    # The expert-major group table, for local expert e: row i < R the first row of source i's
    # entries (group start + entries of lower sources), row R the end of the group's entries, row
    # R + 1 the end of its padding (groups padded to expert_alignment).
    # -- program p: this rank's count row and fingerprint to peer p, released
    epoch = tl.load(state_ptr + sync.EPOCH_NORMAL) + 1
    half_offset = (epoch % 2) * half_bytes + counts_offset
    row_len = num_ranks + num_experts + 1
    dst = (tl.load(normal_bases_ptr + peer) + half_offset).to(tl.pointer_type(tl.int32)) + rank * row_len
    for start in range(0, row_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        value = tl.load(per_rank_ptr + offs, mask=offs < num_ranks, other=0)
        value += tl.load(per_expert_ptr + offs - num_ranks, mask=(offs >= num_ranks) & (offs < row_len - 1), other=0)
        value = tl.where(offs == row_len - 1, num_tokens, value)
        tl.store(dst + offs, value, mask=offs < row_len)
    peers = tl.arange(0, R_P2)
    one_peer = peers == peer
    fp_rows = fingerprint_half(fp_offset, epoch % 2, num_ranks)  # this signal's half of the set
    post_fingerprint(tl.load(flag_bases_ptr + peers, mask=one_peer, other=0) + fp_rows, rank, one_peer, fp0, fp1,
                     epoch)  # (ends with a CTA barrier: every thread's row stores precede the release)
    peer_flag = (tl.load(flag_bases_ptr + peer) + (sync.FLAGS_NORMAL * num_ranks + rank) * 8).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flag, epoch, sem="release", scope="sys")  # RELEASE: row, fingerprint -> peer
    # -- ACQUIRE: peer p's row in this rank's matrix (a timeout is flagged in the mailbox)
    my_base = tl.load(flag_bases_ptr + rank)
    my_flags = (my_base + sync.FLAGS_NORMAL * num_ranks * 8).to(tl.pointer_type(tl.int64))
    timeouts, _, agreement, notify = mailbox_words(mailbox_address, num_ranks)
    settled = fingerprints_settled(my_base + fp_rows, peers, one_peer, fp0, fp1, epoch)
    # (a peer the call board shows in another call is recorded: the host's count wait raises)
    post_call_to_peers(board_bases_ptr, rank, num_ranks, call_tag, fp0, one_peer, R_P2)
    flags, _, _, _ = wait_peers(my_flags, num_ranks, tl.where(one_peer, epoch, 0), state_ptr, timeouts, timeout_ns,
                                tl.load(board_bases_ptr + rank), call_tag, fp0, agreement, HAS_MASK=False,
                                MASK_ON_TIMEOUT=False, CHECK_BOARD=True, R_P2=R_P2)
    # p's flag stamped by an abort (p rejected its input) fails this call only if p never signalled
    # it: p that signalled it and then aborted its next call delivered this one (the stamp's
    # release covers its row and counts as the signal's did)
    check_rows(my_base + fp_offset, epoch % 2, peers, one_peer, settled, one_peer & abort_covers(flags, epoch), fp0,
               fp1, epoch, agreement, num_ranks)
    # -- the last program to arrive: prefix matrix, receive sizes, table, then the mailbox release
    if arrive(state_ptr + sync.ARRIVE_NOTIFY, num_ranks):
        if not WITH_STAGE:  # (with the stage, its last arrival stores e + 1: its programs read e - 1 until then)
            tl.store(state_ptr + sync.EPOCH_NORMAL, epoch)
        counts = (tl.load(normal_bases_ptr + rank) + half_offset).to(tl.pointer_type(tl.int32))
        src = tl.arange(0, R_P2)
        dst_r = tl.arange(0, R_P2)
        live = (src[:, None] < num_ranks) & (dst_r[None, :] < num_ranks)
        sends = tl.load(counts + src[:, None] * row_len + dst_r[None, :], mask=live, other=0)
        prefix = tl.cumsum(sends, axis=0)
        tl.store(prefix_ptr + src[:, None] * num_ranks + dst_r[None, :], prefix, mask=live)
        num_recv = tl.sum(tl.where((src[:, None] == num_ranks - 1) & (dst_r[None, :] == rank), prefix, 0), axis=None)
        max_tokens = tl.max(tl.load(counts + src * row_len + row_len - 1, mask=src < num_ranks, other=0), axis=0)
        tl.store(recv_info_ptr, num_recv)
        tl.store(recv_info_ptr + 1, max_tokens)
        num_local = num_experts // num_ranks
        group_start = 0  # of the expert-major groups
        for start in range(0, num_local, BLOCK):
            local = start + tl.arange(0, BLOCK)
            total, aligned = expert_receive_counts(counts + num_ranks + rank * num_local, row_len, local, num_local,
                                                   num_ranks, expert_alignment)
            tl.store(notify + 3 + local, aligned.to(tl.int64), mask=local < num_local)
            if write_table != 0:
                first = group_start + tl.cumsum(aligned, axis=0) - aligned
                for i in range(0, num_ranks):
                    tl.store(table_ptr + i * num_local + local, first, mask=local < num_local)
                    first += tl.load(counts + i * row_len + num_ranks + rank * num_local + local,
                                     mask=local < num_local, other=0)
                tl.store(table_ptr + num_ranks * num_local + local, first, mask=local < num_local)
                tl.store(table_ptr + (num_ranks + 1) * num_local + local, first - total + aligned,
                         mask=local < num_local)
                group_start += tl.sum(tl.where(local < num_local, aligned, 0), axis=0)
        if WITH_STAGE:
            # RELEASE -> this launch's stage programs (gpu scope: the same GPU), before the mailbox's
            # system-scope release: the arrival (acq_rel) acquired every notify program's wait for
            # its peer, which the stage's stores need, and this program has read the count rows of
            # half e % 2 above, which the stage's signal of e + 1 needs (a peer's pull ends on it,
            # and that peer's next notify, e + 2, writes its row into this half at once). The
            # epoch, not the host's number, so that a CUDA graph's replay waits as its first run did.
            tl.debug_barrier()  # every thread's reads of the count rows precede the release
            tl.atomic_xchg(state_ptr + sync.NOTIFIED, epoch, sem="release", scope="gpu")
        tl.store(notify + 1, num_recv.to(tl.int64))
        tl.store(notify + 2, max_tokens.to(tl.int64))
        tl.debug_barrier()  # all mailbox words precede the sequence number
        store_release_sys(notify.to(tl.int64), sequence)  # RELEASE -> host



@triton.jit
def await_notified(state_ptr, last_epoch, timeout_ns, rank, mailbox_address, R_P2: tl.constexpr):
    """The programs after the count exchange in its launch (ep_dispatch_notify_stage's stage, and
    ep_dispatch's stage and pull with NOTIFY): ACQUIRE NOTIFIED >= ``last_epoch`` + 1, released by
    the notify's last program (the chain in the outline below); then a vote, whose barrier also
    orders the polling threads' acquires before every thread's loads and stores after it. Returns
    1 where it waited past 3 x ``timeout_ns`` (the notify programs never ran: this rank is
    reported late in the mailbox, and the caller stages or pulls nothing), else 0.
    One word, polled by every thread with its own clock: a lean loop (poll_epochs' lanes and
    checks, inlined here, took registers that ep_dispatch's pull then spilled in its item loop)."""
    word = (state_ptr + sync.NOTIFIED).to(tl.int64)
    target = last_epoch + 1
    deadline = now_ns() + 3 * timeout_ns
    seen = load_acquire_sys(word)
    while (seen < target) & (now_ns() < deadline):
        seen = load_acquire_sys(word)
    late_here = cta_any((seen < target).to(tl.int32))  # (the threads' clocks may disagree: one verdict)
    if late_here != 0:
        lanes = tl.arange(0, R_P2)
        report_late(lanes == 0, rank + lanes * 0, state_ptr,
                    mailbox_address.to(tl.pointer_type(tl.int64)) + 1,  # the timeouts (mailbox_words)
                    MASK_ON_TIMEOUT=False)
    return late_here

NOTIFY = KernelSpec(ep_notify_dispatch)
NOTIFY_BLOCK = 256  # count-row entries a notify program moves per step (BLOCK)


# ====================================================================== notify and stage in one launch
# ep_dispatch_notify_stage: a full dispatch's count exchange and its round-0 stage (stage.py) in
# one launch, one launch less on the host's path than ep_notify_dispatch ; ep_dispatch_stage;
# grid = R notify programs, then the stage's programs.
#
#   e - 1 = EPOCH_NORMAL (the previous call's last epoch; the notify takes e, the stage e + 1)
#   programs p < R:  ep_notify_dispatch's program p (the outline above), but the last to arrive
#                    RELEASEs NOTIFIED = e (gpu scope) once it has read the count rows, before the
#                    mailbox, and leaves EPOCH_NORMAL to the stage's last arrival
#   the others:      read e - 1, ACQUIRE NOTIFIED >= e, then the stage of epoch e + 1
#
# Why the stage waits. It writes into its workspace half of epoch e + 1, the half the previous full
# dispatch staged into (two epochs a call). Peers may still be pulling from it until they signal e,
# which each does after its previous pull (stream order); the notify programs acquire those
# signals. In turn, stream order put the stage after them; here the chain is: peer's pull -> its
# RELEASE of e -> a notify program's ACQUIRE -> the arrival (acq_rel) -> the last program's RELEASE
# of NOTIFIED -> the stage programs' ACQUIRE -> their stores. The release also waits until the last
# notify program has read this rank's count rows (half e % 2): the stage's signal of e + 1 lets a
# peer end its pull and start its next notify (e + 2), which writes its row into that half at once.
# The stage needs nothing else (the mailbox is the host's), so it starts while the last notify
# program writes the mailbox and releases it at system scope. The
# stage's own release of e + 1 into the peers' flags then follows every notify program's release of
# e there, so the flag words only grow. The stage programs spin while the notify programs wait for
# the peers: the notify programs have the lowest ids, so they are placed first, and the host takes
# this launch only where every rank's waiting programs fit the GPU at once (mode.py: ranks sharing
# a GPU count them as shared_grids.py does). A stage program that waits past 3 x timeout_ns (the
# notify programs never ran) stages nothing, does not arrive and reports this rank late; a full
# dispatch's count wait on the host has raised long before (after timeout_s + 1 s: the mailbox's
# sequence never came either; a num_worst_tokens dispatch, which has no host wait, raises at the
# next call), and a timeout is sticky: the Buffer is made anew, its state words zeroed. The
# words waited on are device epochs, not the host's notify number (``sequence``): a CUDA graph's
# replay of a num_worst_tokens dispatch (nothing waits on the host there) waits as its first run
# did. Before this launch's release NOTIFIED is below e: an earlier launch released its own e',
# and its stage then took e' + 1 <= e - 1. (On a failure path, a stage that never arrived leaves
# EPOCH_NORMAL at e - 1, and the next launch would take e again and pass its wait at once. Eagerly
# a timeout is sticky, and a resync or a new Buffer zeroes the state words; between the replays of
# a CUDA graph nothing on the host looks, as for every kernel a graph replays after a failure.)
@triton.jit
def ep_dispatch_notify_stage(
        # ep_dispatch_stage's parameters (stage.py: the stage's tensors, sizes, workspace and the
        # call's identity), in its order
        x_ptr: "*i8", scales_ptr: "*fp32", topk_ptr: "*i64", weights_ptr: "*fp32", in_rank_ptr: "*i8",
        list_index_ptr: "*i32", per_rank_ptr: "*i32", per_expert_ptr: "*i32",
        num_tokens: "i32", token_lo: "i32", token_hi: "i32", x_words: "i32", num_scales: "i32",
        scale_stride_t: "i64", scale_stride_c: "i64", num_topk: "i32", num_local: "i32",
        num_position_programs: "i32",
        rank: "i32", num_ranks: "i32", normal_bases_ptr: "*i64", flag_bases_ptr: "*i64", state_ptr: "*i64",
        half_bytes: "i64", lists_offset: "i64", list_cap: "i64", x_offset: "i64", scales_offset: "i64",
        topk_offset: "i64", topk_row_bytes: "i64",
        fp_offset: "i64", fp0: "i64", fp1: "i64", board_bases_ptr: "*i64", call_tag: "i64",
        # then the notify's own (ep_notify_dispatch's, the same meaning)
        prefix_ptr: "*i32", recv_info_ptr: "*i32", table_ptr: "*i32",
        num_experts: "i32", expert_alignment: "i32", write_table: "i32", counts_offset: "i64",
        mailbox_address: "i64", sequence: "i64", timeout_ns: "i64",
        # meta-parameters: ep_dispatch_stage's with WRITE_LISTS, then the notify's block
        HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, WRITE_LISTS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr,
        R_P2: tl.constexpr, LIST_BLOCK: tl.constexpr, L_P2: tl.constexpr, ALIGNED: tl.constexpr,
        EXPERT_MAJOR: tl.constexpr, POSITION_TOKENS: tl.constexpr, POSITION_SUB: tl.constexpr,
        E_P2: tl.constexpr, PUSHED_LISTS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < num_ranks:
        _notify(pid, per_rank_ptr, per_expert_ptr, prefix_ptr, recv_info_ptr, table_ptr, num_tokens, num_experts,
                expert_alignment, write_table, rank, num_ranks, normal_bases_ptr, flag_bases_ptr, state_ptr,
                half_bytes, counts_offset, mailbox_address, sequence, timeout_ns, fp_offset, fp0, fp1,
                board_bases_ptr, call_tag, R_P2, BLOCK, WITH_STAGE=True)
    else:
        # The previous call's last epoch e - 1: stable until this stage's last arrival, which needs
        # this program's arrival first (the notify programs, who read it too, arrived before NOTIFIED).
        last_epoch = tl.load(state_ptr + sync.EPOCH_NORMAL)
        if await_notified(state_ptr, last_epoch, timeout_ns, rank, mailbox_address, R_P2) == 0:
            _stage(pid - num_ranks, tl.num_programs(0) - num_ranks, last_epoch + 2,
                   x_ptr, scales_ptr, topk_ptr, weights_ptr, in_rank_ptr, list_index_ptr, per_rank_ptr,
                   per_expert_ptr, num_tokens, token_lo, token_hi, x_words, num_scales, scale_stride_t,
                   scale_stride_c, num_topk, num_local, num_position_programs, rank, num_ranks, normal_bases_ptr,
                   flag_bases_ptr, state_ptr, half_bytes, lists_offset, list_cap, x_offset, scales_offset,
                   topk_offset, topk_row_bytes, 0, 0, fp_offset, fp0, fp1, board_bases_ptr, call_tag,
                   HAS_SCALES, HAS_TOPK, WRITE_LISTS, BLOCK_R, BLOCK_W, S_P2, K_P2, R_P2, LIST_BLOCK, L_P2, ALIGNED,
                   EXPERT_MAJOR, POSITION_TOKENS, POSITION_SUB, E_P2, OVERLAP=False, PUSHED_LISTS=PUSHED_LISTS)


# (its parameters up to call_tag are ep_dispatch_stage's: the host hands both the same arguments,
# then the notify's; a host test checks the order)
NOTIFY_STAGE = KernelSpec(ep_dispatch_notify_stage, aligned_if={"ALIGNED": ["x_ptr"]})


class _NotifyKernels(dict):
    """NOTIFY bound per R_P2, looked up without keyword building."""

    def __missing__(self, r_p2):
        self[r_p2] = NOTIFY.bind(num_warps=4, R_P2=r_p2, BLOCK=NOTIFY_BLOCK)
        return self[r_p2]


NOTIFY_BOUND = _NotifyKernels()
