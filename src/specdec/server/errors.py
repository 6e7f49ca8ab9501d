"""The server's errors, answered as OpenAI's API answers them: ``{"error": {"message", "type", "param", "code"}}``.

:class:`APIError` is the one error type: every check of a request raises it, with its HTTP status,
and every handler answers it as its :meth:`~APIError.json` body. The functions below build the
errors that more than one part of the server gives (a body over the size limit, a request past its
deadline), and turn what the web framework refuses (a body pydantic could not read, an unknown
route, an unexpected exception) into one, and :func:`engine_error` answers what the serving
engine ends a request with. :func:`outcome` names an answered error for the ``/metrics`` counters.

This module imports no web framework: the handlers that call it are in :mod:`specdec.server.app`,
the middleware in :mod:`specdec.server.guard`.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Sequence

from specdec.serving import errors as engine


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The body as JSON in ASCII (a lone surrogate named in it stays an escape)."""
        return json.dumps(self.body()).encode()


def outcome(err: APIError) -> str:
    """The ``outcome`` label of an answered error in the server's request counter."""
    return {401: "unauthorized", 404: "not_found", 429: "queue_full", 504: "timeout"}.get(
        err.status, "bad_request" if err.status < 500 else "error")


def too_large(limit: int) -> APIError:
    """A request body over ``limit`` bytes (413)."""
    return APIError(413, f"the request body is over this server's limit of {limit} bytes (its --max-body-bytes)",
                    code="body_too_large")


def too_slow(what: str, seconds: float) -> APIError:
    """A request's ``what`` (``"headers"``, ``"body"``) that has not arrived within ``seconds`` (408)."""
    return APIError(408, f"the request {what} did not arrive within {seconds:g} s (the server's --read-timeout)",
                    code="timeout")


def timed_out() -> APIError:
    """A request that ran past its deadline, waiting or generating (504)."""
    return APIError(504, "the request ran past the server's --request-timeout", code="timeout", type="timeout_error")


def internal_error() -> APIError:
    """An exception no check expected (500); what it was goes to the server's log, not the client."""
    return APIError(500, "the server failed on this request; see its log")


def model_failed(source: str, position: int) -> APIError:
    """A model that computed what no token can be drawn from (non-finite logits after ``position``
    tokens: damaged weights in the file ``source``), named by the file's name alone (503, code
    ``model_error``: the server cannot serve this model, and no request of the client's is to
    blame; not a 500, which says the server itself failed): this request fails, the server serves on."""
    name = source.replace("\\", "/").rsplit("/", 1)[-1]
    return APIError(503, f"the model ({name}) computed non-finite logits (NaN or infinity) after {position} tokens: "
                         "its weights are likely damaged; the server's log names the file", code="model_error")


def engine_error(err: engine.EngineError, method: Any) -> APIError:
    """The answer to an error the serving engine ended a request with; ``method``: the request's
    method, as its ``speculative.method`` named it."""
    if isinstance(err, engine.MethodRefused):
        return APIError(400, f"speculative.method: {method}: {err.message}", param="speculative.method")
    if isinstance(err, engine.ConstraintFailed):
        return APIError(400, err.message, param=err.field)
    if isinstance(err, engine.BadInput):
        return APIError(400, err.message)
    if isinstance(err, engine.ModelFailed):
        return model_failed(err.source, err.position)
    if isinstance(err, engine.TimedOut):
        return timed_out()
    if isinstance(err, engine.ShuttingDown):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(err, engine.QueueFull):  # a cluster's replica's queue (a local engine's is answered at submit)
        return APIError(429, f"{err.message}; retry later", code="queue_full", type="rate_limit_error",
                        headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, engine.Unavailable):
        return APIError(503, err.message, code="unavailable", headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, engine.Cancelled):
        return APIError(503, "the request was stopped", code="cancelled")
    return APIError(500, err.message)


def route_error(status: int, detail: str, method: str, path: str) -> APIError:
    """The framework's own HTTP error for ``method path``: no such route (404), a method the route
    does not take (405), or another status with its ``detail``."""
    message = {404: f"no such endpoint: {method} {path}",
               405: f"{method} is not allowed on {path}"}.get(status, detail)
    return APIError(status, message, code="not_found" if status == 404 else None)


def validation_error(problems: Sequence[dict[str, Any]], body: Any = None) -> APIError:
    """pydantic's problems with a request body (a ``ValidationError``'s or ``RequestValidationError``'s
    ``errors()``, at least one): an unknown field first of all, else the first field's problem that
    reached deepest into its value (where a union's members each failed, the member the value
    resembles), as a 400 naming the field (``messages.0.role``), as the request spells it where ``body`` (the body's pydantic model) is
    given (:func:`field_path`)."""
    first = next((e for e in problems if e.get("type") == "extra_forbidden"), None)
    if first is None:  # of the first field's problems (one per member of a union), the one that got deepest
        field = tuple(problems[0].get("loc", ()))[:1]
        first = max((e for e in problems if tuple(e.get("loc", ()))[:1] == field), key=lambda e: len(e.get("loc", ())))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    loc = [str(p) for p in (field_path(body, loc) if body is not None else loc)]
    param = ".".join(loc) or None
    kind, message = first.get("type", ""), str(first.get("msg", "invalid value"))
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", param=None)
    if kind == "missing" and not loc:
        return APIError(400, "the request needs a JSON object body", param=None)
    if kind == "string_unicode":  # a field name pydantic cannot read
        return APIError(400, "a field name holds a lone surrogate: text must be valid Unicode (a UTF-16 surrogate "
                             "needs its pair)", param=param)
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unknown field; this server does not support it", param=param,
                        code="unsupported_field")
    if not loc and kind.endswith("_type"):
        return APIError(400, "the request body must be a JSON object", param=None)
    if kind in ("model_type", "model_attributes_type"):
        return APIError(400, f"{param} must be a JSON object", param=param)
    message = message.removeprefix("Value error, ")
    return APIError(400, message if param and message.startswith(param) else f"{param}: {message}", param=param)


def field_path(model: Any, loc: Sequence[Any]) -> list[Any]:
    """A pydantic error's ``loc`` within ``model`` (a pydantic model class) as a request spells the
    field: pydantic adds, after a field whose type is a union, a tag naming the member it tried
    (``dict[str,any]``, ``literal['none','auto','required']``, a model's class name), which is no
    part of the request; those are dropped. Parts past a type this cannot follow are kept as they are."""
    path: list[Any] = []
    kind: Any = model
    parts = list(loc)
    while parts:
        members = _members(kind)
        if len(members) > 1:  # a union: the next part is pydantic's tag for the member it tried
            tag = parts.pop(0)
            kind = next((m for m in members if getattr(m, "__name__", None) == tag), None)
            continue
        kind, part = (members[0] if members else None), parts.pop(0)
        path.append(part)
        kind = _child(kind, part)
    return path


def _members(kind: Any) -> list[Any]:
    """A union's members other than None (pydantic reads ``X | None`` as X, nullable); [kind] else."""
    if kind is None:
        return []
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [m for m in typing.get_args(kind) if m is not type(None)]
    return [kind]


def _child(kind: Any, part: Any) -> Any:
    """The type of ``part`` of a value of type ``kind`` (a model's field by name or alias, a list's
    item, a dict's value); None where unknown."""
    fields = getattr(kind, "model_fields", None)
    if isinstance(fields, dict):
        found = next((f for name, f in fields.items() if part in (name, f.alias)), None)
        return found.annotation if found is not None else None
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None
