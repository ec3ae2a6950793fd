"""``ep_ll_combine``: the send phase (every expert output row back into its home's slot, then a
flag released per (expert, source)) and the receive phase (acquire, weighted float32 sum per
token); the package docstring has the protocol."""
from __future__ import annotations

import triton
import triton.language as tl

from .. import sync
from ..agreement import abort_covers, check_rows
from ..copy import multiple, ptr_at, word_ptr
from ..launch import KernelSpec
from ..reach.modes import (FAR_LIBRARY, far_complete, far_send_bytes, post_call_any, post_fingerprint_any,
                          release_words, same_node)
from ..sync import (arrive, fingerprint_half, fingerprints_settled, live_peers, mailbox_words,
                    poll_epochs_or_other_call, record_elsewhere, report_late)
from ..walk import peer_after
from ..warps import cta_any


# ====================================================================== combine
@triton.jit
def _push_rows(l, s, x_ptr, layout_ptr, slot_info_ptr, mask_ptr, bases_ptr, num_ranks, rank, max_tokens, x_words,
               half_offset, combine_offset, stage_offset, ranks_per_node, BLOCK_W: tl.constexpr,
               REMOTE: tl.constexpr):
    """Store the rows of local expert l that came from source s into their slots in s's combine
    area (plain peer stores). The slots are free: s read them two combines ago (sync.py). For s
    on another node (REMOTE): copy the rows to this rank's staging rows, then one put per row."""
    if tl.load(mask_ptr + s) == 0:
        packed = tl.load(layout_ptr + l * num_ranks + s)
        offset = (packed >> 32).to(tl.int32)
        n = (packed & 0xFFFFFFFF).to(tl.int32)
        near = same_node(s, rank, ranks_per_node, REMOTE)
        row_bytes = (x_words * 8).to(tl.int64)
        first_row = (l * num_ranks * max_tokens + offset).to(tl.int64)
        my_base = tl.load(bases_ptr + rank)
        stage = my_base + half_offset + stage_offset + first_row * row_bytes  # (far s) rows staged in order
        home = tl.where(near, tl.load(bases_ptr + s) + half_offset + combine_offset, 0)
        cols = tl.arange(0, BLOCK_W)
        for i in range(0, n):
            row = first_row + i
            slot = tl.load(slot_info_ptr + row).to(tl.int64)
            src = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + row * x_words
            dst = word_ptr(tl.where(near, home + slot * row_bytes, stage + i * row_bytes), True)
            for c0 in range(0, x_words, BLOCK_W):
                c = c0 + cols
                tl.store(dst + c, tl.load(src + c, mask=c < x_words), mask=c < x_words)
        if REMOTE:
            if near == 0:
                tl.debug_barrier()  # every thread's staged rows precede the puts
                for i in range(0, n):
                    slot = tl.load(slot_info_ptr + first_row + i).to(tl.int64)
                    far_send_bytes(my_base + half_offset + combine_offset + slot * row_bytes, stage + i * row_bytes,
                               row_bytes, s, bases_ptr, rank, REMOTE)


