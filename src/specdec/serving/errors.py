"""The engine's errors: what a request's generation ends with, or why it was not taken.

Each is an :class:`EngineError` with a message and, where a front end needs them, details as
attributes. They pickle (a cluster hands them between processes) and name no protocol: the HTTP
server maps them to its answers (:mod:`specdec.server.app`).
"""

from __future__ import annotations


class EngineError(Exception):
    """An error of the serving engine: ``message``, and keyword ``details`` kept as attributes."""

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.__dict__.update(details)


class QueueFull(EngineError):
    """``max_queue`` requests wait already; ``retry_after``: whole seconds for those ahead to finish."""

    retry_after: int = 1


class ShuttingDown(EngineError):
    """The engine is closing: no new request is taken, and those waiting are dropped."""


class BadInput(EngineError):
    """The library refused the request's input as its generation was built (a ``ValueError`` or
    ``TypeError``: a prompt longer than the context, a bad value)."""


class MethodRefused(EngineError):
    """The decoding method cannot be built for these models (:class:`specdec.api.MethodError`);
    ``method``: the method, in the text form."""

    method: str = ""


class ConstraintFailed(EngineError):
    """The request's grammar went past the grammar engine's limits as the output grew: ``field``
    the constraint's field, ``tokens`` how many tokens had been generated."""

    field: str | None = None
    tokens: int = 0


class ModelFailed(EngineError):
    """The model computed non-finite logits (damaged weights): ``source`` its file, after
    ``position`` tokens. This request fails; the engine serves on."""

    source: str = ""
    position: int = 0


class TimedOut(EngineError):
    """The request ran past its time allowed (``Work.timeout``), waiting or generating."""


class Cancelled(EngineError):
    """The request was stopped (its handle's ``stop``, or its consumer went away)."""


class Failed(EngineError):
    """A fault no check expected; the engine's log says what it was."""


class Unavailable(EngineError):
    """The engine that ran the request is gone (a cluster's replica was lost) and the request could
    not be sent again; ``retry_after``: whole seconds before another engine is likely to take it."""

    retry_after: int = 1
