"""The HTTP layer's defences: an ASGI middleware in front of the application, and uvicorn's protocol.

:class:`Guard` answers, before any route (redirects included): a ``Host`` that is not one of the
server's names with 400 (a page elsewhere cannot reach a key-less server on loopback through DNS
rebinding); a body over the limit with 413 (from its ``Content-Length``, before reading it); a body
that has not arrived within the read timeout with 408. Every response says ``nosniff``.

:func:`uvicorn_config` runs uvicorn on :class:`GuardedH11Protocol`: a request head over
:data:`MAX_HEADER_BYTES` gets 431, a connection whose request head has not arrived within the read
timeout gets 408 (or, if it sent nothing, is closed), and uvicorn's own answers to malformed HTTP
are OpenAI JSON rather than plain text.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any, Awaitable, Callable, Protocol, Sequence

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.server.errors import APIError, too_large, too_slow

MAX_BODY_BYTES = 4 << 20  # a context's worth of text, JSON-escaped, with room to spare
MAX_HEADER_BYTES = 32 << 10  # the request line and headers together
READ_TIMEOUT_SECONDS = 30.0  # default seconds for a request's headers to arrive, and again for its body
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
ANY_ADDRESS = ("0.0.0.0", "::", "")
LINGER_SECONDS = 2.0  # after an error answer, how long to read and drop what the client still sends

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def allowed_hosts(bind: str, extra: str | Sequence[str] = "") -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``bind`` answers, with ``extra`` (comma-separated;
    ``*`` allows any); None where any is allowed (a server bound to every address)."""
    names = [n.strip() for n in (extra.split(",") if isinstance(extra, str) else extra) if n.strip()]
    if "*" in names or bind in ANY_ADDRESS:
        return None
    own = {*LOOPBACK_HOSTS, _host(bind)} if _is_loopback(bind) else {_host(bind)}
    return frozenset({*own, *map(_host, names)})


def host_name(header: str) -> str:
    """The name in a ``Host`` header, lower-case and without its port (``[::1]:8000`` -> ``[::1]``)."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def _host(name: str) -> str:
    name = name.strip().lower()
    return f"[{name}]" if name.count(":") > 1 and not name.startswith("[") else host_name(name)


def _is_loopback(bind: str) -> bool:
    try:
        return bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware: the Host check, the body's size limit and read timeout, ``nosniff``."""

    def __init__(self, app: Any, *, hosts: frozenset[str] | None, max_body_bytes: int, read_timeout: float) -> None:
        self.app, self.hosts = app, hosts
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _nosniff(send)
        host = _header(scope, b"host")
        if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
            await _answer(send, APIError(400, "the Host header names a host this server does not answer to; "
                                              "add it with --allowed-hosts", code="invalid_host"))
            return
        try:
            body = await self._body(scope, receive)
        except APIError as err:
            await _answer(send, err, close=True)
            return
        if body is not None:  # None: the client left
            await self.app(scope, _replay(body, receive), send)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large(self.max_body_bytes)
        try:
            return await asyncio.wait_for(self._read(receive), self.read_timeout)
        except asyncio.TimeoutError:
            raise too_slow("body", self.read_timeout) from None

    async def _read(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _nosniff(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-content-type-options", b"nosniff")]}
        await send(message)

    return sending


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read handed out first."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receiving() -> Message:
        return pending.pop() if pending else await receive()

    return receiving


async def _answer(send: Send, err: APIError, close: bool = False) -> None:
    body = err.json()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *([(b"connection", b"close")] if close else [])]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ------------------------------------------------------------------------------------------------
# uvicorn


class Timeouts(Protocol):
    """What :func:`uvicorn_config` reads of the server's options (a
    :class:`~specdec.server.app.ServerOptions`)."""

    read_timeout: float


def uvicorn_config(app: Any, options: Timeouts, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: :class:`GuardedH11Protocol` with the options' read
    timeout. ``kwargs`` go to uvicorn."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": options.read_timeout})
    return uvicorn.Config(app, http=protocol, h11_max_incomplete_event_size=MAX_HEADER_BYTES + 4, **kwargs)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and JSON protocol errors.

    The head's clock starts when the connection opens and again when a response completes
    (a kept-alive connection's next request); uvicorn's own keep-alive timer stops at the first
    byte, so a client sending one byte at a time would otherwise hold the connection for ever.
    """

    read_timeout = READ_TIMEOUT_SECONDS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._closing:  # after an error answer, what the client still sends is dropped
            super().data_received(data)

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_long():
            self._refuse(APIError(431, f"the request line and headers are over {MAX_HEADER_BYTES} bytes",
                                  code="headers_too_large"))
            return
        super().handle_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def send_400_response(self, msg: str) -> None:
        self._refuse(APIError(400, "the request is not valid HTTP/1.1 (its request line, a header or its "
                                   "Content-Length is malformed)", code="invalid_http"))

    def _head_too_long(self) -> bool:
        """Whether the request head received so far, complete or not, is over the limit (h11's own
        limit holds for an incomplete head only)."""
        pending = self.conn.trailing_data[0]
        end = pending.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4)
        return (end if end >= 0 else len(pending)) > MAX_HEADER_BYTES

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.read_timeout, self._head_overdue)

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # the head arrived in time
        if self.conn.trailing_data[0]:
            self._refuse(too_slow("headers", self.read_timeout))
        else:
            self.transport.close()

    def _refuse(self, err: APIError) -> None:
        """Answer ``err`` and close, reading and dropping for a while first: closing with unread
        data would reset the connection and could lose the answer on the client's side."""
        body = err.json()
        headers = [("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close")]
        try:
            for event in (h11.Response(status_code=err.status, headers=headers), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response is already under way
            pass
        self._closing = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)
