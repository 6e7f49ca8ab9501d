"""Servers as peers: llama.cpp's own ``llama-server`` and ``specdec serve``, called by one client.

A CPU user with a GGUF file runs ``llama-server``; the comparison that matters to them is one
server against the other, each called over HTTP the same way. :class:`Servers` starts each
server once per bench run as its own process, on the same GGUF files and thread count (and a
context of the same size), and :meth:`Servers.complete` sends every request the same way: the
prompt as token ids to ``POST /v1/completions``, streamed, ``max_tokens`` and the sampling
settings set so that both servers sample plainly (greedy at temperature 0, else softmax(logits /
T) with top-k, top-p, min-p and the penalties off, seeded), EOS ignored when the run ignores it.
A run's wall time is the client's: from sending the request to the stream's end.

With ``endpoint="chat"`` (``specdec bench --server-endpoint chat``) a chat prompt goes instead as
its messages to ``POST /v1/chat/completions`` with the fields an OpenAI client sends by default
(:func:`chat_request_body`: the messages, ``max_tokens``, ``temperature``, ``seed``, streamed with
usage): each server samples with its own defaults, as its users get it (llama-server's top-k 40,
top-p 0.95 and min-p 0.05 at a temperature above 0; specdec's the plain softmax), applies its own
chat template, and llama-server's stream carries text only, so its tokens are the text
tokenised again by the target's tokenizer (:func:`run_server`). Raw-text prompts always go as token
ids to ``/v1/completions``: there is no chat to send.

A prompt with a JSON schema (the ``extract`` set, :mod:`specdec.prompts`) sends it to both servers
the same way: on the chat endpoint as OpenAI's ``response_format: {"type": "json_schema",
"json_schema": {"name", "schema", "strict": true}}``, which llama-server turns into a grammar as
specdec serve does (with llguidance); on ``/v1/completions`` as the top-level ``json_schema`` both
servers take. Such a request never asks to ignore EOS: the output ends where its JSON value ends
(with EOS banned, a grammar that allows only the end leaves llama-server nothing to sample).
Each output is then checked against the schema (:mod:`specdec.bench.schema_check`), and specdec's
final ``speculative`` summary gives ``forced_tokens``, the tokens the grammar forced.

A prompt with a predicted output (a prompt file's ``"prediction"``) sends it, as OpenAI's
Predicted Outputs (``"prediction": {"type": "content", "content": ...}``), to the ``specdec serve``
methods with ``prediction=yes`` only (:mod:`specdec.bench.methods`); every other request, and
every request to llama-server, which has no such field, is the same without it. The answer's usage
gives the prediction tokens the server drafted and kept or rejected
(``completion_tokens_details.accepted_prediction_tokens`` and ``rejected_prediction_tokens``).

``llama-server`` runs with its own defaults (one slot, its prompt cache on, as a user gets it)
plus what a fair comparison needs: the thread count, the context, and for the speculative
configurations ``-md DRAFT --spec-type draft-simple`` (its draft-model speculation, with its
defaults for the draft) or ``--spec-default`` (its n-gram drafter). Its binary is the one :data:`BUILD_SCRIPT` builds from the llama.cpp source that the
installed llama-cpp-python vendors; ``$SPECDEC_LLAMA_SERVER`` or ``PATH`` may name another.
The tokens each server produced are read from the stream: ``speculative.token_ids`` in
specdec's chunks, ``__verbose.tokens`` in llama-server's (asked for with ``return_tokens`` and
``verbose``), and llama-server's draft figures from its final ``timings``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from specdec.backends.table import BY_NAME
from specdec.bench.methods import PEERS, MethodSpec
from specdec.bench.sample import Sample, median as _median
from specdec.bench.schema_check import check_output
from specdec.config import DecodeConfig

BUILD_SCRIPT = "benchmarks/build_llama_server.sh"
LLAMA_SERVER_ENV = "SPECDEC_LLAMA_SERVER"
DEFAULT_BINARY = Path.home() / ".cache" / "specdec" / "llama-server" / "bin" / "llama-server"
# llama-server's configurations, by peer name: the flags beyond the shared ones (PEERS' server rows).
LLAMA_SERVER_FLAGS: dict[str, tuple[str, ...]] = {name: p.server_flags for name, p in PEERS.items() if p.is_server}
START_SECONDS = 300.0  # how long a server may take to load its models and answer /health
REQUEST_SECONDS = 3600.0


PREDICTION_KEY = ":prediction=yes"  # ends the server key of a method that sends predictions
RAY_KEY = ":ray="  # then the replicas, in the server key of a method served on Ray Serve


def server_key(method: MethodSpec) -> str:
    """The :meth:`Servers.server` key of a server method."""
    if method.is_peer:
        return method.kind
    ray = f"{RAY_KEY}{method.replicas}" if method.via == "ray" else ""
    return f"specdec:{method.backend}:{method.config}{ray}" + (PREDICTION_KEY if method.prediction else "")


def key_method(key: str) -> str:
    """The method a ``specdec:`` server key's server was started with (its default method)."""
    return key.removesuffix(PREDICTION_KEY).split(":", 2)[2].partition(RAY_KEY)[0]


