"""Request bodies of the OpenAI-style endpoints, and how a request becomes :func:`specdec.stream` arguments.

Bodies are pydantic models with ``extra="forbid"`` and strict types: a field the server does not
know is refused by name, and a value of the wrong type is never coerced. Two OpenAI fields that
change nothing at their default value (``echo``, ``best_of``) are accepted at that value only, so
clients that always send them work, and a request that asks for their effect is told the server
does not have it.

The fields that change the law a token is drawn from (``response_format``, ``grammar``,
``json_schema``, ``tool_choice`` ``required`` or a named function, the penalties, ``logit_bias``)
become one :class:`specdec.constraints.Constraints` (:func:`constraint_fields`), applied by the
library in every verification row, and checked by it (ranges, schemas, grammars, token ids);
``logprobs`` / ``top_logprobs`` become its ``logprobs=``.

Non-standard fields: ``top_k`` (0 disables), ``ignore_eos`` (generate all ``max_tokens``, as
llama-server's and vLLM's field does), llama-server's ``grammar`` (llguidance Lark text),
``json_schema`` (a JSON schema), ``repeat_penalty`` and ``repeat_last_n``, and ``speculative``:
``{"method": "spec"}``, a method in :class:`~specdec.config.DecodeConfig`'s text form (``spec``
is the default method, as ``specdec generate`` runs it; ``spec:ngram:block:k=8``, ``spec:tree``,
``ar``, ...), and ``{"policy_state": "full"}`` for the draft length policy's whole state in the
answer.

Text must be valid Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which no
tokenizer can encode, so it is refused by field. :class:`PromptLimits` checks a prompt against the
model: its length in characters before tokenizing (a bound no tokenizer can beat), then in tokens.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdec.config import NAME_ONLY, SEED_RANGE, ConfigError, DecodeConfig, text_spelling
from specdec.constraints import JSON_LAYOUT, Constraints
from specdec.server import tools
from specdec.server.errors import APIError

MAX_STOP = 4  # as OpenAI's API
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
# Fields accepted only at the value that makes them do nothing.
_NEUTRAL = {"echo": (False,), "best_of": (None, 1)}
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's API
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI's API
_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # a function's or a schema's name, as OpenAI's API
# The deepest nesting of arrays and objects a body may have: far more than any request's schema or
# tools need, and far less than the depth at which code that walks a value recursively (the JSON
# parser, pydantic, a schema's compiler) runs out of stack.
MAX_JSON_DEPTH = 128


def too_deep() -> APIError:
    return APIError(400, f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} levels deep; "
                         "send a shallower JSON object")


def check_depth(value: Any) -> None:
    """A parsed body nested at most :data:`MAX_JSON_DEPTH` levels deep, else a 400 (walked without
    recursion, so any depth the parser accepted is measured)."""
    level, depth = [value], 0  # the arrays and objects at one depth
    while level := [item for item in level if isinstance(item, (list, dict))]:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    method: str | None = None  # None: the server's method
    policy_state: Literal["short", "full"] = "short"  # the answer's policy_state: all of it with "full"


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file sent back with a few
    lines changed), ``{"type": "content", "content": text or [{"type": "text", "text": ...}]}``. A
    draft source (:mod:`specdec.drafters.prediction`): it changes the speed, never the answer."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: Any

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any) -> str:
        if isinstance(content, str):
            return unicode_text(content, "prediction.content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
                                             for p in content):
            return unicode_text("".join(p["text"] for p in content), "prediction.content")
        raise ValueError("prediction.content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (``{name, schema, strict}``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema goes with "type": "json_schema", and that type needs it: '
                             '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        return self


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # JSON's NaN and Infinity refused

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, lt=SEED_RANGE)
    sampler: Literal["multinomial", "gumbel"] | None = None  # None: the server's choice (choose_method)
    stop: Any = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # a label for the caller; it changes nothing
    speculative: SpeculativeOptions | None = None
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server's: llguidance Lark text
    json_schema: dict[str, Any] | bool | None = None  # llama-server's
    # Their ranges (and logit_bias's keys against the vocabulary) are Constraints.check's.
    presence_penalty: float | None = None  # -2..2
    frequency_penalty: float | None = None  # -2..2
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> -100..100
    repeat_penalty: float | None = None  # llama-server's; > 0, 1 is off
    repeat_last_n: int | None = None  # llama-server's; -1 the whole context, 0 off
    # OpenAI's Predicted Outputs (a chat completion's; a completion also takes the text alone)
    prediction: Prediction | None = None
    PREDICTION_TEXT: ClassVar[bool] = False  # whether ``prediction`` may also be the text alone

    @field_validator("prediction", mode="before")
    @classmethod
    def _prediction_object(cls, value: Any) -> Any:
        if isinstance(value, str) and cls.PREDICTION_TEXT:
            return {"type": "content", "content": value}
        if value is not None and not isinstance(value, dict):
            raise ValueError('prediction must be an object like {"type": "content", "content": "..."}')
        return value

    @property
    def predicted(self) -> str | None:
        """The prediction's text (None for none, or an empty one: nothing to draft from)."""
        return self.prediction.content or None if self.prediction is not None else None

    @field_validator("grammar")
    @classmethod
    def _grammar(cls, grammar: str | None) -> str | None:
        if grammar is not None and not grammar.strip():
            raise ValueError("grammar is empty: give an llguidance Lark grammar, e.g. 'start: \"yes\" | \"no\"'")
        return grammar if grammar is None else unicode_text(grammar, "grammar")

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculative_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError('speculative must be an object like {"method": "spec:block:k=4"}')
        return value

    @field_validator("model", "user")
    @classmethod
    def _text(cls, value: str | None, info: Any) -> str | None:
        return value if value is None else unicode_text(value, info.field_name)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n must be 1: the server returns one choice per request")
        return n

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> list[str]:
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} strings, got {len(stops)}")
        return [unicode_text(s, "stop") for s in stops]

    @field_validator("echo", "best_of", check_fields=False)
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        allowed = _NEUTRAL[info.field_name]
        if not any(_same(value, a) for a in allowed):
            shown = " or ".join("null" if a is None else str(a).lower() for a in allowed)
            raise ValueError(f"{info.field_name} is not supported by this server (only {shown})")
        return value


