"""specdec as a Ray Serve application: replicas of the serving engine behind one OpenAI ingress.

Two deployments (``specdec serve --ray`` and ``serve run specdec.ray:app`` build them, with
:func:`application`):

- ``SpecdecEngine``: each replica (:class:`Replica`) holds one loaded pair in a
  :class:`~specdec.serving.Engine` (its slots, prompt cache and planners' board), built by the
  function ``specdec serve`` builds its own engine with, and answers one :class:`Request` at a time
  per call as a stream of the engine's messages;
- ``SpecdecIngress`` (:class:`Ingress`): ``specdec serve``'s own application
  (:func:`specdec.server.app.app_for`: the same routes, checks, errors and streaming), holding no
  model: its engine is :class:`Replicas`, the engine deployment behind a deployment handle.

Ray Serve's prefix-aware router (:class:`PrefixRouter`) picks each request's replica: the one
that has served the longest prefix of the prompt's tokens (whose prompt cache likely holds it),
unless the replicas' queues differ by more than a threshold, when the less loaded one is picked.

On specdec's GGUF kernel an answer does not depend on what else a replica is decoding, nor on
which replica decodes it; so a greedy or seeded request whose replica is lost is sent again to
another, and its tokens already handed to the client are checked against the new run's instead of
being sent twice. A request that cannot be sent again ends with :class:`~specdec.serving.Unavailable`
(HTTP 503 with Retry-After), never with a half answer presented as whole.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

try:
    import ray
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
    # Ray Serve's prefix-aware router. Its public name, ray.serve.llm.request_router, loads ray.serve.llm,
    # which needs vLLM or SGLang; this is the same class, from the module that defines it.
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
except ImportError as err:
    raise ImportError(f"specdec's Ray Serve application needs Ray Serve ({err.name} is not installed): "
                      "pip install 'specdec[ray]'") from err

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.server.app import ServerOptions, Served, app_for
from specdec.server.metrics import Metrics
from specdec.serving import (
    Chunk, Engine, EngineStatus, Failed, Finished, Handle, Observer, QueueFull, ShuttingDown, Unavailable, Work,
)

log = logging.getLogger("specdec.cluster")

APP = "specdec"  # the application's name, as specdec serve --ray deploys it
ENGINE = "SpecdecEngine"  # the deployments' names
INGRESS = "SpecdecIngress"
RETRIES = 2  # how many times a request whose replica was lost is sent again
LOST_RETRY_AFTER = 5  # seconds a client is told to wait after a lost replica (Ray restarts it)
STATUS_PERIOD = 2.0  # seconds between a replica's status reports to the router
CONNECT_SECONDS = 5.0  # how long a Ray head's address has to answer


@dataclass(frozen=True)
class Scale:
    """How many replicas, and what each takes, from ``specdec serve``'s options: ``replicas``
    fixed, or autoscaling between ``min_replicas`` and ``max_replicas`` aiming at as many requests
    under way per replica as it has ``slots``; ``threads``: each replica's CPUs (``--threads``, else
    this machine's CPUs shared among the most replicas asked for); ``imbalance``: how many more
    requests one replica may have under way than another before the router stops following
    prefixes and picks the less loaded; ``router``: ``prefix`` (Ray Serve's prefix-aware router) or
    ``load`` (Ray Serve's default: the less loaded of two replicas drawn at random, no prefixes)."""

    replicas: int
    min_replicas: int | None
    max_replicas: int | None
    threads: int
    slots: int  # requests a replica decodes at once (--parallel; 1 where each replica chooses its own)
    max_queue: int  # requests that may wait at a replica; as many more wait at the ingress
    imbalance: float
    router: str = "prefix"

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Scale":
        most = max(args.replicas, args.min_replicas or 0, args.max_replicas or 0)
        slots = args.parallel or 1
        return cls(args.replicas, args.min_replicas, args.max_replicas,
                   args.threads or max(1, (os.cpu_count() or 1) // most), slots, args.max_queue,
                   args.router_imbalance if args.router_imbalance is not None else float(slots),
                   getattr(args, "router", "prefix"))

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def deployment(self) -> dict[str, Any]:
        """The engine deployment's options for this scale."""
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.threads},
                                   "max_ongoing_requests": self.slots + self.max_queue,
                                   "max_queued_requests": max(1, self.max_queue)}
        if not self.autoscaling:
            return {**options, "num_replicas": self.replicas}
        low = self.min_replicas if self.min_replicas is not None else 1
        high = max(low, self.max_replicas if self.max_replicas is not None else self.replicas, 1)
        return {**options, "autoscaling_config": AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=min(max(low, self.replicas), high),
            target_ongoing_requests=float(self.slots), look_back_period_s=20.0,
            upscale_delay_s=5.0, downscale_delay_s=30.0)}


