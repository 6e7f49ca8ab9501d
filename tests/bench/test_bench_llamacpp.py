"""The bench on both backends with the llama.cpp binding's own generation as a peer, on the SmolLM2 pack.

Skipped when the binding or the SmolLM2 pack is not installed (the skip message says what to
install). One short interleaved run, greedy and at T=1, through ``specdec bench`` itself.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec import packs

from specdec.backends import llamacpp  # noqa: E402

if not llamacpp.available():
    pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}", allow_module_level=True)

PACK = "smollm2-135m"
SERVED = ("ar:backend=llamacpp:via=serve", "spec:model:block:k=3:policy=static:backend=llamacpp:via=serve")
ON_KERNEL = "spec:model:block:k=3:policy=static:backend=gguf"  # specdec's GGUF kernel, on the same file
METHODS = ",".join(["spec:ngram:block:k=4:policy=static,spec:model:block:k=3:policy=static,llamacpp-ar", *SERVED,
                    ON_KERNEL])
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    from specdec.cli.bench import main

    out = tmp_path_factory.mktemp("bench")
    threads = "1"  # llama.cpp's threads spin at barriers: on a busy machine two threads crawl
    before = torch.get_num_threads()
    argv = ["--target", PACK, "--draft", PACK, "--draft-weights", "bf16", "--backend", "both",
            "--methods", METHODS, "--prompts", "edit:1,humaneval:1", "--temperature", "0", "1",
            "--max-new-tokens", str(NEW_TOKENS), "--warmup-tokens", "4", "--threads", threads,
            "--server-endpoint", "chat",  # the edit prompt's messages to /v1/chat/completions
            "--no-progress", "--out", str(out)]
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    return {name: json.loads((out / name / "results.json").read_text()) for name in ("greedy", "t1")} | {"out": out}


def test_the_served_methods_got_the_chat_prompt_as_messages(bench_run):
    for name in ("greedy", "t1"):
        assert bench_run[name]["settings"]["server_endpoint"].startswith("chat: messages to /v1/chat/completions")
        assert [p["chat"] for p in bench_run[name]["prompts"]] == [True, False]  # edit, humaneval


def test_one_run_holds_both_backends_and_the_llamacpp_peers(bench_run):
    greedy = bench_run["greedy"]
    assert list(greedy["methods"]) == [
        "ar", "ar:backend=llamacpp", "ar:backend=gguf", "spec:ngram:block:k=4:policy=static",
        "spec:ngram:block:k=4:policy=static:backend=llamacpp", "spec:model:block:k=3:policy=static",
        "spec:model:block:k=3:policy=static:backend=llamacpp", "llamacpp-ar", *SERVED, ON_KERNEL,
    ]
    assert not greedy["failed"], greedy["failed"]
    assert [p["set"] for p in greedy["prompts"]] == ["edit", "humaneval"]
    orders = sorted((s["order"], s["prompt"], s["method"]) for s in greedy["samples"])
    assert [m for _, _, m in orders[: len(greedy["methods"])]] == list(greedy["methods"])  # interleaved
    assert all(s["new_tokens"] == NEW_TOKENS for s in greedy["samples"])
    assert greedy["models"]["llamacpp"]["target_gguf"].endswith(".gguf")
    assert greedy["models"]["gguf"]["target_gguf"] == greedy["models"]["llamacpp"]["target_gguf"]
    assert "GGUF on specdec's GGUF kernel" in greedy["environment"]["weights"]


def test_greedy_exact_methods_equal_their_backends_ar(bench_run):
    """Exact methods reproduce greedy ar on torch, and on llama.cpp, whose kernels in this binding
    are batch invariant; the llama.cpp peer is compared with the llama.cpp backend's ar."""
    methods = bench_run["greedy"]["methods"]
    assert methods["llamacpp-ar"]["ar"] == "ar:backend=llamacpp"
    for name in ("spec:ngram:block:k=4:policy=static", "spec:model:block:k=3:policy=static"):
        assert methods[name]["identical_to_ar_fraction"] == 1.0, name
        assert methods[f"{name}:backend=llamacpp"]["identical_to_ar_fraction"] == 1.0, name
    assert methods[ON_KERNEL]["ar"] == "ar:backend=gguf"
    assert methods[ON_KERNEL]["identical_to_ar_fraction"] == 1.0  # the kernel: the tokens of its own ar
    for name in SERVED:  # through specdec serve, over HTTP: the same tokens
        assert methods[name]["ar"] == "ar:backend=llamacpp"
        assert methods[name]["identical_to_ar_fraction"] == 1.0, name


