"""``specdec serve``: load the models once and serve them over HTTP (see :mod:`specdec.server.app`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import specdec
from specdec.cli.common import (
    CLIError, add_backend_option, add_context_option, add_model_options, check_threads, load_models_from, non_negative_float,
    non_negative_int, positive_int,
)
from specdec.backends import table as backend_table
from specdec.backends.shared import default_slots
from specdec import datastore
from specdec.config import SAMPLERS
from specdec.constraints import ConstraintError, Constraints
from specdec.costs import MAX_ROWS, row_costs
from specdec.server.app import ServerOptions, Served, app_for
from specdec.server.guard import allowed_hosts, uvicorn_config
from specdec.server.metrics import Metrics
from specdec.server.requests import method_config, method_kwargs
from specdec.serving import Engine, ModelThread, Observer

API_KEY_ENV = "SPECDEC_API_KEY"
DEFAULT_METHOD = "spec"  # the method of requests that name none: the default method (specdec.config)
DATASTORE_TOKENS = 1 << 20  # the outputs a server's datastore keeps (4 MiB of token ids and as much of index)


def add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the models over an OpenAI-compatible HTTP API",
        description="Load the target (and draft) once and serve OpenAI-style /v1/completions and "
                    "/v1/chat/completions, with streaming, /metrics for Prometheus and a page at / "
                    "that shows which tokens the draft supplied. One generation runs at a time; "
                    "other requests wait in a bounded queue.",
    )
    add_model_options(parser)
    add_backend_option(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 exposes the server)")
    group.add_argument("--allowed-hosts", default="", metavar="NAMES",
                       help="Host header names to answer besides the bound address's own (localhost, 127.0.0.1 "
                            "and [::1] on loopback), comma-separated; '*' answers any. Bound to 0.0.0.0 or ::, "
                            "the server answers any. Other names get 400, so a web page cannot reach the server "
                            "by DNS rebinding")
    group.add_argument("--port", type=positive_int, default=8000, help="(default: 8000)")
    group.add_argument("--method", default=None, metavar="METHOD",
                       help="decoding method for requests that name none, in the text form 'specdec bench "
                            "--methods' takes, e.g. spec:model:block:k=4, spec:tree, spec:ngram:block, ar (default: "
                            "spec, the method 'specdec generate' runs: spec:ngram+model:block:k=4:policy=auto, block "
                            "verification with the planner choosing each step's drafter (n-gram lookup or the draft "
                            "model) and draft length; ar with --draft none); a request may pick its own with "
                            "\"speculative\": {\"method\": ...}")
    group.add_argument("--parallel", type=positive_int, default=None, metavar="N",
                       help="requests decoded at once, each in a slot of its own (its caches of the target and the "
                            "draft), their passes sharing each pass of the weights; every answer is the one the "
                            "request gets alone. Needs the GGUF kernel (--backend gguf, or auto where it runs the "
                            "file); llama.cpp and torch serve one request at a time (default: on the GGUF kernel, "
                            "from this machine's measured cost of a pass of n rows: the fewest slots that make 90%% "
                            "of the most tokens per second, at most 8 and within the memory; else 1)")
    add_context_option(group, per="each slot (each request decoded at once: --parallel)")
    group.add_argument("--max-queue", type=non_negative_int, default=16, metavar="N",
                       help="requests that may wait while --parallel generate; more get 429 (default: 16)")
    group.add_argument("--request-timeout", type=_seconds, default=600.0, metavar="S",
                       help="seconds a request may take, queue wait included (default: 600)")
    group.add_argument("--max-tokens", type=positive_int, default=2048, metavar="N",
                       help="the most tokens a request may ask for; the chat default (default: 2048)")
    group.add_argument("--max-body-bytes", type=positive_int, default=4 << 20, metavar="N",
                       help="the largest request body; a larger one gets 413 (default: 4194304, 4 MiB)")
    group.add_argument("--read-timeout", type=_seconds, default=30.0, metavar="S",
                       help="seconds a client has to send a request's headers, and again its body; a slower "
                            "one gets 408 and is disconnected (default: 30)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health. A key on the "
                            f"command line shows in ps; --api-key-file or ${API_KEY_ENV} keeps it out "
                            f"(default: ${API_KEY_ENV}, else none)")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from the first line of this file (it stays out of ps)")
    group.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads the models run on: specdec's GGUF kernel's or llama.cpp's threads for "
                            "a GGUF, torch's for transformers (default: every CPU this process may use; torch: "
                            "its choice)")
    group.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                       help="prefill every prompt in full. By default the server keeps the models' caches between "
                            "requests and prefills only what a prompt adds to the longest prefix it shares with the "
                            "previous one (as llama-server does)")
    group.add_argument("--prompt-cache-mib", type=non_negative_int, default=2048, metavar="N",
                       help="RAM for the caches of earlier requests, put back when a prompt shares more with one of "
                            "them than with the last request (on the GGUF backends, specdec's kernel and llama.cpp; "
                            "least recently used dropped first; 0: keep only the last request's) (default: 2048)")
    group.add_argument("--seeded-sampler", choices=SAMPLERS, default="gumbel",
                       help="the sampler of a request that sends a seed and no sampler: gumbel gives the text "
                            "plain decoding draws with that seed, whatever the method or machine (coupled "
                            "verification); multinomial keeps block verification's higher acceptance for sampled "
                            "drafts, and the text depends on the method (default: gumbel)")
    group.add_argument("--datastore", default=None, metavar="NAME|PATH",
                       help="the retrieval datastore (from 'specdec index') that requests drafting with "
                            "spec:retrieval or spec:retrieval+model search unless they name one; every finished "
                            "output is added to it (default: an empty store that collects the outputs)")
    group.add_argument("--datastore-max-tokens", type=positive_int, default=DATASTORE_TOKENS, metavar="N",
                       help=f"the most tokens the datastore keeps, the oldest outputs dropped first "
                            f"(default: {DATASTORE_TOKENS})")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: info)")
    cluster = parser.add_argument_group("cluster (Ray Serve; pip install 'specdec[ray]')")
    cluster.add_argument("--ray", action="store_true",
                         help="serve on Ray Serve: replicas of the models, each with its own slots and prompt cache, "
                              "behind one ingress at --host:--port that answers as this server does; a conversation's "
                              "requests go to the replica that served its beginning (docs/scale-out.md)")
    cluster.add_argument("--ray-address", default=None, metavar="ADDRESS",
                         help="the Ray cluster to deploy on: HOST:PORT of its head, or auto for the one this machine "
                              "runs (default: start a Ray of this machine's CPUs, stopped with the server)")
    cluster.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                         help="replicas of the models, each on --threads CPUs (default: 1)")
    cluster.add_argument("--min-replicas", type=non_negative_int, default=None, metavar="N",
                         help="autoscale: never fewer replicas than this (default: no autoscaling)")
    cluster.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                         help="autoscale: never more replicas than this, adding one while the replicas have more "
                              "requests under way than their slots (--parallel) (default: no autoscaling)")
    cluster.add_argument("--router-imbalance", type=non_negative_float, default=None, metavar="N",
                         help="how many more requests one replica may have under way than another before the router "
                              "stops sending a conversation to the replica that holds its beginning and picks the "
                              "less loaded (default: a replica's slots, --parallel)")
    cluster.add_argument("--router", choices=("prefix", "load"), default="prefix",
                         help="how a request's replica is chosen: prefix, the replica whose prompt cache holds the "
                              "longest start of its prompt (Ray Serve's prefix-aware router), or load, the less "
                              "loaded of two drawn at random (Ray Serve's default) (default: prefix)")
    parser.set_defaults(func=run_serve)


def _seconds(text: str) -> float:
    value = non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def default_method(args: argparse.Namespace) -> Any:
    """The server's default method (a :class:`~specdec.config.DecodeConfig`), checked before any
    model loads."""
    no_draft = args.draft is None
    try:
        return method_config(args.method or ("ar" if no_draft else DEFAULT_METHOD), not no_draft, request=False)
    except ValueError as err:
        raise CLIError(f"--method: {err}", "e.g. --method spec, --method spec:ngram:block or --method spec:tree",
                       code=2) from None


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $SPECDEC_API_KEY (in that order); None for none."""
    if args.api_key is not None and args.api_key_file is not None:
        raise CLIError("give --api-key or --api-key-file, not both", "--api-key-file keeps the key out of ps",
                       code=2)
    if args.api_key_file is not None:
        return _key_file(args.api_key_file)
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise CLIError("--api-key is empty", f"give a key, or unset ${API_KEY_ENV}", code=2)
    return key


