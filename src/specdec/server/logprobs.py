"""Log-probabilities in OpenAI's shapes.

The library reports, for each generated token, the target's log-probability of it and of the top
``n`` tokens (:class:`specdec.api.TokenLogprob`: ``token``, ``logprob``, ``top``, as plain decoding
would report them, speculation or not). Here they become chat's
``logprobs.content[j] = {token, logprob, bytes, top_logprobs}`` and completions'
``logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``. A token's ``bytes`` are the
bytes it stands for (a byte-level BPE token may hold part of a character); its ``token`` is
their text, or ``bytes:\\xNN...`` where they are not whole UTF-8 (as OpenAI writes them).
``text_offset`` counts characters of the completion's text before the token (the decoded prefix,
less an incomplete character at its end).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Sequence

from specdec.api import decode_text

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """The bytes and the shown text of a tokenizer's tokens (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        if self._byte_level:
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

            self._unbyte = {c: b for b, c in bytes_to_unicode().items()}
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        if piece is None:
            return b""
        if self._byte_level and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte is not None:  # SentencePiece's byte fallback
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def text(self, token: int) -> str:
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}

    def chat(self, logprobs: Sequence[Any]) -> list[dict[str, Any]]:
        """Chat's ``logprobs.content`` entries."""
        return [{**self.entry(lp.token, lp.logprob), "top_logprobs": [self.entry(t, p) for t, p in lp.top]}
                for lp in logprobs]

    def completion(self, logprobs: Sequence[Any], offsets: Sequence[int]) -> dict[str, Any]:
        """Completions' ``logprobs`` object."""
        return {"tokens": [self.text(lp.token) for lp in logprobs],
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.text(t): p for t, p in lp.top} for lp in logprobs],
                "text_offset": list(offsets)}

    def offsets(self, before: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """``text_offset`` of each of ``tokens``, which follow ``before`` in the output."""
        ids = list(before)
        out = []
        for token in tokens:
            out.append(len(decode_text(self.tokenizer, ids).rstrip("\ufffd")) if ids else 0)
            ids.append(token)
        return out
