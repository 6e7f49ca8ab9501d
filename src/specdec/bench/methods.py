"""Benchmark methods, named by short strings.

Grammar (fields separated by ``:``)::

    ar[:backend=B]               the target alone, through the project's backend
    spec:[<drafter>:]<verifier>[:key=value ...]
                                 a project speculative configuration. Keys: drafter= (default
                                 model), k= (default 4), policy= (default static), backend=
                                 (torch or llamacpp, default torch); k_max= and threshold= go to
                                 the policy; any other key is an option of the drafter (e.g.
                                 exit_layer=20, max_ngram=3, skip=3/5/7)
    spec:tree[:key=value ...]    a token tree from the draft model: bare, the API's default (the
                                 confident tree, threshold 0.8); keys depth=, width=, expand=,
                                 budget= (dynamic tree), threshold= (with width=, depth=, budget=:
                                 the confident tree) or choices=default|<paths> (a static tree,
                                 e.g. choices=0|1|0.0: rank paths joined by '|', ranks by '.')
    spec:heads:tree[:path=DIR]   a static Medusa tree from trained heads (drafter option path=)
    hf-assisted[:k=N]            transformers' assisted generation (assistant_model=); k sets
                                 num_assistant_tokens (default: transformers' own, 20 with its
                                 confidence stop)
    hf-prompt-lookup[:k=N]       transformers' prompt lookup; k = prompt_lookup_num_tokens
                                 (default 10)
    hf-ar                        transformers' own generate without an assistant (a reference)
    llamacpp-ar                  llama-cpp-python's own ``Llama.generate`` on the target's GGUF
                                 (the backend's binding and build; see :mod:`specdec.bench.peers`):
                                 llama.cpp's speed without specdec

``backend=llamacpp`` runs a project method on the llama.cpp backend (the target's GGUF, and the
draft's), ``backend=torch`` (the default) on transformers' weights; the bench's ``--backend``
changes the default, and ``both`` runs each method on both. On llama.cpp the drafters are the
draft model and the n-gram drafter (the others read the transformers model's layers). The
binding's own prompt lookup (``draft_model=``) asks for every position's full-vocabulary logits
and is slower than its plain generation here, so ``llamacpp-ar`` is the only llama.cpp peer.

Examples: ``spec:block:k=4``, ``spec:token:k=2``, ``spec:ngram:block:k=4`` (the same as
``spec:block:drafter=ngram:k=4``), ``spec:block:policy=theory``,
``spec:early-exit:block:k=3:exit_layer=20``, ``spec:tree:budget=16``,
``spec:block:k=4:backend=llamacpp``. Parsing checks the verifier, the drafter, the policy, which
options each takes and every option's value (:data:`OPTION_VALUES`), so a typo or an
out-of-range value fails before any model loads; only what depends on the model (an
``exit_layer`` past the target's layers, a ``path`` without heads) waits for the drafter to be
built (the warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specdec.drafters import DRAFTERS, MODEL_DRAFTERS
from specdec.drafters.tree import TreeDrafter, parse_choices
from specdec.policies import check_k, make_policy
from specdec.verify import VERIFIERS

DEFAULT_K = 4
PROMPT_LOOKUP_K = 10  # transformers' documented example value for prompt_lookup_num_tokens
POLICY_OPTIONS = ("k_max", "threshold")
TREE_OPTIONS = ("depth", "width", "expand", "budget", "choices", "threshold")
# Which peer a project drafter is measured against.
PEER_OF_DRAFTER = {"model": "hf-assisted", "ngram": "hf-prompt-lookup"}
LLAMACPP_PEER_OF_DRAFTER: dict[str, str] = {}  # the binding drafts nothing itself
HF_PEERS = ("hf-assisted", "hf-prompt-lookup", "hf-ar")
LLAMACPP_PEERS = ("llamacpp-ar",)
PEERS = HF_PEERS + LLAMACPP_PEERS
_PEER_KEYS = {"hf-assisted": {"k"}, "hf-prompt-lookup": {"k"}, "hf-ar": set(), "llamacpp-ar": set()}
BACKENDS = ("torch", "llamacpp")
# Drafters that run on the llama.cpp backend: the others read the transformers model's layers.
LLAMACPP_DRAFTERS = ("model", "ngram", "ngram+model")
# The options each drafter takes (see specdec.drafters.make_drafter).
DRAFTER_OPTIONS = {
    "model": (), "ngram": ("max_ngram", "min_ngram"), "ngram+model": ("max_ngram", "min_ngram"),
    "early-exit": ("exit_layer",), "layer-skip": ("skip",), "heads": ("path",), "eagle": ("path",),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(text)
    return value


def _layers(text: str) -> tuple[int, ...]:
    value = tuple(int(x) for x in text.split("/"))
    if any(x < 0 for x in value):
        raise ValueError(text)
    return value


def _text(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


# What each option's value may be: option -> (reader, what it accepts). A reader raises ValueError.
OPTION_VALUES: dict[str, tuple[Callable[[str], Any], str]] = {
    "k_max": (_positive_int, "a positive integer"),
    "threshold": (_fraction, "a number from 0 to 1"),
    "depth": (_positive_int, "a positive integer"),
    "width": (_positive_int, "a positive integer"),
    "expand": (_positive_int, "a positive integer"),
    "budget": (_positive_int, "a positive integer"),
    "choices": (_text, "'default' or rank paths like 0|1|0.0"),
    "max_ngram": (_positive_int, "a positive integer"),
    "min_ngram": (_positive_int, "a positive integer"),
    "exit_layer": (_positive_int, "a positive integer (a layer below the target's top)"),
    "skip": (_layers, "layer indices from 0, joined by '/' (e.g. 3/5/7)"),
    "path": (_text, "a folder"),
}


@dataclass(frozen=True)
class MethodSpec:
    """One method. ``kind`` is ``ar``, ``spec`` or a peer name; the other fields serve ``spec``
    (and ``k`` the peers, None meaning the peer's default). ``options``: sorted (key, value)
    pairs for the policy (:data:`POLICY_OPTIONS`) and the drafter. ``backend``: where the target
    runs, ``torch`` or ``llamacpp`` (a peer's is fixed by its kind)."""

    kind: str
    verifier: str | None = None
    drafter: str | None = None
    k: int | None = None
    policy: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    backend: str = "torch"

    def __post_init__(self) -> None:
        if self.kind in PEERS:  # a peer runs where its library runs
            object.__setattr__(self, "backend", "llamacpp" if self.kind in LLAMACPP_PEERS else "torch")

    @property
    def name(self) -> str:
        """The canonical string; ``parse_method(spec.name) == spec``."""
        backend = "" if self.backend == "torch" or self.is_peer else f":backend={self.backend}"
        if self.kind != "spec":
            return (self.kind if self.k is None else f"{self.kind}:k={self.k}") + backend
        drafter = "" if self.drafter == "model" else f"{self.drafter}:"
        k = "" if self.is_tree else f":k={self.k}"
        policy = "" if self.policy == "static" else f":policy={self.policy}"
        options = "".join(f":{key}={_format(value)}" for key, value in self.options)
        return f"spec:{drafter}{self.verifier}{k}{policy}{options}{backend}"

    @property
    def is_tree(self) -> bool:
        return self.verifier == "tree"

    @property
    def exact(self) -> bool:
        """False for lossy verification rules (reports mark them)."""
        return self.kind != "spec" or self.is_tree or VERIFIERS[self.verifier].exact

    @property
    def is_peer(self) -> bool:
        return self.kind in PEERS

    @property
    def needs_draft_model(self) -> bool:
        return self.kind == "hf-assisted" or (self.kind == "spec" and self.drafter in MODEL_DRAFTERS)

    @property
    def peer(self) -> str | None:
        """The peer a project method is measured against (by its drafter and backend), if any."""
        if self.kind != "spec":
            return None
        return (LLAMACPP_PEER_OF_DRAFTER if self.backend == "llamacpp" else PEER_OF_DRAFTER).get(self.drafter)

    @property
    def ar(self) -> "MethodSpec":
        """The ``ar`` of this method's backend: what its greedy output must equal."""
        return MethodSpec("ar", backend=self.backend)

    @property
    def policy_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options if k in POLICY_OPTIONS}

    @property
    def drafter_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options if k not in POLICY_OPTIONS and k not in TREE_OPTIONS}

    @property
    def tree_options(self) -> dict[str, Any] | None:
        """The API's ``tree=`` argument: None (the API's default tree) without tree options;
        ``choices=default`` is the static default tree."""
        options = {k: v for k, v in self.options if k in TREE_OPTIONS}
        if not options:
            return None
        if "choices" in options:
            options["choices"] = parse_choices(options["choices"])
        return options

    def runs_at(self, temperature: float) -> str | None:
        """None if the method can run at this temperature, else the reason it cannot."""
        if self.kind == "spec" and self.verifier == "greedy" and temperature > 0:
            return "greedy verification reproduces greedy decoding only"
        return None

    def __str__(self) -> str:
        return self.name