def _key_file(path: str) -> str:
    try:
        text = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "it is not UTF-8 text"
        raise CLIError(f"--api-key-file: cannot read {path}: {reason}",
                       "give a file whose first line is the key", code=2) from None
    key = text.split("\n", 1)[0].strip()
    if not key:
        raise CLIError(f"--api-key-file {path} is empty: its first line holds no key",
                       "write the key on the file's first line", code=2)
    return key


def run_serve(args: argparse.Namespace) -> int:
    method = default_method(args)
    key = api_key(args)
    if args.ray:
        return _run_cluster(args, method, key)
    _check_no_cluster_options(args)
    options = server_options(args, method, key, 1, None)  # checked before the models load
    import uvicorn

    metrics = Metrics()
    engine = load_engine(args, metrics)
    options = dataclasses.replace(options, parallel=engine.parallel, datastore=engine.datastore)
    app = app_for(Served.of(engine.pair), options, engine, metrics)
    print(f"specdec: serving {args.target} ({method}) on http://{_url_host(args.host)}:{args.port}/ "
          "(the page is at /, metrics at /metrics)", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn_config(app, options, host=args.host, port=args.port, log_level=args.log_level,
                                  access_log=False)).run()
    return 0


def server_options(args: argparse.Namespace, method: Any, key: str | None, parallel: int, store: Any) -> ServerOptions:
    """The HTTP side's options from the command line's."""
    return ServerOptions(method, max_queue=args.max_queue, request_timeout=args.request_timeout,
                         api_key=key, max_tokens=args.max_tokens,
                         allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                         max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout,
                         prompt_cache=args.prompt_cache, prompt_cache_bytes=args.prompt_cache_mib << 20,
                         seeded_sampler=args.seeded_sampler, datastore=store, parallel=parallel)