# ------------------------------------------------------------------------------------------------
# A replica


@dataclass(frozen=True)
class Request:
    """What the ingress hands a replica: the request's :class:`~specdec.serving.Work`, and its
    prompt's tokens as text, one character per token, which the prefix router matches against the
    prompts each replica has served (so a match is a shared prefix of tokens: what a prompt cache
    reuses)."""

    prompt: str  # read by PrefixCacheAffinityRouter
    work: Work

    @classmethod
    def of(cls, work: Work) -> "Request":
        # one character per token, above the surrogates' code points (which no text may hold)
        text = work.prompt if isinstance(work.prompt, str) else "".join(chr(0x10000 + t) for t in work.prompt)
        return cls(text or " ", work)  # the router divides by the prompt's length


class ReplicaFailed(RuntimeError):
    """A replica could not build its engine (a model that does not load, options it refuses): the
    one line saying why, which ``specdec serve --ray`` prints."""


class Replica:
    """One replica of the engine deployment: the engine ``build(args)`` makes (``specdec serve``'s
    own, :func:`specdec.cli.serve.load_engine`), started, and its answers as streams."""

    def __init__(self, build: Callable[[Any], Engine], args: Any) -> None:
        self.name = serve.get_replica_context().replica_tag
        self.engine: Engine | None = None
        try:
            self.engine = build(args)
        except Exception as err:  # one line for the deployment's status and the command that deployed it
            raise ReplicaFailed(f"replica {self.name} cannot serve: {_one_line(err)}") from None
        self.engine.start()

    def served(self) -> Served:
        """What the ingress needs of the pair (:class:`~specdec.server.app.Served`)."""
        return Served.of(self.engine.pair)

    async def generate(self, request: Request) -> AsyncIterator[tuple[str, Any]]:
        """``("replica", name)``, then the engine's messages for the request through its end."""
        yield "replica", self.name
        try:
            async for message in self.engine.stream(request.work):
                yield message
        except (QueueFull, ShuttingDown) as err:  # raised as the request is queued
            yield "error", err

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's status, read by Ray Serve every :data:`STATUS_PERIOD` seconds for the router
        (and, through it, the ingress's /metrics)."""
        return {"replica": self.name, **dataclasses.asdict(self.engine.status())}

    def check_health(self) -> None:
        """Ray Serve's health check: the engine answers for its status (an engine stuck holding its
        lock does not, and the check's timeout has the replica replaced)."""
        self.engine.status()

    def __del__(self) -> None:
        if self.engine is not None:  # None where it could not be built
            self.engine.close()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


# ------------------------------------------------------------------------------------------------
# The router


class PrefixRouter(PrefixCacheAffinityRouter):
    """Ray Serve's :class:`PrefixCacheAffinityRouter` (a prefix tree of the prompts each replica
    served, balanced against queue lengths), counting its choices: ``prefix`` where the tree chose
    (the longest match, or for a new prefix the replica whose tree holds least), ``load`` where the
    queues were uneven and the power of two choices picked. It runs in the process of the handle
    that calls the replicas (the ingress), which reads the counts and the replicas' reported
    status from it (:data:`ROUTED`)."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        _routed().router = self

    async def _prefix_match_best_replicas(self, pending_request: Any, candidate_replicas: list[Any]) -> list[Any]:
        chosen = await super()._prefix_match_best_replicas(pending_request, candidate_replicas)
        if pending_request is not None and pending_request.args:  # a request, not the ingress asking what is served
            _routed().choices["prefix" if chosen and chosen[0] else "load"] += 1
        return chosen

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Each running replica's last reported status, by replica name."""
        return {r.routing_stats["replica"]: r.routing_stats for r in self._replicas.values()
                if r.routing_stats.get("replica")}


@dataclass
class _Routed:
    router: PrefixRouter | None = None
    choices: dict[str, int] = dataclasses.field(default_factory=lambda: {"prefix": 0, "load": 0})


ROUTED = _Routed()  # this process's router (the ingress's), once its handle has routed a request


def _routed() -> _Routed:
    """This process's :data:`ROUTED`, as the ingress reads it. Ray hands a deployment's router
    class to the process that routes pickled by value, with a copy of this module's names."""
    import specdec.cluster  # the module as imported here, not the copy that came with the router's class

    return specdec.cluster.ROUTED


# ------------------------------------------------------------------------------------------------
# The ingress's engine: the replicas behind a handle


class Replicas:
    """The engine deployment behind a deployment handle, taking :class:`~specdec.serving.Work` as
    :func:`~specdec.server.app.app_for` gives it to an engine; ``observer`` (the ingress's
    metrics) is told each request's steps, first token, end and prompt as a local engine tells it."""

    def __init__(self, handle: Any, observer: Observer) -> None:
        self.handle = handle.options(stream=True, method_name="generate")
        self.observer = observer
        self.lost = {"resent": 0, "unavailable": 0}  # requests whose replica was lost, by what became of them

    def start(self) -> None:
        """Nothing to start: Ray Serve runs the replicas."""

    def close(self) -> None:
        """Nothing to close: the replicas stop with the application."""

    def open(self, work: Work) -> "RemoteHandle":
        handle = RemoteHandle(work, lambda kind, payload: None,
                              None if work.timeout is None else time.monotonic() + work.timeout, _out=asyncio.Queue())
        handle.task = asyncio.get_running_loop().create_task(self._pump(handle))
        return handle

    async def _pump(self, handle: "RemoteHandle") -> None:
        """Send the request to a replica and hand its messages to ``handle``; where the replica is
        lost, send it again (:func:`replayable`) and check the tokens already handed out."""
        request, tries, out = Request.of(handle.work), 0, handle._out
        while True:
            skip = list(handle.given)  # tokens already handed out: the new run must give them again, first
            try:
                async for kind, payload in self.handle.remote(request):
                    if kind == "replica":
                        handle.served_by = payload
                    elif skip and (kind == "step" or kind == "done"):  # a run sent again, not yet past what was sent
                        ids = payload.token_ids if kind == "step" else []
                        if kind == "done" or len(ids) > len(skip) or ids != skip[:len(ids)]:
                            self.lost["unavailable"] += 1
                            out.put_nowait(("error", _lost(handle, "its new run's steps did not line up with those sent")))
                            return
                        skip = skip[len(ids):]
                    else:
                        self._observe(handle, kind, payload)
                        out.put_nowait((kind, payload))
                return
            except (RayActorError, ReplicaUnavailableError) as err:
                tries += 1
                log.warning("replica %s lost a request (%s); %s", handle.served_by, type(err).__name__,
                            "sending it again" if replayable(handle.work) and tries <= RETRIES else "answering 503")
                if not replayable(handle.work) or tries > RETRIES:
                    self.lost["unavailable"] += 1
                    out.put_nowait(("error", _lost(handle, "it cannot be sent again unchanged" if tries == 1
                                                   else f"so were the {tries - 1} it was sent to again")))
                    return
                self.lost["resent"] += 1
            except BackPressureError as err:
                out.put_nowait(("error", QueueFull(f"every replica's queue is full: {err.message}",
                                                   retry_after=int(err.retry_after_s or 1))))
                return
            except DeploymentUnavailableError:
                out.put_nowait(("error", Unavailable("no replica is running; retry", retry_after=LOST_RETRY_AFTER)))
                return
            except Exception as err:  # a fault of the replica's (its traceback is in its log) or of Ray's
                log.exception("a request to the replicas failed")
                out.put_nowait(("error", Failed(f"the replica failed: {_one_line(err)}")))
                return

    def _observe(self, handle: "RemoteHandle", kind: str, payload: Any) -> None:
        now = time.monotonic()
        if kind == "step":
            step: Chunk = payload
            if not handle.given and step.token_ids:
                self.observer.first_token(now - handle.arrived)
            gap = None if handle.last is None else now - handle.last
            self.observer.step(len(step.token_ids), step.drafted, sum(step.from_draft), gap)
            handle.given.extend(step.token_ids)
            handle.last = now
        elif kind == "done":
            done: Finished = payload
            self.observer.finished(now - handle.arrived)
            self.observer.prompt(done.prompt_cached, done.prompt_tokens - done.prompt_cached)


def _lost(handle: "RemoteHandle", why: str) -> Unavailable:
    return Unavailable(f"the replica running this request was lost ({handle.served_by}), and {why}; retry",
                       retry_after=LOST_RETRY_AFTER)


def replayable(work: Work) -> bool:
    """Whether a request sent again gets the same tokens: greedy, or sampled with a seed (the
    same method on the same models gives the same text on any replica). A sampled request without
    a seed draws afresh each run."""
    return work.config.temperature == 0 or work.config.seed is not None


@dataclass(eq=False)
class RemoteHandle(Handle):
    """A request sent to the replicas: :meth:`next` and the deadline as a local engine's
    :class:`~specdec.serving.Handle`; :meth:`stop` cancels the call (the replica stops the job)."""

    task: asyncio.Task | None = None
    given: list[int] = dataclasses.field(default_factory=list)  # token ids handed out in steps
    last: float | None = None  # when the last step was handed out

    def stop(self) -> None:
        super().stop()
        if self.task is not None:
            self.task.cancel()


# ------------------------------------------------------------------------------------------------
# The ingress and its metrics


class ReplicaFigures:
    """A Prometheus collector of the replicas' figures for the ingress's /metrics: each replica's
    engine status as it last reported it (requests, tokens, prompt-cache hits and lookups, slots
    and how many are busy, its queue), labelled ``replica``; the router's choices; the requests
    whose replica was lost, sent again or answered 503."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def collect(self) -> Any:
        statuses = _routed().router.statuses() if _routed().router is not None else {}
        for field in dataclasses.fields(EngineStatus):
            now = field.name in ("slots", "busy", "queued")  # the others are totals since the replica started
            family = (GaugeMetricFamily if now else CounterMetricFamily)(
                f"specdec_replica_{field.name}", f"A replica's {field.name.replace('_', ' ')}, as it last reported it",
                labels=["replica"])
            for name, status in sorted(statuses.items()):
                family.add_metric([name], float(status.get(field.name, 0)))
            yield family
        choices = CounterMetricFamily("specdec_router_choices", "Requests routed, by how the replica was chosen: "
                                      "prefix (the prefix tree) or load (queues uneven)", labels=["choice"])
        for choice, n in sorted(_routed().choices.items()):
            choices.add_metric([choice], n)
        yield choices
        lost = CounterMetricFamily("specdec_replica_lost_requests", "Requests under way on a replica that was lost, "
                                   "by what became of them: resent (to another replica) or unavailable (503)",
                                   labels=["then"])
        for then, n in sorted(self.replicas.lost.items()):
            lost.add_metric([then], n)
        yield lost


@serve.ingress()
class Ingress:
    """The ingress deployment: ``specdec serve``'s application over the engine deployment's replicas."""

    def __init__(self, replicas: Any, options: ServerOptions) -> None:
        self.replicas, self.options = replicas, options

    async def __serve_build_asgi_app__(self) -> Any:
        served = await self.replicas.served.remote()  # from any replica: they serve the same pair
        return ingress_app(served, self.options, self.replicas)


def ingress_app(served: Served, options: ServerOptions, handle: Any) -> Any:
    """The ingress's application: the server's, with ``options``, answering through the engine
    deployment's ``handle``, its /metrics with the replicas' figures."""
    metrics = Metrics()
    replicas = Replicas(handle, metrics)
    metrics.registry.register(ReplicaFigures(replicas))
    return app_for(served, options, replicas, metrics)


def application(build: Callable[[argparse.Namespace], Engine], args: argparse.Namespace,
                options: ServerOptions) -> Any:
    """The Ray Serve application of ``specdec serve``'s options ``args``: the ingress, with the
    server's ``options``, over :class:`Scale`'s replicas of the engine ``build(args)`` makes."""
    scale = Scale.of(args)
    replica_args = argparse.Namespace(**{**vars(args), "threads": scale.threads})
    router = {} if scale.router == "load" else {"request_router_config": RequestRouterConfig(
        request_router_class=PrefixRouter, request_router_kwargs={"imbalanced_threshold": scale.imbalance},
        request_routing_stats_period_s=STATUS_PERIOD)}
    engine = serve.deployment(Replica, name=ENGINE).options(
        max_constructor_retry_count=1, health_check_period_s=10, **router, **scale.deployment())
    ingress = serve.deployment(Ingress, name=INGRESS).options(num_replicas=1, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(build, replica_args), options)


# ------------------------------------------------------------------------------------------------
# Deploying from the command line


class ClusterError(Exception):
    """Why the cluster could not be started or deployed on, in one line, and a hint."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def run(app: Any, args: argparse.Namespace, deploying: Callable[[], None], ready: Callable[[], None]) -> None:
    """Join the Ray cluster at ``args.ray_address`` (or start one on this machine), call
    ``deploying``, deploy ``app`` with its HTTP proxy at ``args.host``:``args.port``, call
    ``ready``, and serve until Ctrl-C or SIGTERM (what ``kill``, systemd and a container's stop
    send); then delete the application (and stop the Ray this started)."""
    local, deployed = args.ray_address is None, False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)
    _connect(args.ray_address)
    try:
        _check_cpus(Scale.of(args))
        deploying()
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True
        try:
            serve.run(app, name=APP, route_prefix="/")
        except RuntimeError as err:
            raise ClusterError(_deploy_failure(err), "the replicas' logs say more: ray logs, or "
                               "/tmp/ray/session_latest/logs") from None
        ready()
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(Exception):  # Ray may be gone already
            if deployed:
                serve.delete(APP)
            if local:
                serve.shutdown()
                ray.shutdown()


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the cluster as Ctrl-C does: its application deleted, its Ray stopped