class ServerMissing(RuntimeError):
    """No llama-server binary; the message says how to build one."""


def llama_server_binary() -> Path:
    """$SPECDEC_LLAMA_SERVER, else the build script's output, else ``llama-server`` on PATH."""
    named = os.environ.get(LLAMA_SERVER_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise ServerMissing(f"${LLAMA_SERVER_ENV} names {path}, which is not a file")
        return path
    if DEFAULT_BINARY.is_file():
        return DEFAULT_BINARY
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    raise ServerMissing(
        f"llama-server is not built: run {BUILD_SCRIPT} (it builds llama.cpp's server from the source the "
        f"installed llama-cpp-python vendors, about 4 minutes on 2 cores), or set ${LLAMA_SERVER_ENV} to a "
        "llama-server binary")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """One server process on a loopback port; its output goes to a log file, shown if it fails."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, client: httpx.Client) -> None:
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} while starting:\n"
                                   f"{self.tail()}")
            try:
                if client.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.close()
        raise RuntimeError(f"{self.name} did not answer /health within {START_SECONDS:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return "\n".join(self.log.read().decode("utf-8", "replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None


@dataclass
class Servers:
    """The servers of a bench run, started on first use and kept until :meth:`close`.

    target_gguf / draft_gguf: the files llama-server loads. specdec_argv: ``specdec serve``'s
    model options (the bench's own ``--target``, ``--draft``, ``--cache-dir``, ...), to which the
    backend, threads, port and context are added. torch_argv: the options of the torch backend
    (``--dtype``, ``--kernels``, ``--draft-weights``), given only to a server whose method runs on
    torch (a GGUF backend refuses them). n_threads: both servers' threads (None: each server's
    default). n_ctx: the context both allocate, for each request. parallel: the requests each server
    decodes at once (``specdec serve --parallel N``, ``llama-server -np N`` with N times the context,
    which it divides among its slots; None: specdec serve's default, llama-server's one slot); a
    server started after it changes has the new value.
    """

    target_gguf: Path | None
    draft_gguf: Path | None
    specdec_argv: list[str]
    n_threads: int | None = None
    n_ctx: int = 4096
    torch_argv: list[str] = field(default_factory=list)
    parallel: int | None = None  # requests each server decodes at once: specdec serve's --parallel, llama-server's -np (None: each server's default, llama-server given one slot)
    running: dict[str, ServerProcess] = field(default_factory=dict)
    # A new connection per request: llama-server may close a kept-alive one just as it is reused.
    client: httpx.Client = field(default_factory=lambda: httpx.Client(
        timeout=REQUEST_SECONDS, limits=httpx.Limits(max_keepalive_connections=0)))

    def server(self, key: str) -> ServerProcess:
        """The running server for ``key`` (:func:`server_key`): a llama-server peer's name, or
        ``specdec:<backend>:<method>`` (one ``specdec serve`` per method, with that method as its
        default and, for ``ar``, no draft model: as a user would start it, and so that no server
        finds the prompt another method's run just left in its cache), followed by ``:ray=N`` for
        ``specdec serve --ray`` with N replicas (on a Ray of its own; the threads and slots divided
        among the replicas; ``:ray=N/load``: with ``--router load``) and by ``:prediction=yes`` for the method that sends predictions (a
        server of its own, for the same reason)."""
        if key not in self.running:
            process = ServerProcess(key, self._argv(key), free_port())
            process.argv = [a.replace("{port}", str(process.port)) for a in process.argv]
            process.start(self.client)
            self.running[key] = process
        return self.running[key]

    def _argv(self, key: str) -> list[str]:
        threads = [] if self.n_threads is None else [str(self.n_threads)]
        if key.startswith("specdec:"):
            backend, method = key.split(":", 2)[1], key_method(key)
            replicas = key.removesuffix(PREDICTION_KEY).partition(RAY_KEY)[2]
            replicas, _, router = replicas.partition("/")
            argv = list(self.specdec_argv) + (self.torch_argv if not BY_NAME[backend].runs_gguf else [])
            if method == "ar" and "--draft" in argv:
                argv[argv.index("--draft") + 1] = "none"
            share = int(replicas or 1)  # a cluster's replicas share the threads and slots one server has
            cluster = ["--ray", "--replicas", replicas, *(["--router", router] if router else [])] if replicas else []
            if self.n_threads is not None:
                threads = [str(max(1, self.n_threads // share))]
            return [sys.executable, "-m", "specdec", "serve", *argv, "--backend", backend, "--method", method,
                    "--port", "{port}", "--log-level", "warning", "--max-tokens", str(self.n_ctx), *cluster,
                    *(["--threads", *threads] if threads else []),
                    *(["--parallel", str(max(1, self.parallel // share))] if self.parallel is not None else [])]
        if self.target_gguf is None:
            raise ValueError(f"{key} runs the target's GGUF; give a pack or a .gguf file as the target")
        flags = list(PEERS[key].server_flags)
        if "{draft}" in flags:
            if self.draft_gguf is None:
                raise ValueError(f"{key} needs the draft's GGUF; give a draft pack or .gguf file (--draft)")
            flags = [str(self.draft_gguf) if f == "{draft}" else f for f in flags]
        return [str(llama_server_binary()), "-m", str(self.target_gguf), *flags, "--host", "127.0.0.1",
                "--port", "{port}", "-c", str(self.n_ctx * (self.parallel or 1)), "-np", str(self.parallel or 1), "--no-webui",
                *(["-t", *threads, "-tb", *threads] if threads else [])]

    def complete(self, key: str, body: dict[str, Any], path: str = "/v1/completions",
                 client: httpx.Client | None = None) -> "Completion":
        """POST ``body`` (streamed) to the server's ``path``; the tokens, text and timings.
        ``client``: the HTTP client to send it with (default: the run's; a client thread has its own)."""
        server = self.server(key)
        out = Completion()
        start = time.perf_counter()
        with (client or self.client).stream("POST", f"{server.url}{path}", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"{key} answered {response.status_code}: {response.text[:500]}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{key} failed: {chunk['error']}")
                out.add(chunk, now - start)
        out.seconds = time.perf_counter() - start
        return out

    def stop(self) -> None:
        """Stop every server (the next request starts its server again, with empty caches)."""
        for process in self.running.values():
            process.close()
        self.running.clear()

    def close(self) -> None:
        self.stop()
        self.client.close()


@dataclass
class Completion:
    """What one streamed completion brought back."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the request, tokens)
    text_arrivals: list[float] = field(default_factory=list)  # chunks with text and no token ids: when each came
    timings: dict[str, Any] = field(default_factory=dict)  # llama-server's final timings
    speculative: dict[str, Any] = field(default_factory=dict)  # specdec's final summary
    usage: dict[str, Any] = field(default_factory=dict)  # the usage chunk, where the request asked for one
    finish_reason: str | None = None  # the last choice's, as the stream gave it
    drafted: list[int] = field(default_factory=list)  # specdec: per step
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, chunk: dict[str, Any], at: float) -> None:
        piece = ""
        for choice in chunk.get("choices", []):  # a completion's text, or a chat delta's content
            piece += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.text += piece
        ids: list[int] = []
        spec = chunk.get("speculative")
        if spec is not None and "token_ids" in spec:
            ids = spec["token_ids"]
            self.drafted.append(spec["drafted"])
            self.accepted.append(sum(spec["from_draft"]))
        elif spec is not None:
            self.speculative = spec
        verbose = chunk.get("__verbose")
        if verbose is not None:
            ids = verbose.get("tokens") or []
        if "timings" in chunk:
            self.timings = chunk["timings"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if ids:
            self.token_ids += ids
            self.arrivals.append((at, len(ids)))
        elif piece:
            self.text_arrivals.append(at)


def request_body(prompt_ids: Sequence[int], temperature: float, max_new_tokens: int, seed: int,
                 ignore_eos: bool, *, llama_server: bool, method: str | None = None,
                 schema: dict[str, Any] | None = None, prediction: str | None = None) -> dict[str, Any]:
    """The request both servers get: plain sampling (see the module docstring), streamed;
    ``schema``: the JSON schema the output must follow (``json_schema``; EOS then not ignored);
    ``prediction``: the predicted output's text (:func:`predicted_output`)."""
    body: dict[str, Any] = {"prompt": list(prompt_ids), "max_tokens": max_new_tokens, "temperature": temperature,
                            "top_p": 1.0, "top_k": 0, "seed": seed, "stream": True}
    if schema is not None:
        body["json_schema"] = schema
        ignore_eos = False
    if prediction:  # with the usage chunk, which counts the prediction's tokens
        body |= predicted_output(prediction) | {"stream_options": {"include_usage": True}}
    if llama_server:
        body |= {"min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                 "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0,
                 "ignore_eos": ignore_eos, "return_tokens": True, "verbose": True}
    else:  # the method's own sampler: a seeded request would otherwise get the server's (--seeded-sampler)
        sampler = "gumbel" if DecodeConfig.parse(method or "spec").gumbel else "multinomial"
        body |= {"ignore_eos": ignore_eos, "sampler": sampler, "speculative": {"method": method or "spec"}}
    return body


def chat_request_body(messages: Sequence[dict[str, str]], temperature: float, max_new_tokens: int, seed: int,
                      ignore_eos: bool, schema: dict[str, Any] | None = None,
                      schema_name: str = "output", prediction: str | None = None) -> dict[str, Any]:
    """The chat request both servers get: what an OpenAI client sends by default (no sampler
    field but the temperature and seed; usage asked for at the stream's end), and
    ``ignore_eos`` when the run makes every completion its full length. ``schema``: the JSON
    schema the answer must follow, sent as an OpenAI client sends structured output
    (``response_format``, strict; EOS then not ignored, see the module docstring).
    ``prediction``: the predicted output's text (:func:`predicted_output`)."""
    body: dict[str, Any] = {"messages": [dict(m) for m in messages], "max_tokens": max_new_tokens,
                            "temperature": temperature, "seed": seed, "stream": True,
                            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": schema_name, "schema": schema, "strict": True}}
    elif ignore_eos:
        body["ignore_eos"] = True
    return body | predicted_output(prediction)


def predicted_output(prediction: str | None) -> dict[str, Any]:
    """The request's ``prediction`` field as an OpenAI client sends it (none for no prediction)."""
    return {"prediction": {"type": "content", "content": prediction}} if prediction else {}


def prediction_counts(done: Completion) -> tuple[int | None, int | None]:
    """(accepted, rejected) prediction tokens the answer's usage reports; (None, None) where it
    reports none (a request without a prediction, or a server that takes none)."""
    details = done.usage.get("completion_tokens_details") or {}
    if "accepted_prediction_tokens" not in details:
        return None, None
    return int(details["accepted_prediction_tokens"]), int(details["rejected_prediction_tokens"])


def end_of_turn_token(tokenizer: Any, eos: Sequence[int]) -> int | None:
    """The end-of-generation token (one of ``eos``) the chat template closes an assistant's turn
    with, the last one in a rendered user/assistant exchange; None where the run ignores the end,
    the template renders none or cannot be rendered."""
    if not eos or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                            tokenize=True)
    except Exception:  # a template that takes no such exchange: nothing put back
        return None
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    ends = set(eos)
    return next((int(t) for t in reversed(list(ids)) if int(t) in ends), None)


def run_server(servers: Servers, key: str, name: str, prompt_ids: list[int], temperature: float,
               max_new_tokens: int, eos: list[int], seed: int, method: str | None = None,
               messages: Sequence[dict[str, str]] | None = None,
               tokenize: Callable[[str], list[int]] | None = None, schema: dict[str, Any] | None = None,
               schema_name: str = "output", prediction: str | None = None,
               end_of_turn: int | None = None) -> Sample:
    """One timed completion through a server (``key``: see :meth:`Servers.server`) as a Sample.

    messages: send these to /v1/chat/completions (:func:`chat_request_body`) instead of
    ``prompt_ids`` to /v1/completions; a stream that carries no token ids (llama-server's chat
    stream) then has its text tokenised by ``tokenize``, and where it stopped by itself
    (``finish_reason`` ``stop``: the bench sends no stop strings) ``end_of_turn``
    (:func:`end_of_turn_token`) is put back at its end: the token the model ended on, which the
    text does not show, so that an answer equal to plain decoding's compares equal. schema: the
    JSON schema the output must follow, sent with the request; the text the client received is
    checked against it (the sample's ``json_parsed`` and ``schema_valid``). prediction: the predicted output sent with the
    request; the sample's ``prediction_accepted`` and ``prediction_rejected`` are the usage's counts."""
    reported = None
    if messages:
        body = chat_request_body(messages, temperature, max_new_tokens, seed, not eos, schema, schema_name,
                                 prediction)
        done = servers.complete(key, body, "/v1/chat/completions")
        if not done.token_ids and done.text:
            if tokenize is None:
                raise ValueError(f"{key}'s chat stream carries no token ids; give run_server a tokenize function")
            done.token_ids = tokenize(done.text) + ([end_of_turn] if done.finish_reason == "stop"
                                                    and end_of_turn is not None else [])
            done.arrivals = [(at, 1) for at in done.text_arrivals]  # llama-server streams a token a chunk
            reported = int(done.usage["completion_tokens"]) if "completion_tokens" in done.usage else None
    else:
        body = request_body(prompt_ids, temperature, max_new_tokens, seed, not eos,
                            llama_server=not key.startswith("specdec:"), method=method, schema=schema,
                            prediction=prediction)
        done = servers.complete(key, body)
    checked = check_output(done.text, schema) if schema is not None else None
    first = done.arrivals[0] if done.arrivals else (done.seconds, 0)
    gaps = [b[0] - a[0] for a, b in zip(done.arrivals, done.arrivals[1:])]
    timings = done.timings
    drafted, accepted = done.drafted, done.accepted
    totals = (None, None)
    if key in PEERS and PEERS[key].drafter is not None:  # totals only, left out where it drafted none
        totals = (int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0)))
    spec = done.speculative
    kept, rejected = prediction_counts(done)
    return Sample(
        method=name, prompt=0, repeat=0, order=0, seed=seed, token_ids=done.token_ids, seconds=done.seconds,
        target_forwards=int(spec.get("target_forwards") or (len(done.token_ids) if reported is None else reported)
                            - sum(accepted) - (totals[1] or 0)),
        step_drafted=drafted, step_accepted=accepted, drafted_total=totals[0], accepted_total=totals[1],
        draft_seconds=float(spec.get("draft_seconds") or 0.0),
        verify_seconds=float(spec.get("verify_seconds") or 0.0),
        step_seconds=_median(gaps), first_step_seconds=first[0], first_step_tokens=first[1],
        json_parsed=checked.parsed if checked else None, schema_valid=checked.valid if checked else None,
        forced_tokens=int(spec["forced_tokens"]) if "forced_tokens" in spec else None,
        reported_tokens=reported, prediction_accepted=kept, prediction_rejected=rejected,
    )
