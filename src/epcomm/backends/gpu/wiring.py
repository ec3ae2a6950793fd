"""What both GPU backends wire the same way, so each backend module holds only what differs (its
workspace, how a peer is reached, its abort): the group's call board (pending reports, the group
resync) and the calls handed on to the normal mode (``self.normal``: one_node.NormalMode or
two_level.TwoLevelMode) and the low-latency mode (:meth:`GpuBackend._low_latency`)."""
from __future__ import annotations

from ..base import Backend, DispatchArgs, DispatchResult
from .launch import stream_capturing
from .shared_grids import GridCaps, grid_caps, sharing


class GpuBackend(Backend):
    """A backend over the GPU layer. A subclass sets, in its constructor:

    - ``seat``: its place on the group's call board (:func:`call_board.join`);
    - ``normal``: its normal mode, which checks and makes dispatch and combine;
    - ``low_latency``: its :class:`LowLatencyMode`, or None (then :meth:`_low_latency` says why);
    - the caps of its grids, from :meth:`share_gpu` (before it makes the modes).
    """

    # ------------------------------------------------------------------ ranks sharing a GPU
    def share_gpu(self, places, backend: str, ll_receive_programs: int = 0) -> GridCaps:
        """The caps of every call's grids (shared_grids.py) for this group's ``places`` (every
        rank's ``(host, GPU, SMs)``, shared_grids.gpu_places): where ranks share a GPU, normal mode's
        SMs (``max_num_sms``, which Buffer applies to every Config) and the low-latency send and
        receive programs are capped so that all ranks' grids fit at once with room for a late
        sender. ``ll_receive_programs`` (the Buffer's ``Tuning``; 0: none) wins where smaller."""
        ranks_on_gpu, device_sms = sharing(places)
        caps = grid_caps(device_sms, ranks_on_gpu, backend, ll_receive_programs)
        self.max_num_sms = caps.num_sms
        self.caps = caps
        return caps

    # ------------------------------------------------------------------ the group's call board
    def raise_pending(self) -> None:
        """Raise what kernels reported since the last call (disagreements, timeouts, dropped input),
        and a disagreement another Buffer of the group recorded (call_board.py)."""
        self.seat.board.raise_pending(self)

    @property
    def needs_resync(self) -> bool:
        return self.seat.board.needs_resync

    @property
    def resync_generation(self) -> int:
        return self.seat.board.generation

    def resync(self) -> None:
        """Collective over the group (every rank that raised calls it at its next call): every
        Buffer of the group starts again from zero signals (call_board.CallBoard.resync)."""
        self.seat.board.resync(self.device)

    # ------------------------------------------------------------------ normal mode
    def refuse_capture(self, kind: str, handle=None, num_worst_tokens: int = 0):
        """(Backend.refuse_capture.) A dispatch asks whether the stream is being captured (once a
        call: the one-node mode's call-board tag reads the answer from DispatchArgs), a combine only
        where the mode's epochs live on the host; a captured call goes to the mode's
        ``refuse_capture``: EPError where it would wait on the host, which a capture never runs
        (the wait would end in a timeout naming no real cause). Not an EPInputError, whose abort
        would go into the graph: every rank that captures the same step raises it alike."""
        if kind == "combine" and not self.normal.host_epochs:
            return None
        capturing = stream_capturing()
        if capturing:
            self.normal.refuse_capture(kind, handle, num_worst_tokens)
        return capturing

    def check_dispatch(self, args: DispatchArgs) -> None:
        self.normal.check_dispatch(args)

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        return self.normal.dispatch(args)

    def check_combine(self, x, handle, topk_weights, bias) -> None:
        self.normal.check_combine(x, handle, topk_weights, bias)

    def combine(self, x, handle, topk_weights, bias, config):
        return self.normal.combine(x, handle, topk_weights, bias, config)

    # ------------------------------------------------------------------ low-latency mode
    def _low_latency(self):
        """The low-latency mode, ready for a call (a subclass raises EPError where it is not)."""
        return self.low_latency

    def check_low_latency_dispatch(self, args) -> None:
        self._low_latency().check_dispatch(args)

    def check_low_latency_combine(self, args) -> None:
        self._low_latency().check_combine(args)

    def low_latency_dispatch(self, args):
        return self._low_latency().dispatch(args)

    def low_latency_combine(self, args):
        return self._low_latency().combine(args)
