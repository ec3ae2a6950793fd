"""The order in which a rank's programs visit its peers: DESIGN's scale rule (at every moment each
GPU's links carry traffic to or from all its peers). The low-latency kernels walk their items
(gpu/low_latency: experts, homes) and the two-level mode its NVLink hops (gpu/normal/two_level)
in this order; the one-node normal mode's pull rotates its sources per round the same way
(gpu/normal/one_node/schedule.py)."""
from __future__ import annotations

import triton
import triton.language as tl  # noqa: F401 (Triton's interpreter looks for it in a jit function's module)


@triton.jit
def peer_after(i, me, n):
    """The ``i``-th of ``n`` peers in a walk that starts on the one after ``me``: ``(me + 1 + i) % n``.
    For each ``me`` it is a bijection of ``0..n-1``, and at each ``i`` the ``n`` values of ``me``
    give ``n`` different peers: where every rank took peer ``i`` at step ``i`` (a rank-order
    walk), all of them loaded one GPU's links at once while the others idled."""
    return (me + 1 + i) % n
