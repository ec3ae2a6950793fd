"""The host mailbox: pinned, device-mapped words that kernels write and the host reads without a
stream synchronisation — reports (disagreements, late peers, dropped ids) and the receive counts a
full dispatch publishes. Kernels find its parts with :func:`sync.mailbox_words`."""
from __future__ import annotations

import time

import numpy as np
import torch
import triton
import triton.language as tl

from ...errors import EPError, EPInputError, EPTimeoutError
from . import agreement
from .launch import KernelSpec
from .sync import DOORBELL_WORDS, store_release_sys

SPIN_S = 200e-6  # host polls of the mailbox spin this long before they yield the GIL (wait_notify)

class HostMailbox:
    """Pinned, device-mapped int64 words written by kernels and read by the host, no stream sync.

    Layout (word index; kernels find the parts with :func:`mailbox_words`)::

        0                 pending: nonzero once anything below was raised
        1 .. R            timeouts: word 1 + p set when a wait for peer p gave up
        R + 1             dropped input: count of expert ids outside [-1, num_experts)
        R + 2 ..          agreement: [R + 1][2] fingerprints of the ranks whose call differed
                          (pair R: this rank's own), see agreement.py
        3R + 4            notify sequence number (written last, with a release)
        3R + 5, 3R + 6    notify: rows this rank receives, most tokens any rank sends
        3R + 7 ..         notify: per-local-expert receive counts (aligned)
        D = 3R + 7 + L    the doorbell (written by the host, read by an overlapped full dispatch;
                          :meth:`ring`): D the tag, D + 1 .. D + 6 the rows received and the
                          outputs' addresses, D + 7 written by the device (a launch that stopped waiting)
    """

    def __init__(self, num_ranks: int, max_local_experts: int, pinned: bool = True):
        self.num_ranks = R = num_ranks
        self.max_local_experts = max_local_experts
        # pinned=False only for tests of the host logic on machines without CUDA
        self._doorbell = 3 * R + 7 + max_local_experts
        self.words = torch.zeros(self._doorbell + DOORBELL_WORDS, dtype=torch.int64, device="cpu",
                                 pin_memory=pinned)  # host memory whatever the default device
        self.view = self.words.numpy()
        self.address = self.words.data_ptr()
        self._agreement = R + 2
        self._notify = 3 * R + 4
        self.notify_address = self.address + 8 * self._notify
        self.doorbell_address = self.address + 8 * self._doorbell
        self.sequence = 0  # notify sequence numbers handed out
        # Set when this rank raised EPInputError for a disagreement or aborted a call: the ranks'
        # signals are out of step until the backend's resync (collective), at the next call.
        self.resync_needed = False

    def clear(self) -> None:
        """Forget every report and start the notify sequence again (resync: no kernel runs)."""
        self.view[:] = 0
        self.sequence = 0
        self.resync_needed = False

    def raise_pending(self, rank: int, timeout_s: float) -> None:
        """Raise what kernels reported since the last call (cheap: a few host-memory reads). The
        agreement words are read even without the pending word: a record may land while this
        clears the word below, or its pending store land after the host looked."""
        if self.view[0] == 0:
            self.raise_disagreement()  # (nothing recorded: two word reads)
            return
        self.raise_disagreement()
        timeouts = self.view[1:1 + self.num_ranks]
        if timeouts.any():  # sticky: this buffer's peers can no longer be trusted to be in step
            peers = np.nonzero(timeouts)[0].tolist()
            raise EPTimeoutError(f"rank {rank}: a wait for peers exceeded {timeout_s:g} s; destroy this Buffer "
                                 f"and create a new one", peers)
        dropped = int(self.view[self.num_ranks + 1])
        self.view[self.num_ranks + 1] = 0
        self.view[0] = 0
        if dropped:
            raise EPInputError("topk_idx", f"an earlier call held {dropped} expert ids outside [-1, num_experts); "
                                           f"those entries were dropped")

    def raise_disagreement(self) -> None:
        """Raise EPInputError for a disagreement kernels recorded (ranks in different calls, or
        with different arguments), and mark the signals out of step until the resync. (Every call
        asks it of each other Buffer of the group, call_board.py: the usual answer, nothing
        recorded, is two word reads; numpy's slice and ``any`` cost about 2.5 µs.)"""
        own = self._agreement + 2 * self.num_ranks  # pair R: this rank's own words, set by every record
        if self.view[own] == 0 and self.view[own + 1] == 0:
            return
        pairs = self.view[self._agreement:self._agreement + 2 * (self.num_ranks + 1)].reshape(-1, 2)
        if pairs[self.num_ranks].any():  # until the resync: the ranks' signals are out of step
            posted = {r: (int(w0), int(w1)) for r, (w0, w1) in enumerate(pairs[:self.num_ranks]) if w0 or w1}
            self.resync_needed = True
            agreement.raise_disagreement(posted, (int(pairs[-1, 0]), int(pairs[-1, 1])), self.num_ranks)

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence

    def wait_notify(self, sequence: int, rank: int, timeout_s: float):
        """Poll until the notify kernel published ``sequence``; returns ``(num_recv, max_tokens,
        per_expert_view)``. Bounded: raises EPTimeoutError after ``timeout_s`` (+1 s, so the
        device-side waits, which name the peers, give up first). The first ``SPIN_S`` it spins; after
        that each poll yields the GIL (``time.sleep(0)``): a spinning thread keeps it for the
        interpreter's switch interval (5 ms) each time another thread needs it, which would stall
        every other Python thread of the process — ranks run as threads of one process in the one-GPU
        tests.
        While it waits it also watches the pending word: a disagreement or a late peer that an
        earlier kernel of the call recorded raises at once (the count exchange may never finish
        then), naming the argument or the peers."""
        view, index = self.view, self._notify
        if view[index] != sequence:
            now = time.monotonic()
            spin_until, deadline = now + SPIN_S, now + timeout_s + 1.0
            while view[index] != sequence:
                now = time.monotonic()
                if now > spin_until:
                    time.sleep(0)
                    if view[0] != 0:  # a kernel of this call already reported (a disagreement, a late peer)
                        self.raise_pending(rank, timeout_s)
                    if now > deadline:
                        self.raise_pending(rank, timeout_s)  # names the late peers if a wait flagged them
                        raise EPTimeoutError(f"rank {rank}: the count exchange did not finish within {timeout_s:g} s "
                                             f"(the GPU may be stuck on earlier work)", [])
        self.raise_pending(rank, timeout_s)
        return int(view[index + 1]), int(view[index + 2]), view[index + 3:]

    def ring(self, sequence: int, rank: int, timeout_s: float, num_rows: int = 0, addresses: tuple = ()) -> None:
        """Ring the doorbell of the full dispatch of ``sequence``, whose launch is already waiting
        (one_node/dispatch.py, ep_dispatch with DOORBELL): with ``addresses`` (recv_x, recv_scales,
        recv_topk, recv_weights, recv_src_idx: int byte addresses) its pull programs go on and pull
        ``num_rows`` rows into them; without, they stand down (the host pulls in turn, or raises).
        The words first, then the tag (x86 keeps stores in order; the device's read of the tag is an
        acquire). Then the device's word: a launch that stopped waiting before the tag landed wrote
        ``sequence`` there first, so a go it missed raises here instead of returning rows nobody
        wrote. (Python cannot fence between the tag's store and that load; the window is the store
        buffer's drain, nanoseconds after a stall of 2 x ``timeout_s``.)"""
        view, index = self.view, self._doorbell
        if addresses:
            view[index + 1:index + 2 + len(addresses)] = (num_rows,) + addresses
        view[index] = 2 * sequence + (1 if addresses else 0)
        if addresses and view[index + DOORBELL_WORDS - 1] == sequence:
            raise EPTimeoutError(f"rank {rank}: the dispatch waited more than {2 * timeout_s:g} s for this process "
                                 f"to allocate its outputs (the host thread stalled, e.g. in the caching "
                                 f"allocator freeing memory); its outputs were not written")


def check_host_mapping(mailbox: HostMailbox, device: torch.device) -> None:
    """Fail clearly (instead of hanging later) if pinned memory is not device-mapped here."""
    probe = torch.tensor([0], dtype=torch.int64, device=device)
    try:
        _probe_kernel.bind(num_warps=1).launch(1, 1, torch._C._cuda_getCurrentRawStream(device.index),
                                               mailbox.notify_address, probe)
        torch.cuda.synchronize(device)
    except Exception as exc:  # pragma: no cover - depends on the machine
        raise EPError(f"the GPU backends need device-mapped pinned host memory: {exc}") from exc
    if mailbox.view[mailbox._notify] != -7 or int(probe.item()) != 1:
        raise EPError("the GPU backends need device-mapped pinned host memory (unified addressing)")
    mailbox.view[mailbox._notify] = 0


@triton.jit
def _probe_host_store(host_word_address: "i64", done_ptr: "*i64"):
    store_release_sys(host_word_address, tl.full([], -7, tl.int64))
    tl.store(done_ptr, 1)


_probe_kernel = KernelSpec(_probe_host_store)
