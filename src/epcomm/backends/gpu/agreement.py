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
  launches :func:`ep_abort` instead: abort words into every peer's areas and, into every flag and
  count word it owns on its peers, an epoch no wait can be ahead of — so the peers' waits end at
  once and they raise for that argument too.

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
from . import call_board, sync
from .launch import KernelSpec
from .reach.modes import FAR_LIBRARY, far_complete, post_call_any, release_words, same_node, set_row
from .sync import fingerprint_half, post_fingerprint

# The fields of the two words, low bits first: (name, bits). Names are the arguments they describe.
FIELDS = (
    (("call", 4), ("hidden", 24), ("x", 2), ("num_topk", 8), ("num_experts", 22), ("buffer", 3)),
    (("abort", 8), ("handle", 28), ("num_worst_tokens", 1), ("num_max_dispatch_tokens_per_rank", 20),
     ("use_fp8", 1), ("round_scale", 1), ("use_ue8m0", 1), ("expert_major", 1)),
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
# sync.ABORT_EPOCH as a low-latency count word: (epoch << 32) | 0 messages.
ABORT_COUNT_WORD = tl.constexpr(1 << 62)


@triton.jit
def ep_abort(bases_ptr: "*i64",  # [R] int64: each rank's workspace
             state_ptr: "*i64",  # [16] int64 local (a spare word for masked-off lanes)
             fingerprints_offset: "i64",  # bytes from a workspace to its fingerprint area
             ll_counts_ptr: "*i64",  # [num_shapes, 3] int64: (counts offset of half 0, of half 1, experts per rank)
             num_shapes: "i32", fp0: "i64", fp1: "i64", rank: "i32", num_ranks: "i32",
             ranks_per_node: "i32", spare_word: "i64",  # (REMOTE only: gpu/reach/)
             board_bases_ptr: "*i64",  # [R] int64: each rank's call board (gpu/call_board.py)
             call_tag: "i64",  # the aborted call's number and Buffer (0: not posted)
             NUM_ROWS: tl.constexpr, NUM_FLAG_SETS: tl.constexpr, R_P2: tl.constexpr, BLOCK_L: tl.constexpr,
             REMOTE: tl.constexpr):
    # On every peer (self included): the abort words into each fingerprint row this rank owns (all
    # sets, both halves), then RELEASE ABORT_EPOCH into each flag word and low-latency count word
    # this rank owns. Every wait for this rank then ends at once, and the check after it finds the
    # abort words (the release covers them) and names the argument. Peers of other nodes
    # (REMOTE) get the same words by signals (gpu/reach), the rows completed before the epochs. The
    # abort is posted on the call board too: peers waiting in another Buffer's call of the same
    # number (this rank skipped theirs: a rejected layout's stand-in) stop waiting for it.
    peers = tl.arange(0, R_P2)
    live = peers < num_ranks
    far = live & (same_node(peers, rank, ranks_per_node, REMOTE) == 0)
    base = tl.load(bases_ptr + peers, mask=live & (far == 0), other=0)
    my_base = tl.load(bases_ptr + rank)
    spare = (state_ptr + sync.SPARE).to(tl.int64)
    epoch = tl.zeros([R_P2], tl.int64) + sync.ABORT_EPOCH
    post_call_any(board_bases_ptr, rank, num_ranks, call_tag, fp0, ranks_per_node, R_P2, REMOTE)
    for row in range(0, NUM_ROWS):  # (set, half) pairs
        rows_offset = fingerprint_half(fingerprints_offset, row, num_ranks)
        post_fingerprint(base + rows_offset, rank, live & (far == 0), fp0, fp1, epoch)
        if REMOTE:
            set_row(my_base + rows_offset, peers, far, fp0, fp1, sync.ABORT_EPOCH, bases_ptr, rank, spare_word, R_P2,
                    REMOTE)
    if REMOTE:
        far_complete(REMOTE)  # the rows land before the epochs
    for flag_set in range(0, NUM_FLAG_SETS):
        release_words(bases_ptr, ((flag_set * num_ranks + rank) * 8 + tl.zeros([R_P2], tl.int32)).to(tl.int64), peers,
                      epoch, live, spare, rank, ranks_per_node, spare_word, REMOTE)
    experts = tl.arange(0, BLOCK_L)
    receivers = peers[:, None] + tl.zeros([R_P2, BLOCK_L], tl.int32)
    for shape in range(0, num_shapes * 2):
        counts_offset = tl.load(ll_counts_ptr + (shape // 2) * 3 + shape % 2)
        num_local = tl.load(ll_counts_ptr + (shape // 2) * 3 + 2)
        for first in range(0, num_local, BLOCK_L):
            local = first + experts
            offsets = counts_offset + ((rank * num_local + local) * 8).to(tl.int64)[None, :] + \
                tl.zeros([R_P2, BLOCK_L], tl.int64)
            lanes = live[:, None] & (local < num_local)[None, :]
            release_words(bases_ptr, offsets, receivers, tl.zeros([R_P2, BLOCK_L], tl.int64) + ABORT_COUNT_WORD,
                          lanes, spare, rank, ranks_per_node, spare_word, REMOTE)
    if REMOTE:
        far_complete(REMOTE)  # every SET has landed when the kernel ends: none can land after a resync zeroed


ABORT = KernelSpec(ep_abort, **FAR_LIBRARY)


def bind_abort(num_ranks: int, remote: int = 0):
    """The abort kernel's launcher for ``num_ranks`` ranks (compiled on first use)."""
    from .workspace import NUM_FP_SETS
    return ABORT.bind(num_warps=4, NUM_ROWS=2 * NUM_FP_SETS, NUM_FLAG_SETS=sync.NUM_FLAG_SETS,
                      R_P2=1 << (num_ranks - 1).bit_length(), BLOCK_L=128, REMOTE=remote)


def launch_abort(ws, state, experts_seen, argument: str, device, remote: int = 0, ranks_per_node: int = 0,
                 board: Tuple[int, int] = (0, 0)) -> None:
    """Launch :func:`ep_abort` on the current stream over workspace ``ws`` (workspace.py) for a
    rejected ``argument``: every fingerprint row, flag word and low-latency count word (of the
    expert counts ``experts_seen`` used so far) this rank owns, on every peer. ``remote`` and
    ``ranks_per_node``: how far peers are reached (gpu/reach/); ``board``: the call board's bases
    address and the aborted call's tag (call_board.py)."""
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