def load_engine(args: argparse.Namespace, observer: Observer | None = None) -> Engine:
    """The engine ``specdec serve`` answers with, built from its options: the pair loaded on the
    engine's model thread, its slots (--parallel, or chosen from the measured cost of a pass), its
    prompt cache and datastore; warmed up, not started. Each replica of ``specdec serve --ray``
    builds its own with it. ``observer``: the engine's (the server's metrics)."""
    method = default_method(args)
    store = served_datastore(args)
    check_threads(args.threads)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    thread = ModelThread()  # every call into the models, loading included, runs on it (specdec.serving.engine)
    models = thread.call(load_models_from, args)  # a Pair: its target_name is the model id clients pass
    parallel = args.parallel or thread.call(choose_slots, models)
    if args.parallel is not None:
        check_slots_fit(models, parallel)
    try:
        engine = Engine(models, parallel=parallel, max_queue=args.max_queue,
                        prompt_cache_bytes=args.prompt_cache_mib << 20 if args.prompt_cache else None,
                        datastore=store, observer=observer, thread=thread)
    except ValueError as err:
        sharing = " or ".join(b.name for b in backend_table.TABLE if b.shares_passes)
        raise CLIError(f"--parallel {parallel}: {err}", f"add --backend {sharing}, or serve with --parallel 1",
                       code=2) from None
    thread.call(_warm_up, engine, method, args.prompt_cache)
    return engine


def _check_no_cluster_options(args: argparse.Namespace) -> None:
    given = [flag for flag, value, unset in (("--ray-address", args.ray_address, None), ("--replicas", args.replicas, 1),
                                             ("--min-replicas", args.min_replicas, None),
                                             ("--max-replicas", args.max_replicas, None),
                                             ("--router-imbalance", args.router_imbalance, None),
                                             ("--router", args.router, "prefix")) if value != unset]
    if given:
        raise CLIError(f"{given[0]} is an option of a cluster", "add --ray to serve on Ray Serve", code=2)


def _run_cluster(args: argparse.Namespace, method: Any, key: str | None) -> int:
    """``specdec serve --ray``: deploy :func:`cluster_options`' application on Ray Serve and serve
    until Ctrl-C (:func:`specdec.cluster.run`)."""
    try:
        from specdec import cluster  # Ray Serve: only the ray extra installs it, and only a cluster needs it
    except ImportError as err:
        raise CLIError(f"--ray: {err}", "docs/scale-out.md says how to set up a cluster", code=2) from None
    app = cluster.application(load_engine, args, cluster_options(args, method, key))

    def deploying() -> None:
        print(f"specdec: deploying {args.target} ({method}) on Ray Serve", file=sys.stderr, flush=True)

    def ready() -> None:
        print(f"specdec: serving on http://{_url_host(args.host)}:{args.port}/ (the page is at /, metrics at "
              "/metrics); Ctrl-C stops it", file=sys.stderr, flush=True)

    try:
        cluster.run(app, args, deploying, ready)
    except cluster.ClusterError as err:
        raise CLIError(err.message, err.hint) from None
    return 0


