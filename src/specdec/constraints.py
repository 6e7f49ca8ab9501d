"""Constrained decoding, penalties, logit bias and log-probabilities, exact under speculation.

:class:`Constraints` says how a generation changes the target's logits: a grammar (a JSON Schema,
a regular expression or an llguidance Lark grammar, matched by llguidance), a bias per token id,
and the OpenAI presence and frequency penalties and llama.cpp's repeat penalty. The law of the
output is then the *processed* target law: at each position, the softmax of the target's logits
after the bias, the penalties and the grammar's mask (-inf on forbidden tokens), renormalised,
before temperature, top-k and top-p.

A :class:`LogitProcessor` holds one generation's state (the grammar matcher after the output so far,
the output's token counts) and processes every row the target scores: in a speculative step row i
of a chain comes after the context and draft tokens 0..i-1, so it is processed as if those tokens
had been generated (they count in the penalties, the matcher has consumed them); a tree node's row
sees the node's path. Every verifier then sees the processed law of each position given its
prefix, which is all that exactness asks of it (docs/exactness.md, "Constraints").

Draft tokens the grammar forbids have processed probability 0. :meth:`LogitProcessor.screen` cuts a
draft after its first forbidden token (the rows beyond it are reached with probability 0), and the
forbidden token itself where that keeps the law: where its draft law q is a point mass, under greedy
decoding and under the Gumbel-max sampler. A sampled forbidden token must stay: token and block
verification reject it with probability 1 but then draw the residual norm(max(0, p - q)) (block:
max(0, keep p - q)), which depends on q; the law of the output is p only averaged over the draws of
q, forbidden ones included. Replacing a forbidden draw by a draw from p would skew it (p = (1/2,
1/2, 0), q = (0, 1/2, 1/2): the rule outputs token 0 with probability 1/2, the cut one 1/4).

Where the grammar allows one continuation only (llguidance's fast-forward tokens, such as the
``{"name":"`` a schema's first key forces), :meth:`LogitProcessor.forced` gives those tokens; the
engine drafts them first, as point masses, before whatever the configured drafter proposes, at no
model cost. They are verified like any draft token.
"""

from __future__ import annotations

import copy
import json
import math
import urllib.parse
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from specdec.token_tree import TokenTree

if TYPE_CHECKING:
    from specdec.sampling import SamplingConfig

# OpenAI's ranges: logit_bias values in [-100, 100], presence and frequency penalties in [-2, 2].
MAX_BIAS = 100.0
MAX_PENALTY = 2.0
MAX_TOP_LOGPROBS = 20
# Whitespace a JSON schema allows between two tokens of the JSON text: nothing, one space, or one
# line break and an indent of at most 20 spaces or tabs (llama.cpp's JSON grammars allow the same).
# llguidance's default allows any run of whitespace, blank lines included: a model that drifts into
# them can loop ("\n  \n  ,\n  {" ...) until it runs out of tokens, where one line break per place
# keeps it to the layout JSON is written in. A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})"
JSON_LAYOUT = {"whitespace_pattern": JSON_WHITESPACE}
NO_FINITE_VALUE = ("admits no finite JSON value (every value it describes would contain another without end, as "
                   "in a $ref that leads back to itself); give each recursive definition a case that ends")
# How many of the tokens allowed first (after the forced ones) a check with the model's tokenizer
# tries, each on its own copy of the grammar's matcher, so that a grammar too large for llguidance's
# limits is refused before generating rather than failing at its first steps.
PROBE_TOKENS = 32