def parse_method(text: str, default_backend: str = "torch") -> MethodSpec:
    """Parse one method string (see the module docstring); raises ValueError naming the problem.

    ``default_backend``: where ``ar`` and ``spec`` methods without ``backend=`` run.
    """
    kind, *fields = [f.strip() for f in text.strip().split(":")]
    if kind != "spec" and kind != "ar" and kind not in PEERS:
        raise ValueError(
            f"unknown method {text!r}; use ar, spec:<verifier>[:key=value...], "
            f"or a peer: {', '.join(PEERS)}"
        )
    positional = [f for f in fields if "=" not in f]
    options: dict[str, str] = {}
    for f in fields:
        if "=" in f:
            key, _, value = f.partition("=")
            allowed_keys = {"backend"} if kind == "ar" else _PEER_KEYS.get(kind)
            if allowed_keys is not None and key not in allowed_keys:
                allowed = ", ".join(sorted(allowed_keys)) or "none"
                raise ValueError(f"method {text!r}: unknown key {key!r} (keys for {kind}: {allowed})")
            if key in options:
                raise ValueError(f"method {text!r}: {key}= given twice")
            options[key] = value
    backend = _parse_backend(text, options.pop("backend", default_backend))
    k = _parse_k(text, options.pop("k")) if "k" in options else None
    if kind != "spec":
        if positional:
            raise ValueError(f"method {text!r}: unexpected field {positional[0]!r}")
        return MethodSpec(kind, k=k, backend=backend)
    if len(positional) == 2:
        if "drafter" in options:
            raise ValueError(f"method {text!r}: the drafter is given twice")
        options["drafter"] = positional[0]
    elif len(positional) != 1:
        raise ValueError(
            f"method {text!r}: expected spec:[<drafter>:]<verifier>[:key=value...], "
            f"e.g. spec:block:k=4; verifiers: {', '.join(sorted(VERIFIERS))}, tree"
        )
    if positional[-1] == "tree" and k is not None:
        raise ValueError(f"method {text!r}: a tree has no k; size it with depth= and budget=")
    drafter = options.pop("drafter", "model")
    policy = options.pop("policy", "static")
    spec = MethodSpec(
        "spec", verifier=positional[-1], drafter=drafter, k=DEFAULT_K if k is None else k,
        policy=policy, options=tuple(sorted((key, _option(text, key, v)) for key, v in options.items())),
        backend=backend,
    )
    _check_spec(text, spec)
    if backend == "llamacpp" and drafter not in LLAMACPP_DRAFTERS:
        raise ValueError(
            f"method {text!r}: the {drafter} drafter reads the transformers model's layers, so it runs on "
            f"backend=torch only; on llamacpp draft with {' or '.join(LLAMACPP_DRAFTERS)}"
        )
    return spec


