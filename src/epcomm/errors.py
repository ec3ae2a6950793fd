"""Exceptions raised by epcomm.

Every error that epcomm raises on purpose derives from :class:`EPError`, so callers can catch the
library's failures in one place while still telling bad input apart from a failed exchange.
"""


class EPError(RuntimeError):
    """A dispatch/combine could not be carried out (wrong buffer state, backend failure)."""


class EPInputError(EPError, ValueError):
    """An argument of a public call is invalid.

    Raised before any communication starts on the rejecting rank; its peers raise it too (the
    call's fingerprint or an abort tells them). The message names the argument (``argument`` holds
    it as well). On the reference backend the buffer stays usable: every rank raised in the same
    call, and the next call pairs. On the GPU backends (nvlink, nvshmem), after ranks disagreed or
    one rejected its input, the buffer still raises on every later call: make a new one (README,
    "the recovery rule").
    """

    def __init__(self, argument: str, message: str):
        self.argument = argument
        super().__init__(f"{argument}: {message}")


class EPTimeoutError(EPError, TimeoutError):
    """A wait for peers exceeded the configured timeout.

    ``peers`` lists the ranks that had not answered when the wait gave up.
    """

    def __init__(self, message: str, peers=()):
        self.peers = sorted(int(p) for p in peers)
        if self.peers:
            message = f"{message} (waited for ranks {self.peers})"
        super().__init__(message)