class ConstraintError(ValueError):
    """A bad constraint; ``field`` names the offending field (``json_schema``, ``logit_bias``, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the processed target law (the log-softmax of the
    target's logits after logit_bias, penalties and the grammar's mask, before temperature, top-k and
    top-p), and the ``top`` most likely tokens there as (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Constraints:
    """What a generation constrains or changes in the target's logits (none by default).

    json_schema: a JSON Schema (a dict or its JSON text; ``{"type": "object"}`` is any JSON
    object), regex: a regular expression the whole output matches, grammar: an llguidance Lark
    grammar; at most one of the three. logit_bias: token id -> a value in [-100, 100] added to its
    logit. presence_penalty, frequency_penalty (OpenAI's, in [-2, 2]): subtracted from the logit of
    every token generated so far, once and once per occurrence. repeat_penalty (llama.cpp's, > 0,
    1 = off): the logit of each token among the last ``repeat_last_n`` of prompt and output
    (-1: all of them, 0: off) is divided by it where positive, multiplied where not. Applied in
    this order: bias, repeat penalty, presence and frequency penalties, the grammar's mask.
    """

    json_schema: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def check(self, vocab_size: int, tokenizer: Any = None, eos_ids: Sequence[int] = ()) -> None:
        """Raise :class:`ConstraintError` naming the field for a bad value, a grammar that does not
        compile, or a logit_bias id outside the vocabulary (0 .. vocab_size - 1). With the model's
        ``tokenizer`` (and its end-of-sequence ``eos_ids``), also a grammar that no output can
        complete or that is too large for llguidance's limits (:func:`try_grammar`)."""
        for name, limit in (("presence_penalty", MAX_PENALTY), ("frequency_penalty", MAX_PENALTY)):
            value = getattr(self, name)
            if not _is_number(value) or not -limit <= value <= limit:
                raise ConstraintError(name, f"must be a number in [-{limit:g}, {limit:g}], got {value!r}")
        if not _is_number(self.repeat_penalty) or not (0 < self.repeat_penalty < math.inf):
            raise ConstraintError("repeat_penalty", f"must be a positive number (1 disables it), got {self.repeat_penalty!r}")
        n = self.repeat_last_n
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise ConstraintError("repeat_last_n", f"must be an integer >= -1 (-1: the whole context, 0: off), got {n!r}")
        self.bias(vocab_size)
        grammar = self.grammar_text()
        if grammar is not None:
            from llguidance import LLMatcher

            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
            if failed:
                raise ConstraintError(self._grammar_field(), f"does not compile: {_one_line(messages[0])}")
            if self.json_schema is not None and not admits_a_value(self._schema()):
                raise ConstraintError("json_schema", NO_FINITE_VALUE)
            if tokenizer is not None:
                self._try(grammar, grammar_tokenizer(tokenizer, vocab_size, eos_ids))

    @property
    def active(self) -> bool:
        """False when nothing would change any logit (True for values :meth:`check` refuses)."""
        bias = self.logit_bias
        return (any(getattr(self, name) is not None for name in ("json_schema", "regex", "grammar"))
                or not isinstance(bias, Mapping) or any(not _is_number(v) or v != 0 for v in bias.values())
                or self.presence_penalty != 0 or self.frequency_penalty != 0
                or (self.repeat_penalty != 1 and self.repeat_last_n != 0))

    def bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with integer keys (JSON's string keys such as ``"123"`` read as ids), checked."""
        if not isinstance(self.logit_bias, Mapping):
            raise ConstraintError("logit_bias", f"must map token ids to numbers, got {type(self.logit_bias).__name__}")
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _token_id(key)
            if token is None or not 0 <= token < vocab_size:
                raise ConstraintError("logit_bias", f"key {key!r} is not a token id of this model's vocabulary "
                                      f"(0..{vocab_size - 1})")
            if not _is_number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ConstraintError("logit_bias", f"the bias of token {token} must be a number in "
                                      f"[-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}")
            out[token] = float(value)
        return out

    def _grammar_field(self) -> str | None:
        given = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ConstraintError(given[1], f"give one of json_schema, regex and grammar, not {' and '.join(given)}")
        return given[0] if given else None

    def _schema(self) -> dict | bool:
        """json_schema as a value (its JSON text read), checked to be a schema."""
        value = self.json_schema
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise ConstraintError("json_schema", f"is not valid JSON: {err}") from None
        if not isinstance(value, (dict, bool)):
            raise ConstraintError("json_schema", f"must be a JSON object (a schema), got {type(value).__name__}")
        return value

    def grammar_text(self) -> str | None:
        """The llguidance grammar of json_schema, regex or grammar (None without one)."""
        name = self._grammar_field()
        if name is None:
            return None
        from llguidance import LLMatcher

        value = getattr(self, name)
        if name == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(self._schema(), defaults=JSON_LAYOUT)
            except (ValueError, TypeError) as err:
                raise ConstraintError("json_schema", str(err)) from None
        if not isinstance(value, str) or not value:
            raise ConstraintError(name, f"must be a non-empty string, got {value!r}")
        return LLMatcher.grammar_from_regex(value) if name == "regex" else LLMatcher.grammar_from_lark(value)

    def processor(self, tokenizer: Any, vocab_size: int, prompt: Sequence[int], eos_ids: Sequence[int] = (),
                  logprobs: int | None = None) -> "LogitProcessor":
        """This generation's :class:`LogitProcessor` after ``prompt`` (checks first). The grammar
        needs ``tokenizer`` (a fast Hugging Face tokenizer, as :func:`specdec.models.load` returns
        for model directories and GGUF files alike); its end-of-sequence tokens are ``eos_ids``."""
        self.check(vocab_size)
        check_logprobs(logprobs)
        matcher = vocabulary = None
        grammar = self.grammar_text()
        if grammar is not None:
            if tokenizer is None:
                raise ConstraintError(self._grammar_field() or "grammar", "a grammar needs the model's tokenizer; pass tokenizer=")
            from llguidance import LLMatcher

            vocabulary = grammar_tokenizer(tokenizer, vocab_size, eos_ids)
            self._try(grammar, vocabulary)
            matcher = LLMatcher(vocabulary, grammar, log_level=0)
        return LogitProcessor(self, matcher, vocab_size, prompt, logprobs, vocabulary)

    def _try(self, grammar: str, vocabulary: Any) -> None:
        """:func:`try_grammar` on the grammar, and on each regular expression of a JSON schema's
        ``pattern`` and ``patternProperties`` alone (a string's pattern is only reached after the
        tokens before it, beyond what the first tokens try)."""
        from llguidance import LLMatcher

        field_name = self._grammar_field() or "grammar"
        try_grammar(grammar, vocabulary, field_name, schema=field_name == "json_schema")
        if field_name == "json_schema":
            for pattern in sorted(set(schema_patterns(self._schema()))):
                try_grammar(LLMatcher.grammar_from_regex(pattern), vocabulary, field_name, pattern=pattern)


def try_grammar(grammar: str, vocabulary: Any, field: str, schema: bool = False, pattern: str | None = None) -> None:
    """Build the grammar's matcher over the model's ``vocabulary`` (an ``llguidance.LLTokenizer``)
    and take its first steps: the first mask, the forced tokens, and each of up to
    :data:`PROBE_TOKENS` tokens allowed after them (spread over the allowed ones), each on a copy,
    with the mask after it. llguidance builds its lexer and parser states lazily, so a grammar that
    compiles may still exceed its limits at the first token (``"a"{1000000}`` in Lark, the
    pattern ``(a|aa)*(b|bb){1000}``); and a grammar whose every derivation goes on forever (a JSON
    schema ``{"$ref": "#"}``) allows nothing at all, not even the end. Raise
    :class:`ConstraintError` on ``field`` for these (``pattern``: the regular expression tried,
    named in the message; one that does not compile alone is left to the schema's grammar);
    ``schema``: the grammar is a JSON schema's."""
    from llguidance import LLMatcher

    what = f"its pattern {pattern!r}" if pattern is not None else "it"

    def fail(matcher: Any) -> ConstraintError:
        error = _one_line(matcher.get_error())
        if error.startswith("NoExtensionBias"):  # no token, not even the end, can follow the empty output
            return ConstraintError(field, NO_FINITE_VALUE if schema else
                                   "matches no finite text (every rule goes on forever); give each recursive "
                                   "rule a case that ends")
        return ConstraintError(field, f"is too large for the grammar engine: {what} exceeds llguidance's limits at "
                                      f"the first tokens ({error}); make it smaller (fewer repetitions or alternatives)")

    matcher = LLMatcher(vocabulary, grammar, log_level=0)
    if matcher.is_error() and pattern is not None:
        return
    if matcher.is_error():
        raise ConstraintError(field, f"does not compile: {_one_line(matcher.get_error())}")
    _mask(matcher)
    if matcher.is_error():
        raise fail(matcher)
    if matcher.is_stopped() and pattern is None:
        raise ConstraintError(field, "allows only an empty output; it must admit some text")
    forced = matcher.compute_ff_tokens()
    if matcher.is_error() or (forced and not matcher.consume_tokens(forced)):
        raise fail(matcher)
    allowed = [t for t in np.flatnonzero(_mask(matcher)) if t != vocabulary.eos_token]
    if matcher.is_error():
        raise fail(matcher)
    for token in allowed[::max(1, len(allowed) // PROBE_TOKENS)][:PROBE_TOKENS]:
        branch = matcher.deep_copy()
        if branch.consume_token(int(token)):
            _mask(branch)
        if branch.is_error():
            raise fail(branch)


def admits_a_value(schema: Any, budget: int = 10_000) -> bool:
    """Whether a JSON schema admits a finite JSON value, as far as its structure shows: False where
    every value it describes would have to contain another one without end (``{"$ref": "#"}``, two
    definitions that only refer to each other, an object whose required property is the object
    itself), True where some value can end (a tree whose children are optional, an empty array, a
    ``null`` among the types) and for any keyword this does not model. A local ``$ref`` (``#``,
    ``#/$defs/name``) is followed; past ``budget`` schemas visited the answer is True."""
    left = [budget]

    def finite(node: Any, visiting: frozenset[int]) -> bool:
        left[0] -= 1
        if left[0] < 0 or not isinstance(node, (dict, bool)):
            return True
        if isinstance(node, bool) or id(node) in visiting:
            return node is True  # a schema met again on its own path: a value there never ends
        inside = visiting | {id(node)}
        ref = node.get("$ref")
        target = _local_ref(schema, ref) if isinstance(ref, str) else None
        if target is not None and not finite(target, inside):
            return False
        if any(not finite(sub, inside) for sub in _schemas(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            options = _schemas(node.get(key))
            if options and not any(finite(sub, inside) for sub in options):
                return False
        return _some_type_ends(node, lambda sub: finite(sub, inside))

    return finite(schema, frozenset())


def _some_type_ends(node: dict, finite: Any) -> bool:
    """Whether one of the types ``node`` allows has a finite value, given ``finite`` for subschemas."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None or "enum" in node or "const" in node:
        return True
    if set(types) - {"object", "array"}:
        return True  # a string, number, boolean or null ends
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if "object" in types and all(finite(properties.get(name, True)) for name in required):
        return True
    least = node.get("minItems", 0) if isinstance(node.get("minItems", 0), int) else 0
    prefix = _schemas(node.get("prefixItems"))
    return "array" in types and all(finite(sub) for sub in prefix[:least]) and (
        least <= len(prefix) or finite(node.get("items", True)))


def _schemas(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _local_ref(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#`` or a JSON pointer after ``#``) names in ``root``; None
    for another document or a pointer to nothing."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_patterns(schema: Any) -> list[str]:
    """The regular expressions of a JSON schema: each ``pattern`` and ``patternProperties`` key,
    outside ``enum``, ``const``, ``default`` and ``examples`` (values, not schemas)."""
    found: list[str] = []
    if isinstance(schema, list):
        for item in schema:
            found += schema_patterns(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                found.append(value)
            elif key == "patternProperties" and isinstance(value, dict):
                found += [k for k in value if isinstance(k, str)]
            if key not in ("enum", "const", "default", "examples"):
                found += schema_patterns(value)
    return found


def _mask(matcher: Any) -> np.ndarray:
    """The matcher's mask in its current state: [V'] bool (V' the vocabulary rounded up to 32)."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)


def check_logprobs(logprobs: int | None) -> None:
    """None (no log-probabilities), 0 (the chosen token's) or 1..20 (also the top ones)."""
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ConstraintError("logprobs", f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the top tokens "
                              f"reported beside each chosen one), got {logprobs!r}")


def _one_line(message: str) -> str:
    """llguidance's error message on one line: its first line, and the line that names the error
    where the message goes on to quote the source."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    detail = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0].rstrip(':')}: {detail}" if detail else lines[0]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_id(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return None


_GRAMMAR_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] = ()) -> Any:
    """llguidance's tokenizer for a fast Hugging Face tokenizer, ``vocab_size`` wide (the model's
    logits may be wider than the tokenizer), ending at ``eos_ids`` (the tokenizer's EOS if none).
    Built once per tokenizer (about half a second) and kept while the tokenizer lives."""
    import llguidance

    eos = tuple(sorted(eos_ids)) or None
    try:
        built = _GRAMMAR_TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: built each time
        built = {}
    key = (vocab_size, eos)
    if key not in built:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConstraintError("grammar", "the grammar needs a fast Hugging Face tokenizer (one with a "
                                  "backend_tokenizer); load the model's tokenizer with use_fast=True")
        built[key] = llguidance.LLTokenizer(_byte_level_json(backend), n_vocab=vocab_size,
                                            eos_token=list(eos) if eos else tokenizer.eos_token_id)
    return built[key]


def _byte_level_json(backend: Any) -> str:
    """The tokenizer's JSON as llguidance reads it (``llguidance.hf.from_tokenizer`` does the same,
    padding and truncation off), with a byte-level decoder where a sequence of decoders ends in
    one (SmolLM2's): llguidance reads a token's bytes from a plain ``ByteLevel`` decoder, and
    otherwise takes the token's text for its bytes, so 'Ċ' would be two bytes instead of a
    newline and no grammar could write a space or a line break."""
    import tokenizers

    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    decoder = backend.decoder
    if decoder is not None and not isinstance(decoder, tokenizers.decoders.ByteLevel) and "ByteLevel" in str(
            json.loads(backend.to_str()).get("decoder")):
        backend.decoder = tokenizers.decoders.ByteLevel()
    return backend.to_str()


class LogitProcessor:
    """One generation's processing of the target's logits (module docstring). The engine calls
    :meth:`forced` and :meth:`screen` on each draft, :meth:`apply` on the rows the target scored,
    :meth:`logprobs` for the tokens it appends, and :meth:`advance` with them."""

    def __init__(self, constraints: Constraints, matcher: Any, vocab_size: int, prompt: Sequence[int],
                 logprobs: int | None = None, vocabulary: Any = None) -> None:
        self.constraints = constraints
        self.matcher = matcher
        self.vocabulary = vocabulary  # the grammar's tokenizer (tokens to bytes and back), with the matcher
        self.vocab_size = vocab_size
        self.top_logprobs = logprobs
        self.bias_ids = torch.tensor(sorted(constraints.bias(vocab_size)), dtype=torch.long)  # [B]
        self.bias_values = torch.tensor([constraints.bias(vocab_size)[int(t)] for t in self.bias_ids],
                                        dtype=torch.float64)  # [B], cast to the logits' dtype when added
        self.prompt_len = len(prompt)
        self.counts: Counter[int] = Counter()  # the output's tokens so far
        self.finished = False  # the grammar is complete: nothing but the end may follow

    # -- drafts -----------------------------------------------------------------------------------

    def forced(self, room: int) -> list[int]:
        """The tokens the grammar forces after the output so far (at most ``room``): llguidance's
        fast-forward tokens (the canonical tokens of the bytes the grammar forces), then while the
        mask leaves a single token other than an end, that token."""
        if self.matcher is None or room <= 0 or self.finished:
            return []
        forced = list(self.matcher.compute_ff_tokens())[:room]
        if forced and not self.matcher.consume_tokens(forced) or self.matcher.is_error():
            raise self._engine_error("computing the tokens it forces")
        while len(forced) < room and not self.matcher.is_stopped():
            allowed = torch.nonzero(self._allowed()).flatten()
            if len(allowed) != 1 or self.matcher.is_accepting():
                break
            forced.append(int(allowed[0]))
            self.matcher.consume_token(forced[-1])
        if forced:
            self.matcher.rollback(len(forced))
        return forced

    def screen(self, draft: Any, sampling: "SamplingConfig") -> Any:
        """The draft (a chain :class:`~specdec.drafters.base.Draft` or a
        :class:`~specdec.token_tree.TokenTree`) without what the grammar makes unreachable: every
        token after a forbidden one, and the forbidden token itself where cutting it keeps the law
        (a point-mass draft law, greedy decoding, the Gumbel-max sampler; module docstring)."""
        if self.matcher is None or len(draft) == 0:
            return draft
        free = sampling.greedy or sampling.coupled
        if isinstance(draft, TokenTree):
            return self._screen_tree(draft, free or draft.q is None)
        tokens = draft.tokens.tolist()
        allowed = self.matcher.validate_tokens(tokens)
        if allowed >= len(tokens):
            return draft
        row = draft.q[allowed]
        keep = allowed if free or int(torch.count_nonzero(row)) == 1 else allowed + 1
        return type(draft)(draft.tokens[:keep], draft.q[:keep])

    def _screen_tree(self, tree: Any, cut_forbidden: bool) -> Any:
        kept: list[int] = []
        ok = [False] * len(tree)  # the node's path is allowed by the grammar
        for i, parent in enumerate(tree.parents):
            if parent >= 0 and not ok[parent]:
                continue  # below a forbidden node: reached with probability 0
            path = tree.tokens_on(tree.path(i))
            ok[i] = self.matcher.validate_tokens(path) == len(path)
            if ok[i] or not cut_forbidden:
                kept.append(i)
        return tree if len(kept) == len(tree) else subtree(tree, kept)

    # -- rows -------------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, context: Sequence[int], draft: Any = None) -> torch.Tensor:
        """The processed logits: [1 + N, V] float32 (float64 for float64 logits), a new tensor.
        logits: [1 + N, V], row 0 after ``context``, row 1 + i after draft node i (a chain's node i
        follows node i - 1); each row is processed with its path as generated tokens."""
        out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        n = 0 if draft is None else len(draft)
        if n == 0:
            self._process(out[0], context, [], True)
            return out
        tokens = draft.tokens if isinstance(draft, TokenTree) else draft.tokens.tolist()
        parents = draft.parents if isinstance(draft, TokenTree) else list(range(-1, n - 1))
        paths: list[list[int]] = [[]]  # row r's path of tokens
        for i, parent in enumerate(parents):
            paths.append(paths[parent + 1] + [tokens[i]])
        allowed = [True] * (1 + n)  # the grammar allows the row's path: mask it
        if self.matcher is not None:
            for r in range(1, 1 + n):
                allowed[r] = allowed[parents[r - 1] + 1] and self.matcher.validate_tokens(paths[r]) == len(paths[r])
        for r in range(1 + n):
            self._process(out[r], context, paths[r], allowed[r])
        return out

    def _process(self, row: torch.Tensor, context: Sequence[int], path: Sequence[int], grammar: bool) -> None:
        """Process one row ([V], in place) after ``context`` and ``path``; ``grammar``: mask it
        (False for a row after a forbidden token, reached with probability 0: left finite)."""
        c = self.constraints
        if len(self.bias_ids):
            row[self.bias_ids] += self.bias_values.to(row.dtype)
        last_n = c.repeat_last_n
        if c.repeat_penalty != 1 and last_n != 0:
            whole = list(context) + list(path)
            window = whole if last_n < 0 else whole[-last_n:]
            ids = torch.tensor(sorted(set(window)), dtype=torch.long)
            seen = row[ids]
            row[ids] = torch.where(seen > 0, seen / c.repeat_penalty, seen * c.repeat_penalty)
        if c.presence_penalty != 0 or c.frequency_penalty != 0:
            counts = self.counts + Counter(path) if path else self.counts
            if counts:
                ids = torch.tensor(sorted(counts), dtype=torch.long)
                times = torch.tensor([counts[int(t)] for t in ids], dtype=row.dtype)
                row[ids] -= times * c.frequency_penalty + c.presence_penalty
        if grammar and self.matcher is not None:
            consumed = path and self.matcher.consume_tokens(list(path))
            mask = self._allowed()
            if consumed:
                self.matcher.rollback(len(path))
            row.masked_fill_(~mask, float("-inf"))

    def _allowed(self) -> torch.Tensor:
        """The grammar's mask in its current state: [V] bool."""
        bits = _mask(self.matcher)
        if self.matcher.is_error():
            raise self._engine_error("computing the tokens it allows")
        allowed = np.zeros(self.vocab_size, dtype=bool)
        width = min(self.vocab_size, bits.shape[0])
        allowed[:width] = bits[:width]
        return torch.from_numpy(allowed)

    def _engine_error(self, doing: str) -> "ConstraintError":
        """The matcher stopped on one of llguidance's limits while ``doing`` something (in a grammar
        whose first steps, which the check takes, stayed within them): a :class:`ConstraintError` on
        the grammar's field."""
        return ConstraintError(self.constraints._grammar_field() or "grammar",
                               f"is too large for the grammar engine: after {sum(self.counts.values())} output "
                               f"tokens, {doing} exceeded llguidance's limits ({_one_line(self.matcher.get_error())}); "
                               "make it smaller (fewer repetitions or alternatives)")

    def logprobs(self, rows: torch.Tensor, tokens: Sequence[int]) -> list[TokenLogprob]:
        """The log-probabilities of ``tokens[i]`` under processed row ``rows[i]`` ([n, V]) and the
        top :attr:`top_logprobs` tokens there."""
        logp = torch.log_softmax(rows, dim=-1)  # [n, V]
        out = []
        for row, token in zip(logp, tokens):
            top: tuple[tuple[int, float], ...] = ()
            if self.top_logprobs:
                values, ids = torch.topk(row, self.top_logprobs)
                top = tuple((int(t), float(v)) for t, v in zip(ids, values) if v > -math.inf)  # allowed ones only
            out.append(TokenLogprob(int(token), float(row[token]), top))
        return out

    # -- the output -------------------------------------------------------------------------------

    def advance(self, tokens: Sequence[int]) -> int:
        """The output grew by ``tokens``: count them and move the grammar on. Returns how many of
        them the output keeps: all, or those up to the one that completed the grammar (after it
        only the end may follow, so the generation ends there, :attr:`finished`)."""
        keep = len(tokens)
        if self.matcher is not None:
            for i, token in enumerate(tokens):
                if not self.matcher.consume_token(int(token)):  # a token its mask allowed: a limit
                    raise self._engine_error(f"reading token {token}")
                if self.matcher.is_stopped():
                    self.finished, keep = True, i + 1
                    break
        self.counts.update(int(t) for t in tokens[:keep])
        return keep


class Unprocessed:
    """The processor of a generation without constraints or log-probabilities: the target's logits
    as they are, no forced tokens, nothing screened, never finished. It keeps no state, so one
    instance, :data:`UNPROCESSED`, serves every such generation."""

    vocabulary = None
    top_logprobs = None
    finished = False

    def forced(self, room: int) -> list[int]:
        return []

    def screen(self, draft: Any, sampling: "SamplingConfig") -> Any:
        return draft

    def apply(self, logits: torch.Tensor, context: Sequence[int], draft: Any = None) -> torch.Tensor:
        return logits

    def advance(self, tokens: Sequence[int]) -> int:
        return len(tokens)


UNPROCESSED = Unprocessed()


def subtree(tree: Any, nodes: Sequence[int]) -> Any:
    """The token tree of ``nodes`` (ascending, each node's parent among them), re-indexed, with its
    draft laws where the tree has them."""
    index = {old: new for new, old in enumerate(nodes)}
    parents = [index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in nodes]
    q = None if tree.q is None else tree.q[[0] + [1 + i for i in nodes]]
    return TokenTree([tree.tokens[i] for i in nodes], parents, q)


def with_forced(forced: Sequence[int], draft: Any, vocab_size: int) -> Any:
    """``forced`` tokens, as point-mass drafts, followed by ``draft`` (drafted after them)."""
    if not forced:
        return draft
    f = len(forced)
    one_hot = torch.zeros(f, vocab_size)  # [f, V]: row j the law of forced token j
    one_hot[torch.arange(f), torch.tensor(forced)] = 1.0
    if isinstance(draft, TokenTree):
        parents = list(range(-1, f - 1)) + [p + f if p >= 0 else f - 1 for p in draft.parents]
        q = None if draft.q is None else torch.cat([one_hot, draft.q.to(one_hot.dtype)])  # [1 + f + N, V]
        return TokenTree(list(forced) + list(draft.tokens), parents, q)
    tokens = torch.cat([torch.tensor(forced, dtype=torch.long), draft.tokens.to(torch.long)])
    q = torch.cat([one_hot.to(draft.q.dtype), draft.q]) if len(draft) else one_hot
    return type(draft)(tokens, q)
