"""The tokenizer a GGUF file carries, built from its vocabulary as llama.cpp reads it.

:func:`tokenizer_from_gguf` gives a GGUF's tokenizer as a transformers fast tokenizer: one specdec
builds itself from the file's SentencePiece vocabulary (:func:`spm_tokenizer_from_gguf`, for
:data:`SPM_ARCHITECTURES`), else transformers' own GGUF converter with the file's special tokens and
token types applied (:func:`fix_gguf_tokenizer`). Which tokens are text is decided by the
vocabulary's token types (:data:`HIDDEN_TYPES`, :func:`add_typed_tokens`), as llama.cpp decides it.
:data:`TOKENIZER_FORMAT` stamps how a tokenizer was built, so that one kept in a cache by another
version is built again. A pack's tokenizer, read once and kept in the cache, is
:func:`specdec.packs.gguf_tokenizer`.

Reading a GGUF's metadata through transformers parses the file several times;
:func:`one_reader` makes it once.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from specdec.backends import gguf as gguf_backend

# Bump when the tokenizer built from a GGUF changes: a tokenizer kept in the cache (a conversion's
# or one saved under tokenizers/) by an older version is not used, and is built again from the GGUF.
TOKENIZER_FORMAT = 2


# Architectures whose GGUF tokenizer specdec builds itself from the file's SentencePiece vocabulary
# (spm_tokenizer_from_gguf): transformers 4.57 builds Gemma 3's wrongly.
SPM_ARCHITECTURES = ("gemma3",)

# The token types of a GGUF vocabulary (``tokenizer.ggml.token_type``), as llama.cpp reads them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Types whose tokens are special: matched whole, and left out of the text (llama.cpp renders them
# as nothing). USER_DEFINED tokens (Gemma's "\n", "\n\n", runs of spaces and tabs; Qwen's
# "<tool_call>") are matched whole too but are text, shown like any other.
HIDDEN_TYPES = (UNKNOWN, CONTROL, UNUSED)


def tokenizer_from_gguf(gguf: Path) -> Any:
    """The tokenizer a GGUF file carries, its metadata parsed once (:func:`one_reader`): built by
    :func:`spm_tokenizer_from_gguf` for :data:`SPM_ARCHITECTURES`, else by transformers' own GGUF
    converter with the file's special tokens applied (:func:`fix_gguf_tokenizer`)."""
    import gguf as gguf_package
    from transformers import AutoTokenizer

    with one_reader(gguf):
        architecture = gguf_package.GGUFReader(gguf).fields["general.architecture"].contents()
        if architecture in SPM_ARCHITECTURES:
            return spm_tokenizer_from_gguf(gguf)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        fix_gguf_tokenizer(tokenizer, gguf)
    return tokenizer


def _gguf_array(fields: Any, key: str) -> list[Any]:
    """The array ``tokenizer.ggml.<key>`` of a GGUF's metadata fields, as Python strings or numbers."""
    field = fields[f"tokenizer.ggml.{key}"]
    return [field.parts[i].tobytes().decode("utf-8") if field.types[-1].name == "STRING" else field.parts[i][0].item()
            for i in field.data]


def add_typed_tokens(tokenizer: Any, tokens: Sequence[str], kinds: Sequence[int]) -> None:
    """Add to ``tokenizer`` (a ``tokenizers.Tokenizer``) the vocabulary's tokens that are matched
    whole, each ``special`` as its own token type says (:data:`HIDDEN_TYPES`): special ones are
    skipped when text is decoded (``skip_special_tokens``), user-defined ones are text. A token
    the vocabulary holds already keeps its id."""
    from tokenizers import AddedToken

    def added(types: Sequence[int], special: bool) -> list[Any]:
        return [AddedToken(token, special=special, normalized=False)
                for token, kind in zip(tokens, kinds) if kind in types]

    tokenizer.add_special_tokens(added(HIDDEN_TYPES, True))
    tokenizer.add_tokens(added((USER_DEFINED,), False))


