"""Low-latency mode (decode) on the GPU layer: one launch per call or two, kernels beside their launches.

    low_latency_dispatch   ep_ll_dispatch   send messages + counts  ->  wait + pack
    low_latency_combine    ep_ll_combine    push rows + signal      ->  wait + reduce

A call runs the send phase, then the receive phase. Eagerly (``Tuning.ll_one_launch``'s auto) a
call without a hook runs both in one cooperative launch no larger than the GPU holds at once
(launch.py): all programs are resident, so the receive phase's spin cannot starve the send phase
it waits for. While a CUDA graph is captured, and with ``return_recv_hook=True`` (the call returns
after the send phase; ``hook()`` issues the receive phase), the phases are two launches.

Dispatch: the programs take the tokens in turn; each casts its token (FP8 fused) and stores one
message per top-k expert (no dedup) into the receiver's fixed ``[E_local][R][M]`` slots — slot
from a per-expert atomic counter. The program arriving last publishes, for every expert,
``(epoch << 32) | messages`` into the count word of the expert's rank with a release; no separate
signal. The receive phase acquires the count words of its experts (a word carrying this call's
epoch means "all messages are there") and packs the rows of each (expert, source) into ``recv_x``
in source order.

Combine: the programs take the (local expert l, source s) pairs in turn and store the rows of l
that came from s into slot ``token * K + k`` of s's combine area; the last program releases the
epoch into every live peer's flag. The home acquires the flags and takes ``Σ_k w_k · slot(t, k)``
in float32.

Halves alternate per call kind (dispatch, combine), so at most two results may be held at once;
epochs live in device memory, so captured CUDA graphs replay correctly. A peer that does not
answer within the timeout is masked (``low_latency_query_mask_buffer`` shows it) and the call
completes without it. Ordering: see :mod:`.sync`.

Peers on other nodes (``REMOTE``, a multi-node backend: nodes of ``ranks_per_node`` consecutive
ranks). A rank's stores reach only its own node; everything for a rank of another node is built
in this rank's staging area (workspace.py) and sent there by ``far_send_bytes`` (gpu/reach/modes.py,
the one place that knows how). Each sending program completes its sends (``far_complete``) before
it arrives, so the program arriving last has every byte of the call delivered when it SETs the
count words / flags of the far peers (``release_words``) — the same release step, over the
network. The receive phases read only their own memory and are unchanged.
"""
from .combine import COMBINE
from .dispatch import DISPATCH
from .mode import LowLatencyMode, LowLatencyState

__all__ = ["LowLatencyMode", "LowLatencyState", "DISPATCH", "COMBINE"]
