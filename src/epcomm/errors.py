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
    it as well). The buffer stays usable: the next call pairs (on the GPU backends every rank
    that raised first resyncs with its peers there; docs/ERRORS.md, the recovery rule).
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
        if self.peers and str(self.peers) not in message:  # said once, whether or not the message names them
            message = f"{message} (waited for ranks {self.peers})"
        super().__init__(message)
