"""One generation at a time: a bounded FIFO queue and the worker thread that owns the models.

A :class:`Job` is submitted from the event loop; the worker thread builds its token stream and
drives it one step (one target forward) at a time, posting each step back to the job's asyncio
queue. Between steps it checks whether the job was stopped (the client went away, or its time ran
out), so a stopped job runs at most the one step already under way.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from specdec.server.metrics import Metrics
from specdec.server.requests import APIError

log = logging.getLogger("specdec.server")


class QueueFull(Exception):
    pass


@dataclass
class Step:
    """What one generation step appended (a snapshot: the stream's stats keep changing)."""

    token_ids: list[int]
    text: str
    from_draft: list[bool]
    draft_chars: int  # the first draft_chars characters of text came from draft tokens
    drafted: int


@dataclass
class Job:
    """One request's generation. ``start`` (called on the worker thread) returns the token stream
    and raises ``ValueError`` for bad input; ``finish`` turns the token ids, the final text and the
    stats into the end summary."""

    start: Callable[[], Iterator[Any]]
    decode: Callable[[list[int]], str]
    finish: Callable[[list[int], str, Any], dict[str, Any]]
    deadline: float  # time.monotonic() by which the last token must be out
    loop: asyncio.AbstractEventLoop
    stop_strings: list[str] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    stopped: threading.Event = field(default_factory=threading.Event)
    steps: int = 0
    tokens: int = 0
    steps_at_stop: int | None = None
    outcome: str | None = None

    def stop(self) -> None:
        """Ask the worker to stop this job (at the end of the step under way)."""
        if not self.stopped.is_set():
            self.steps_at_stop = self.steps
            self.stopped.set()

    def post(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.stop()


class Scheduler:
    """At most ``max_queue`` jobs wait while one runs; ``submit`` raises :class:`QueueFull` beyond."""

    def __init__(self, max_queue: int, metrics: Metrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.history: collections.deque[Job] = collections.deque(maxlen=256)  # finished jobs, newest last
        self.durations: collections.deque[float] = collections.deque(maxlen=16)  # seconds of recent ok jobs
        self._waiting: collections.deque[Job] = collections.deque()
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="specdec-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.post("error", APIError(503, "the server is shutting down", code="shutting_down"))
            self._waiting.clear()
            self.metrics.queue_length.set(0)
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) + self._busy > self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self.metrics.queue_length.set(len(self._waiting))
            self._cond.notify()

    def retry_after(self) -> int:
        """Whole seconds (at least 1) for the jobs ahead, waiting and running, to finish at the
        recent mean time of a generation (1 s before any has finished)."""
        with self._cond:
            ahead = len(self._waiting) + self._busy
            mean = statistics.fmean(self.durations) if self.durations else 1.0
        return max(1, math.ceil(ahead * mean))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._busy = True
                self.metrics.queue_length.set(len(self._waiting))
            self.metrics.running.set(1)
            started = time.monotonic()
            try:
                self._run(job)
            finally:
                self.metrics.running.set(0)
                self.history.append(job)
                with self._cond:
                    self._busy = False
                    if job.outcome == "ok":
                        self.durations.append(time.monotonic() - started)

    def _run(self, job: Job) -> None:
        if job.stopped.is_set():
            job.outcome = "cancelled"
            return
        if time.monotonic() > job.deadline:
            job.outcome = "timeout"
            job.post("error", _timeout())
            return
        try:
            events = job.start()
        except (ValueError, TypeError) as err:  # the library's promise for bad input
            job.outcome = "bad_request"
            job.post("error", APIError(400, str(err)))
            return
        except Exception:
            log.exception("building a generation failed")
            job.outcome = "error"
            job.post("error", APIError(500, "the server failed to start this generation; see its log"))
            return
        try:
            self._drive(job, events)
        except Exception:
            log.exception("a generation failed")
            job.outcome = "error"
            job.post("error", APIError(500, "the generation failed; see the server's log"))
        finally:
            events.close()

    def _drive(self, job: Job, events: Iterator[Any]) -> None:
        ids: list[int] = []
        text = _HeldText(job.stop_strings)
        drafted = 0
        last = job.arrived
        stats = None
        for event in events:  # each step is one target forward pass
            now = time.monotonic()
            job.steps += 1
            stats = event.stats
            draft_chars = _draft_chars(job.decode, ids, text.seen, event)
            delta, draft_chars = text.add(event.text, draft_chars)
            step = Step(list(event.token_ids), delta, list(event.from_draft), draft_chars,
                        stats.drafted_tokens - drafted)
            self.metrics.step(len(step.token_ids), step.drafted, sum(step.from_draft),
                              None if job.steps == 1 else now - last)
            if job.steps == 1:
                self.metrics.ttft.observe(now - job.arrived)
            ids += step.token_ids
            job.tokens = len(ids)
            drafted = stats.drafted_tokens
            last = now
            job.post("step", step)
            if job.stopped.is_set():
                job.outcome = "cancelled"
                return
            if now > job.deadline:
                job.outcome = "timeout"
                job.post("error", _timeout())
                return
        self.metrics.request_seconds.observe(time.monotonic() - job.arrived)
        job.outcome = "ok"
        final = text.final(job.decode(ids))
        job.post("done", (final[len(text.sent):], job.finish(ids, final, stats)))


class _HeldText:
    """Text as it may be shown: a tail that could begin a stop string is held back until the next
    tokens tell (the stream's events show it at once, and a stop string cut afterwards would leave
    its first characters on the client's screen)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.seen = ""  # the events' text
        self.sent = ""  # what was let through: a prefix of seen

    def add(self, delta: str, draft_chars: int) -> tuple[str, int]:
        """The text to send now and how many of its leading characters the draft supplied."""
        start = len(self.seen)
        self.seen += delta
        end = len(self.seen) - self._held_tail()
        out = self.seen[len(self.sent):end]
        if len(self.sent) == start:  # the text sent now begins with this step's own text
            draft_chars = max(0, min(draft_chars, len(out)))
        else:  # it begins with held text of an earlier step: no colour for this step
            draft_chars = 0
        self.sent += out
        return out, draft_chars

    def _held_tail(self) -> int:
        for n in range(min(len(self.seen), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.seen[-n:]) for s in self.stops):
                return n
        return 0

    def final(self, decoded: str) -> str:
        """The whole text at the end: cut before the first stop string, as the stream cut it."""
        cuts = [at for at in (decoded.find(s) for s in self.stops) if at >= 0]
        text = decoded[:min(cuts)] if cuts else self.seen
        return text if text.startswith(self.sent) else self.sent


def _draft_chars(decode: Callable[[list[int]], str], ids: list[int], text: str, event: Any) -> int:
    """How many leading characters of the event's text its kept draft tokens make (the rest is the
    target's own token): the decoded length up to the last draft token, less the text before."""
    n = sum(event.from_draft)
    if n == 0 or not event.text:
        return 0
    if n == len(event.token_ids):
        return len(event.text)
    cut = len(decode(ids + list(event.token_ids[:n]))) - len(text)
    return max(0, min(len(event.text), cut))


def _timeout() -> APIError:
    return APIError(504, "the request ran past the server's --request-timeout", code="timeout", type="timeout_error")