class CompletionBody(_Body):
    PREDICTION_TEXT: ClassVar[bool] = True
    prompt: Any
    suffix: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    echo: Any = False
    best_of: Any = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # the top n with the chosen token

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int]:
        """One prompt: text, token ids, or a list holding one of those (OpenAI's batch form)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token of text")
            return unicode_text(prompt, "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("prompt holds several prompts; this server takes one prompt per request")
        raise ValueError("prompt must be a string or a non-empty list of token ids")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, suffix: str | None) -> str | None:
        return suffix if suffix is None else unicode_text(suffix, "suffix")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(unicode_text(arguments, "arguments"))
        except ValueError:
            raise ValueError("arguments must be a JSON object in a string, e.g. '{\"city\": \"Paris\"}'") from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object in a string, e.g. '{\"city\": \"Paris\"}'")
        return arguments


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (``message.tool_calls`` sent back in the history)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    content: Any = Field(None, validate_default=True)  # last: its check reads the fields above

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_the_assistant(cls, calls: Any, info: Any) -> Any:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("tool_calls go on an assistant message")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _id_on_a_tool_message(cls, call_id: str | None, info: Any) -> str | None:
        if call_id is not None and info.data.get("role") != "tool":
            raise ValueError("tool_call_id goes on a tool message (role \"tool\")")
        return call_id if call_id is None else unicode_text(call_id, "text")

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any, info: Any) -> str | None:
        """Text, or a list of ``{"type": "text", "text": ...}`` parts (joined); None only on an
        assistant message that makes tool calls."""
        if content is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise ValueError("content is missing: every message but an assistant's tool calls has content")
        if isinstance(content, str):
            return unicode_text(content, "text")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
                                             for p in content):
            return unicode_text("".join(p["text"] for p in content), "text")
        raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str | None) -> str | None:
        return name if name is None else unicode_text(name, "text")

    def chars(self) -> int:
        """Characters of text this message puts in the prompt, before the template."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or [])
        return len(self.content or "") + len(self.name or "") + calls


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools: the function name {twice[0]!r} is given twice; names must differ")
        return tools

    def check_fields(self) -> None:
        """The rules that tie fields together: an :class:`APIError` naming the field."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs \"logprobs\": true", param="top_logprobs")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools: give the functions in tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or []}:
                raise APIError(400, f"tool_choice.function.name: {name!r} is not the name of a function in tools",
                               param="tool_choice.function.name")

    @property
    def calls_tools(self) -> bool:
        """Whether the model is shown the tools and its calls are read (``tool_choice`` is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_functions(self) -> list[dict[str, Any]]:
        """The functions a call is forced to (``required``: any; a named one: that one); [] if none."""
        if not self.calls_tools or self.tool_choice in (None, "auto"):
            return []
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []
                if named is None or t.function.name == named]


