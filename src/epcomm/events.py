"""EventOverlap and the communication-stream discipline shared by all backends.

On CUDA every dispatch/combine runs on the buffer's communication stream: it first waits for
``previous_event`` (or the caller's current stream), then works, then either makes the caller's
stream wait (synchronous call) or hands back an event (``async_finish=True``). Tensors crossing
streams are kept alive with ``record_stream``. On CPU there are no streams: work completes inside
the call and the returned :class:`EventOverlap` is already complete.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch


class EventHandle:
    """A capture of the current CUDA stream's progress (DeepEP's ``deep_ep.utils.EventHandle``).

    ``EventHandle()`` records an event on the current stream of the current device; on a machine
    without CUDA there is nothing to wait for and it is complete. ``EventOverlap(EventHandle())``
    is what Megatron-Core passes as ``previous_event``.
    """

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the captured point (no-op without CUDA)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def _cuda_event(event):
    """The ``torch.cuda.Event`` behind an EventOverlap's ``event`` (an EventHandle's), or None."""
    return event.event if isinstance(event, EventHandle) else event


class EventOverlap:
    """A handle on work that may still be running on the communication stream.

    Args:
        event: a ``torch.cuda.Event`` or :class:`EventHandle` recorded after the work, or ``None``
            when the work is done.
        extra_tensors: tensors to keep alive until the event is waited on.

    ``with event: ...`` runs the block and then makes the current stream wait for the event, so
    computation can overlap communication (DeepEP's idiom).
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[tuple] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the caller's current CUDA stream wait for the work (no-op on CPU)."""
        event = _cuda_event(self.event)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def synchronize(self) -> None:
        """Block the host until the work is done."""
        event = _cuda_event(self.event)
        if event is not None:
            event.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.current_stream_wait()
        return False


class StreamScope:
    """Runs a block of backend work on ``comm_stream`` with DeepEP's ordering rules.

    Usage::

        with StreamScope(comm_stream, previous_event, async_finish) as scope:
            ...work...
            scope.keep(outputs...)   # outputs consumed on the caller's stream
        event = scope.event_overlap()
    """

    def __init__(self, comm_stream, previous_event: Optional[EventOverlap], async_finish: bool,
                 inputs: Iterable = ()):
        # A synchronous call with no previous_event runs on the caller's stream: the same ordering
        # as hopping to the comm stream and back (the caller waits for the result either way),
        # without the host cost of two cross-stream waits and per-tensor record_stream.
        self.inline = comm_stream is None or (not async_finish and previous_event is None)
        self.comm_stream = comm_stream
        self.previous_event = previous_event
        self.async_finish = async_finish
        self._inputs = inputs
        self.outputs: list = []
        self._event = None
        self._stack = None

    def __enter__(self):
        if self.inline:
            return self
        self.inputs = [t for t in self._inputs if isinstance(t, torch.Tensor)]
        self._stack = contextlib.ExitStack()
        self.caller_stream = torch.cuda.current_stream()
        previous = _cuda_event(self.previous_event.event) if self.previous_event is not None else None
        if previous is not None:
            self.comm_stream.wait_event(previous)
        else:
            self.comm_stream.wait_stream(self.caller_stream)
        self._stack.enter_context(torch.cuda.stream(self.comm_stream))
        return self

    def keep(self, *tensors) -> None:
        """Register outputs that the caller will read on its own stream."""
        if self.inline:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.outputs.append(t)
            elif isinstance(t, (tuple, list)):
                self.keep(*t)

    def __exit__(self, exc_type, exc, tb):
        if self.inline:
            return False
        self._stack.close()
        if exc_type is not None:
            return False
        # Outputs were allocated on the comm stream; the caller's stream will use them too.
        for t in self.outputs:
            if t.is_cuda:
                t.record_stream(self.caller_stream)
        if self.async_finish:
            # Inputs may be freed by the caller while the comm stream still reads them.
            for t in self.inputs:
                if t.is_cuda:
                    t.record_stream(self.comm_stream)
            self._event = torch.cuda.Event()
            self._event.record(self.comm_stream)
        else:
            self.caller_stream.wait_stream(self.comm_stream)
        return False

    def event_overlap(self) -> EventOverlap:
        if self._event is None:
            return EventOverlap(None)
        return EventOverlap(self._event, tuple(self.inputs + self.outputs))


def capture_event(device: torch.device) -> EventOverlap:
    """An event recorded on the current stream (``Buffer.capture``); a done event on CPU."""
    if device.type != "cuda":
        return EventOverlap(None)
    return EventOverlap(EventHandle().event)
