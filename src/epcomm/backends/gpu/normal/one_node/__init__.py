"""Normal mode on one node (the one-node backend): every peer reached by stores; kernels and their launches.

Launches per call (one cross-rank barrier per launch pair, halves alternate by barrier epoch)::

    get_dispatch_layout   ep_dispatch_layout                          1 launch
    dispatch (full)       ep_dispatch_notify_stage ; [host polls the mailbox] ; ep_dispatch_pull
                          (notify_with_stage off, or past 4 x num_sms waiting programs, notify_stage_fits:
                          ep_notify_dispatch ; ep_dispatch_stage ; ...; doorbell_dispatch:
                          ep_notify_dispatch ; ep_dispatch, its pull waiting for the doorbell ; [host
                          polls, allocates, rings])
    dispatch (num_worst)  ep_dispatch with its count exchange (NOTIFY)   1 launch; past notify_stage_fits'
                          bound or notify_with_stage off: ep_notify_dispatch ; ep_dispatch; where one
                          launch does not fit (expert-major): as a full dispatch in turn, without the wait
    dispatch (cached)     ep_dispatch (stage and pull overlapped)     1 launch
                          ep_dispatch_stage ; ep_dispatch_pull        2 launches: several rounds, expert-major
    combine               ep_combine (push and reduce overlapped)     1 launch
                          ep_combine_push ; ep_combine_reduce         2 launches: several rounds, expert-major
    (a batch larger than one half of the payload area repeats stage/pull or push/reduce per round)

Dispatch is "stage and pull": each rank copies its tokens (x, scales, top-k) into its own
workspace half at HBM speed and writes, for each destination, the ascending list of tokens it
sends there; then every receiver pulls its rows straight from the sources into ``recv_x``, at
rank-prefix offsets (rows grouped by source in rank order, source token order within). Combine is
"push and reduce": each rank stores every received row into slot ``(token, own rank)`` of the
token's home, and the home sums the slots present in ``is_token_in_rank`` in float32. The pull and
the push take their rows in blocks of one peer, every peer at once (schedule.py: DESIGN's scale
rule), not in rank order.

Ordering follows the contract in :mod:`...sync`: every kernel that writes for peers ends with an
arrival and a release of the next epoch; every kernel that reads peers' data begins with the
acquire-wait. The host never synchronises the stream: the one host wait of a full dispatch polls
the mailbox word the notify kernel publishes.
"""
from ..layout_kernel import LAYOUT
from .combine import PUSH, PUSH_REDUCE, REDUCE
from .dispatch import PULL, STAGE_PULL
from .stage import STAGE
from .mode import NormalMode
from .notify import NOTIFY, NOTIFY_STAGE

__all__ = ["NormalMode", "LAYOUT", "NOTIFY", "NOTIFY_STAGE", "STAGE", "PULL", "STAGE_PULL", "PUSH", "REDUCE",
           "PUSH_REDUCE"]
