"""The public API: ``generate`` and ``stream``, in the spirit of transformers' ``generate``."""

from __future__ import annotations

import dataclasses
import numbers
import secrets
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

from specdec.backends.base import CausalLM, common_prefix_len
from specdec.backends.hf import eos_token_ids
from specdec.build import build
from specdec.config import DecodeConfig
from specdec.constraints import UNPROCESSED, Constraints, LogitProcessor, TokenLogprob, Unprocessed, check_logprobs
from specdec.engine import autoregressive_steps, speculative_steps, tree_steps
from specdec.policies import DraftLengthPolicy
from specdec.stats import GenerationStats, Step


class MethodError(ValueError):
    """The decoding method (the config) cannot be built for the models given: a drafter's option
    or file, what the target's backend can do, a draft model the method does not use. Raised by
    :func:`generate` and :func:`stream` before any model work, with the builder's message."""


@dataclass
class GenerationResult:
    """token_ids: the new tokens only; text: their decoding (None without a tokenizer). method: what
    ran, in the text form (:meth:`DecodeConfig.parse` reads it back; a chain names the verifier that
    ran, ``coupled`` under the Gumbel-max sampler); exact: False for a lossy verification rule;
    shape: a token tree's shape as it was built (empty for a chain; see :class:`specdec.build.Built`)."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    method: str
    exact: bool = True
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, where asked for
    shape: str = ""


@dataclass
class StreamEvent:
    """Tokens appended by one step; ``from_draft[i]`` tells whether token i was a kept draft token.

    text: the text that settled with this step. An end of the decoded text that could still begin
    a stop string, or an incomplete multi-byte character, is held back until later tokens settle it;
    at the last step it is released (unless a stop string completed). So no text is ever taken
    back: the events' texts, joined, are the final ``GenerationResult.text``.

    draft_chars: how many characters of ``text`` kept draft tokens wrote. Each character is
    credited to the step whose decoding first holds it whole: to the step's kept draft tokens if
    it lies within the text decoded through the last of them, else to the target's own token.
    Held text keeps its credit and counts in the event that releases it, so the draft's characters
    lead ``text`` unless text held back at an earlier step comes first.

    A last event with no tokens carries held text only where the decode loop ended early without
    the stream foreseeing it (the step limit and the end-of-sequence ids are foreseen).
    """

    token_ids: list[int]
    text: str
    from_draft: list[bool]
    draft_chars: int
    stats: GenerationStats = field(repr=False)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, where asked for


def stream(
    target: Any,
    prompt: str | Sequence[int],
    *,
    draft: Any = None,
    tokenizer: Any = None,
    config: DecodeConfig | None = None,
    constraints: Constraints | None = None,
    logprobs: int | None = None,
    **overrides: Any,
) -> Iterator[StreamEvent]:
    """Yield tokens as they are accepted. Arguments as for :func:`generate`.

    Bad input raises ``ValueError`` or ``TypeError`` here, before the first event.
    """
    return _Run.build(target, prompt, draft=draft, tokenizer=tokenizer, config=_config(config, overrides),
                      constraints=constraints, logprobs=logprobs).events()


def generate(
    target: Any,
    prompt: str | Sequence[int],
    *,
    draft: Any = None,
    tokenizer: Any = None,
    config: DecodeConfig | None = None,
    constraints: Constraints | None = None,
    logprobs: int | None = None,
    **overrides: Any,
) -> GenerationResult:
    """Generate from ``target``, speculatively if a ``draft`` model or a drafter is given: the
    events of :func:`stream`, collected.

    target, draft: transformers causal LMs (or :class:`CausalLM` backends) sharing a vocabulary,
    e.g. from :func:`specdec.models.load`. prompt: text (needs ``tokenizer``) or token ids.
    config: a :class:`~specdec.config.DecodeConfig`; ``overrides`` are its fields by name
    (``verify="block", k=4, temperature=0.7, ...``), applied on top of it (or of the defaults).

    The fields, in brief (see :class:`~specdec.config.DecodeConfig`): draft_weights ``int8``
    (default) runs a llama/qwen2-style bf16 draft model on int8 copies of its weights (half the
    bytes per draft token; the output law is unchanged, only the draft's proposals shift
    slightly), ``bf16`` on its own weights. drafter: a :class:`Drafter`, or a name from
    :func:`specdec.drafters.names` (``model`` uses ``draft``; ``ngram``, ``early-exit``,
    ``layer-skip``, ``heads`` and ``eagle`` need no draft model) built with ``drafter_options``
    (e.g. ``{"exit_layer": 20}``, ``{"path": "heads/"}``). verify: ``greedy``, ``token``,
    ``block``, ``coupled`` (the Gumbel-max sampler's rule), or ``tree`` (the draft model builds a token tree; ``tree`` holds
    :class:`TreeDrafter` options: ``mode`` ``confident`` (``threshold``, ``width``, ``depth``,
    ``budget``), ``dynamic`` (``depth``, ``width``, ``expand``, ``budget``, EAGLE-2-style) or
    ``static`` (``choices``); None: :data:`~specdec.drafters.tree.DEFAULT_TREE`, the confident
    tree). k: draft tokens per step (the starting/maximum length for adaptive policies).
    temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. seed fixes sampling.
    sampler: ``multinomial`` (default) or ``gumbel``: every token drawn by Gumbel-max with noise
    keyed by (seed, position) and drafts verified by coupling, so that a seed gives plain
    decoding's text with any drafter (see :class:`DecodeConfig`). stop: a string or strings that end generation (the text is cut before them; needs
    ``tokenizer``). Without a draft or drafter, decodes autoregressively through the same backend.
    A prompt that leaves less room in the model's context than ``max_new_tokens`` is allowed: a
    ``UserWarning`` says so and ``stats.truncated_to`` holds the number of new tokens allowed.
    constraints: a :class:`~specdec.constraints.Constraints` (a JSON schema, regex or grammar the
    output follows, a logit bias, penalties; a grammar needs ``tokenizer``), applied to the
    target's logits at every position, drafted or not. logprobs: None, 0 (each token's
    log-probability in ``result.logprobs``) or up to 20 (also the most likely tokens there).

    The output follows the target's distribution under the given sampling settings (and
    constraints) exactly.
    Raises ``ValueError`` (a bad value) or ``TypeError`` (a value of the wrong kind), naming the
    argument, on bad input, before any model work.
    """
    run = _Run.build(target, prompt, draft=draft, tokenizer=tokenizer, config=_config(config, overrides),
                     constraints=constraints, logprobs=logprobs)
    for _ in run.events():
        pass
    return run.result()


def _config(config: DecodeConfig | None, overrides: dict[str, Any], name: str = "config") -> DecodeConfig:
    if config is None:
        return DecodeConfig().replace(**overrides)
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"{name} must be a specdec.DecodeConfig, got {type(config).__name__}")
    return config.replace(**overrides)


@dataclass
class _Run:
    steps: Iterator[Step]
    tokenizer: Any
    stop: Sequence[str]
    method: str
    exact: bool
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the text released so far: the events' texts, joined
    stats: GenerationStats = field(default_factory=GenerationStats)
    policy: DraftLengthPolicy | None = None
    limit: int | None = None  # the decode loop ends at this many new tokens, or at one of the eos ids
    eos: set[int] = field(default_factory=set)
    decoded: str = ""  # the output's decoding at the last step
    settled: int = 0  # its length less a trailing incomplete multi-byte character
    by_draft: list[bool] = field(default_factory=list)  # for decoded[:settled]: written by a draft token?
    finished: bool = False  # the text is complete (a stop string was hit, or the last step is in)
    logprobs: list[TokenLogprob] | None = None
    shape: str = ""  # a token tree's shape as built (Built.shape)

    @classmethod
    def build(cls, target: Any, prompt: Any, *, draft: Any, tokenizer: Any, config: DecodeConfig,
              constraints: Constraints | None = None, logprobs: int | None = None, seat: Any = None) -> "_Run":
        """Check the inputs, build the backends and the drafter (one-time costs such as a draft's
        int8 weights are paid here, before the timed generation), and choose the decode loop.
        ``seat``: a slot's seat on its pool's board (:mod:`specdec.serving.board`), for the planner."""
        _check_model(target, "target")
        if draft is not None:
            _check_model(draft, "draft")
        _check_tokenizer(tokenizer)
        if config.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the text; pass tokenizer=")
        if constraints is not None and not isinstance(constraints, Constraints):
            raise TypeError(f"constraints must be a specdec.Constraints, got {type(constraints).__name__}")
        check_logprobs(logprobs)
        prompt = _checked_prompt(prompt, tokenizer)
        try:
            built = build(config, target, draft, seat)
        except MethodError:
            raise
        except ValueError as err:  # the method does not fit these models
            raise MethodError(str(err)) from err
        backend = built.target
        _check_tokenizer_vocabulary(tokenizer, backend)
        _check_eos_ids(config.eos_token_ids, backend)
        prompt_ids = _prompt_ids(prompt, tokenizer, backend)
        room = _room(backend, len(prompt_ids), config.max_new_tokens)
        eos = set(config.eos_token_ids) if config.eos_token_ids is not None else eos_token_ids_of(target, tokenizer)
        generator = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        cached = _start_cache(backend, prompt_ids, config.prompt_cache)
        sampling = config.sampling
        if config.gumbel and sampling.gumbel_seed is None:  # unseeded: fresh public noise
            sampling = dataclasses.replace(sampling, gumbel_seed=secrets.randbits(64))
        processor: LogitProcessor | Unprocessed = UNPROCESSED
        if constraints is not None or logprobs is not None:  # checked here, whether active or not
            processor = (constraints or Constraints()).processor(tokenizer, backend.vocab_size, prompt_ids, sorted(eos),
                                                                 logprobs)
            if not processor.constraints.active and logprobs is None:
                processor = UNPROCESSED
        read_text = getattr(built.drafter, "read_text", None)  # a lookup on the text drafts under a grammar only
        if read_text is not None:
            read_text(processor.vocabulary)
        common = dict(sampling=sampling, max_new_tokens=config.max_new_tokens, eos_ids=eos, generator=generator,
                      processor=processor)
        if built.drafter is None:
            steps = autoregressive_steps(backend, prompt_ids, **common)
        elif built.tree:
            steps = tree_steps(backend, built.drafter, prompt_ids, **common)
        else:
            steps = speculative_steps(backend, built.drafter, built.verifier, built.policy, prompt_ids, **common)
        run = cls(steps, tokenizer, config.stop, built.method, built.exact, policy=built.policy, shape=built.shape)
        run.stats.truncated_to = room
        run.stats.prompt_cached = cached
        run.stats.gumbel_seed = sampling.gumbel_seed if sampling.coupled else None
        run.limit, run.eos = (config.max_new_tokens if room is None else room), eos
        run.logprobs = [] if logprobs is not None else None
        return run

    def events(self) -> Iterator[StreamEvent]:
        start = time.perf_counter()
        for step in self.steps:
            self.token_ids += step.tokens
            delta, draft_chars = self._advance_text(step)
            step = self._through_stop(step)
            self.stats.add(step)
            if self.logprobs is not None:
                self.logprobs += step.logprobs or []
            self.stats.seconds = time.perf_counter() - start
            yield StreamEvent(step.tokens, delta, step.from_draft, draft_chars, self.stats, step.logprobs)
            if self.finished:
                break
        if not self.finished:  # the steps ended where the limits did not foresee: release the held text
            self.finished = True
            delta, draft_chars = self._release(self.settled)
            if delta:
                yield StreamEvent([], delta, [], draft_chars, self.stats)
        self.stats.seconds = time.perf_counter() - start
        if self.policy is not None:
            self.stats.policy = self.policy.describe()

    def _advance_text(self, step: Step) -> tuple[str, int]:
        """Decode the output so far and release the text that settled: (the new text, how many of
        its characters draft tokens wrote). At a stop string, or at the last step, the text ends."""
        last = (self.limit is not None and len(self.token_ids) >= self.limit) or step.tokens[-1] in self.eos
        if self.tokenizer is None:
            self.finished = last
            return "", 0
        before = self.settled
        self.decoded = self._decode(self.token_ids)
        self.settled = len(self.decoded.rstrip("\ufffd"))  # an incomplete multi-byte character waits for more
        self._credit(step, before)
        cut = min((at for at in (self.decoded.find(s) for s in self.stop) if at >= 0), default=-1)
        if cut >= 0 or last:
            self.finished = True
            return self._release(cut if cut >= 0 else self.settled)
        return self._release(self.settled - _stop_prefix(self.decoded[: self.settled], self.stop))

    def _through_stop(self, step: Step) -> Step:
        """The step's tokens through the one that completed a stop string, and no further: plain
        decoding ends at that token, so a kept draft that ran past the stop leaves no token after it
        (in ``token_ids``, the counts or the logprobs)."""
        if not (self.finished and self.stop and any(s in self.decoded for s in self.stop)):
            return step
        start = len(self.token_ids) - len(step.tokens)
        for n in range(start + 1, len(self.token_ids)):
            text = self._decode(self.token_ids[:n])
            if any(s in text for s in self.stop):
                del self.token_ids[n:]
                kept = n - start
                logprobs = step.logprobs[:kept] if step.logprobs is not None else None
                return dataclasses.replace(step, tokens=step.tokens[:kept], accepted=min(step.accepted, kept),
                                           logprobs=logprobs, forced=min(step.forced, kept))
        return step

    def _credit(self, step: Step, start: int) -> None:
        """Credit the characters this step settled (``decoded[start:settled]``) to the draft or the
        target: the draft's share runs to the length decoded through the last kept draft token."""
        end = self.settled
        start = min(start, end)
        if step.accepted == 0:
            split = start
        elif step.accepted == len(step.tokens):
            split = end
        else:
            through_draft = self.token_ids[: len(self.token_ids) - len(step.tokens) + step.accepted]
            split = min(max(len(self._decode(through_draft).rstrip("\ufffd")), start), end)
        self.by_draft[start:] = [True] * (split - start) + [False] * (end - split)

    def _release(self, end: int) -> tuple[str, int]:
        """Release ``decoded`` up to ``end``: (the new text, how many of its characters draft tokens wrote)."""
        start = len(self.text)
        delta = self.decoded[start:max(start, end)]
        self.text += delta
        return delta, sum(self.by_draft[start : start + len(delta)])

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)

    def result(self) -> GenerationResult:
        text = self.text if self.tokenizer is not None else None
        return GenerationResult(self.token_ids, text, self.stats, self.method, self.exact, self.logprobs, self.shape)


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids`` as outputs show it: special tokens skipped and spaces left as the tokens
    spell them. A tokenizer's clean-up of spaces (``clean_up_tokenization_spaces``, on for SmolLM2's)
    rewrites text already decoded once a later token arrives (a newline and a space before a comma
    lose the space), so text streamed by position would drop or repeat characters."""
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some stop string (0 if none): text
    that may yet turn into a stop string, so held back."""
    for n in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def _start_cache(backend: CausalLM, prompt_ids: list[int], keep: bool) -> int:
    """Empty the target's cache, or with the prompt cache keep the part of it the prompt begins
    with (all but the prompt's last token, whose logits the first step needs): the number of
    prompt tokens that will not be prefilled."""
    if keep:
        try:
            backend.trim(min(common_prefix_len(backend.tokens, prompt_ids), len(prompt_ids) - 1))
            return len(backend.tokens)
        except ValueError:  # a token tree left unresolved (a generation stopped mid-step)
            pass
    backend.reset()
    return 0


