"""The final text of a generation does not depend on how the steps split the tokens.

A step may end inside a multi-byte UTF-8 character; the text is then held back until the
character completes. At the end, the text is every complete character of the output, so a
speculative run and the autoregressive run that made the same tokens give the same text.
"""

from __future__ import annotations

import pytest
from tiny import noisy_copy, tiny_llama

from specdec import generate

# Tokens 0-7 are continuation bytes, 8-15 lead bytes of two-byte characters: most outputs end
# inside a character or hold invalid sequences somewhere.
BYTES = [0x80 + 5 * i for i in range(8)] + [0xC3 + i for i in range(8)]


class ByteTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1, 2, 3]}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(BYTES[int(i)] for i in ids).decode("utf-8", errors="replace")


def complete_characters(ids: list[int]) -> str:
    full = ByteTokenizer().decode(ids)
    return full.rstrip("\ufffd") if full.endswith("\ufffd") else full


@pytest.mark.parametrize("seed", [4, 11])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_final_text_is_every_complete_character_whatever_the_steps(k, seed):
    target = tiny_llama(seed, vocab=16, sharpness=4.0)  # outputs of lead and continuation bytes in turn
    draft = noisy_copy(target, 0.3)
    ends_inside = 0
    for n in range(1, 25):
        ar = generate(target, [1, 2, 3], tokenizer=ByteTokenizer(), max_new_tokens=n)
        spec = generate(target, [1, 2, 3], draft=draft, tokenizer=ByteTokenizer(), policy="static", k=k,
                        max_new_tokens=n)
        assert spec.token_ids == ar.token_ids
        assert ar.text == spec.text == complete_characters(ar.token_ids)
        ends_inside += ByteTokenizer().decode(ar.token_ids).endswith("\ufffd")
    assert ends_inside > 0  # some outputs did end inside a character