# Seconds Serve's HTTP proxy has to say it is ready once it starts, before Ray's controller counts a
# failed check (three in a row and it kills the proxy and starts another). Ray's own 5 s is too short
# where the machine is busy: on a 2-core machine with both cores loaded, the proxy's imports took
# longer than three checks, and Serve never started. Set in the environment of a Ray this process
# starts (Ray's processes inherit it); a value already in the environment is kept.
PROXY_READY_SECONDS = "60"


def patient_proxy() -> None:
    """Give Serve's proxy :data:`PROXY_READY_SECONDS` to start (a Ray started after this call)."""
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_SECONDS)


def _connect(address: str | None) -> None:
    if address is not None and ":" in address and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
        except (OSError, ValueError) as err:
            raise ClusterError(f"--ray-address {address}: no Ray head answers there ({_one_line(err)})",
                               "start one with 'ray start --head' and give its address, or leave --ray-address "
                               "out to start Ray on this machine") from None
    patient_proxy()
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                 ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ClusterError(f"--ray-address {address}: {_one_line(err)}",
                           "give HOST:PORT of a Ray head ('ray start --head' prints it), or auto") from None


def _check_cpus(scale: Scale) -> None:
    first = max(scale.replicas, scale.min_replicas or 0) if scale.autoscaling else scale.replicas
    have = ray.cluster_resources().get("CPU", 0)
    if first * scale.threads > have:
        raise ClusterError(f"{first} replica(s) of {scale.threads} CPU(s) need {first * scale.threads} CPUs, and "
                           f"the Ray cluster has {have:g}",
                           "serve fewer --replicas or fewer --threads each, or add machines (ray start --address)")


def _deploy_failure(err: RuntimeError) -> str:
    """The one line that says why the deployment failed: a replica's :class:`ReplicaFailed`, read
    from the deployments' status, else the error's first line."""
    with contextlib.suppress(Exception):  # the status is a help, not a need
        for deployment in serve.status().applications[APP].deployments.values():
            found = re.search(r"ReplicaFailed: (replica \S+ cannot serve: [^\n]*)", deployment.message or "")
            if found:
                return found[1].rstrip(".\"' ")
    return _one_line(err)