def unicode_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode, else a ``ValueError`` at its first lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} holds a lone surrogate (U+{ord(text[err.start]):04X}) at character {err.start}: "
                         "text must be valid Unicode (a UTF-16 surrogate needs its pair)") from None
    return text


def _same(value: Any, neutral: Any) -> bool:
    """Whether ``value`` is the neutral value (0 and 0.0 alike; False is not 0)."""
    if isinstance(neutral, (int, float)) and not isinstance(neutral, bool):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


@dataclass
class Generation:
    """What the worker runs: :func:`specdec.stream` arguments, and how the answer is shaped."""

    kind: Literal["completion", "chat"]
    prompt: str | list[int]
    prompt_tokens: int
    method: DecodeConfig
    sampling: dict[str, Any]  # temperature, top_k, top_p, max_new_tokens, seed, stop (, eos_token_ids)
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    constraints: Any = None  # a specdec.constraints.Constraints, or None
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    tool_calls: bool = False  # read tool calls out of the answer (server.tools.ToolCallParser)
    policy_state: str = "short"  # the answer's policy_state: "short" or "full" (responses.policy_state_of)
    prediction: str | None = None  # the predicted output's text (OpenAI's Predicted Outputs), a draft source


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit: the model's context in tokens (None: no limit) and vocabulary.

    ``longest_token`` is the most characters one vocabulary entry spells (byte-level and
    SentencePiece entries spell at least as many characters as they decode to), so a text of more
    than ``longest_token * context`` characters cannot fit the context whatever its tokens: it is
    refused without tokenizing it.
    """

    context: int | None
    vocab_size: int
    longest_token: int

    @classmethod
    def of(cls, target: Any, tokenizer: Any) -> "PromptLimits":
        if all(hasattr(target, a) for a in ("forward", "trim", "tokens", "vocab_size")):  # a CausalLM backend
            context, vocab = target.max_context, target.vocab_size
        else:  # a transformers model, read as specdec's backend reads it
            head = target.get_output_embeddings()
            context = getattr(target.config, "max_position_embeddings", None)
            vocab = int(head.weight.shape[0]) if head is not None else int(target.config.vocab_size)
        return cls(context, vocab, max((len(t) for t in tokenizer.get_vocab()), default=1))

    def check_chars(self, chars: int, param: str) -> None:
        if self.context is not None and chars > self.longest_token * self.context:
            raise APIError(400, f"{param}: {chars} characters cannot fit the model's context of {self.context} "
                                f"tokens (no token spells more than {self.longest_token} characters); shorten it",
                           param=param)

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        if self.context is not None and len(ids) >= self.context:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens but the model's context holds "
                                f"{self.context}; shorten it to leave room for new tokens", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{param}: token ids {bad[:5]} are outside the vocabulary "
                                f"(0..{self.vocab_size - 1})", param=param)


def method_config(text: str, has_draft: bool, *, request: bool = True) -> DecodeConfig:
    """The method a method string names (:meth:`DecodeConfig.parse`), its drafter named for this
    server's models; a ``ValueError`` naming the problem. ``request``: a request's method, which
    may not name a file on the server (a datastore)."""
    try:
        config = DecodeConfig.parse(text)
    except ConfigError as err:
        raise ValueError(err.render(text_spelling, joined=True)) from None
    if config.is_ar:
        return config
    config = config.resolve(True)
    if request and "datastore" in (config.drafter_options or {}):
        raise ValueError("datastore= names a file on the server, which a request may not choose; a retrieval "
                         "method searches the datastore the server was started with (specdec serve --datastore)")
    if config.uses_draft_model and not has_draft:
        raise ValueError(f"{config} needs a draft model, but the server runs without one (--draft none); use ar "
                         "or a drafter of its own, e.g. spec:ngram:block")
    return config


def choose_method(body: _Body, default: DecodeConfig, has_draft: bool, seeded_sampler: str = "gumbel") -> DecodeConfig:
    """The request's method (``speculative.method``), checked against what this server can run,
    with its sampler: the request's ``sampler``; without one, ``seeded_sampler`` for a request
    with a ``seed`` and the config's default for one without (``multinomial``; ``gumbel`` for a
    coupled method, whatever the seed). Under the Gumbel-max sampler a chain's exact rule is
    ``coupled`` (:attr:`DecodeConfig.chain_verifier`), and the method says so. The rules that tie
    the method to the sampling are :class:`DecodeConfig`'s; a broken one is a 400 naming
    ``sampler`` where the sampler broke it, else ``speculative.method``."""
    method = default
    if body.speculative is not None and body.speculative.method is not None:
        try:
            method = method_config(body.speculative.method, has_draft)
        except ValueError as err:
            raise APIError(400, f"speculative.method: {err}", param="speculative.method") from None
    sampler = body.sampler
    if sampler is None and body.seed is not None and not method.replace(sampler=None).gumbel:
        sampler = seeded_sampler  # a method that implies its sampler (coupled) keeps it
    try:
        method.replace(sampler=sampler, temperature=body.temperature)
    except ConfigError as err:
        param = "sampler" if ("sampling", "sampler") in err.options else "speculative.method"
        raise APIError(400, f"{param}: {method}: {err.render(request_spelling, joined=True)}", param=param) from None
    method = method.replace(sampler=sampler)
    return method.as_run


def request_spelling(group: str, name: str, value: Any) -> str:
    """How a request names an option (:class:`~specdec.config.ConfigError`): the method's fields as
    its text form spells them (``typical``), the sampling options as the request's JSON fields
    (``"sampler": "gumbel"``)."""
    if group != "sampling":
        return text_spelling(group, name, value)
    return f'"{name}"' if value is NAME_ONLY else f'"{name}": {json.dumps(value)}'


def method_kwargs(method: DecodeConfig, draft: Any, draft_weights: str) -> dict[str, Any]:
    """The :func:`specdec.stream` keyword arguments that run ``method`` (its config, and the draft
    model where its drafter drafts with one)."""
    return {"config": method.replace(draft_weights=draft_weights),
            "draft": draft if method.uses_draft_model else None}


@dataclass(frozen=True)
class ConstraintFields:
    """:class:`specdec.constraints.Constraints`' fields a request asks for, and for each the request
    field that gave it (to name in an error)."""

    fields: dict[str, Any]
    params: dict[str, str]

    @property
    def any(self) -> bool:
        return bool(self.fields)

    def build(self) -> Any:
        return Constraints(**self.fields)

    def param(self, field: str | None) -> str | None:
        """The request field behind ``field`` (a ConstraintError's), or None."""
        return self.params.get(field or "", field)


_PENALTIES = ("presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n")


def constraint_fields(body: _Body) -> ConstraintFields:
    """The constraints a request asks for: at most one shape of the answer (``response_format``,
    ``json_schema``, ``grammar``, or the grammar of a forced tool call), the penalties and
    ``logit_bias``. Two shapes at once are an :class:`APIError` naming the second."""
    shapes: list[tuple[str, str, Any]] = []  # (request field, Constraints field, value)
    form = body.response_format
    if form is not None and form.type == "json_object":
        shapes.append(("response_format", "json_schema", {"type": "object"}))
    elif form is not None and form.type == "json_schema":
        schema = form.json_schema.schema_ if form.json_schema.schema_ is not None else {"type": "object"}
        shapes.append(("response_format.json_schema.schema", "json_schema", schema))
    if body.json_schema is not None:
        shapes.append(("json_schema", "json_schema", body.json_schema))
    if body.grammar is not None:
        shapes.append(("grammar", "grammar", body.grammar))
    if len(shapes) > 1:
        second = shapes[1][0].split(".")[0]
        raise APIError(400, f"{second}: give one of response_format, json_schema and grammar, not several",
                       param=second)
    fields: dict[str, Any] = {}
    params: dict[str, str] = {}
    forced = body.forced_functions if isinstance(body, ChatBody) else []
    several = isinstance(body, ChatBody) and body.parallel_tool_calls is not False
    if forced:
        if shapes:
            raise APIError(400, f"tool_choice: {_choice_text(body)} makes the answer a tool call; drop "
                                f"{shapes[0][0].split('.')[0]} or use \"tool_choice\": \"auto\"", param="tool_choice")
        fields["grammar"] = tools.tool_grammar(forced, several=several and body.tool_choice == "required")
        params["grammar"] = "tools"
    elif shapes and isinstance(body, ChatBody) and body.calls_tools:
        param, kind, value = shapes[0]
        if kind == "grammar":
            raise APIError(400, "grammar: a grammar cannot go with tools (the answer may be a tool call); use "
                                "response_format or json_schema, or \"tool_choice\": \"none\"", param="grammar")
        functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
        fields["grammar"] = tools.tool_grammar(functions, several=several, content_schema=_json_layout(value))
        params["grammar"] = param
    elif shapes:
        param, kind, value = shapes[0]
        fields[kind], params[kind] = value, param
    for name in _PENALTIES:
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.logit_bias:
        fields["logit_bias"] = dict(body.logit_bias)  # string keys: Constraints reads them as token ids
    return ConstraintFields(fields, params)


def _json_layout(schema: Any) -> Any:
    """A schema embedded in a grammar, with the whitespace a ``json_schema`` constraint allows
    (:data:`specdec.constraints.JSON_LAYOUT`) unless it says its own ``x-guidance``."""
    return {"x-guidance": JSON_LAYOUT, **schema} if isinstance(schema, dict) and "x-guidance" not in schema else schema


def _choice_text(body: ChatBody) -> str:
    choice = body.tool_choice
    return f"the named function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else f'"{choice}"'


def logprobs_of(body: _Body) -> int | None:
    """The library's ``logprobs=``: None for none, 0 for the chosen token's, n for the top n too."""
    if isinstance(body, ChatBody):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def sampling_kwargs(body: _Body, max_tokens: int) -> dict[str, Any]:
    return dict(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, max_new_tokens=max_tokens,
                seed=body.seed, stop=list(body.stop or []), **({"eos_token_ids": []} if body.ignore_eos else {}))


def completion_ids(body: CompletionBody, tokenizer: Any, fim: bool) -> list[int]:
    prompt = completion_prompt(body, tokenizer, fim)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"] if isinstance(prompt, str) else list(prompt)


def completion_prompt(body: CompletionBody, tokenizer: Any, fim: bool) -> str | list[int]:
    """The prompt; with ``suffix``, the token ids of ``<|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|>``.

    The FIM tokens are placed by id: a tokenizer may hold them in its vocabulary without reading
    their text as one token (the converted Qwen2.5-Coder tokenizer splits ``<|fim_prefix|>`` into
    seven pieces), and text in the prompt that looks like them stays text.
    """
    if body.suffix is None:
        return body.prompt
    if not fim:
        raise APIError(400, "suffix: this model's tokenizer has no fill-in-the-middle tokens "
                            f"({', '.join(FIM_TOKENS)}); drop suffix", param="suffix")
    if not isinstance(body.prompt, str):
        raise APIError(400, "suffix goes with a text prompt, not token ids", param="suffix")
    prefix, suffix, middle = tokenizer.convert_tokens_to_ids(list(FIM_TOKENS))
    start = tokenizer("", add_special_tokens=True)["input_ids"]  # a BOS, where the tokenizer adds one

    def text(piece: str) -> list[int]:
        return tokenizer(piece, add_special_tokens=False)["input_ids"]

    return [*start, prefix, *text(body.prompt), suffix, *text(body.suffix), middle]


# Tokens a code model ends a middle with (llama.cpp counts them among a vocabulary's end-of-generation
# tokens): the padding and file markers of Qwen2.5-Coder's repository format, and the plain end of text.
FIM_END_TOKENS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")
INFILL_STOP_LINES = 2  # the suffix's first lines with text: the middle is done once the model writes them


def infill_ends(gen: Generation, body: CompletionBody, tokenizer: Any, eos: set[int]) -> Generation:
    """A fill-in-the-middle generation that ends where the middle does: at the model's end tokens
    and the FIM end tokens (:data:`FIM_END_TOKENS`), or where the text reaches the suffix's first
    lines (an instruct model often writes on past the middle, through the suffix and beyond; the
    text is cut before them, as at a stop string). Unchanged without ``suffix`` or with ``ignore_eos``."""
    if body.suffix is None or body.ignore_eos:
        return gen
    vocab = tokenizer.get_vocab()
    ends = sorted(set(eos) | {vocab[t] for t in FIM_END_TOKENS if t in vocab})
    stops = list(gen.stop)
    lead = _suffix_lead(body.suffix)
    if "\n" in lead and lead not in stops:  # a whole line of the suffix: never a piece a middle may hold
        stops.append(lead)
    sampling = {**gen.sampling, "eos_token_ids": ends, "stop": stops}
    return dataclasses.replace(gen, sampling=sampling, stop=stops)


def _suffix_lead(suffix: str) -> str:
    """The suffix from its start through its first :data:`INFILL_STOP_LINES` lines with text
    (trailing blanks dropped); empty for a suffix of blanks. Where the model writes it, the middle
    has ended."""
    lines = suffix.split("\n")
    seen = 0
    for n, line in enumerate(lines):
        seen += bool(line.strip())
        if seen == INFILL_STOP_LINES:
            return "\n".join(lines[: n + 1]).rstrip()
    return suffix.rstrip() if seen else ""


def chat_prompt(body: ChatBody, tokenizer: Any) -> list[int]:
    """The messages (and the tools, unless ``tool_choice`` is ``none``) through the chat template
    (see :mod:`specdec.server.tools` for templates that do not take tools)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    listed = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.calls_tools else None
    native = tools.template_takes_tools(tokenizer)
    messages, given = tools.template_messages(messages, listed, native)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **({"tools": given} if given else {}))
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]


def has_fim_tokens(tokenizer: Any) -> bool:
    vocab = tokenizer.get_vocab()
    return all(token in vocab for token in FIM_TOKENS)