def _check_eos_ids(ids: Sequence[int] | None, backend: CausalLM) -> None:
    """An id outside the vocabulary is never sampled: stopping on it would silently never happen."""
    bad = [t for t in ids or () if not 0 <= t < backend.vocab_size]
    if bad:
        raise ValueError(f"eos_token_ids {bad[:5]} are outside the vocabulary (0..{backend.vocab_size - 1}); "
                         "give the ids of tokens that end generation")


def eos_token_ids_of(model: Any, tokenizer: Any) -> set[int]:
    return eos_token_ids(getattr(model, "model", model), tokenizer)


def _check_model(model: Any, name: str) -> None:
    """A transformers causal LM or a :class:`CausalLM` backend, else a ``TypeError`` with a hint."""
    if isinstance(model, torch.nn.Module) or all(hasattr(model, a) for a in ("forward", "trim", "tokens")):
        return
    if isinstance(model, str):
        raise TypeError(
            f"{name} must be a loaded model, got the string {model!r}; load it first: "
            f"model, tokenizer = specdec.models.load({model!r})"
        )
    raise TypeError(
        f"{name} must be a loaded model (a transformers causal LM or a specdec CausalLM), got "
        f"{type(model).__name__}; load one with specdec.models.load(name)"
    )


def _check_tokenizer(tokenizer: Any) -> None:
    if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "decode")):
        raise TypeError(
            f"tokenizer must be a transformers tokenizer (or None with token ids), got {type(tokenizer).__name__}; "
            "specdec.models.load(name) returns the model's"
        )


