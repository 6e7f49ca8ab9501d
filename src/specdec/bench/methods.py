"""Benchmark methods, named by short strings.

A project method is a :class:`~specdec.config.DecodeConfig` in its text form
(:meth:`DecodeConfig.parse`: ``ar``, or ``spec[:<drafter>][:<verifier>][:key=value ...]``, ``spec``
alone being the default method that ``specdec generate`` runs), plus one key of the bench's own,
``backend=`` (torch, llamacpp or gguf -- specdec's own GGUF kernel: where the target runs; the
bench's ``--backend`` sets the default, and ``both`` runs each method on torch and llamacpp). Names are canonical: the drafter and policy are
spelled out, so ``spec:block:k=2`` is reported as ``spec:ngram+model:block:k=2:policy=auto``.

The peers are other tools' own generation, named by the bench: one row each of :data:`PEERS`
(a :class:`Peer`: the tool that runs it, what it drafts with, the project drafter it is compared
with, the keys it takes, llama-server's flags for a server peer, and what it is). They are
transformers' ``generate`` (``hf-assisted[:k=N]``, ``hf-prompt-lookup[:k=N]``, ``hf-ar``),
llama-cpp-python's own generation (``llamacpp-ar``, see :mod:`specdec.bench.peers`) and llama.cpp's
own server (``llama-server``, ``llama-server-md``, ``llama-server-spec-default``,
``llama-server-ngram``).

The server peers are called over HTTP by the same client as ``specdec serve``: a project method
with ``via=serve`` runs through a ``specdec serve`` process of its own (started with that
method, and for ``ar`` with ``--draft none``) instead of the library, so the server path is what is compared (:mod:`specdec.bench.servers`).
``via=ray`` runs it through ``specdec serve --ray`` instead: the same
models deployed on a local Ray Serve (:mod:`specdec.cluster`), ``replicas=N`` of them (default 1),
the bench's threads and slots shared among them, so the cluster's path is what is compared.
A ``spec`` method with ``via=serve`` or ``via=ray`` also takes ``prediction=yes``: its requests carry the
prompt's predicted output (OpenAI's Predicted Outputs, from a prompt file's ``"prediction"``),
which the server drafts from; the same method without the key sends the same requests without
it, as every other method does (llama-server has no such field).

On llama.cpp the drafters are the draft model and the n-gram drafter (the others read the
transformers model's layers or hidden states). The binding's own prompt lookup
(``draft_model=``) asks for every position's full-vocabulary logits and is slower than its plain
generation here, so ``llamacpp-ar`` is the only llama.cpp peer.

Examples: ``spec``, ``spec:model:block:k=4:policy=static``, ``spec:ngram:block``,
``spec:block:policy=theory``, ``spec:early-exit:block:k=3:exit_layer=20``,
``spec:tree:budget=16``, ``spec:block:k=4:backend=llamacpp``. Parsing checks every option and
value, so a typo fails before any model loads; only what depends on the model (an
``exit_layer`` past the target's layers, a ``path`` without heads) waits for the drafter to be
built (the warm-up). Result files written before drafters and policies were spelled out are read
through :func:`method_of_record`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

from specdec.backends import table as backend_table
from specdec.backends.table import LLAMACPP, TORCH
from specdec.config import AR, ConfigError, DecodeConfig, text_spelling
from specdec.drafters import registry as drafters


@dataclass(frozen=True)
class Peer:
    """One peer: another tool's own generation, run by the bench on the same models and prompts.

    ``tool``: what runs it -- ``transformers`` (its ``generate`` on the torch models),
    ``llama-cpp-python`` (the llama.cpp binding, in the bench's process, on the target's GGUF) or
    ``llama-server`` (llama.cpp's server on the target's GGUF, called over HTTP). ``description``:
    what it is, in one line. ``drafter``: what it drafts with, named as the project's drafter of
    the same sort (``model``: the draft model; ``ngram``: lookup in the context); None: plain
    decoding. ``peer_of``: the project drafter whose methods the "vs peer" column compares with it
    (:attr:`MethodSpec.peer`). ``keys``: the keys its method string takes (``k``: its draft
    length). ``default_k``: its draft length when the method gives none (None: the tool's own
    default). ``server_flags``: a server peer's llama-server flags beyond the shared ones
    (``{draft}`` stands for the draft's GGUF)."""

    name: str
    tool: Literal["transformers", "llama-cpp-python", "llama-server"]
    description: str
    drafter: str | None = None
    peer_of: str | None = None
    keys: tuple[str, ...] = ()
    default_k: int | None = None
    server_flags: tuple[str, ...] = ()

    @property
    def backend(self) -> str:
        """Where its target runs, as a method's ``backend``: transformers' on ``torch``, llama.cpp's
        on the target's GGUF (``llamacpp``)."""
        return TORCH if self.tool == "transformers" else LLAMACPP

    @property
    def is_server(self) -> bool:
        return self.tool == "llama-server"

    @property
    def uses_draft_model(self) -> bool:
        return self.drafter == "model"


# The peers by name, in the order the bench lists them.
PEERS: dict[str, Peer] = {peer.name: peer for peer in (
    Peer("hf-assisted", "transformers",
         "transformers' assisted generation (assistant_model=); k sets num_assistant_tokens (default: "
         "transformers' own, 20 with its confidence stop)",
         drafter="model", peer_of="model", keys=("k",)),
    Peer("hf-prompt-lookup", "transformers",
         "transformers' prompt lookup; k sets prompt_lookup_num_tokens (default 10, transformers' documented "
         "example value)",
         drafter="ngram", peer_of="ngram", keys=("k",), default_k=10),
    Peer("hf-ar", "transformers", "transformers' own generate without an assistant (a reference)"),
    Peer("llamacpp-ar", "llama-cpp-python",
         "llama-cpp-python's own Llama.generate on the target's GGUF (the backend's binding and build): "
         "llama.cpp's speed without specdec"),
    Peer("llama-server", "llama-server", "llama.cpp's own server on the target's GGUF, plain decoding"),
    # -md alone loads the draft but drafts nothing in this llama.cpp unless the GGUF names a
    # speculative type; draft-simple is its classic draft-model speculation.
    Peer("llama-server-md", "llama-server",
         "llama-server with the draft's GGUF (-md, --spec-type draft-simple, its defaults)",
         drafter="model", server_flags=("-md", "{draft}", "--spec-type", "draft-simple")),
    Peer("llama-server-spec-default", "llama-server", "llama-server with --spec-default (its n-gram drafter)",
         drafter="ngram", server_flags=("--spec-default",)),
    # ngram-simple: the 12 tokens before each step looked up in the prompt and the output, up to 48 drafted
    Peer("llama-server-ngram", "llama-server",
         "llama-server with --spec-type ngram-simple (its prompt lookup, its defaults)",
         drafter="ngram", server_flags=("--spec-type", "ngram-simple")),
)}

VIAS = ("library", "serve", "ray")  # how a project method is called: specdec.stream, a specdec serve process, or specdec serve --ray


@dataclass(frozen=True)
class MethodSpec:
    """One method. ``kind`` is ``ar``, ``spec`` or a peer name. ``config``: an ``ar`` or ``spec``
    method's decoding method, its drafter named (:meth:`DecodeConfig.resolve`). ``k``: a peer's
    (None: the peer's default). ``backend``: where the target runs, ``torch``, ``llamacpp`` or ``gguf`` (a
    peer's is its :attr:`Peer.backend`). ``via``: ``library`` or ``serve`` (see the module docstring).
    ``prediction``: a served ``spec`` method's requests carry the prompt's predicted output.
    ``replicas``: a ``via=ray`` method's replicas."""

    kind: str
    config: DecodeConfig | None = None
    k: int | None = None
    backend: str = TORCH
    via: str = "library"
    prediction: bool = False
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.kind in PEERS:  # a peer runs where its tool runs
            object.__setattr__(self, "backend", PEERS[self.kind].backend)
        elif self.config is None:
            object.__setattr__(self, "config", DecodeConfig(drafter=AR))

    @property
    def name(self) -> str:
        """The canonical string; ``parse_method(spec.name) == spec``."""
        backend = "" if self.backend == TORCH or self.is_peer else f":backend={self.backend}"
        backend += f":via={self.via}" if self.via != "library" else ""
        backend += f":replicas={self.replicas}" if self.replicas != 1 else ""
        backend += ":prediction=yes" if self.prediction else ""
        if self.kind != "spec":
            return (self.kind if self.k is None else f"{self.kind}:k={self.k}") + backend
        return f"{self.config}{backend}"

    @property
    def verifier(self) -> str | None:
        return self.config.verify if self.kind == "spec" else None

    @property
    def drafter(self) -> str | None:
        return self.config.drafter if self.kind == "spec" else None

    @property
    def policy(self) -> str | None:
        return self.config.policy if self.kind == "spec" and not self.is_tree else None

    @property
    def is_tree(self) -> bool:
        return self.verifier == "tree"

    @property
    def exact(self) -> bool:
        """False for lossy verification rules (reports mark them)."""
        return self.kind != "spec" or self.config.exact

    @property
    def is_peer(self) -> bool:
        return self.kind in PEERS

    @property
    def is_server(self) -> bool:
        """Called over HTTP: a llama-server peer, or a project method with ``via=serve`` or ``via=ray``."""
        return (self.kind in PEERS and PEERS[self.kind].is_server) or self.via != "library"

    @property
    def needs_draft_model(self) -> bool:
        if self.kind in PEERS:
            return PEERS[self.kind].uses_draft_model
        return self.kind == "spec" and self.config.uses_draft_model

    @property
    def peer(self) -> str | None:
        """The peer a project method is measured against (by its drafter and backend), if any."""
        if self.kind != "spec" or self.backend == LLAMACPP:  # the llama.cpp binding drafts nothing itself
            return None
        return next((peer.name for peer in PEERS.values() if peer.peer_of == self.drafter), None)

    @property
    def without_prediction(self) -> "MethodSpec":
        """The same method, its requests sent without the prompt's prediction."""
        return replace(self, prediction=False)

    @property
    def ar(self) -> "MethodSpec":
        """The ``ar`` of this method's backend: what its greedy output must equal."""
        return MethodSpec("ar", backend=self.backend)

    def runs_at(self, temperature: float) -> str | None:
        """None if the method can run at this temperature, else the reason it cannot (the rule of
        :class:`~specdec.config.DecodeConfig` it breaks there)."""
        if self.kind != "spec":
            return None
        try:
            self.config.replace(temperature=temperature)
        except ConfigError as err:
            return err.render(text_spelling, joined=True)
        return None

    def record(self) -> dict[str, Any]:
        """What results.json says of the method (read back by :func:`method_of_record`)."""
        config = self.config if self.kind == "spec" else None
        options = {} if config is None else {
            **(config.policy_options or {}), **(config.tree or {}), **(config.drafter_options or {})}
        return {"kind": self.kind, "backend": self.backend, "via": self.via, "prediction": self.prediction,
                "replicas": self.replicas,
                "verifier": self.verifier,
                "drafter": self.drafter,
                "k": config.k if config is not None else self.k, "policy": self.policy,
                "options": sorted([key, _plain(value)] for key, value in options.items()), "name": self.name}

    def __str__(self) -> str:
        return self.name


def _plain(value: Any) -> Any:
    return [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value


def parse_method(text: str, default_backend: str = TORCH) -> MethodSpec:
    """Parse one method string (see the module docstring); raises ValueError naming the problem.

    ``default_backend``: where ``ar`` and ``spec`` methods without ``backend=`` run.
    """
    kind, *fields = [f.strip() for f in text.strip().split(":")]
    if kind not in ("spec", "ar") and kind not in PEERS:
        raise ValueError(f"unknown method {text!r}; use ar, spec[:<drafter>][:<verifier>][:key=value...], "
                         f"or a peer: {', '.join(PEERS)}")
    backends = [f.partition("=")[2] for f in fields if f.partition("=")[0] == "backend"]
    vias = [f.partition("=")[2] for f in fields if f.partition("=")[0] == "via"]
    predictions = [f.partition("=")[2] for f in fields if f.partition("=")[0] == "prediction"]
    replicas = [f.partition("=")[2] for f in fields if f.partition("=")[0] == "replicas"]
    fields = [f for f in fields if f.partition("=")[0] not in ("backend", "via", "prediction", "replicas")]
    for key, given in (("backend", backends), ("via", vias), ("prediction", predictions), ("replicas", replicas)):
        if len(given) > 1:
            raise ValueError(f"method {text!r}: {key}= given twice")
    if predictions and predictions[0] not in ("yes", "no"):
        raise ValueError(f"method {text!r}: prediction= takes yes or no, got {predictions[0]!r}")
    prediction = predictions == ["yes"]
    if prediction and (kind != "spec" or vias not in (["serve"], ["ray"])):
        raise ValueError(f"method {text!r}: prediction=yes sends the prompt's predicted output with a server "
                         "request: give it to a spec method with via=serve or via=ray")
    if replicas and vias != ["ray"]:
        raise ValueError(f"method {text!r}: replicas= is the number of a cluster's replicas: give it with via=ray")
    if replicas and (not replicas[0].isdigit() or int(replicas[0]) < 1):
        raise ValueError(f"method {text!r}: replicas must be a positive integer, got {replicas[0]!r}")
    backend = backends[0] if backends else default_backend
    if backend not in backend_table.NAMES:
        raise ValueError(f"method {text!r}: unknown backend {backend!r}; choose one of {', '.join(backend_table.NAMES)}")
    via = vias[0] if vias else "library"
    if via not in VIAS:
        raise ValueError(f"method {text!r}: unknown via {via!r}; choose one of {', '.join(VIAS)}")
    if kind in PEERS:
        if vias:
            raise ValueError(f"method {text!r}: via= is for ar and spec methods; a peer runs its own way")
        return _parse_peer(text, kind, fields)
    try:
        config = DecodeConfig.parse(":".join([kind, *fields]))
        config = config if config.is_ar else config.resolve(True)
    except ConfigError as err:
        raise ValueError(f"method {text!r}: {err.render(text_spelling, joined=True)}") from None
    except ValueError as err:
        raise ValueError(f"method {text!r}: {err}") from None
    if drafters.needs(config.drafter) - backend_table.BY_NAME[backend].capabilities:
        raise ValueError(
            f"method {text!r}: the {config.drafter} drafter reads the transformers model's layers or hidden "
            f"states, so it runs on backend=torch only; on {backend} draft with model, ngram or ngram+model")
    return MethodSpec("ar" if config.is_ar else "spec", config, backend=backend, via=via, prediction=prediction,
                      replicas=int(replicas[0]) if replicas else 1)


def _parse_peer(text: str, kind: str, fields: list[str]) -> MethodSpec:
    k = None
    for f in fields:
        key, eq, value = f.partition("=")
        if not eq:
            raise ValueError(f"method {text!r}: unexpected field {f!r}")
        if key not in PEERS[kind].keys:
            allowed = ", ".join(sorted(PEERS[kind].keys)) or "none"
            raise ValueError(f"method {text!r}: unknown key {key!r} (keys for {kind}: {allowed})")
        if k is not None:
            raise ValueError(f"method {text!r}: k= given twice")
        try:
            k = int(value)
            if k <= 0:
                raise ValueError(value)
        except ValueError:
            raise ValueError(f"method {text!r}: k must be a positive integer, got {value!r}") from None
    return MethodSpec(kind, k=k)


def method_of_record(record: dict[str, Any]) -> MethodSpec:
    """The method a results.json entry's ``spec`` record describes, however its name was spelled
    when it was written (the record always names the drafter and policy)."""
    kind, backend, via = record["kind"], record.get("backend", TORCH), record.get("via", "library")
    if kind != "spec":
        return MethodSpec(kind, k=record.get("k"), backend=backend, via=via, replicas=record.get("replicas", 1))
    options = dict(record.get("options") or [])
    tree = record["verifier"] == "tree"
    fields = ["spec", record["drafter"], record["verifier"]]
    if not tree:
        fields += [f"k={record['k']}", f"policy={record['policy']}"]
    for key, value in sorted(options.items()):
        if key == "choices" and isinstance(value, list):
            value = "|".join(".".join(map(str, p)) for p in value)
        fields.append(f"{key}={'/'.join(map(str, value)) if isinstance(value, list) else value}")
    fields += [f"via={via}"] if via != "library" else []
    fields += [f"replicas={record['replicas']}"] if record.get("replicas", 1) != 1 else []
    fields += ["prediction=yes"] if record.get("prediction") else []
    return parse_method(":".join(fields), default_backend=backend)


def parse_methods(text: str, backends: Sequence[str] = (TORCH,)) -> list[MethodSpec]:
    """A comma-separated list; duplicates are dropped. A method without ``backend=`` runs on each
    of ``backends`` in turn. ``ar`` comes first, once per backend the methods use (torch's at
    least when a method runs there or a transformers peer needs it)."""
    unknown = [b for b in backends if b not in backend_table.NAMES]
    if unknown or not backends:
        raise ValueError(f"unknown backend {unknown[0] if unknown else ''!r}; choose from {', '.join(backend_table.NAMES)}")
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"no methods in {text!r}; name at least one, e.g. spec:block:k=4 (ar always runs)")
    specs: list[MethodSpec] = []
    for part in parts:
        for backend in backends:
            spec = parse_method(part, default_backend=backend)
            if spec not in specs:
                specs.append(spec)
    used = [b for b in backend_table.NAMES if any(s.backend == b for s in specs)] or list(backends[:1])
    ars = [MethodSpec("ar", backend=b) for b in used]
    return ars + [s for s in specs if s not in ars]


