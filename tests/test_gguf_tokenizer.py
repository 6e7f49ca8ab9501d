"""The tokenizer specdec builds from a GGUF file (:func:`specdec.tokenizers.tokenizer_from_gguf`): which
tokens are text is decided by the vocabulary's own token types (``tokenizer.ggml.token_type``), as
llama.cpp decides it. Control, unknown and unused tokens are left out of the text; user-defined
ones (Gemma 3's newlines and runs of spaces, Qwen's ``<tool_call>``) are text.

Tiny vocabularies check the rule on both builders (specdec's SentencePiece one, transformers' BPE
one with the file's types applied) and that a tokenizer kept in the cache by an older build is built
again; the installed packs' vocabularies are decoded token by token against llama.cpp's own
detokenization (marked slow), and a Gemma 3 server answers a ``"\\n"`` stop and logprobs that spell
its text.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

from specdec import api, models, packs, tokenizers
from specdec.backends import llamacpp
from helpers import THREADS, Server

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def write_vocabulary(path: Path, architecture: str, model: str, tokens: list[str], types: list[int],
                     merges: list[str] | None = None, **ids: int) -> None:
    """A GGUF holding only a tokenizer's metadata (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if model == "llama":
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_add_space_prefix(False)
    else:
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(merges or [])
    for role, token_id in ids.items():
        getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Gemma 3's layout in miniature: control tokens first, user-defined whitespace, then pieces.
SPM_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<unused0>", "\n", "\n\n", "    ",
              "▁", "d", "e", "f", "x", ":", "(", ")", "de", "def", "▁x", "r", "t", "u", "n", "ret", "return"]
SPM_TYPES = [CONTROL, CONTROL, CONTROL, CONTROL, CONTROL, UNUSED, USER_DEFINED, USER_DEFINED, USER_DEFINED] + \
            [NORMAL] * (len(SPM_TOKENS) - 9)


def test_gemmas_user_defined_whitespace_tokens_are_text_and_its_control_tokens_are_not(tmp_path):
    """A SentencePiece vocabulary (Gemma 3's): "\\n", "\\n\\n" and four spaces are user-defined
    tokens, matched whole and kept in the text; control and unused tokens are left out of it."""
    path = tmp_path / "spm.gguf"
    write_vocabulary(path, "gemma3", "llama", SPM_TOKENS, SPM_TYPES, bos=2, eos=1, unk=3, pad=0)
    tokenizer = tokenizers.tokenizer_from_gguf(path)
    code = "def(x):\n    return x\n\n"
    ids = tokenizer(code, add_special_tokens=False)["input_ids"]
    index = {t: i for i, t in enumerate(SPM_TOKENS)}
    assert [index["\n"], index["    "], index["\n\n"]] == [t for t in ids if t in (6, 7, 8)]
    assert api.decode_text(tokenizer, ids) == code
    hidden = [index[t] for t in ("<bos>", "<start_of_turn>", "<unused0>", "<eos>", "<pad>", "<unk>")]
    assert api.decode_text(tokenizer, hidden[:3] + ids + hidden[3:]) == code
    assert tokenizer("<start_of_turn>def", add_special_tokens=False)["input_ids"] == [index["<start_of_turn>"],
                                                                                     index["def"]]


def test_a_bpe_vocabularys_control_and_unused_tokens_are_hidden_and_user_defined_ones_kept(tmp_path):
    """A byte-level BPE vocabulary (Qwen's) through transformers' converter with the file's token
    types applied: a control token transformers does not know by name (``<|fim_prefix|>``) and an
    unused one (``[PAD9]``) are left out of the text, a user-defined one (``<tool_call>``) is text,
    matched whole."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_end|>",
                                                   "<|fim_prefix|>", "<tool_call>", "[PAD9]"]
    types = [NORMAL] * 259 + [CONTROL, CONTROL, CONTROL, USER_DEFINED, UNUSED]
    path = tmp_path / "bpe.gguf"
    write_vocabulary(path, "qwen2", "gpt2", tokens, types, ["Ġ t", "h e", "Ġt he"], eos=260, pad=259, bos=259)
    tokenizer = tokenizers.tokenizer_from_gguf(path)
    fim, call, pad = (tokens.index(t) for t in ("<|fim_prefix|>", "<tool_call>", "[PAD9]"))
    the = tokenizer(" the", add_special_tokens=False)["input_ids"]
    assert api.decode_text(tokenizer, [fim, *the, call, *the, pad, 260]) == " the<tool_call> the"
    assert tokenizer("<tool_call> the", add_special_tokens=False)["input_ids"] == [call, *the]
    assert tokenizer.eos_token == "<|im_end|>"


def test_a_pack_tokenizer_kept_by_an_older_build_is_built_again(tmp_path, monkeypatch):
    """A pack's tokenizer is kept in the cache with the build it came from: one kept without that
    stamp (an older build, which lost Gemma's newlines) is not used but built again from the GGUF;
    a current one is read back, not rebuilt."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = tmp_path / "spm.gguf"
    write_vocabulary(path, "gemma3", "llama", SPM_TOKENS, SPM_TYPES, bos=2, eos=1, unk=3, pad=0)
    pack = packs.Pack("tiny-spm", "a vocabulary", (), path.stat().st_size, "0" * 64, len(SPM_TOKENS))
    cache = tmp_path / "cache"
    stale = cache / "tokenizers" / pack.name
    old = tokenizers.tokenizer_from_gguf(path)
    old.backend_tokenizer.add_special_tokens([AddedToken("\n", special=True, normalized=False)])  # as older builds
    old.save_pretrained(stale)
    assert api.decode_text(AutoTokenizer.from_pretrained(stale), [10, 6]) == "d"
    built = []
    real = tokenizers.tokenizer_from_gguf
    monkeypatch.setattr(tokenizers, "tokenizer_from_gguf", lambda gguf: built.append(gguf) or real(gguf))
    assert api.decode_text(packs.gguf_tokenizer(path, pack=pack, cache_dir=cache), [10, 6]) == "d\n"
    assert built == [path]
    assert json.loads((stale / packs.TOKENIZER_MARKER).read_text())["tokenizer_format"] == tokenizers.TOKENIZER_FORMAT
    assert api.decode_text(packs.gguf_tokenizer(path, pack=pack, cache_dir=cache), [10, 6]) == "d\n"
    assert built == [path]  # read back from the cache


# ------------------------------------------------------------------------------------------------
# The installed packs against llama.cpp

PACK_NAMES = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
# llama.cpp makes "</s>" a control (end-of-generation) token by its text, whatever type the file
# gives it ("control-looking token ... its type will be overridden"): Gemma 3's is user-defined,
# Qwen's normal. specdec keeps the vocabulary's own type, so these two texts differ.
RETYPED_BY_LLAMA_CPP = {"</s>"}
SAMPLE = ("def reverse(s):\n    return s[::-1]\n\n\nclass Stack:\n\tdef push(self, x):  # à la carte, 日本語 🙂\n"
          "        self.items.append(x)\r\n<tool_call>{\"name\": 1}</tool_call>  \n")


class LlamaVocabulary:
    """A GGUF's vocabulary as llama.cpp loads it (``vocab_only``): its detokenization and types."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def text(self, ids: list[int]) -> str:
        """llama.cpp's text of ``ids``, special tokens not rendered (bytes not UTF-8 replaced as
        transformers' decoders replace them)."""
        tokens = (self.lib.llama_token * len(ids))(*ids)
        size = 64 * len(ids) + 64
        buffer = ctypes.create_string_buffer(size)
        n = self.lib.llama_detokenize(self.vocab, tokens, len(ids), buffer, size, False, False)
        assert 0 <= n <= size
        return buffer.raw[:n].decode("utf-8", "replace")

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        tokens = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, len(data) + 8, False, False)
        assert n >= 0
        return list(tokens[:n])

    def is_control(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_control(self.vocab, token))

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