def cluster_options(args: argparse.Namespace, method: Any, key: str | None) -> ServerOptions:
    """The options of a cluster's ingress (``specdec serve --ray``, ``serve run specdec.ray:app``):
    the server's, its datastore left to the replicas."""
    if args.min_replicas is not None and args.max_replicas is not None and args.min_replicas > args.max_replicas:
        raise CLIError(f"--min-replicas {args.min_replicas} is more than --max-replicas {args.max_replicas}",
                       "give a range, e.g. --min-replicas 1 --max-replicas 4", code=2)
    return server_options(args, method, key, args.parallel or 1, None)


def choose_slots(models: Any) -> int:
    """--parallel's default: where the models' passes may be shared (the GGUF kernel's,
    :func:`specdec.backends.table.shares_passes`), :func:`~specdec.backends.shared.default_slots` of the
    target's measured cost curve (measured once per machine and cached), as many as fit in memory; 1 elsewhere."""
    if not backend_table.shares_passes(models.target, models.draft):
        return 1
    curve, source = row_costs(models.target, MAX_ROWS)
    slots = default_slots(curve)
    fits = slots_that_fit(models)
    if fits is not None:
        slots = max(1, min(slots, fits))
    rates = [n / seconds * curve[0] for n, seconds in enumerate(curve, start=1)]
    print(f"specdec: --parallel {slots}: {slots} sequences in a pass make {rates[slots - 1]:.2f}x the tokens per "
          f"second of one (a pass of {len(curve)}: {rates[-1]:.2f}x; from the target's row costs, {source})", file=sys.stderr, flush=True)
    check_slots_fit(models, slots)
    return slots


def slots_that_fit(models: Any) -> int | None:
    """How many slots' caches fit in the memory available now (None where that is not known)."""
    available = available_memory()
    if available is None:
        return None
    return max(1, available // _slot_bytes(models))


def _slot_bytes(models: Any) -> int:
    """What one slot's caches of the target and the draft take at a full context."""
    return sum(backend_table.cache_bytes(model) or 0 for model in (models.target, models.draft) if model is not None)


def check_slots_fit(models: Any, parallel: int) -> None:
    """Say what a slot's caches take, and refuse a --parallel whose caches do not fit in the memory
    available now (the caches' pages are taken as they fill: a slot reaches this at a full context)."""
    if parallel == 1 or backend_table.cache_bytes(models.target) is None:
        return
    per_slot = _slot_bytes(models)
    available = available_memory()
    context = models.target.max_context
    print(f"specdec: {parallel} slots, each with {per_slot / 2**20:.0f} MiB of KV cache at a full context "
          f"({context} tokens)", file=sys.stderr, flush=True)
    if available is not None and parallel * per_slot > available:
        fits = max(1, available // per_slot)
        raise CLIError(f"--parallel {parallel}: the slots' caches take up to {parallel * per_slot / 2**30:.1f} GiB "
                       f"at a full context, and {available / 2**30:.1f} GiB of memory is available",
                       f"serve with --parallel {fits} or fewer, or a shorter context (--ctx-size, now {context})",
                       code=2)


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def served_datastore(args: argparse.Namespace) -> Any:
    """The datastore the server searches and feeds (``--datastore``, bounded by
    ``--datastore-max-tokens``), made the process's default (:func:`specdec.datastore.use_default`)."""
    try:
        store = datastore.open_store(args.datastore) if args.datastore else datastore.Datastore()
    except ValueError as err:
        raise CLIError(f"--datastore: {err}", "build a store with 'specdec index PATH... --name NAME'", code=2) from None
    store.max_tokens = args.datastore_max_tokens
    datastore.use_default(store)
    return store


def _warm_up(engine: Engine, method: Any, prompt_cache: bool) -> None:
    """Two tokens with the default method on the models requests will run on, before serving, so
    the first request does not pay for one-time work (the draft's int8 weights, the kernels'
    first calls); then one token under a JSON schema, which builds llguidance's view of the
    vocabulary once (about a second for a 150k-token vocabulary) for every constrained request."""
    print("specdec: warming up", file=sys.stderr, flush=True)
    models = engine.pair
    prompt = models.tokenizer("def", add_special_tokens=True)["input_ids"] or [0]
    target, draft = engine.backends(method.replace(prompt_cache=prompt_cache))
    kwargs = method_kwargs(method, draft, models.draft_weights)
    specdec.generate(target, prompt, max_new_tokens=2, **kwargs)
    if importlib.util.find_spec("llguidance") is not None:
        try:
            specdec.generate(target, prompt, tokenizer=models.tokenizer, max_new_tokens=1,
                             constraints=Constraints(json_schema={"type": "object"}), **kwargs)
        except ConstraintError as err:  # e.g. a slow tokenizer: constrained requests get this error, others are served
            print(f"specdec: constrained output is not available: {err}", file=sys.stderr, flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
