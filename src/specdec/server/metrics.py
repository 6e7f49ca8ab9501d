"""The server's Prometheus metrics, on a registry of their own (nothing global at import).

Outcomes of a request: ``ok``, ``bad_request`` (4xx for the request's content), ``unauthorized``,
``not_found``, ``queue_full`` (429), ``timeout``, ``cancelled`` (the client went away) and
``error`` (a fault of the server's own).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from specdec.serving import Observer

OUTCOMES = ("ok", "bad_request", "unauthorized", "not_found", "queue_full", "timeout", "cancelled", "error")
# Seconds: from a few milliseconds (a tiny model, a warm cache) to a long queue wait on a CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics(Observer):
    """Counters, gauges and histograms for one server; ``render()`` is the /metrics body. As the
    serving engine's :class:`~specdec.serving.Observer`, it counts what the engine tells."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specdec_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.queue_length = Gauge("specdec_queue_length", "Generation requests waiting for the models", registry=r)
        self.running = Gauge("specdec_running", "Generation requests running now (up to --parallel)", registry=r)
        self.tokens = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        self.forwards = Counter("specdec_target_forwards", "Target forward passes", registry=r)
        self.drafted = Counter("specdec_drafted_tokens", "Draft tokens proposed to the target", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds",
                              "From a request's arrival (queue wait included) to its first generated tokens",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds",
                             "Time between a request's successive tokens: each step's wall time divided "
                             "among the tokens it produced, one observation per token",
                             buckets=_ITL_BUCKETS, registry=r)
        self.request_seconds = Histogram("specdec_request_seconds", "From arrival to the last token",
                                         buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of generations, by whether the "
                                     "prompt cache held them (cached) or they were prefilled (computed)",
                                     ["source"], registry=r)
        self.queue_wait = Histogram("specdec_queue_wait_seconds", "From a request's arrival to its start on the models",
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.passes = Counter("specdec_shared_passes", "Passes of the weights run for the slots (--parallel), by "
                              "model (target, draft)", ["model"], registry=r)
        self.pass_rows = Counter("specdec_shared_pass_rows", "Rows in those passes, by model", ["model"], registry=r)
        self.pass_sequences = Counter("specdec_shared_pass_sequences", "Sequences in those passes (per pass: how "
                                      "many slots shared it), by model", ["model"], registry=r)

    def shared_pass(self, model: str, rows: int, sequences: int) -> None:
        """One pass of ``model``'s weights for the slots: its rows and how many sequences they came from."""
        self.passes.labels(model=model).inc()
        self.pass_rows.labels(model=model).inc(rows)
        self.pass_sequences.labels(model=model).inc(sequences)

    def queued(self, waiting: int) -> None:
        self.queue_length.set(waiting)

    def busy(self, running: int) -> None:
        self.running.set(running)

    def started(self, waited: float) -> None:
        self.queue_wait.observe(waited)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, seconds: float) -> None:
        self.request_seconds.observe(seconds)

    def prompt(self, cached: int, computed: int) -> None:
        self.prompt_tokens.labels(source="cached").inc(cached)
        self.prompt_tokens.labels(source="computed").inc(computed)

    def outcome(self, endpoint: str, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def step(self, tokens: int, drafted: int, accepted: int, gap: float | None) -> None:
        """One generation step: its token counts, and the seconds since the request's previous step
        (None for the first, whose wait is the time to first token)."""
        self.tokens.inc(tokens)
        self.forwards.inc()
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        if gap is not None and tokens:
            for _ in range(tokens):
                self.itl.observe(gap / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
