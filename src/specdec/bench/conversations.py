"""The multi-turn workload: conversations that re-send their history, against each server.

Chat front-ends, agents and editors send the whole conversation again with every request, so
most of each prompt is what the server saw a moment ago. Each :class:`~specdec.prompts.Conversation`
runs on each server (:class:`~specdec.bench.servers.Servers`) turn by turn: the prompt of turn i
is the chat template over the user's turns so far and that server's own answers, as token ids,
sent the way every bench request is sent (streamed ``/v1/completions``, plain sampling), EOS
ending the answer as it would for a user. The servers take the conversations in an order that
turns by one place from one conversation to the next; each runs a whole conversation before the
next server starts it.

Per turn it records the prompt's tokens, how many the server reused (specdec's
``usage.prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``), the time to
the first streamed token (the prompt's prefill and the first step: what the prompt cache saves),
the whole turn's time, the answer's tokens and (specdec) the tokens drafted and kept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from specdec.bench.servers import Servers, key_method, request_body
from specdec.prompts import Conversation, Prompt


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int | None
    first_token_seconds: float
    seconds: float
    new_tokens: int
    drafted: int = 0  # specdec: the tokens its steps drafted, and how many of them were kept
    accepted: int = 0


@dataclass
class ConversationRun:
    server: str
    conversation: str
    turns: list[Turn] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.turns)

    @property
    def new_tokens(self) -> int:
        return sum(t.new_tokens for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        return {"server": self.server, "conversation": self.conversation, "seconds": self.seconds,
                "new_tokens": self.new_tokens, "turns": [asdict(t) for t in self.turns], "answers": self.answers}


def run_conversation(servers: Servers, key: str, conversation: Conversation, tokenizer: Any, *,
                     max_tokens: int, temperature: float, seed: int, eos: bool = True,
                     method: str | None = None) -> ConversationRun:
    """Every turn of ``conversation`` on the server ``key``, each re-sending the history."""
    run = ConversationRun(key, conversation.id)
    if method is None and key.startswith("specdec:"):
        method = key_method(key)  # the method that server was started with
    messages: list[dict[str, str]] = []
    for text in conversation.turns:
        messages.append({"role": "user", "content": text})
        ids = Prompt(conversation.set, conversation.id, messages=tuple(messages)).token_ids(tokenizer)
        body = request_body(ids, temperature, max_tokens, seed, not eos, llama_server=not key.startswith("specdec:"),
                            method=method)
        if key.startswith("specdec:"):
            body["stream_options"] = {"include_usage": True}
        done = servers.complete(key, body)
        cached = (done.usage.get("prompt_tokens_details", {}).get("cached_tokens") if done.usage
                  else done.timings.get("cache_n"))
        first = done.arrivals[0][0] if done.arrivals else done.seconds
        run.turns.append(Turn(len(ids), cached, first, done.seconds, len(done.token_ids),
                              sum(done.drafted), sum(done.accepted)))
        run.answers.append(done.text)
        messages.append({"role": "assistant", "content": done.text})
    return run


def run_all(servers: Servers, keys: Sequence[str], conversations: Sequence[Conversation], tokenizer: Any, *,
            max_tokens: int, temperature: float, seed: int = 0, methods: dict[str, str] | None = None,
            on_run: Callable[[ConversationRun], None] | None = None) -> list[ConversationRun]:
    """Each conversation on each server, the servers' order turned by one place per conversation."""
    runs = []
    for i, conversation in enumerate(conversations):
        turn = i % len(keys)
        for key in [*keys[turn:], *keys[:turn]]:
            run = run_conversation(servers, key, conversation, tokenizer, max_tokens=max_tokens,
                                   temperature=temperature, seed=seed, method=(methods or {}).get(key))
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs
