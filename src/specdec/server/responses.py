"""The bodies of the OpenAI-style answers: a completion or chat completion, whole or as chunks.

:class:`Answer` builds one request's answer: ``text_completion`` / ``chat.completion`` objects, or,
streamed, their chunks (``chat.completion.chunk`` for chat), the last carrying ``finish_reason``
and, if the request asked for it, a chunk with ``usage`` after it; :func:`sse` frames a chunk as a
server-sent event. :func:`summary` gives what a finished generation adds: its ``finish_reason``,
``usage`` and the ``speculative`` figures (:func:`speculative_stats`).

Every answer carries a non-standard ``speculative`` object. In a chunk it is the step's
``token_ids``, ``from_draft`` (which of them were draft tokens the target accepted),
``draft_chars`` (how many characters of the chunk's text draft tokens wrote: its leading ones,
unless text held back from an earlier step begins it) and ``drafted`` (draft tokens proposed); in
the last chunk and the whole answer, the run's figures: its method, whether its rule is exact
(``exact``: the output keeps the target's law, docs/exactness.md), whether greedy and seeded output
is plain decoding's token for token on the backend that ran it (``token_identical``; where not,
``caveat`` says what may differ: on llama.cpp a near-tie, and a cached prompt, may change the
answer), the sampler (``greedy`` at temperature 0, else ``gumbel`` or ``multinomial``), the draft
length policy and its state, target forwards, acceptance and timings. The policy's state is short
by default (its single-valued figures, :func:`policy_state_of`); a request with
``"speculative": {"policy_state": "full"}`` gets all of it (the planner's cost curves, acceptance
tables and per-length histograms: kilobytes).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

import specdec
from specdec.backends.table import BY_NAME, TORCH
from specdec.config import DecodeConfig
from specdec.drafters.prediction import SOURCE
from specdec.server.logprobs import TokenText
from specdec.server.requests import Generation
from specdec.server.tools import ToolCallParser

SYSTEM_FINGERPRINT = f"fp_specdec_{specdec.__version__}"  # OpenAI's field: which server build answered


def sse(obj: dict[str, Any]) -> str:
    """``obj`` as one server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Answer:
    """Builds the OpenAI-shaped response: chunks as steps arrive, or the whole at the end.

    A chat whose tools may be called reads its text through a :class:`ToolCallParser`: content
    goes out as ``delta.content``, a call as ``delta.tool_calls`` (first its ``index``, ``id``,
    ``type`` and name, then pieces of its arguments), and the whole answer is the same
    parser fed at once, so the deltas add up to ``message.tool_calls``.
    """

    def __init__(self, gen: Generation, model: str, token_text: TokenText) -> None:
        self.gen, self.model, self.token_text = gen, model, token_text
        chat = gen.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.sent_role = False
        self.parser = ToolCallParser() if gen.tool_calls else None
        self.ids: list[int] = []  # the tokens streamed so far (for completions' text_offset)

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.gen.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def _logprobs(self, logprobs: list[Any] | None, ids: list[int], before: list[int]) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        if self.gen.kind == "chat":
            return {"content": self.token_text.chat(logprobs), "refusal": None}
        return self.token_text.completion(logprobs, self.token_text.offsets(before, ids[:len(logprobs)]))

    def _delta(self, text: str | None, final: bool) -> tuple[dict[str, Any], bool]:
        """A chunk's delta for ``text`` (and, at the end, what the parser still held); whether a
        tool call has been seen."""
        delta: dict[str, Any] = {}
        if self.parser is None:
            if text is not None:
                delta["content"] = text
        else:
            pieces = self.parser.feed(text or "") + (self.parser.finish() if final else [])
            content = "".join(p[1] for p in pieces if p[0] == "content")
            if content:
                delta["content"] = content
            calls: dict[int, dict[str, Any]] = {}
            for piece in pieces:
                if piece[0] == "call":
                    call = self.parser.calls[piece[1]]
                    calls[piece[1]] = {"index": piece[1], "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}
                elif piece[0] == "arguments":
                    entry = calls.setdefault(piece[1], {"index": piece[1], "function": {"arguments": ""}})
                    entry["function"]["arguments"] += piece[2]
            if calls:
                delta["tool_calls"] = list(calls.values())
        if not self.sent_role:
            delta = {"role": "assistant", **delta}
            self.sent_role = True
        return delta, self.parser is not None and bool(self.parser.calls)

    def chunk(self, step: Any) -> dict[str, Any]:
        before = list(self.ids)
        self.ids += step.token_ids
        logprobs = self._logprobs(step.logprobs, step.token_ids, before)
        if self.gen.kind == "completion":
            choice = {"index": 0, "text": step.text, "logprobs": logprobs, "finish_reason": None}
        else:
            choice = {"index": 0, "delta": self._delta(step.text, False)[0], "logprobs": logprobs,
                      "finish_reason": None}
        return {**self._head(True), "choices": [choice],
                "speculative": {"token_ids": step.token_ids, "from_draft": step.from_draft,
                                "draft_chars": step.draft_chars, "drafted": step.drafted}}

    def last_chunks(self, rest: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunk with finish_reason (and any held-back text), then usage if asked for."""
        reason = summary["finish_reason"]
        if self.gen.kind == "completion":
            choice = {"index": 0, "text": rest, "logprobs": None, "finish_reason": reason}
        else:
            delta, called = self._delta(rest or None, True)
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": "tool_calls" if called and reason == "stop" else reason}
        chunks = [{**self._head(True), "choices": [choice], "speculative": summary["speculative"]}]
        if self.gen.include_usage:
            chunks.append({**self._head(True), "choices": [], "usage": summary["usage"]})
        return chunks

    def whole(self, summary: dict[str, Any]) -> dict[str, Any]:
        text, reason, ids = summary["text"], summary["finish_reason"], summary["ids"]
        logprobs = self._logprobs(summary["logprobs"], ids, [])
        if self.gen.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if self.parser is not None:
                self.parser.feed(text)
                self.parser.finish()
                calls = self.parser.calls
                message["content"] = self.parser.content if self.parser.content or not calls else None
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head(False), "choices": [choice], "usage": summary["usage"],
                "speculative": summary["speculative"]}


def summary(gen: Generation, ids: list[int], text: str, stats: Any, decode: Callable[[list[int]], str],
            eos: set[int], backend: str = TORCH) -> dict[str, Any]:
    """The text, finish_reason, usage and the speculative figures of a finished generation: its
    output ``ids`` (their ``text``, ``decode`` turning ids into text), the run's ``stats`` (None for
    a generation that ran no step), the model's end tokens ``eos`` and the ``backend`` the target
    runs on (a name of :mod:`specdec.backends.table`)."""
    full = decode(ids)
    ends = eos if gen.sampling.get("eos_token_ids") is None else set(gen.sampling["eos_token_ids"])
    limit = gen.sampling["max_new_tokens"]
    if stats is not None and stats.truncated_to is not None:  # the context left room for fewer
        limit = stats.truncated_to
    # short of the limit: an end token, a stop string, or a grammar that completed ended it
    stopped = bool(ids and ids[-1] in ends) or any(s in full for s in gen.stop) or len(ids) < limit
    return {"text": text, "finish_reason": "stop" if stopped else "length",
            "usage": usage(gen.prompt_tokens, len(ids), stats.prompt_cached if stats is not None else 0,
                           predicted(stats) if gen.prediction else None),
            "speculative": speculative_stats(gen.method, stats, temperature=gen.sampling["temperature"],
                                             backend=backend, policy_state=gen.policy_state)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          prediction: tuple[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``cached_tokens``: the prompt's tokens the prompt cache supplied;
    ``prediction``: (accepted, rejected) prediction tokens where the request sent a prediction
    (:func:`predicted`), reported in ``completion_tokens_details`` as OpenAI does."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if prediction is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                            "rejected_prediction_tokens": prediction[1]}
    return out


def predicted(stats: Any) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens of a run: the tokens drafted from the prediction that
    the answer kept, and those it did not (verification rejected them, or a stop string cut them off).
    A prediction token the drafter never proposed (the output had left the prediction there) is in
    neither count."""
    if stats is None:
        return 0, 0
    drafted, kept = stats.drafted_by.get(SOURCE, 0), stats.accepted_by.get(SOURCE, 0)
    return kept, drafted - kept


def speculative_stats(method: DecodeConfig, stats: Any, *, temperature: float = 1.0,
                      backend: str = TORCH, policy_state: str = "short") -> dict[str, Any]:
    """The non-standard ``speculative`` object of a whole answer and of the last chunk: how
    ``method`` ran at ``temperature`` on the target's ``backend``, from the run's ``stats`` (a
    :class:`specdec.stats.GenerationStats`; None: no step ran), with the policy's state
    ``policy_state`` ("short" or "full", :func:`policy_state_of`)."""
    caveat = BY_NAME[backend].caveat
    return {
        "method": str(method), "exact": method.exact, "token_identical": method.exact and caveat is None,
        "caveat": caveat,
        "sampler": sampler_name(method, temperature),
        "gumbel_seed": stats.gumbel_seed if stats is not None else None,
        "policy": None if method.is_ar or method.verify == "tree" else method.policy,
        "policy_state": policy_state_of(stats.policy, policy_state) if stats is not None else {},
        "target_forwards": stats.target_forwards if stats else 0,
        "tokens_per_forward": stats.mean_accepted_per_forward if stats else 0.0,
        "drafted_tokens": stats.drafted_tokens if stats else 0,
        "accepted_tokens": stats.accepted_tokens if stats else 0,
        "acceptance_rate": stats.acceptance_rate if stats else 0.0,
        "draft_seconds": stats.draft_seconds if stats else 0.0,
        "verify_seconds": stats.verify_seconds if stats else 0.0,
        "seconds": stats.seconds if stats else 0.0,
        "tokens_per_second": stats.tokens_per_second if stats else 0.0,
        # tokens a grammar forced: drafted at no model cost where it allowed one continuation only
        "forced_tokens": stats.forced_tokens if stats else 0,
        # each draft source's tokens drafted and kept (the prediction's: usage.completion_tokens_details)
        "sources": {name: {"drafted": n, "accepted": stats.accepted_by.get(name, 0)}
                    for name, n in stats.drafted_by.items()} if stats else {},
    }


def policy_state_of(state: dict[str, Any], detail: str = "short") -> dict[str, Any]:
    """The draft length policy's ``state`` (its ``describe()``) as an answer shows it: ``detail``
    "full" gives all of it; "short" its single-valued entries (the name, ``k`` or ``k_max``, the
    acceptance rate, the planner's reason for its most common choice, its step counts), leaving out
    the tables (cost curves, acceptance by position, calibration, histograms of the lengths planned
    and drafted), which the planner fills with kilobytes."""
    if detail == "full":
        return state
    return {key: value for key, value in state.items() if not isinstance(value, (dict, list, tuple))}


def sampler_name(method: DecodeConfig, temperature: float) -> str:
    """How the answer's tokens were chosen: ``greedy`` (the argmax, at temperature 0 whatever the
    method's sampler), else ``gumbel`` (Gumbel-max with public noise) or ``multinomial``."""
    if temperature == 0:
        return "greedy"
    return "gumbel" if method.gumbel else "multinomial"