@triton.jit
def _reduce_tokens(pid, num_programs, topk_ptr, weights_ptr, mask_ptr, out_ptr, slots_address, num_tokens, hidden,
                   num_topk, num_local, num_ranks, shrink, gone, any_gone, K_P2: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[t] = Σ_k w[t, k] · slot(t, k) in float32 over entries whose expert id is valid and
    whose rank is not masked, for this program's tokens. A token with an entry whose contribution
    did not land is a NaN row instead: an entry on a rank in ``gone`` ([R_P2] lanes: found in
    another call, or with another fingerprint; ``any_gone``: any lane set) or, without ``shrink``,
    on a masked rank (a late one: without enable_shrink nothing else is masked).

    The sum runs over the entries one [BLOCK_C] row at a time, in k order, unrolled so every
    entry's load is in flight at once; each entry's weight and presence are taken from the token's
    [K_P2] vectors, which every warp holds whole (shuffles, no barrier), so the column loop never
    meets the other warps. A [K_P2, BLOCK_C] tile summed over its entries splits them over the warps
    at K = 8 and meets them through shared memory per column block: its round trip took 6–7 µs more
    in one CUDA graph at 2 and 4 ranks (performance-log, 2026-11-28h)."""
    slots = ptr_at(slots_address, tl.bfloat16, True)  # slots are 16-byte aligned, hidden % 128 == 0
    ks = tl.arange(0, K_P2)
    cols = tl.arange(0, BLOCK_C)
    num_experts = num_local * num_ranks
    ranks = tl.arange(0, gone.shape[0])
    for token in range(pid, num_tokens, num_programs):
        t64 = tl.cast(token, tl.int64)  # (tl.cast: also a plain int, under the interpreter)
        expert = tl.load(topk_ptr + t64 * num_topk + ks, mask=ks < num_topk, other=-1)
        valid = (expert >= 0) & (expert < num_experts)
        owner = expert // num_local
        masked = tl.load(mask_ptr + owner, mask=valid, other=1) != 0
        lost = valid & masked & (shrink == 0)
        if any_gone:  # (only after a failure: a [K_P2, R_P2] compare per token)
            lost |= valid & (tl.max(((owner[:, None] == ranks[None, :]) & gone[None, :]).to(tl.int32), axis=1) != 0)
        token_lost = tl.max(lost.to(tl.int32), axis=0) != 0
        present = valid & (masked == 0)
        weight = tl.load(weights_ptr + t64 * num_topk + ks, mask=present, other=0.0)
        for c0 in range(0, hidden, BLOCK_C):
            c = c0 + cols
            cm = c < hidden
            acc = tl.zeros([BLOCK_C], tl.float32)
            for k in tl.static_range(K_P2):
                here = tl.max(tl.where(ks == k, present.to(tl.int32), 0), axis=0) != 0
                w = tl.sum(tl.where(ks == k, weight, 0.0), axis=0)
                row = tl.load(slots + (t64 * num_topk + k) * hidden + c, mask=cm & here, other=0.0)
                acc += row.to(tl.float32) * w
            acc = tl.where(token_lost, float("nan"), acc)  # no plausible row for a lost contribution
            tl.store(out_ptr + t64 * hidden + c, acc.to(tl.bfloat16), mask=cm)


# ep_ll_combine: one launch (SEND and RECEIVE, a cooperative grid), or two (a hook). Grid:
# programs striding over the items of each phase.
#
#   SEND   epoch = EPOCH_LL_COMBINE + 1
#          program 0: post the call's fingerprint and board word on every live peer
#          for each (local expert l, source s), s not masked:                    (_push_rows)
#              for i < count(l, s):  s.half.slots[slot_info[l, offset + i]] <- x[l, offset + i]
#              (a peer store; s on another node: staged here, then one put per row)
#          (REMOTE: this program's puts complete before it arrives)
#          last to arrive:  RELEASE every live peer's LL-combine flag[rank] = epoch
#   RECEIVE  (a hook's launch: the epoch its half was pushed with)
#          ACQUIRE every live peer's flag == epoch — a peer the board shows in another call is
#          recorded, a silent one is masked at the timeout (without shrink also reported: the host
#          raises EPTimeoutError at the next call); fingerprints compared, and a flag an abort
#          stamped covering this call taken as a difference (recorded: the reduction reads only
#          this rank's own slots, in bounds whatever a peer pushed)
#          for each token t of this program:                                     (_reduce_tokens)
#              out[t] = bf16( Σ_k w[t, k] · float32(slots[t, k]) )  over valid, unmasked entries;
#              NaN where an entry's rank is in another call or differs, or (no shrink) was late
@triton.jit
def ep_ll_combine(
                  # the call's tensors, and the dispatch's handle
                  x_ptr: "*i8",  # [E_local, R*M, H] bf16 expert outputs, dispatch's layout
                  layout_ptr: "*i64",  # [E_local, R] int64 (offset << 32) | count
                  slot_info_ptr: "*i32",  # [E_local, R*M] int32 home slot t*K+k
                  topk_ptr: "*i64", weights_ptr: "*fp32",  # [T, K] int64 / float32, as given to dispatch
                  # the rank mask, the workspaces, this rank's state
                  mask_ptr: "*i32", bases_ptr: "*i64", state_ptr: "*i64",
                  out_ptr: "*bf16",  # [T, H] bf16
                  wait_stats_ptr: "*i64",  # [R] int64 (HAS_WAIT_STATS)
                  my_flags_address: "i64",  # this rank's LL-combine flag set
                  slots_address: "i64",  # this rank's combine slots of this half: bf16 [M][K][H]
                  mailbox_address: "i64",  # host mailbox (sync.py)
                  # sizes
                  num_tokens: "i32", hidden: "i32", num_topk: "i32", num_local: "i32", num_ranks: "i32", rank: "i32",
                  max_tokens: "i32", x_words: "i32",
                  # this call's half of the workspace, and the timeout of a wait
                  half_offset: "i64", combine_offset: "i64", half: "i32", timeout_ns: "i64",
                  shrink: "i32",  # 1: a late rank is masked (enable_shrink); 0: reported, its rows NaN
                  # peers on other nodes (REMOTE only: gpu/reach)
                  stage_offset: "i64", ranks_per_node: "i32", spare_word: "i64",
                  # the call's identity: its fingerprint, and its word on the call board (gpu/call_board.py)
                  fp_offset: "i64", fp0: "i64", fp1: "i64",
                  board_bases_ptr: "*i64",  # [R] int64: each rank's call board
                  call_tag: "i64",  # this call's number and Buffer on the board (0: not posted, not checked)
                  # meta-parameters
                  SEND: tl.constexpr, RECEIVE: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, BLOCK_W: tl.constexpr,
                  K_P2: tl.constexpr, BLOCK_C: tl.constexpr, R_P2: tl.constexpr, ALIGNED: tl.constexpr,
                  REMOTE: tl.constexpr):
    # One launch holds both phases only as a cooperative grid, all resident (see ep_ll_dispatch).
    # Rows are a multiple of 16 bytes (hidden % 128 == 0); ALIGNED: x and out are 16-byte aligned.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    hidden = multiple(hidden, 128, True)
    fp_rows = fingerprint_half(fp_offset, half, num_ranks)  # this call's fingerprint rows
    # -- SEND: rows back to their homes' slots, then the epoch released by the last arrival
    if SEND:
        epoch = tl.load(state_ptr + sync.EPOCH_LL_COMBINE) + 1  # read before arriving (see ep_ll_dispatch)
        if pid == 0:
            post_fingerprint_any(bases_ptr, fp_rows, rank, num_ranks, mask_ptr, fp0, fp1, epoch, ranks_per_node,
                                 spare_word, R_P2, REMOTE)
            post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, ranks_per_node, R_P2, REMOTE)
        # items (local expert, home) with the homes rotated per rank: with fewer programs than ranks
        # the ranks still write to different homes at once (DESIGN's scale rule)
        for item in range(pid, num_local * num_ranks, num_programs):
            _push_rows(item // num_ranks, peer_after(item, rank, num_ranks), x_ptr, layout_ptr, slot_info_ptr, mask_ptr, bases_ptr,
                       num_ranks, rank, max_tokens, multiple(x_words, 2, True), half_offset, combine_offset,
                       stage_offset, ranks_per_node, BLOCK_W, REMOTE)
        if REMOTE:
            far_complete(REMOTE)  # this program's puts land before it arrives
        if arrive(state_ptr + sync.ARRIVE_LL_PUSH, num_programs):
            tl.store(state_ptr + sync.EPOCH_LL_COMBINE, epoch)
            tl.store(state_ptr + sync.LL_COMBINE_HALF_EPOCH + half, epoch)
            peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK=True, R_P2=R_P2)
            release_words(bases_ptr, (sync.FLAGS_LL_COMBINE * num_ranks + rank) * 8 + tl.zeros([R_P2], tl.int64),
                          peers, tl.zeros([R_P2], tl.int64) + epoch, live, (state_ptr + sync.SPARE).to(tl.int64), rank,
                          ranks_per_node, spare_word, REMOTE)  # RELEASE: rows, fingerprint -> homes
    else:
        epoch = tl.load(state_ptr + sync.LL_COMBINE_HALF_EPOCH + half)  # a hook's receive launch
    # -- RECEIVE: acquire every live peer's rows, then reduce this program's tokens
    if RECEIVE:
        peers, live = live_peers(mask_ptr, num_ranks, HAS_MASK=True, R_P2=R_P2)
        my_rows = tl.load(bases_ptr + rank) + fp_rows
        settled = fingerprints_settled(my_rows, peers, live, fp0, fp1, epoch)
        timeouts, _, agreement, _ = mailbox_words(mailbox_address, num_ranks)
        board_address = tl.load(board_bases_ptr + rank)
        my_flags = my_flags_address.to(tl.pointer_type(tl.int64))
        # ACQUIRE; a peer the call board shows in another call (a skipped call) is recorded
        flags, waited, late, elsewhere = poll_epochs_or_other_call(my_flags + peers, live, epoch, timeout_ns,
                                                                   my_flags, my_flags, fp0, 0, board_address,
                                                                   call_tag, EPOCH_SHIFT=0, CHECK_ROWS=False,
                                                                   CHECK_BOARD=True)
        report_late(late, peers, mask_ptr, mask_ptr, MASK_ON_TIMEOUT=True)
        if shrink == 0:  # no enable_shrink: a late rank is an error (the host raises), its rows NaN here
            report_late(late, peers, mask_ptr, timeouts, MASK_ON_TIMEOUT=False)
        record_elsewhere(board_address, peers, elsewhere, call_tag, fp0, agreement, num_ranks)
        # Recorded: the reduction reads this rank's own slots, in bounds whatever a differing peer
        # pushed, and the host raises; the rows of those peers' entries are NaN (they did not land).
        # A flag an abort stamped (agreement.ep_abort) counts as a difference only for a call the
        # peer never pushed: a peer that pushed this call and then aborted its next one delivered
        # this one (its row of this call is left alone too), so a receiver behind it is not failed.
        differ = check_rows(tl.load(bases_ptr + rank) + fp_offset, half, peers, live, settled,
                            live & abort_covers(flags, epoch), fp0, fp1, epoch, agreement, num_ranks)
        gone = elsewhere | differ
        tl.debug_barrier()  # this program's mask stores (report_late) precede its reduce's loads
        if HAS_WAIT_STATS:
            if pid == 0:
                tl.atomic_add(wait_stats_ptr + peers, waited, mask=peers < num_ranks, sem="relaxed")
        # (a vote: each warp reduced its own readings, and the branch it guards meets the other warps)
        any_gone = cta_any(tl.max(gone.to(tl.int32), axis=0)) != 0
        _reduce_tokens(pid, num_programs, topk_ptr, weights_ptr, mask_ptr, out_ptr, slots_address, num_tokens,
                       hidden, num_topk, num_local, num_ranks, shrink, gone, any_gone, K_P2, BLOCK_C)


COMBINE = KernelSpec(ep_ll_combine, aligned_if={"ALIGNED": ["x_ptr", "out_ptr"]}, **FAR_LIBRARY)