def test_every_greedy_difference_on_llamacpp_is_explained(bench_run):
    """Where a llama.cpp method leaves the backend's ar (its batched passes round differently), the
    run gives the position, the two tokens and the target's top-2 margin in ar's pass, whose best
    token is ar's; for the project's methods also in their own pass, whose best is theirs."""
    data = bench_run["greedy"]
    samples = {(s["method"], s["prompt"]): s["token_ids"] for s in data["samples"]}
    for name, m in data["methods"].items():
        if m["ar"] != "ar:backend=llamacpp" or name == "ar:backend=llamacpp":
            continue
        differs = [p for p in range(len(data["prompts"])) if samples[name, p] != samples["ar:backend=llamacpp", p]]
        assert [d["prompt"] for d in m["divergences"]] == differs, name
        for d in m["divergences"]:
            p = d["position"]
            assert samples[name, d["prompt"]][:p] == samples["ar:backend=llamacpp", d["prompt"]][:p]
            assert d["ar_top"][0] == d["ar_token"] and d["ar_margin"] >= 0 and d["replayed"]["ar"] is True
            if not name.startswith("llamacpp-"):
                assert d["top"][0] == d["token"] and d["replayed"]["method"] is True


def test_report_gives_ms_per_token_and_speedups_against_llamacpp_ar(bench_run):
    for run in ("greedy", "t1"):
        methods = bench_run[run]["methods"]
        assert methods["llamacpp-ar"]["speedup_vs_llamacpp_ar"] == pytest.approx(1.0)
        for name, m in methods.items():
            assert m["ms_per_token"] == pytest.approx(1000 * m["seconds"] / m["new_tokens"]), name
            assert m["speedup_vs_llamacpp_ar"] == pytest.approx(
                m["tokens_per_second"] / methods["llamacpp-ar"]["tokens_per_second"]), name
            assert set(m["speedup_vs_llamacpp_ar_by_set"]) == {"edit", "humaneval"}, name
        table = (bench_run["out"] / run / "results.md").read_text()
        assert "| ms/token |" in table and "| vs llamacpp-ar |" in table
    for s in bench_run["greedy"]["samples"]:  # the peer's prefill is timed apart, as for every method
        if s["method"] == "llamacpp-ar":
            assert s["target_forwards"] == s["new_tokens"] and s["first_step_tokens"] == 1
            assert 0 < s["first_step_seconds"] < s["seconds"]


def test_sampling_runs_on_both_backends(bench_run):
    t1 = bench_run["t1"]
    assert not t1["failed"], t1["failed"]
    assert all(s["new_tokens"] == NEW_TOKENS for s in t1["samples"])
    assert all(m["identical_to_ar_fraction"] is None and not m["divergences"] for m in t1["methods"].values())


def test_the_run_records_the_machine_and_each_gguf_backends_one_row_step(bench_run):
    """Both backends' one-token step on the run's target, the memory read speed and the CPU's
    vector features are stored with the run and printed under the report's title."""
    record = bench_run["greedy"]["environment"]["machine"]
    assert record == bench_run["t1"]["environment"]["machine"]  # measured once per invocation
    assert set(record) == {"cpu", "features", "memory_read", "one_row_step", "gguf_kernel_path"} and record["cpu"]
    steps = record["one_row_step"]
    assert steps["model"] == packs.gguf_file(PACK, progress=False).name and steps["threads"] == 1
    assert set(steps["ms"]) | set(steps["skipped"]) == {"gguf", "llamacpp"} and "llamacpp" in steps["ms"]
    assert all(ms > 0 for ms in steps["ms"].values())
    assert record["memory_read"].get("gb_per_s", 1) > 0 and record["memory_read"].get("threads", 1) == 1
    table = (bench_run["out"] / "greedy" / "results.md").read_text().splitlines()
    assert table[2].startswith(f"Machine: {record['cpu']}; ") and "one-token step on " in table[2]
