"""A bounded FIFO queue and the threads that run the generations: one at a time on the model
thread, or, with slots, several at once whose passes share each pass of the weights on it.

A :class:`Job` is submitted from the event loop; the worker thread builds its token stream and
drives it one step (one target forward) at a time, posting each step back to the job's asyncio
queue. Between steps it checks whether the job was stopped (the client went away, or its time ran
out), and on the GGUF kernel so does the forward between the passes of a long prompt
(:func:`specdec.backends.gguf.stop_when`): a stopped job runs at most the step, or the prompt's
pass, already under way.

The worker is a :class:`ModelThread`, and ``specdec serve`` loads and warms the models on that
same thread: every call into the models comes from one thread (with slots, the shared passes run
there, and each job's thread only hands its pieces in). llama.cpp computes a pass on an
OpenMP team of the calling thread, and GNU OpenMP keeps a pool of threads for each thread that
starts a team; once the pools' threads outnumber the CPUs, it cuts how long idle threads spin
before they sleep, and llama.cpp's barriers slow down. Loading and warming up on the main thread
and generating on another made a one-token step of Qwen2.5-Coder-1.5B Q4_K_M on 2 cores take
35-39 ms instead of 26 (docs/backends.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from specdec.backends.gguf import Stopped, stop_when
from specdec.constraints import ConstraintError
from specdec.engine import NonFiniteLogitsError
from specdec.server.errors import APIError, model_failed, outcome, timed_out
from specdec.server.metrics import Metrics

log = logging.getLogger("specdec.server")


class QueueFull(Exception):
    pass


@dataclass
class Chunk:
    """What one generation step appended (a snapshot: the stream's stats keep changing)."""

    token_ids: list[int]
    text: str  # the text that settled this step (the library holds back what a stop string may take)
    from_draft: list[bool]
    draft_chars: int  # how many characters of text draft tokens wrote (see specdec.api.StreamEvent)
    drafted: int
    logprobs: list[Any] | None = None  # one specdec.api.TokenLogprob per token, where the request asked


@dataclass
class Job:
    """One request's generation. ``start(slot)`` (called on the thread that runs the job, with its
    :class:`Slot`, or None where jobs run one at a time) returns the token stream and raises
    ``ValueError`` for bad input; ``finish`` turns the token ids, the final text, the
    stats and the tokens' log-probabilities (None where not asked for) into the end summary."""

    start: Callable[[Any], Iterator[Any]]
    decode: Callable[[list[int]], str]
    finish: Callable[[list[int], str, Any, list[Any] | None], dict[str, Any]]
    deadline: float  # time.monotonic() by which the last token must be out
    loop: asyncio.AbstractEventLoop
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


class ModelThread:
    """A daemon thread that runs the callables given to it, one at a time, in order (see the
    module docstring for why the models want one thread)."""

    def __init__(self, name: str = "specdec-models") -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread and return its result (or raise its exception)."""
        return self.submit(fn, *args).result()

    def _serve(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed to the caller
                future.set_exception(err)


@dataclass(frozen=True)
class Slot:
    """One sequence's models in a server that decodes several requests at once: caches of the
    target and of the draft (None without one) whose passes run in ``passes``
    (:class:`specdec.backends.shared.SharedPasses`)."""

    target: Any
    draft: Any
    passes: Any


class Scheduler:
    """Jobs run one at a time on ``thread`` (a new :class:`ModelThread` if None), or, with
    ``slots``, up to one per slot at once, each on a thread of its own, their passes shared on
    ``thread`` (:mod:`specdec.backends.shared`). At most ``max_queue`` jobs wait beyond those
    running; ``submit`` raises :class:`QueueFull` beyond. Jobs start once :meth:`start` is called."""

    def __init__(self, max_queue: int, metrics: Metrics, thread: ModelThread | None = None,
                 slots: list[Slot] | None = None) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.history: collections.deque[Job] = collections.deque(maxlen=256)  # finished jobs, newest last
        self.durations: collections.deque[float] = collections.deque(maxlen=16)  # seconds of recent ok jobs
        self.slots = list(slots or [])
        self._free: list[Slot | None] = list(self.slots) if self.slots else [None]
        self._width = len(self._free)  # jobs at once
        self._waiting: collections.deque[Job] = collections.deque()
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = thread
        self._running: Future | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = ModelThread()
        if not self.slots:
            self._running = self._thread.submit(self._loop)
            return
        passes = self.slots[0].passes
        # the passes run on the model thread, their budget's cost curves read (or measured once) first
        self._thread.submit(passes.prepare, [self.slots[0].target, self.slots[0].draft])
        self._thread.submit(passes.serve)
        dispatcher = threading.Thread(target=self._loop, name="specdec-dispatch", daemon=True)
        dispatcher.start()
        self._running = Future()
        threading.Thread(target=lambda: (dispatcher.join(), self._running.set_result(None)), daemon=True).start()

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.post("error", APIError(503, "the server is shutting down", code="shutting_down"))
            self._waiting.clear()
            self.metrics.queue_length.set(0)
            self._cond.notify_all()
        if self.slots:
            self.slots[0].passes.close()
        if self._running is not None:
            try:
                self._running.result(timeout)
            except TimeoutError:  # a generation's step is under way; the daemon thread ends with the process
                pass

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) + self._busy > self.max_queue + self._width - 1:
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
        return max(1, math.ceil(ahead * mean / self._width))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting and self._free) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, slot = self._waiting.popleft(), self._free.pop()
                self._busy += 1
                self.metrics.queue_length.set(len(self._waiting))
                self.metrics.running.set(self._busy)
            if slot is None:  # one at a time, here on the model thread
                self._job(job, slot)
            else:
                threading.Thread(target=self._job, args=(job, slot), name="specdec-slot", daemon=True).start()

    def _job(self, job: Job, slot: Slot | None) -> None:
        started = time.monotonic()
        self.metrics.queue_wait.observe(started - job.arrived)
        try:
            with stop_when(job.stopped):
                if slot is None:
                    self._run(job, slot)
                else:
                    with slot.passes.member():
                        self._run(job, slot)
        finally:
            self.history.append(job)
            with self._cond:
                self._busy -= 1
                self._free.append(slot)
                self.metrics.running.set(self._busy)
                if job.outcome == "ok":
                    self.durations.append(time.monotonic() - started)
                self._cond.notify_all()

    def _run(self, job: Job, slot: Slot | None) -> None:
        if job.stopped.is_set():
            job.outcome = "cancelled"
            return
        if time.monotonic() > job.deadline:
            job.outcome = "timeout"
            job.post("error", timed_out())
            return
        try:
            events = job.start(slot)
        except APIError as err:  # the request's own error, found as its generation was built
            job.outcome = outcome(err)
            job.post("error", err)
            return
        except (ValueError, TypeError) as err:  # the library's promise for bad input
            job.outcome = "bad_request"
            job.post("error", APIError(400, str(err)))
            return
        except Stopped:  # stopped while it measured its costs
            job.outcome = "cancelled"
            return
        except Exception:
            log.exception("building a generation failed")
            job.outcome = "error"
            job.post("error", APIError(500, "the server failed to start this generation; see its log"))
            return
        try:
            self._drive(job, events)
        except Stopped:  # stopped between the passes of its prompt (the step under way)
            job.outcome = "cancelled"
        except ConstraintError as err:  # the request's grammar went past the engine's limits as it grew
            job.outcome = "bad_request"
            job.post("error", APIError(400, f"{err} (after {job.tokens} generated tokens)", param=err.field))
        except NonFiniteLogitsError as err:  # the model's weights are damaged: this request fails, the server stays
            log.error("%s", err)
            job.outcome = "error"
            job.post("error", model_failed(err.source, err.position))
        except Exception:
            log.exception("a generation failed")
            job.outcome = "error"
            job.post("error", APIError(500, "the generation failed; see the server's log"))
        finally:
            events.close()

    def _drive(self, job: Job, events: Iterator[Any]) -> None:
        ids: list[int] = []
        sent = ""  # the steps' text
        rest = ""  # text the stream released after its last step, sent with the end summary
        drafted = 0
        last = job.arrived
        stats = None
        logprobs: list[Any] | None = None
        for event in events:
            stats = event.stats
            if not event.token_ids:  # no step: the held text, released at the end
                rest += event.text
                continue
            now = time.monotonic()  # each step is one target forward pass
            job.steps += 1
            step = Chunk(list(event.token_ids), event.text, list(event.from_draft), event.draft_chars,
                         stats.drafted_tokens - drafted, getattr(event, "logprobs", None))
            if step.logprobs is not None:
                logprobs = (logprobs or []) + list(step.logprobs)
            self.metrics.step(len(step.token_ids), step.drafted, sum(step.from_draft),
                              None if job.steps == 1 else now - last)
            if job.steps == 1:
                self.metrics.ttft.observe(now - job.arrived)
            ids += step.token_ids
            sent += step.text
            job.tokens = len(ids)
            drafted = stats.drafted_tokens
            last = now
            job.post("step", step)
            if job.stopped.is_set():
                job.outcome = "cancelled"
                return
            if now > job.deadline:
                job.outcome = "timeout"
                job.post("error", timed_out())
                return
        self.metrics.request_seconds.observe(time.monotonic() - job.arrived)
        job.outcome = "ok"
        job.post("done", (rest, job.finish(ids, sent + rest, stats, logprobs)))