@pytest.mark.slow
@pytest.mark.parametrize("name", PACK_NAMES)
def test_every_token_of_a_packs_vocabulary_decodes_as_llama_cpp_detokenizes_it(name):
    """Each token of the pack's vocabulary, between two ordinary tokens (a byte token alone),
    decodes to the text llama.cpp's detokenization gives the same ids; and a sample of code,
    tokenized as llama.cpp tokenizes it, to that text and to the sample itself."""
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    pack = packs.PACKS[name]
    if packs.missing_parts(pack):
        pytest.skip(f"pack {name} is not installed: {pack.install_command(packs.missing_parts(pack))}")
    path = packs.gguf_file(pack, progress=False)
    tokenizer = packs.gguf_tokenizer(None, pack=pack)
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.token_type"]
    types = [field.parts[i][0].item() for i in field.data]
    llama = LlamaVocabulary(path)
    try:
        word = next(i for i, kind in enumerate(types) if kind == NORMAL and llama.text([i]).isalpha())
        retyped, wrong = set(), []
        for token, kind in enumerate(types):
            ids = [token] if kind == BYTE else [word, token, word]
            if llama.is_control(token) and kind != CONTROL:
                retyped.add(llama.text([token]) or tokenizer.convert_ids_to_tokens(token))
                continue
            if api.decode_text(tokenizer, ids) != llama.text(ids):
                wrong.append((token, kind, api.decode_text(tokenizer, ids), llama.text(ids)))
        assert retyped <= RETYPED_BY_LLAMA_CPP
        assert wrong == [], f"{len(wrong)} tokens decode otherwise than llama.cpp's text, e.g. {wrong[:5]}"
        ids = llama.tokenize(SAMPLE)
        assert api.decode_text(tokenizer, ids) == llama.text(ids) == SAMPLE
        assert tokenizer(SAMPLE, add_special_tokens=False)["input_ids"] == ids
    finally:
        llama.close()


@pytest.mark.slow
def test_a_gemma_server_stops_at_a_newline_and_its_logprobs_spell_its_text():
    """Gemma 3's newline is a token of its own: a ``"\\n"`` stop ends the text at the first line,
    and the logprobs' tokens of a longer answer join into its text, newlines included."""
    pack = packs.PACKS["gemma3-270m"]
    if packs.missing_parts(pack):
        pytest.skip(f"pack gemma3-270m is not installed: {pack.install_command(packs.missing_parts(pack))}")
    from specdec.server.app import ServerOptions, create_app
    from specdec.server.requests import method_config

    pair = models.load_pair("gemma3-270m", None, n_threads=THREADS)
    app = create_app(pair, ServerOptions(method_config("spec:ngram:block:k=4:policy=static", False)))
    prompt = "# Reverse a string.\ndef reverse_string(s):\n"
    with Server(app) as running:
        client = running.client()
        stopped = client.completions.create(model=pair.target_name, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=["\n"])
        whole = client.completions.create(model=pair.target_name, prompt=prompt, max_tokens=24, temperature=0,
                                          logprobs=0)
    text = whole.choices[0].text
    print(repr(text), repr(stopped.choices[0].text))
    assert text.startswith("    ") and text.count("\n") >= 2  # the body, indented, over lines
    assert "".join(whole.choices[0].logprobs.tokens) == text
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index("\n")]
