"""The one description of a decoding method: :class:`DecodeConfig`, its text form and its options.

Every front end says a method the same way. :func:`specdec.generate` takes a config (or its
fields as keywords); ``specdec generate`` builds its options from :func:`options`; a method string
(``specdec bench --methods``, ``specdec serve --method``, a request's ``speculative.method``) is
:meth:`DecodeConfig.parse`'s text form::

    ar                                  the target alone
    spec[:<drafter>][:<verifier>][:key=value ...]

``spec`` alone is the default, the same as ``DecodeConfig()`` and ``specdec generate`` with no
options: with a draft model, the ``ngram+model`` drafter (the draft model a tree's drafter),
``block`` verification, ``k=4`` and the ``auto`` policy; without one, the target alone.
:meth:`DecodeConfig.resolve` spells that out, and ``str(config)`` writes the canonical text,
drafter and policy included: ``spec:ngram+model:block:k=4:policy=auto``. Keys: ``k``,
``policy``, the policy's options (``k_max``, ``threshold``), the drafter's (``max_ngram``,
``min_ngram``, ``exit_layer``, ``skip``, ``path``) and a tree's (``mode``, ``choices``, ``depth``,
``width``, ``expand``, ``budget``, ``threshold``). Sampling and limits (temperature, seed, ...)
are not part of a method: they come with each generation.

Every rule that ties fields together is in :meth:`DecodeConfig.__post_init__` and
:meth:`DecodeConfig.resolve`. A broken rule raises :class:`ConfigError` (a ``ValueError``), whose
text names the options as the front end's users type them (``verify='tree'``, ``--verify tree``,
``tree``); a value of the wrong kind is a ``TypeError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from specdec.drafters import registry
from specdec.drafters.base import Drafter
from specdec.drafters.tree import DEFAULT_CHOICES, TREE_MODES, TreeDrafter, parse_choices
from specdec.options import Option, as_name, fraction, integer_from, positive, real
from specdec.policies import POLICIES, DraftLengthPolicy, check_k, make_policy
from specdec.sampling import SamplingConfig
from specdec.verify import VERIFIERS

AR = "none"  # the drafter of autoregressive decoding: the target alone (text form ``ar``)
VERIFY = (*VERIFIERS, "tree")  # "tree": a token tree (specdec.drafters.tree, specdec.verify.tree)
CHAIN_VERIFIERS = tuple(sorted(VERIFIERS))
DRAFT_WEIGHTS = ("bf16", "int8")  # specdec.backends.lean.WEIGHTS
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1
SAMPLERS = ("multinomial", "gumbel")  # specdec.sampling: inversion with a generator, Gumbel-max with public noise
DEFAULT_K = 4


# ------------------------------------------------------------------------------------------------
# Errors that name options as each front end spells them


class ConfigError(ValueError):
    """A broken rule. ``message`` and ``hint`` name options as ``{group.name}`` (the option) or
    ``{group.name=value}`` (the option set to a value); :meth:`render` spells them for a front end
    (:func:`api_spelling`, :func:`text_spelling`, the command line's flags). ``str()`` is the API's
    spelling, the hint appended."""

    def __init__(self, message: str, hint: str = "") -> None:
        self.message, self.hint = message, hint
        super().__init__(self.render(api_spelling, joined=True))

    def render(self, spell: Callable[[str, str, Any], str], *, joined: bool = False) -> Any:
        def fill(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: spell(m[1], m[2], NAME_ONLY if m[3] is None else m[3]), text)

        message, hint = fill(self.message), fill(self.hint)
        if joined:
            return f"{message}; {hint}" if hint else message
        return message, hint

    @property
    def options(self) -> list[tuple[str, str]]:
        """The options the message names, as ``(group, name)`` in order: a front end that takes
        options from several places points at the one that broke the rule."""
        return [(m[1], m[2]) for m in _PLACEHOLDER.finditer(self.message)]


class NothingToVerify(ConfigError):
    """The default drafter without a draft model leaves the target decoding alone, so option
    ``name`` (set to ``value``) has nothing to act on (:meth:`DecodeConfig._unused_alone`)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value
        shown = repr(value) if isinstance(value, (str, numbers.Number)) else type(value).__name__
        super().__init__(f"{name}={shown} needs a draft model or a drafter",
                         f"pass draft= (or drafter=), or leave {name} out to decode with the target alone")


_PLACEHOLDER = re.compile(r"\{(\w+)\.([\w-]+)(?:=([^}]*))?\}")
NAME_ONLY = object()


def api_spelling(group: str, name: str, value: Any) -> str:
    """``verify``, ``verify='tree'``, ``k=2``: :func:`specdec.generate`'s keyword arguments."""
    if value is NAME_ONLY:
        return name
    return f"{name}={value!r}" if group in ("method",) and not _is_number(value) else f"{name}={value}"


def text_spelling(group: str, name: str, value: Any) -> str:
    """``tree``, ``ngram+model``, ``k=2``: the text form's fields; a sampling option, which comes
    beside the text, as the API names it (``temperature``)."""
    if group == "method" and name in ("drafter", "verify"):
        return f"the {name if name == 'drafter' else 'verifier'}" if value is NAME_ONLY else str(value)
    if group == "sampling":
        return api_spelling(group, name, value)
    return f"{name}=" if value is NAME_ONLY else f"{name}={value}"


def _is_number(value: Any) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------------------
# The option table


def _write_choices(value: Any) -> str:
    return "default" if tuple(value) == DEFAULT_CHOICES else "|".join(".".join(map(str, p)) for p in value)


# Every option but the drafters' (each drafter declares its own in its spec: specdec.drafters.registry).
METHOD_ROWS: tuple[Option, ...] = (
    Option("method", "drafter", as_name, "a drafter's name", None,
           "who proposes tokens: n-gram prompt lookup where the context repeats itself and the draft model "
           "elsewhere (ngram+model; the policy picks each step), the draft model alone, n-gram lookup alone, "
           "the target's first layers, the target with layers skipped, trained Medusa heads, or a trained "
           "one-layer head (default: ngram+model with a draft model, model for a tree, the target alone "
           "without a draft model)", "--drafter", registry.names),
    Option("method", "verify", as_name, "a verifier's name", "block",
           "verification rule; 'tree' drafts a token tree and verifies it in one pass (by default the "
           "confident tree, threshold 0.8); 'typical' is lossy (default: block)", "--verify", lambda: VERIFY),
    Option("method", "k", positive, "a positive integer", DEFAULT_K,
           "draft tokens per step of the static policy, and the first length of heuristic and theory; "
           "the adaptive policies, auto included, draft up to max(k, 16) tokens (--k-max) (default: 4)", "-k"),
    Option("method", "policy", as_name, "a policy's name", "auto",
           "draft length: fixed k; grow/shrink on full acceptance/rejection; stop when the draft is unsure; "
           "the k the speed-up formula picks from running estimates; or 'auto', the planner: each step the k "
           "(0 = a plain target step) with the most expected tokens per second from this machine's measured "
           "costs (default: auto)", "--policy", lambda: POLICIES),
)
POLICY_ROWS: tuple[Option, ...] = (
    Option("policy", "k_max", positive, "a positive integer", None,
           "the longest draft an adaptive policy asks for (default: max(k, 16))", "--k-max"),
    Option("policy", "threshold", fraction, "a number from 0 to 1", None,
           "--policy confidence: stop drafting when the draft's top probability falls below this (default: 0.8)",
           "--policy-threshold"),
)
TREE_ROWS: tuple[Option, ...] = (
    Option("tree", "mode", as_name, "a tree mode", None,
           "--verify tree: confident, dynamic, sequoia or static (default: from the other tree options; "
           "confident without any); sequoia: the tree with the most expected accepted tokens for the "
           "measured acceptance of each child rank, its --tree-budget chosen from measured costs unless "
           "given", "--tree-mode", lambda: TREE_MODES),
    Option("tree", "choices", parse_choices, "'default' or rank paths like 0|1|0.0", None,
           "--verify tree: a static Medusa-style tree: the default shape, or rank paths joined by '|' with "
           "ranks joined by '.', e.g. 0|1|0.0", "--tree-static", write=_write_choices),
    Option("tree", "threshold", fraction, "a number from 0 to 1", None,
           "--verify tree: the confident tree: a chain while the draft's top probability is at least P, a "
           "fork of --tree-width children where it is not (default tree: P = 0.8)", "--tree-threshold"),
    Option("tree", "depth", positive, "a positive integer", None,
           "--verify tree: deepest level (default: 16 confident, the confidence policy's k_max; 5 dynamic)",
           "--tree-depth"),
    Option("tree", "width", positive, "a positive integer", None,
           "--verify tree: children per expanded node (default: 2 confident, 4 dynamic)", "--tree-width"),
    Option("tree", "expand", positive, "a positive integer", None,
           "--verify tree: nodes expanded per level of the dynamic tree (default: 4)", "--tree-expand"),
    Option("tree", "budget", positive, "a positive integer", None,
           "--verify tree: most nodes in the tree (default: 16; a sequoia tree's chosen from measured costs); without --tree-threshold, --tree-budget, "
           "--tree-depth and --tree-width shape the EAGLE-2-style dynamic tree", "--tree-budget"),
)
SAMPLING_ROWS: tuple[Option, ...] = (
    Option("sampling", "draft_weights", as_name, "int8 or bf16", "int8",
           "the draft model's weights: int8 copies (half the bytes per draft token; the output law is "
           "unchanged) or its own bf16 ones (default: int8)", "--draft-weights", lambda: DRAFT_WEIGHTS),
    Option("sampling", "temperature", real(lambda v: v >= 0.0), "a finite number >= 0", 0.0,
           "0 means greedy (default: 0)", "--temperature"),
    Option("sampling", "top_k", integer_from(0), "an integer >= 0", 0, "0 disables (default: 0)", "--top-k"),
    Option("sampling", "top_p", real(lambda v: 0.0 < v <= 1.0), "a number in (0, 1]", 1.0,
           "1 disables (default: 1)", "--top-p"),
    Option("sampling", "max_new_tokens", positive, "a positive integer", 128, "(default: 128)",
           "--max-new-tokens"),
    Option("sampling", "seed", integer_from(0, SEED_RANGE), "an integer in [0, 2**64)", None,
           "fixes sampling (an integer in [0, 2**64))", "--seed"),
    Option("sampling", "sampler", as_name, "multinomial or gumbel", None,
           "how tokens are drawn: 'gumbel' draws each by Gumbel-max with noise keyed by the seed and the "
           "token's position, and verifies drafts by coupling, so a seed gives the same text with any drafter, "
           "draft length or machine (plain decoding's text), at some acceptance cost against block "
           "verification for sampled drafts; 'multinomial' draws with a random generator (default: "
           "multinomial; gumbel under --verify coupled, which verifies Gumbel-max draws only)", "--sampler", lambda: SAMPLERS),
)
GROUP_FIELD = {"drafter": "drafter_options", "policy": "policy_options", "tree": "tree"}
TREE_OPTIONS = tuple(o.name for o in TREE_ROWS)
POLICY_OPTIONS = tuple(o.name for o in POLICY_ROWS)


def options() -> tuple[Option, ...]:
    """Every decoding option, in the order the command line lists them: the method's, the
    policy's, the registered drafters' (:func:`specdec.drafters.registry.options`, read now), the
    tree's and the sampling options."""
    return (*METHOD_ROWS, *POLICY_ROWS, *registry.options(), *TREE_ROWS, *SAMPLING_ROWS)


def option(group: str, name: str) -> Option:
    """The row of option ``name`` of ``group``; a ``KeyError`` if there is none."""
    for row in options():
        if row.group == group and row.name == name:
            return row
    raise KeyError((group, name))


# ------------------------------------------------------------------------------------------------
# The config


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode: the method, the verifier, draft lengths, sampling and limits.

    drafter: None (the default: :meth:`resolve`), ``"none"`` (the target alone), a name from
    :func:`specdec.drafters.names` (the registered drafters) built with ``drafter_options``, or a
    :class:`~specdec.drafters.base.Drafter`.
    draft_weights: ``int8`` (default) or ``bf16`` for a draft model (see :func:`specdec.generate`).
    verify: ``greedy``, ``token``, ``block``, ``typical`` (lossy) or ``tree``; ``tree`` holds
    :class:`~specdec.drafters.tree.TreeDrafter` options (``mode``: confident, dynamic or static).
    k: draft tokens per step with the ``static`` policy; the starting length of ``heuristic`` and
    ``theory``; ``auto`` and ``confidence`` draft up to max(k, 16) tokens.
    policy: a name from :data:`specdec.policies.POLICIES` (``policy_options``: ``k_max``,
    ``threshold``) or a :class:`~specdec.policies.DraftLengthPolicy`. The default, ``auto``, is
    the planner (:mod:`specdec.policies.auto`): each step it drafts the length -- 0 included --
    with the most expected tokens per second from this machine's measured costs; ``static``
    drafts k tokens every step. Autoregressive decoding and tree verification use no policy.
    temperature 0 means greedy; top_k 0 and top_p 1 disable those filters; seed fixes sampling.
    sampler: ``multinomial`` (the default, except under ``verify="coupled"``) draws with a generator seeded by ``seed``; ``gumbel`` draws
    every token by Gumbel-max with noise keyed by (seed, position) and verifies chains by the
    ``coupled`` rule (whatever exact chain rule ``verify`` names; trees by the coupled walk), so
    the text depends only on the prompt, the seed and the sampling options. ``verify="coupled"``
    implies it and refuses ``multinomial``. stop: strings that end generation (one string is one stop string). eos_token_ids: the ids that
    end generation (None: the model's and tokenizer's own). prompt_cache: keep what a
    :class:`~specdec.backends.base.CausalLM` backend (and a draft backend) cached in the previous
    generation as far as the new prompt shares it, and prefill only the rest (a conversation held
    in a loop, a server's next request); a transformers model is wrapped afresh each call, so
    only a backend object keeps its cache. Off: every generation starts from an empty cache.
    """

    drafter: Any = None
    drafter_options: Mapping[str, Any] | None = None
    draft_weights: str = "int8"
    verify: str = "block"
    k: int = DEFAULT_K
    policy: str | DraftLengthPolicy = "auto"
    policy_options: Mapping[str, Any] | None = None
    tree: Mapping[str, Any] | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    sampler: str | None = None
    stop: Sequence[str] = ()
    eos_token_ids: Sequence[int] | None = None
    prompt_cache: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, here
        set_(self, "stop", _stop_strings(self.stop))
        set_(self, "eos_token_ids", _eos_ids(self.eos_token_ids))
        for name in ("drafter_options", "policy_options", "tree"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
            if name == "tree" and value is not None and not value:
                value = {"mode": "dynamic"}  # tree={}: the dynamic tree with its defaults, as TreeDrafter reads it
            set_(self, name, _frozen(value) if value else None)
        if self.tree and "choices" in self.tree and isinstance(self.tree["choices"], str):
            set_(self, "tree", _frozen({**self.tree, "choices": parse_choices(self.tree["choices"])}))
        self._check_names()
        self._check_sampling()
        _positive_int(self.max_new_tokens, "max_new_tokens")
        if not isinstance(self.prompt_cache, bool):
            raise TypeError(f"prompt_cache must be True or False, got {type(self.prompt_cache).__name__} "
                            f"{self.prompt_cache!r}")
        if self.seed is not None:
            _integer(self.seed, "seed")
            if not 0 <= self.seed < SEED_RANGE:
                raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {self.seed}")
            set_(self, "seed", int(self.seed))  # a numpy integer too
        self._check_combination()

    # -- the rules --------------------------------------------------------------------------------

    def _check_names(self) -> None:
        if self.drafter is not None and not isinstance(self.drafter, (str, Drafter)):
            raise TypeError(f"drafter must be a drafter's name or a Drafter, got {type(self.drafter).__name__} "
                            "(a drafter of your own: subclass specdec.drafters.Drafter)")
        if isinstance(self.drafter, str) and self.drafter != AR:
            registry.spec(self.drafter)  # an unknown name: the error names the choices
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"unknown verifier {self.verify!r}; choose one of {', '.join(VERIFY)}")
        check_k(self.k)
        if isinstance(self.policy, str):
            if self.policy not in POLICIES:
                raise ValueError(f"unknown draft-length policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        elif not isinstance(self.policy, DraftLengthPolicy):
            raise TypeError(f"policy must be a policy's name or a DraftLengthPolicy, got {type(self.policy).__name__} "
                            "(a policy of your own: subclass specdec.policies.DraftLengthPolicy)")
        for group, keys in (("policy", POLICY_OPTIONS), ("tree", TREE_OPTIONS)):
            unknown = sorted(set(getattr(self, GROUP_FIELD[group]) or ()) - set(keys))
            if unknown:
                raise ValueError(f"unknown {group} option {unknown[0]!r}; the {group} takes {', '.join(keys)}")

    def _check_sampling(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        _integer(self.top_k, "top_k")
        SamplingConfig(float(self.temperature), self.top_k, float(self.top_p))  # the value checks
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLERS)}")

    def _check_combination(self) -> None:
        """Every rule that ties options together, once."""
        if self.verify == "coupled" and self.sampler == "multinomial":
            raise ConfigError("coupled verification ({method.verify=coupled}) verifies Gumbel-max draws, but "
                              "{sampling.sampler} is " + str(self.sampler),
                              "drop {sampling.sampler} (coupled implies gumbel), or use {method.verify=block}")
        if self.gumbel and self.verify == "typical":
            raise ConfigError("typical acceptance ({method.verify=typical}) draws by its own lossy rule, but "
                              "{sampling.sampler=gumbel} draws by Gumbel-max with public noise",
                              "use {method.verify=coupled}, or {sampling.sampler=multinomial} for typical")
        if self.verify == "greedy" and self.temperature > 0:
            raise ConfigError(
                f"greedy verification ({{method.verify=greedy}}) reproduces greedy decoding only, but "
                f"{{sampling.temperature}} is "
                f"{self.temperature}", "use {method.verify=token} or {method.verify=block} to sample")
        named = self.drafter if isinstance(self.drafter, str) else None
        if self.drafter_options and (named is None or named == AR) and self.drafter is not None:
            raise ValueError("drafter_options go with a drafter given by name")
        declared = registry.find(named or "ngram+model")  # None: the default drafter's
        takes = declared.option_names if declared is not None else ()
        for key in self.drafter_options or ():
            if key not in takes:
                owners = [s.name for s in registry.specs() if key in s.option_names]
                if not owners:
                    raise ValueError(f"bad option for the {named or 'ngram+model'} drafter: no drafter takes {key!r}")
                shown = named or "the default (ngram+model)"
                others = [", " + o for o in owners[1:-1]] + [" or " + o for o in owners[-1:] if len(owners) > 1]
                raise ConfigError(f"{{drafter.{key}}} is an option of {{method.drafter={owners[0]}}}"
                                  f"{''.join(others)}, but {{method.drafter}} is {shown}",
                                  f"add {{method.drafter={owners[0]}}} or drop {{drafter.{key}}}")
        if _trees(named) == "only" and self.verify != "tree":
            raise ConfigError(f"{{method.drafter={named}}} drafts a token tree each step, verified in one pass",
                              "add {method.verify=tree}")
        if self.verify == "tree":
            self._check_tree(named)
        else:
            for key in self.tree or ():
                raise ConfigError(f"{{tree.{key}}} is an option of {{method.verify=tree}}",
                                  f"add {{method.verify=tree}} or drop {{tree.{key}}}")
            if isinstance(self.policy, str):
                try:
                    make_policy(self.policy, self.k, **(self.policy_options or {}))
                except TypeError as err:
                    raise ConfigError(f"{{method.policy={self.policy}}} takes no such option ({err})") from None
                for key in self.policy_options or ():
                    if key == "threshold" and self.policy != "confidence":
                        raise ConfigError("{policy.threshold} is an option of {method.policy=confidence}",
                                          "add {method.policy=confidence} or drop {policy.threshold}")
                    if key == "k_max" and self.policy == "static":
                        raise ConfigError("{policy.k_max} is an option of an adaptive policy, but "
                                          "{method.policy} is static", "drop {policy.k_max}")
            elif self.policy_options:
                raise ValueError("policy_options go with a policy given by name")
        if named == AR:
            self._check_nothing_to_verify()

    def _check_tree(self, named: str | None) -> None:
        chain = f"{', '.join(CHAIN_VERIFIERS[:-1])} or {CHAIN_VERIFIERS[-1]}"
        for group, name, changed in (("method", "k", self.k != DEFAULT_K), ("method", "policy", self.policy != "auto"),
                                     ("method", "policy", bool(self.policy_options))):
            if changed:
                raise ConfigError(
                    f"{{{group}.{name}}} is an option of {{method.verify={CHAIN_VERIFIERS[0]}}}"
                    f"{chain[len(CHAIN_VERIFIERS[0]):]}, but {{method.verify}} is tree",
                    f"drop {{{group}.{name}}} (the tree's shape sets how much it drafts: {{tree.depth}}, "
                    "{tree.budget}), or use {method.verify=block}")
        tree = dict(self.tree or {})
        if "choices" in tree and {"threshold", "budget", "depth", "width"} & set(tree):
            raise ConfigError("{tree.choices} fixes the tree's shape; {tree.threshold}, {tree.budget}, "
                              "{tree.depth} and {tree.width} shape the confident and the dynamic trees",
                              "use one or the other")
        declared = registry.find(named)
        if declared is not None and declared.tree_keys is not None:
            _check_own_tree(declared, tree)
            return
        if named is not None and _trees(named) == "no":
            raise ConfigError(f"{{method.verify=tree}} drafts its tree with the draft model or the heads, "
                              f"not {{method.drafter={named}}}", "drop {method.drafter}, or use {method.verify=block}")
        if declared is not None and declared.static_tree:
            if set(tree) - {"choices", "mode"} or tree.get("mode", "static") != "static":
                raise ConfigError(f"a {named} tree is static and takes only {{tree.choices}}",
                                  "drop the other tree options")
            return
        try:
            TreeDrafter(None, **tree)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def _check_nothing_to_verify(self) -> None:
        unused = self._unused_alone()
        if unused:
            raise ConfigError(f"{{method.{unused}={getattr(self, unused)}}} has nothing to act on: "
                              "the target decodes alone", f"drop {{method.{unused}}}")

    def _unused_alone(self) -> str | None:
        """The first method option set away from its default, which a target decoding alone
        (no draft model, or ``drafter="none"``) would leave with nothing to act on."""
        for name, changed in (("verify", self.verify != "block"), ("policy", self.policy != "auto"),
                              ("k", self.k != DEFAULT_K)):
            if changed:
                return name
        return None

    # -- the default, spelled out -------------------------------------------------------------------

    def resolve(self, has_draft: bool, *, draft_flag: str = "draft=") -> "DecodeConfig":
        """This config with the default drafter named: with a draft model ``ngram+model`` (``model``
        for a tree), without one the target alone (``"none"``), which leaves nothing to verify:
        a verifier or policy other than the defaults is then a :class:`ConfigError`.
        ``draft_flag``: how the front end names the draft model in that error."""
        if self.drafter is not None:
            if self.uses_draft_model and not has_draft:
                raise ConfigError(f"the {self.drafter} drafter needs a draft model; pass {draft_flag}",
                                  "or use {method.drafter=ngram}, which needs none")
            return self
        if has_draft:
            return self.replace(drafter="model" if self.verify == "tree" else "ngram+model")
        unused = self._unused_alone()
        if unused:
            raise NothingToVerify(unused, getattr(self, unused))
        return self.replace(drafter=AR, drafter_options=None)

    @property
    def is_ar(self) -> bool:
        return self.drafter == AR

    @property
    def uses_draft_model(self) -> bool:
        """Whether the drafter named drafts with the draft model (``model``, ``ngram+model``, ...)."""
        declared = registry.find(self.drafter)
        return declared is not None and declared.uses_draft_model

    @property
    def exact(self) -> bool:
        """False for a lossy verification rule (reports mark it)."""
        return self.verify == "tree" or VERIFIERS[self.verify].exact

    @property
    def gumbel(self) -> bool:
        """Tokens are drawn by Gumbel-max with public noise (``sampler="gumbel"``, which
        ``verify="coupled"`` implies when ``sampler`` is left out)."""
        return self.sampler == "gumbel" or (self.sampler is None and self.verify == "coupled")

    def sampling_fields(self) -> dict[str, Any]:
        """The fields the method string does not hold, the sampler named as it draws: another
        method given these (plain decoding, to compare) draws the same way."""
        fields = {f: getattr(self, f) for f in SAMPLING_FIELDS}
        return {**fields, "sampler": "gumbel" if self.gumbel else "multinomial"}

    @property
    def chain_verifier(self) -> str:
        """The rule that verifies a chain: ``verify``, or under the Gumbel-max sampler ``coupled``,
        the one exact rule that keeps its draws (greedy verification stays greedy)."""
        return "coupled" if self.gumbel and self.verify in ("token", "block") else self.verify

    @property
    def as_run(self) -> "DecodeConfig":
        """This config as it runs and as reports name it: a chain's verifier the one that runs
        (:attr:`chain_verifier`; ``coupled`` under the Gumbel-max sampler)."""
        if self.is_ar or self.chain_verifier == self.verify:
            return self
        return self.replace(verify=self.chain_verifier)

    @property
    def sampling(self) -> SamplingConfig:
        """The sampling settings. Under the Gumbel-max sampler ``gumbel_seed`` is the seed (None for
        an unseeded config: the caller draws one, :func:`specdec.generate` does)."""
        return SamplingConfig(float(self.temperature), self.top_k, float(self.top_p),
                              gumbel_seed=self.seed if self.gumbel else None)

    def replace(self, **overrides: Any) -> "DecodeConfig":
        """A copy with some fields changed (checked again). An unknown name is a ``TypeError``."""
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise TypeError(
                f"unknown decoding option {unknown[0]!r}; the options are {', '.join(FIELDS)}"
            )
        return dataclasses.replace(self, **overrides) if overrides else self

    # -- the text form ----------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str, **fields: Any) -> "DecodeConfig":
        """The config a method string describes (see the module docstring), with ``fields`` (the
        sampling options, which the text does not hold) on top. A ``ValueError`` names the
        problem, spelled as the text is (:func:`text_spelling`)."""
        head, *parts = [p.strip() for p in text.strip().split(":")]
        if head == "ar":
            if parts:
                raise ValueError(f"ar takes no options, got {parts[0]!r}")
            return cls(drafter=AR, **fields)
        if head != "spec":
            raise ValueError(f"unknown method {text.strip()!r}; write ar or spec[:<drafter>][:<verifier>][:key=value...]")
        values: dict[str, Any] = {}
        keys: dict[str, str] = {}
        for part in parts:
            key, eq, value = part.partition("=")
            if not eq:
                slot = "drafter" if registry.find(part) is not None else "verify" if part in VERIFY else None
                if slot is None:
                    drafters = ", ".join(registry.names())
                    raise ValueError(f"unknown verifier {part!r} (nor is it a drafter); choose a verifier from "
                                     f"{', '.join(VERIFY)} or a drafter from {drafters}")
                key, value = slot, part
            elif key == "verify" or key not in ("drafter", "k", "policy") and not _keyed(key):
                raise ValueError(f"unknown option {key}=; the options are k, policy, "
                                 f"{', '.join(sorted({o.name for o in options() if o.group != 'method' and o.in_text}))}")
            if key in keys:
                raise ValueError(f"{'the ' + key if not eq else key + '='} is given twice")
            keys[key] = value
        verify = keys.pop("verify", "block")
        drafter = keys.pop("drafter", None)
        if drafter is not None:
            registry.spec(drafter)  # an unknown name: the error names the choices
        _check_tree_only(drafter, verify, parts)
        values.update(drafter=drafter, verify=verify)
        for name in ("k", "policy"):
            if name in keys:
                values[name] = option("method", name).value(keys.pop(name))
        for key, value in keys.items():
            group = "tree" if verify == "tree" and key in TREE_OPTIONS else (
                "policy" if key in POLICY_OPTIONS else "drafter")
            if group == "drafter" and key in TREE_OPTIONS:
                raise ConfigError(f"{{tree.{key}}} shapes a token tree", f"give it to {{method.verify=tree}}")
            values.setdefault(GROUP_FIELD[group], {})[key] = option(group, key).value(value)
        return cls(**values, **fields)

    def __str__(self) -> str:
        """The canonical text: ``parse(str(c))`` equals ``c`` but for the sampling options. A drafter
        or policy given as an object is written by its name (which does not parse back)."""
        if self.is_ar:
            return "ar"
        drafter = self.drafter if isinstance(self.drafter, str) or self.drafter is None else self.drafter.name
        fields = ["spec"] + ([drafter] if drafter is not None else []) + [self.verify]
        if self.verify != "tree":
            policy = self.policy if isinstance(self.policy, str) else self.policy.name
            fields += [f"k={self.k}", f"policy={policy}"]
        for group, values in (("policy", self.policy_options), ("tree", self.tree), ("drafter", self.drafter_options)):
            fields += [f"{key}={option(group, key).format(value)}" for key, value in sorted((values or {}).items())]
        return ":".join(fields)


FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig))
# The fields that come with each generation rather than with the method (not in the text form).
SAMPLING_FIELDS = ("draft_weights", "temperature", "top_k", "top_p", "max_new_tokens", "seed", "sampler", "stop",
                   "eos_token_ids", "prompt_cache")


def _keyed(key: str) -> bool:
    return any(o.name == key and o.group in ("drafter", "policy", "tree") for o in options())


def _trees(drafter: Any) -> str:
    """Whether the drafter named ``drafter`` proposes token trees: ``no``, ``also`` or ``only``
    (its :class:`~specdec.drafters.registry.DrafterSpec`); ``no`` for anything not a registered
    name (the default, the target alone, a drafter object)."""
    declared = registry.find(drafter)
    return declared.trees if declared is not None else "no"


def _check_own_tree(declared: registry.DrafterSpec, tree: Mapping[str, Any]) -> None:
    """The tree options of a drafter whose trees are its own: only its ``tree_keys``, each a
    positive integer; the hint names what shapes its trees instead (those keys, else its options)."""
    keys, names = declared.tree_keys or (), declared.option_names
    if keys:
        shapers = f" ({_and([f'{{tree.{key}}}' for key in keys])} {'do' if len(keys) > 1 else 'does'})"
    else:
        shapers = f" ({_and([f'{name}=' for name in names])} {'shape' if len(names) > 1 else 'shapes'} it)" if names else ""
    for key in sorted(set(tree) - set(keys)):
        raise ConfigError(f"{{tree.{key}}} does not shape a {declared.name} tree", f"drop {{tree.{key}}}{shapers}")
    for key in keys:
        if key in tree and (isinstance(tree[key], bool) or not isinstance(tree[key], int) or tree[key] < 1):
            raise ConfigError(f"{{tree.{key}}} must be a positive integer, got {tree[key]!r}")


def _and(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _check_tree_only(drafter: str | None, verify: str, parts: Sequence[str]) -> None:
    """The text form of the rule that a tree-only drafter (lookahead decoding) is verified as a
    tree: the one-line error spells the method to write instead, the text's other fields kept
    (``spec:lookahead:window=6`` -> ``spec:lookahead:tree:window=6``). A config built from
    keywords meets the same rule in :meth:`DecodeConfig._check_combination`."""
    if _trees(drafter) != "only" or verify == "tree":
        return
    kept = [p for p in parts if p not in (drafter, verify) and p.partition("=")[0] != "drafter"]
    fixed = ":".join(["spec", drafter, "tree", *kept])
    raise ConfigError(f"{drafter} decoding drafts a token tree each step, verified in one pass", f"write {fixed}")


class _FrozenDict(dict):
    """A dict that hashes (a frozen config's option groups)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a DecodeConfig's options are read-only; use config.replace(...)")

    __setitem__ = __delitem__ = update = pop = clear = setdefault = _refuse  # type: ignore[assignment]


def _frozen(mapping: Mapping[str, Any]) -> _FrozenDict:
    return _FrozenDict((k, tuple(v) if isinstance(v, list) else v) for k, v in mapping.items())


def _integer(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")


def _positive_int(value: Any, name: str) -> None:
    _integer(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings; one string is one stop string, not its letters."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, (list, tuple, set, frozenset)):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError("stop strings must not be empty (an empty string would stop before the first token)")
    return tuple(stop)


def _eos_ids(ids: Any) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"eos_token_ids must be a list of token ids, got {type(ids).__name__}")
    ids = tuple(ids)
    for t in ids:
        _integer(t, "eos_token_ids")
    return tuple(int(t) for t in ids)