# A model's logits may be wider than its tokenizer's vocabulary (padded, e.g. Qwen2.5's 151,936 for
# 151,665 tokens), by at most this many ids or 2% of them.
VOCABULARY_PADDING = 1024


def _check_tokenizer_vocabulary(tokenizer: Any, backend: Any) -> None:
    """A tokenizer of another model's vocabulary would turn the text into ids the model reads as
    other tokens (or cannot read): refuse it, naming both sizes."""
    if tokenizer is None:
        return
    try:
        tokens = len(tokenizer)
    except TypeError:
        return  # a tokenizer that does not say its size
    width = backend.vocab_size
    if not width - max(VOCABULARY_PADDING, width // 50) <= tokens <= width:
        raise ValueError(f"the tokenizer has {tokens} tokens but the model's vocabulary has {width}: they belong to "
                         "different models; load both with specdec.models.load(name)")


def _checked_prompt(prompt: Any, tokenizer: Any) -> str | list[int]:
    """Text that can be encoded, or a list of int token ids; anything else is a ``TypeError``."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"the prompt is not valid text: character {err.start} is a lone surrogate "
                f"({prompt[err.start]!r}, e.g. from bytes that are not UTF-8); decode the bytes with "
                "errors='replace' or pass token ids"
            ) from None
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass tokenizer= or token ids")
        return prompt
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be text (str) or a list of token ids, got bytes; decode it first: "
                        "prompt.decode('utf-8')")
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool or prompt.dim() != 1:
            raise TypeError(f"a tensor prompt must hold token ids: 1-D and of an integer dtype, got "
                            f"{prompt.dtype} of shape {list(prompt.shape)}")
        return prompt.tolist()
    if not isinstance(prompt, Iterable):
        raise TypeError(f"prompt must be text (str) or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt token ids must be integers, but item {i} is {type(t).__name__} {t!r}")
    return [int(t) for t in ids]


def _prompt_ids(prompt: str | list[int], tokenizer: Any, backend: CausalLM) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if isinstance(prompt, str) else prompt
    if not ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    if backend.max_context is not None and len(ids) >= backend.max_context:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the model's context holds {backend.max_context}; "
            "shorten the prompt to leave room for new tokens"
        )
    bad = [t for t in ids if not 0 <= t < backend.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{backend.vocab_size - 1})")
    return ids


def _room(backend: CausalLM, prompt_len: int, max_new_tokens: int) -> int | None:
    """The new tokens the model's context leaves room for, where fewer than ``max_new_tokens``
    (with a warning: the output will be shorter than asked); None where all fit."""
    if backend.max_context is None or backend.max_context - prompt_len >= max_new_tokens:
        return None
    room = backend.max_context - prompt_len
    warnings.warn(
        f"the prompt has {prompt_len} tokens and the model's context holds {backend.max_context}: "
        f"at most {room} new tokens fit, not max_new_tokens={max_new_tokens}; shorten the prompt for more",
        UserWarning,
        stacklevel=4,
    )
    return room