def parse_methods(text: str, backends: Sequence[str] = ("torch",)) -> list[MethodSpec]:
    """A comma-separated list; duplicates are dropped. A method without ``backend=`` runs on each
    of ``backends`` in turn. ``ar`` comes first, once per backend the methods use (torch's at
    least when a method runs there or a transformers peer needs it)."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"unknown backend {unknown[0] if unknown else ''!r}; choose from {', '.join(BACKENDS)}")
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"no methods in {text!r}; name at least one, e.g. spec:block:k=4 (ar always runs)")
    specs: list[MethodSpec] = []
    for part in parts:
        for backend in backends:
            spec = parse_method(part, default_backend=backend)
            if spec not in specs:
                specs.append(spec)
    used = [b for b in BACKENDS if any(s.backend == b for s in specs)] or list(backends[:1])
    ars = [MethodSpec("ar", backend=b) for b in used]
    return ars + [s for s in specs if s not in ars]


def _parse_backend(text: str, value: str) -> str:
    if value not in BACKENDS:
        raise ValueError(f"method {text!r}: unknown backend {value!r}; choose one of {', '.join(BACKENDS)}")
    return value


def _parse_k(text: str, value: str) -> int:
    try:
        k = int(value)
        check_k(k)
    except ValueError:
        raise ValueError(f"method {text!r}: k must be a positive integer, got {value!r}") from None
    return k


def _option(text: str, key: str, value: str) -> Any:
    """The value of option ``key`` read by :data:`OPTION_VALUES`; a ValueError naming the option
    and what it accepts if it cannot be read."""
    if key not in OPTION_VALUES:
        return value  # an option no drafter has: _check_spec names the ones the drafter takes
    read, accepts = OPTION_VALUES[key]
    try:
        return read(value.strip())
    except ValueError:
        raise ValueError(f"method {text!r}: {key}= takes {accepts}, got {value!r}") from None


def _format(value: Any) -> str:
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _check_spec(text: str, spec: MethodSpec) -> None:
    if spec.is_tree:  # the tree options make a tree (a ValueError says why not)
        try:
            TreeDrafter(None, **(spec.tree_options or {}))
        except ValueError as e:
            raise ValueError(f"method {text!r}: {e}") from None
    if spec.is_tree and spec.drafter == "heads":
        unknown = [key for key, _ in spec.options if key not in ("path", "choices")]
        if spec.policy != "static" or unknown:
            raise ValueError(f"method {text!r}: a heads tree is static and takes only path= and choices=")
        return
    if spec.is_tree:
        unknown = [key for key, _ in spec.options if key not in TREE_OPTIONS]
        if spec.drafter != "model" or spec.policy != "static" or unknown:
            raise ValueError(
                f"method {text!r}: a tree is drafted by the draft model (or spec:heads:tree) and takes "
                f"only {', '.join(TREE_OPTIONS)} (choices=default or rank paths like 0|1|0.0)"
            )
        return
    if spec.verifier not in VERIFIERS:
        raise ValueError(
            f"method {text!r}: unknown verifier {spec.verifier!r}; choose one of "
            f"{', '.join(sorted(VERIFIERS))} or tree"
        )
    if spec.drafter not in DRAFTERS:
        raise ValueError(
            f"method {text!r}: unknown drafter {spec.drafter!r}; choose one of {', '.join(DRAFTERS)}"
        )
    takes = DRAFTER_OPTIONS.get(spec.drafter, ())
    for key, _ in spec.options:
        if key in POLICY_OPTIONS or key in takes:
            continue
        if key in TREE_OPTIONS:
            raise ValueError(f"method {text!r}: {key}= shapes a token tree; give it to spec:tree")
        drafter_takes = f"takes {', '.join(takes)}" if takes else "takes no options"
        raise ValueError(
            f"method {text!r}: unknown option {key}=; the {spec.drafter} drafter {drafter_takes}, "
            f"the policy {', '.join(POLICY_OPTIONS)}"
        )
    try:
        make_policy(spec.policy, spec.k, **spec.policy_options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"method {text!r}: {e}") from None
