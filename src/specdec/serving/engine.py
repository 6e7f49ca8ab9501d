"""The serving engine: one loaded pair, its slots, its prompt cache and the scheduling of requests.

:class:`Engine` takes requests as data (:class:`Work`: prompt ids, the resolved
:class:`~specdec.config.DecodeConfig`, constraints, logprobs, the time allowed), queues them in a
bounded FIFO queue and runs them: one at a time on the model thread, or, with ``parallel`` slots
(:mod:`specdec.serving.pool`), up to one per slot at once, each on a thread of its own, their
passes shared on the model thread. Each step is posted back as a :class:`Chunk`, the end as
:class:`Finished` or an :class:`~specdec.serving.errors.EngineError`. ``specdec serve``
(:mod:`specdec.server.app`), :func:`specdec.generate_many` (:meth:`Engine.run`) and a cluster's
replica are its callers; it knows no protocol.

Between steps the engine checks whether a request was stopped (its consumer went away, or its time
ran out), and on the GGUF kernel so does the forward between the passes of a long prompt
(:func:`specdec.backends.gguf.stop_when`): a stopped request runs at most the step, or the
prompt's pass, already under way.

Every call into the models comes from one thread, a :class:`ModelThread` (with slots, the shared
passes run there, and each request's thread only hands its pieces in), and ``specdec serve`` loads
and warms the models on that same thread. llama.cpp computes a pass on an OpenMP team of the
calling thread, and GNU OpenMP keeps a pool of threads for each thread that starts a team; once the
pools' threads outnumber the CPUs, it cuts how long idle threads spin before they sleep, and
llama.cpp's barriers slow down. Loading and warming up on the main thread and generating on another
made a one-token step of Qwen2.5-Coder-1.5B Q4_K_M on 2 cores take 35-39 ms instead of 26
(docs/backends.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from specdec.api import GenerationResult, MethodError, _Run
from specdec.backends.gguf import Stopped, stop_when
from specdec.build import as_backend, is_backend
from specdec.config import DecodeConfig
from specdec.constraints import ConstraintError, Constraints, TokenLogprob
from specdec.datastore import MAX_MATCH
from specdec.drafters import registry as drafters
from specdec.engine import NonFiniteLogitsError
from specdec.models import Pair
from specdec.serving.errors import (
    BadInput, Cancelled, ConstraintFailed, EngineError, Failed, MethodRefused, ModelFailed, QueueFull, ShuttingDown,
    TimedOut,
)
from specdec.serving.pool import Pool, Slot
from specdec.serving.prompt_cache import DEFAULT_BUDGET_MIB, PromptCache
from specdec.stats import GenerationStats

log = logging.getLogger("specdec.serving")

DEFAULT_PROMPT_CACHE_BYTES = DEFAULT_BUDGET_MIB << 20
GRACE_SECONDS = 0.5  # past a request's deadline, how long a consumer waits for the engine to notice it


@dataclass(frozen=True)
class Work:
    """One request, as data (it pickles). ``prompt``: token ids (text is encoded with the pair's
    tokenizer, as :func:`specdec.generate` encodes it). ``config``: the method with every sampling
    field, ``max_new_tokens``, ``stop``, ``eos_token_ids``, ``draft_weights`` and ``prompt_cache``
    (keep the models' caches between requests) set; the pair's draft model is used where the
    method drafts with one. ``timeout``: seconds allowed from :meth:`Engine.submit`, queue wait
    included (None: no limit). ``prediction``: the output's predicted text or token ids (OpenAI's
    Predicted Outputs), a draft source (:mod:`specdec.drafters.prediction`)."""

    prompt: list[int] | str
    config: DecodeConfig
    constraints: Constraints | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    timeout: float | None = None
    prediction: str | list[int] | None = None


@dataclass
class Chunk:
    """What one generation step appended (a snapshot: the run's stats keep changing)."""

    token_ids: list[int]
    text: str  # the text that settled this step (the library holds back what a stop string may take)
    from_draft: list[bool]
    draft_chars: int  # how many characters of text draft tokens wrote (see specdec.api.StreamEvent)
    drafted: int
    logprobs: list[TokenLogprob] | None = None  # one per token, where the request asked


@dataclass
class Finished:
    """A generation's end: ``held``, text released after its last step (to send with the end);
    the output's ``token_ids`` and whole ``text``; the run's ``stats`` (None where no step ran);
    the tokens' ``logprobs`` (None where not asked for); the prompt's tokens and how many of them
    the prompt cache supplied."""

    held: str
    token_ids: list[int]
    text: str
    stats: GenerationStats | None
    logprobs: list[TokenLogprob] | None
    prompt_tokens: int
    prompt_cached: int


@dataclass(frozen=True)
class EngineStatus:
    """What an engine is doing, and its totals since it started (what a cluster reports per replica)."""

    slots: int  # requests decoded at once
    busy: int  # of those, running now
    queued: int  # waiting for a slot
    requests: int  # finished, whatever their outcome
    tokens: int  # generated
    prompt_cache_hits: int  # requests whose prompt began with tokens the cache held
    prompt_cache_lookups: int
    prompt_tokens_cached: int
    prompt_tokens_computed: int


class Observer:
    """What the engine tells as it runs (every method a no-op here; the server's
    :class:`~specdec.server.metrics.Metrics` counts them)."""

    def queued(self, waiting: int) -> None:
        """Requests waiting now."""

    def busy(self, running: int) -> None:
        """Requests running now."""

    def started(self, waited: float) -> None:
        """A request started on the models after ``waited`` seconds in the queue."""

    def step(self, tokens: int, drafted: int, accepted: int, gap: float | None) -> None:
        """One step: its token counts, and the seconds since the request's previous step (None for the first)."""

    def first_token(self, seconds: float) -> None:
        """A request's first tokens, ``seconds`` after it arrived."""

    def finished(self, seconds: float) -> None:
        """A request's last token, ``seconds`` after it arrived."""

    def prompt(self, cached: int, computed: int) -> None:
        """A finished request's prompt tokens: those the prompt cache held, those prefilled."""

    def shared_pass(self, model: str, rows: int, sequences: int) -> None:
        """One pass of ``model``'s weights (target, draft) for the slots: its rows, and how many sequences they came from."""


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


@dataclass(eq=False)
class Handle:
    """A submitted request: :meth:`stop` it; with :meth:`Engine.open`, read its messages with :meth:`next`."""

    work: Work
    post: Callable[[str, Any], None]
    deadline: float | None  # time.monotonic() by which the last token must be out
    arrived: float = field(default_factory=time.monotonic)
    stopped: threading.Event = field(default_factory=threading.Event)
    steps: int = 0
    tokens: int = 0
    steps_at_stop: int | None = None
    outcome: str | None = None  # ok, bad_request, timeout, cancelled or error, once it ended
    served_by: str | None = None  # where the request runs, where that is not this process (a cluster's replica)
    _out: asyncio.Queue | None = None

    def stop(self) -> None:
        """Stop this request (at the end of the step under way)."""
        if not self.stopped.is_set():
            self.steps_at_stop = self.steps
            self.stopped.set()

    async def next(self, timeout: float | None = None) -> tuple[str, Any] | None:
        """The next message, ``(kind, payload)``; None if none came within ``timeout`` seconds.
        Past the deadline (and a grace for the engine to report it) the request is stopped and
        ``("error", TimedOut)`` returned."""
        assert self._out is not None, "next() reads a request submitted with Engine.open"
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            left = None if self.deadline is None else self.deadline + GRACE_SECONDS - now
            if left is not None and left <= 0:
                self.stop()
                return "error", TimedOut("the request ran past its time allowed")
            if until is not None and now >= until:
                return None
            waits = [w for w in (left, None if until is None else until - now) if w is not None]
            try:
                return await asyncio.wait_for(self._out.get(), min(waits) if waits else None)
            except asyncio.TimeoutError:
                pass


class Engine:
    """The serving engine of one loaded :class:`~specdec.models.Pair` (see the module docstring).

    ``parallel``: requests decoded at once (more than 1 only where the models share passes: a
    ``ValueError`` says so elsewhere). ``max_queue``: requests that may wait beyond those running;
    :meth:`submit` raises :class:`QueueFull` past it. ``prompt_cache_bytes``: RAM for the saved
    caches of earlier requests (:mod:`specdec.serving.prompt_cache`; None: keep the live cache
    only). ``datastore``: a :class:`specdec.datastore.Datastore` each finished output is added to.
    ``observer``: an :class:`Observer`. ``thread``: the :class:`ModelThread` the models were loaded
    on (None: a new one at :meth:`start`). ``slots``: decode in slots whose passes are shared even
    with ``parallel`` 1 (None: with more than one), as :func:`specdec.generate_many` does for any
    number of prompts. Requests run once :meth:`start` is called."""

    def __init__(self, pair: Pair, *, parallel: int = 1, max_queue: int = 16,
                 prompt_cache_bytes: int | None = DEFAULT_PROMPT_CACHE_BYTES, datastore: Any = None,
                 observer: Observer | None = None, thread: ModelThread | None = None,
                 slots: bool | None = None) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        self.pair = pair
        self.parallel = parallel
        self.max_queue = max_queue
        self.datastore = datastore
        self.observer = observer if observer is not None else Observer()
        self.thread = thread
        slots = parallel > 1 if slots is None else slots
        self.pool = Pool(pair.target, pair.draft, parallel, self.observer) if slots else None
        self.prompt_cache = (PromptCache(prompt_cache_bytes) if prompt_cache_bytes is not None and is_backend(pair.target)
                             else None)
        self.history: collections.deque[Handle] = collections.deque(maxlen=256)  # finished requests, newest last
        self.durations: collections.deque[float] = collections.deque(maxlen=16)  # seconds of recent ok requests
        self._held: dict[str, Any] = {}  # transformers models' backends, kept for the prompt cache
        self._cache_lock = threading.Lock()  # the prompt cache, between slots
        self._free: list[Slot | None] = list(self.pool.slots) if self.pool is not None else [None]
        self._waiting: collections.deque[Handle] = collections.deque()
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()
        self._running: Future | None = None
        self._totals = collections.Counter()  # requests, tokens, prompt cache hits and lookups, prompt tokens

    # -- running ---------------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the model thread (started here if need be) and return its result."""
        if self.thread is None:
            self.thread = ModelThread()
        return self.thread.call(fn, *args)

    def start(self) -> None:
        """Start taking requests off the queue: on the model thread, or with slots, each on a
        thread of its own while the model thread runs their passes."""
        if self.thread is None:
            self.thread = ModelThread()
        if self.pool is None:
            self._running = self.thread.submit(self._loop)
            return
        # the passes run on the model thread, their budget's cost curves read (or measured once) first
        self.thread.submit(self.pool.prepare)
        self.thread.submit(self.pool.serve)
        dispatcher = threading.Thread(target=self._loop, name="specdec-dispatch", daemon=True)
        dispatcher.start()
        running: Future = Future()
        self._running = running
        threading.Thread(target=lambda: (dispatcher.join(), running.set_result(None)), daemon=True).start()

    def close(self, timeout: float = 5.0) -> None:
        """Take no more requests; those waiting end with :class:`ShuttingDown`; wait up to
        ``timeout`` seconds for the one under way."""
        with self._cond:
            self._closed = True
            for handle in self._waiting:
                handle.post("error", ShuttingDown("the server is shutting down"))
            self._waiting.clear()
            self.observer.queued(0)
            self._cond.notify_all()
        if self.pool is not None:
            self.pool.close()
        if self._running is not None:
            try:
                self._running.result(timeout)
            except TimeoutError:  # a generation's step is under way; the daemon thread ends with the process
                pass

    def submit(self, work: Work, post: Callable[[str, Any], None]) -> Handle:
        """Queue ``work``; the engine calls ``post(kind, payload)`` from its threads with each
        ``"step"`` (a :class:`Chunk`), then ``"done"`` (:class:`Finished`) or ``"error"`` (an
        :class:`EngineError`). Raises :class:`QueueFull` or :class:`ShuttingDown`."""
        handle = Handle(work, post, None)
        if work.timeout is not None:
            handle.deadline = handle.arrived + work.timeout
        self._enqueue(handle)
        return handle

    def open(self, work: Work) -> Handle:
        """:meth:`submit` from a running event loop, the messages kept for :meth:`Handle.next`."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def post(kind: str, payload: Any) -> None:
            try:
                loop.call_soon_threadsafe(out.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop is closed: its consumer is gone
                handle.stop()

        handle = Handle(work, post, None, _out=out)
        if work.timeout is not None:
            handle.deadline = handle.arrived + work.timeout
        self._enqueue(handle)
        return handle

    async def stream(self, work: Work) -> AsyncIterator[tuple[str, Any]]:
        """The request's messages, ``(kind, payload)``, through ``"done"`` or ``"error"``;
        :class:`QueueFull` or :class:`ShuttingDown` at the first. A consumer that leaves early
        stops the request."""
        handle = self.open(work)
        try:
            while True:
                message = await handle.next()
                yield message
                if message[0] != "step":
                    return
        finally:
            handle.stop()

    def run(self, works: Sequence[Work]) -> list[GenerationResult]:
        """Generate every work and return the results in order, the passes on this thread (the one
        that calls the models, as when decoding alone: a second thread calling the GGUF kernel would
        start a second OpenMP team; see :func:`~specdec.backends.shared.torch_on_one_thread`). Raises
        the first failing work's exception as :func:`specdec.generate` raises it. For an engine that
        is not started."""
        if self.pool is None:
            return [self._generate(work, None) for work in works]
        pool = self.pool
        results: list[GenerationResult | BaseException | None] = [None] * len(works)
        order = iter(range(len(works)))
        lock = threading.Lock()

        def drive(slot: Slot) -> None:
            with pool.member(slot):
                while True:
                    with lock:
                        i = next(order, None)
                    if i is None:
                        return
                    try:
                        results[i] = self._generate(works[i], slot)
                    except BaseException as err:  # raised in the caller's thread below
                        results[i] = err

        threads = [threading.Thread(target=drive, args=(slot,), name=f"specdec-slot-{n}")
                   for n, slot in enumerate(pool.slots[:len(works)])]

        def close_when_done() -> None:
            for thread in threads:
                thread.join()
            pool.close()

        for thread in threads:
            thread.start()
        threading.Thread(target=close_when_done, name="specdec-slots-done", daemon=True).start()
        pool.serve()  # until every slot is done
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    def status(self) -> EngineStatus:
        with self._cond:
            t = self._totals
            return EngineStatus(len(self._free) + self._busy, self._busy, len(self._waiting), t["requests"],
                                t["tokens"], t["hits"], t["lookups"], t["cached"], t["computed"])

    def retry_after(self) -> int:
        """Whole seconds (at least 1) for the requests ahead, waiting and running, to finish at the
        recent mean time of a generation (1 s before any has finished)."""
        with self._cond:
            return self._retry_after_locked()

    def backends(self, config: DecodeConfig) -> tuple[Any, Any]:
        """The target (and draft) a request runs on without slots. With the prompt cache, a
        transformers model is wrapped once and the wrapper kept, so its cache outlives the request;
        a drafter that reads the target's layers or hidden states gets a fresh wrapper of its own kind."""
        target, draft = self.pair.target, self.pair.draft
        if not config.prompt_cache or is_backend(target) or drafters.needs(config.drafter):
            return target, draft
        if "target" not in self._held:
            self._held["target"] = as_backend(target)
        if draft is not None and not is_backend(draft) and "draft" not in self._held:
            self._held["draft"] = as_backend(draft, self.pair.draft_weights)
        return self._held["target"], self._held.get("draft", draft)

    # -- the queue -------------------------------------------------------------------------------

    def _enqueue(self, handle: Handle) -> None:
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) + self._busy > self.max_queue + self.parallel - 1:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)",
                                retry_after=self._retry_after_locked())
            self._waiting.append(handle)
            self.observer.queued(len(self._waiting))
            self._cond.notify()

    def _retry_after_locked(self) -> int:
        """:meth:`retry_after`, the lock held."""
        ahead = len(self._waiting) + self._busy
        mean = statistics.fmean(self.durations) if self.durations else 1.0
        return max(1, math.ceil(ahead * mean / self.parallel))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting and self._free) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                handle, slot = self._waiting.popleft(), self._free.pop()
                self._busy += 1
                self.observer.queued(len(self._waiting))
                self.observer.busy(self._busy)
            if slot is None:  # one at a time, here on the model thread
                self._job(handle, slot)
            else:
                threading.Thread(target=self._job, args=(handle, slot), name="specdec-slot", daemon=True).start()

    def _job(self, handle: Handle, slot: Slot | None) -> None:
        started = time.monotonic()
        self.observer.started(started - handle.arrived)
        # The request's last message ("done" or "error") leaves once the engine has counted it and
        # freed its slot, so a caller that has it finds the request in status() and the slot free.
        post, last = handle.post, []
        handle.post = lambda kind, payload: post(kind, payload) if kind == "step" else last.append((kind, payload))
        try:
            with stop_when(handle.stopped):
                if slot is None:
                    self._run(handle, slot)
                else:
                    with self.pool.member(slot):
                        self._run(handle, slot)
        finally:
            self.history.append(handle)
            with self._cond:
                self._busy -= 1
                self._free.append(slot)
                self._totals["requests"] += 1
                self._totals["tokens"] += handle.tokens
                self.observer.busy(self._busy)
                if handle.outcome == "ok":
                    self.durations.append(time.monotonic() - started)
                self._cond.notify_all()
            handle.post = post
            for kind, payload in last:
                post(kind, payload)

    # -- one request -----------------------------------------------------------------------------

    def _build(self, work: Work, slot: Slot | None) -> _Run:
        """The request's run on ``slot`` (None: the pair's models), its prompt cache prepared."""
        prompt = work.prompt
        if self.prompt_cache is not None and not isinstance(prompt, str):
            with self._cache_lock:
                prepared = self.prompt_cache.prepare(slot.target if slot is not None else self.pair.target, prompt)
                self._totals["lookups"] += 1
                self._totals["hits"] += prepared.shared > 0
        target, draft = (slot.target, slot.draft) if slot is not None else self.backends(work.config)
        uses_draft = self.pair.draft is not None and work.config.resolve(True).uses_draft_model
        return _Run.build(target, prompt, draft=draft if uses_draft else None, tokenizer=self.pair.tokenizer,
                          config=work.config, constraints=work.constraints, logprobs=work.logprobs,
                          prediction=work.prediction, seat=slot.seat if slot is not None else None)

    def _generate(self, work: Work, slot: Slot | None) -> GenerationResult:
        run = self._build(work, slot)
        for _ in run.events():
            pass
        return run.result()

    def _run(self, handle: Handle, slot: Slot | None) -> None:
        if handle.stopped.is_set():
            handle.outcome = "cancelled"
            handle.post("error", Cancelled("the request was stopped"))
            return
        if handle.deadline is not None and time.monotonic() > handle.deadline:
            handle.outcome = "timeout"
            handle.post("error", TimedOut("the request ran past its time allowed"))
            return
        try:
            run = self._build(handle.work, slot)
        except MethodError as err:  # e.g. a drafter that needs layers or hidden states the backend does not give
            self._fail(handle, "bad_request", MethodRefused(str(err), method=str(handle.work.config)))
            return
        except (ValueError, TypeError) as err:  # the library's promise for bad input
            self._fail(handle, "bad_request", BadInput(str(err)))
            return
        except Stopped:  # stopped while it measured its costs
            self._fail(handle, "cancelled", Cancelled("the request was stopped"))
            return
        except Exception:
            log.exception("building a generation failed")
            self._fail(handle, "error", Failed("the server failed to start this generation; see its log"))
            return
        events = run.events()
        try:
            self._drive(handle, events)
        except Stopped:  # stopped between the passes of its prompt (the step under way)
            self._fail(handle, "cancelled", Cancelled("the request was stopped"))
        except ConstraintError as err:  # the request's grammar went past the engine's limits as it grew
            self._fail(handle, "bad_request", ConstraintFailed(f"{err} (after {handle.tokens} generated tokens)",
                                                               field=err.field, tokens=handle.tokens))
        except NonFiniteLogitsError as err:  # the model's weights are damaged: this request fails, the engine serves on
            log.error("%s", err)
            self._fail(handle, "error", ModelFailed(str(err), source=err.source, position=err.position))
        except Exception:
            log.exception("a generation failed")
            self._fail(handle, "error", Failed("the generation failed; see the server's log"))
        finally:
            events.close()

    @staticmethod
    def _fail(handle: Handle, outcome: str, error: EngineError) -> None:
        handle.outcome = outcome
        handle.post("error", error)

    def _drive(self, handle: Handle, events: Any) -> None:
        ids: list[int] = []
        sent = ""  # the steps' text
        rest = ""  # text the stream released after its last step, sent with the end
        drafted = 0
        last = handle.arrived
        stats = None
        logprobs: list[Any] | None = None
        for event in events:
            stats = event.stats
            if not event.token_ids:  # no step: the held text, released at the end
                rest += event.text
                continue
            now = time.monotonic()  # each step is one target forward pass
            handle.steps += 1
            step = Chunk(list(event.token_ids), event.text, list(event.from_draft), event.draft_chars,
                         stats.drafted_tokens - drafted, event.logprobs)
            if step.logprobs is not None:
                logprobs = (logprobs or []) + list(step.logprobs)
            self.observer.step(len(step.token_ids), step.drafted, sum(step.from_draft),
                               None if handle.steps == 1 else now - last)
            if handle.steps == 1:
                self.observer.first_token(now - handle.arrived)
            ids += step.token_ids
            sent += step.text
            handle.tokens = len(ids)
            drafted = stats.drafted_tokens
            last = now
            handle.post("step", step)
            if handle.stopped.is_set():
                handle.outcome = "cancelled"
                handle.post("error", Cancelled("the request was stopped"))
                return
            if handle.deadline is not None and now > handle.deadline:
                handle.outcome = "timeout"
                handle.post("error", TimedOut("the request ran past its time allowed"))
                return
        self.observer.finished(time.monotonic() - handle.arrived)
        handle.outcome = "ok"
        handle.post("done", self._finish(handle.work, rest, ids, sent + rest, stats, logprobs))

    def _finish(self, work: Work, held: str, ids: list[int], text: str, stats: GenerationStats | None,
                logprobs: list[Any] | None) -> Finished:
        """The end of a request: its prompt tokens counted, its output added to the datastore."""
        prompt_tokens = len(work.prompt if not isinstance(work.prompt, str)
                            else self.pair.tokenizer(work.prompt, add_special_tokens=True)["input_ids"])
        cached = stats.prompt_cached if stats is not None else 0
        self.observer.prompt(cached, prompt_tokens - cached)
        with self._cond:
            self._totals["cached"] += cached
            self._totals["computed"] += prompt_tokens - cached
        if self.datastore is not None and ids:  # the output, after the prompt's last tokens it followed
            tail = list(work.prompt[-MAX_MATCH:]) if not isinstance(work.prompt, str) else []
            self.datastore.add(tail + list(ids))
        return Finished(held, ids, text, stats, logprobs, prompt_tokens, cached)
