"""Request bodies of the OpenAI-style endpoints, and how a request becomes :func:`specdec.stream` arguments.

Bodies are pydantic models with ``extra="forbid"`` and strict types: a field the server does not
know is refused by name, and a value of the wrong type is never coerced. A few OpenAI fields that
change nothing at their default value (``echo``, ``logprobs``, the penalties, ...) are accepted at
that value only, so clients that always send them work, and a request that asks for their effect
is told the server does not have it.

Non-standard fields: ``top_k`` (0 disables), ``ignore_eos`` (generate all ``max_tokens``, as
llama-server's and vLLM's field does) and ``speculative``: ``{"method": "spec"}``, a method
in :class:`~specdec.config.DecodeConfig`'s text form (``spec`` is the default method, as
``specdec generate`` runs it; ``spec:ngram:block:k=8``, ``spec:tree``, ``ar``, ...).

Text must be valid Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which no
tokenizer can encode, so it is refused by field. :class:`PromptLimits` checks a prompt against the
model: its length in characters before tokenizing (a bound no tokenizer can beat), then in tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.config import SEED_RANGE, ConfigError, DecodeConfig, text_spelling
from specdec.drafters import MODEL_DRAFTERS

MAX_STOP = 4  # as OpenAI's API
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
# Fields accepted only at the value that makes them do nothing.
_NEUTRAL = {
    "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "parallel_tool_calls": (None,), "tools": (None, []), "tool_choice": (None, "none"),
}


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The body as JSON in ASCII (a lone surrogate named in it stays an escape)."""
        return json.dumps(self.body()).encode()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    method: str


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None

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

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "echo", "best_of",
                     "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", check_fields=False)
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        allowed = _NEUTRAL[info.field_name]
        if not any(_same(value, a) for a in allowed):
            shown = " or ".join("null" if a is None else str(a).lower() for a in allowed)
            raise ValueError(f"{info.field_name} is not supported by this server (only {shown})")
        return value


class CompletionBody(_Body):
    prompt: Any
    suffix: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    echo: Any = False
    best_of: Any = None

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any) -> str:
        """Text, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
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


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


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


def method_config(text: str, has_draft: bool) -> DecodeConfig:
    """The method a method string names (:meth:`DecodeConfig.parse`), its drafter named for this
    server's models; a ``ValueError`` naming the problem."""
    try:
        config = DecodeConfig.parse(text)
    except ConfigError as err:
        raise ValueError(err.render(text_spelling, joined=True)) from None
    if config.is_ar:
        return config
    config = config.resolve(True)
    if config.drafter in MODEL_DRAFTERS and not has_draft:
        raise ValueError(f"{config} needs a draft model, but the server runs without one (--draft none); use ar "
                         "or a drafter of its own, e.g. spec:ngram:block")
    return config


def choose_method(body: _Body, default: DecodeConfig, has_draft: bool, seeded_sampler: str = "gumbel") -> DecodeConfig:
    """The request's method (``speculative.method``), checked against what this server can run,
    with its sampler: the request's ``sampler``; without one, ``seeded_sampler`` for a request
    with a ``seed`` and ``multinomial`` for one without; ``gumbel`` for a coupled method. Under the
    Gumbel-max sampler a chain's exact rule is ``coupled`` (:attr:`DecodeConfig.chain_verifier`),
    and the method says so."""
    method = default
    if body.speculative is not None:
        try:
            method = method_config(body.speculative.method, has_draft)
        except ValueError as err:
            raise APIError(400, f"speculative.method: {err}", param="speculative.method") from None
    if method.verify == "greedy" and body.temperature > 0 and not method.is_ar:
        raise APIError(400, f"speculative.method: {method} cannot sample at temperature {body.temperature}: "
                            "greedy verification reproduces greedy decoding only", param="speculative.method")
    sampler = body.sampler or (seeded_sampler if body.seed is not None else None)  # None: the config's default
    if method.verify == "coupled":
        if body.sampler == "multinomial":
            raise APIError(400, f"sampler: {method} verifies Gumbel-max draws; drop sampler or name another "
                                "method", param="sampler")
        sampler = "gumbel"
    if sampler == "gumbel" and method.verify == "typical":
        raise APIError(400, f"sampler: {method} accepts by its own lossy rule, not by coupling; use "
                            "\"sampler\": \"multinomial\" or an exact method", param="sampler")
    method = method.replace(sampler=sampler)
    return method.replace(verify=method.chain_verifier) if not method.is_ar else method


def method_kwargs(method: DecodeConfig, draft: Any, draft_weights: str) -> dict[str, Any]:
    """The :func:`specdec.stream` keyword arguments that run ``method`` (its config, and the draft
    model where its drafter drafts with one)."""
    return {"config": method.replace(draft_weights=draft_weights),
            "draft": draft if method.drafter in MODEL_DRAFTERS else None}


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


def chat_prompt(body: ChatBody, tokenizer: Any) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]


def has_fim_tokens(tokenizer: Any) -> bool:
    vocab = tokenizer.get_vocab()
    return all(token in vocab for token in FIM_TOKENS)