def spm_tokenizer_from_gguf(gguf: Path) -> Any:
    """A fast tokenizer built from a GGUF's SentencePiece vocabulary (``tokenizer.ggml.model`` =
    ``llama``: tokens, scores and types), tokenizing as llama.cpp's SPM tokenizer does: spaces
    become ``▁`` (no space prefix where ``add_space_prefix`` is false, as Gemma 3's), then the
    adjacent pair whose joined piece scores highest is merged, over and over (a BPE whose merges
    are ranked by the joined piece's score), and a character outside the vocabulary falls back to
    its UTF-8 bytes (``<0xNN>``). Control tokens (``<bos>``, ``<start_of_turn>``, ...) are matched
    whole, and so are user-defined ones (Gemma's newlines and runs of spaces), which unlike control
    tokens are text (:func:`add_typed_tokens`). The BOS token is prepended where ``add_bos_token`` says so.

    (transformers 4.57 builds Gemma 3's tokenizer from the GGUF with a vocabulary and merges that
    split ordinary words into single characters.)"""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf))
    fields = reader.fields

    def array(key: str) -> list[Any]:
        return _gguf_array(fields, key)

    def value(key: str, default: Any = None) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return default if field is None else field.parts[field.data[0]][0].item()

    tokens, scores, kinds = array("tokens"), array("scores"), array("token_type")
    vocab = {token: i for i, token in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    normal = {t for t, kind in zip(tokens, kinds) if kind == NORMAL}  # NORMAL pieces take part in merges
    merges = []
    for token in normal:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                merges.append((score[token], vocab[token], left, right))
    merges.sort(key=lambda m: (-m[0], m[1]))
    unk = value("unknown_token_id")
    model = models.BPE(vocab, [(a, b) for _, _, a, b in merges], unk_token=tokens[unk] if unk is not None else None,
                       byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    prefix = bool(value("add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    add_typed_tokens(tok, tokens, kinds)
    names = {}
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = value(key)
        if token_id is not None and 0 <= token_id < len(tokens):
            names[role] = tokens[token_id]
    add_bos = bool(value("add_bos_token", False)) and "bos_token" in names
    if add_bos:
        bos = names["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)


def fix_gguf_tokenizer(tokenizer: Any, gguf: Path) -> None:
    """Apply the GGUF's special tokens and token types, which transformers 4.57 does not always
    carry over.

    (From SmolLM2's GGUF it builds a tokenizer whose EOS is ``<|im_start|>`` and which prepends a
    BOS the model was not trained with; from Qwen's its EOS is ``<|endoftext|>``, not ``<|im_end|>``,
    and control tokens such as ``<|fim_prefix|>`` are left in the text.) Tokens the vocabulary types
    as control, unknown or unused become special, user-defined ones are matched whole
    (:func:`add_typed_tokens`).
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def value(key: str) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.parts[field.data[0]][0].item()

    if "tokenizer.ggml.token_type" in fields and "tokenizer.ggml.tokens" in fields:
        add_typed_tokens(tokenizer.backend_tokenizer, _gguf_array(fields, "tokens"), _gguf_array(fields, "token_type"))
    for role in ("bos", "eos", "unk"):
        token_id = value(f"{role}_token_id" if role != "unk" else "unknown_token_id")
        if token_id is not None and token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    pad = value("padding_token_id")
    if pad is not None and pad < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad))
    for flag in ("add_bos_token", "add_eos_token"):
        wanted = value(flag)
        if wanted is not None and hasattr(tokenizer, flag):
            setattr(tokenizer, flag, bool(wanted))


@contextlib.contextmanager
def one_reader(gguf: Path) -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader`` of this file (transformers makes one for the
    tokenizer's class, one for the tokenizer, one for the configuration; the conversion one
    more) is the same parsed reader, a :func:`_metadata_reader`. Readers of other files are made
    as usual; a reader holds the file mapped read-only."""
    import gguf as gguf_package

    real = gguf_package.GGUFReader
    key = os.path.realpath(gguf)
    if getattr(real, "one_reader_of", None) == key:  # inside a block for this file already
        yield
        return
    readers: dict[str, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or os.path.realpath(path) != key:
            return real(path, *args, **kwargs)
        if key not in readers:
            readers[key] = _metadata_reader(path)
        return readers[key]

    reader.one_reader_of = key  # type: ignore[attr-defined]
    gguf_package.GGUFReader = reader
    try:
        yield
    finally:
        gguf_package.GGUFReader = real


def _metadata_reader(path: str | Path) -> Any:
    """The GGUF reader transformers is given: every array element a part of its own, parsed in one
    pass over the header (:func:`specdec.backends.gguf._reader` with ``elements``)."""
    return gguf_backend._reader(path, elements=True)
