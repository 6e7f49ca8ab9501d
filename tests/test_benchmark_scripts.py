"""The scripts in ``benchmarks/`` run, each as a user runs it: ``python benchmarks/X.py``.

Nothing else runs them, so they rot when the library moves (an import that moved, a tokenizer
read from a torch conversion that a llama.cpp user never makes). For every ``benchmarks/*.py``:

- ``--help`` exits 0 and prints its usage (all scripts at once, in parallel processes);
- a tiny run end to end, writing its output into the test's folder, and the test reads that
  output (the JSON's keys, and numbers of the right type and count, not just the exit status).
  The runs use the SmolLM2 pack (``smollm2-135m``, the smallest model each accepts): on torch
  (converted into the user's cache on first use, as in tests/test_real_models.py) for draft_cost,
  forward_cost, freed_memory, prefill, tree_vs_chain and trimmed_head (with random heads made
  here, since heads ship only for the 1.5B target); its GGUF on llama.cpp for
  coupled_acceptance, gguf_row_cost, prefill_layouts and request_path, and on specdec's GGUF
  kernel for default_overhead, kv_cache_f16 and prefill_beside (a ``specdec serve`` app in the
  script's process); no model for sampler_cost, attention_shared_kv (its ``--before`` build: a
  copy of the current kernel, which must agree bit for bit) and coupled_text (whose input, a
  bench run's saved samples, is written here by the bench's own writer). A new script without a run test here fails
  :func:`test_every_script_has_a_run_test`.

multi_turn.py compares ``specdec serve`` with llama.cpp's ``llama-server``: without a
llama-server binary (none is built in CI) its test checks that it stops at argument checking,
before any model or tokenizer loads, with the error that says how to build one; the small run
end to end, ``test_multi_turn_runs``, is marked ``slow`` and is skipped where no llama-server
is found ($SPECDEC_LLAMA_SERVER, ``benchmarks/build_llama_server.sh``'s output, or PATH).
The tests that run a real model are marked ``slow`` (pyproject's marker: a real model from an
installed pack); each runs a few tokens on one prompt, once: the file takes about two to three
minutes on 2 busy cores.

Also here: ``specdec bench --help`` tells how to run the server methods (``via=serve``) and the
llama-server peers, and the bench's results header states what ran: the torch dtype for
methods on transformers' weights, the GGUF's quantisation as llama.cpp describes it for methods
on llama.cpp.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec import packs
from specdec.backends import llamacpp

from helpers import REPO

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))
PACK = "smollm2-135m"
THREADS = "1"  # a shared 2-core machine: one thread each


def run_script(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> args...`` from the repository root, as the docstrings run them."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false") | (env or {})
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def ran(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit status {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def read_json(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())  # NaN (a standard error of one draw) is read as Python reads it


def positive_numbers(values, count: int | None = None) -> None:
    values = list(values)
    assert all(isinstance(v, float) and v > 0 for v in values), values
    if count is not None:
        assert len(values) == count, values


def machine_recorded(record: dict) -> None:
    """The machine a GGUF script measured on (:func:`specdec.bench.machine.machine_record`): the
    CPU, its vector features, the memory read speed and the kernel's one-token step on the pack."""
    assert set(record) == {"cpu", "features", "memory_read", "one_row_step", "gguf_kernel_path"} and record["cpu"]
    assert record["memory_read"]["mib"] == 16 and record["memory_read"]["threads"] == int(THREADS)
    positive_numbers([record["memory_read"]["gb_per_s"]])
    steps = record["one_row_step"]
    assert steps["model"].endswith(".gguf") and steps["threads"] == int(THREADS) and "gguf" in steps["ms"]
    positive_numbers(steps["ms"].values())


def need_pack() -> None:
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")


def need_llamacpp() -> None:
    need_pack()
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")


# ------------------------------------------------------------------------------------------------
# --help, every script


# Runs each script given as an argument as ``python SCRIPT --help`` would, one after another in this
# one process (each script mostly imports torch and specdec: once here instead of once per script),
# and prints {script: [exit status, stdout, stderr]} as JSON.
_EVERY_HELP = """
import contextlib, io, json, os, runpy, sys
results = {}
for path in sys.argv[1:]:
    out, err, status = io.StringIO(), io.StringIO(), 0
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)  # as python puts a script's folder first
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException as error:
            status = 1
            print(f"{type(error).__name__}: {error}", file=err)
    results[os.path.basename(path)] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """Every script's ``--help``, all in one Python process (:data:`_EVERY_HELP`)."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="100")
    proc = ran(subprocess.run([sys.executable, "-c", _EVERY_HELP, *(str(BENCHMARKS / name) for name in SCRIPTS)],
                              cwd=REPO, env=environment, capture_output=True, text=True, timeout=600))
    return {name: subprocess.CompletedProcess([name, "--help"], status, out, err)
            for name, (status, out, err) in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage(helps, script):
    proc = helps[script]
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.startswith(f"usage: {script}"), proc.stdout[:300]
    assert "-h, --help" in proc.stdout


def test_every_script_has_a_run_test():
    """A script added to benchmarks/ needs its own small run here (test_<name>_runs)."""
    assert SCRIPTS, "no scripts found in benchmarks/"
    missing = [s for s in SCRIPTS if f"test_{s.removesuffix('.py')}_runs" not in globals()]
    assert not missing, f"no run test for {missing}: add test_<name>_runs to {Path(__file__).name}"


# ------------------------------------------------------------------------------------------------
# One small run per script


@pytest.mark.slow
def test_coupled_acceptance_runs(tmp_path):
    need_llamacpp()
    out = tmp_path / "coupled.json"
    ran(run_script("coupled_acceptance.py", "--target", PACK, "--draft", PACK, "--prompts", "humaneval:1",
                   "--tokens", "4", "--temperatures", "1", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert (data["target"], data["draft"], data["backend"]) == (PACK, PACK, "llamacpp")
    assert list(data["summary"]) == ["T=1"]
    row = data["summary"]["T=1"]
    assert row["positions"] == 4
    # the draft is the target: p = q at every position, so both rules keep every draft token
    for key in ("rejection_alpha", "coupled_alpha", "bound_alpha", "coupled_over_rejection"):
        assert row[key] == pytest.approx(1.0, abs=1e-6), key
    assert len(data["prompts"]) == 1 and data["prompts"][0]["prompt"].startswith("HumanEval/")
    assert data["prompts"][0]["T=1"]["coupled"] == pytest.approx(1.0, abs=1e-6)
    assert "--target smollm2-135m" in data["command"] and data["seconds"] > 0


def test_coupled_text_runs(tmp_path):
    """Its input is a bench run's saved samples, written here by the bench's own writer."""
    from specdec.bench.resume import SavedRuns
    from specdec.bench.sample import Sample
    from specdec.prompts import Prompt

    run = tmp_path / "t1"
    store = SavedRuns(run)
    texts = {  # method -> the tokens of prompt 0 and prompt 1
        "spec:model:coupled:k=2:policy=static": ([1, 2, 3, 4], [5, 6, 7, 8]),
        "spec:ngram:coupled:k=2:policy=static": ([1, 2, 3, 4], [5, 6, 9, 9]),  # parts at new token 2
        "spec:model:block:k=2:policy=static": ([0, 0, 0, 0], [0, 0, 0, 0]),  # not coupled: left out
        "spec:model:coupled:k=2:policy=static:backend=llamacpp": ([1, 2, 3, 4], [5, 6, 7, 8]),
    }
    prompts = [Prompt("humaneval", "HumanEval/0", text="a"), Prompt("humaneval", "HumanEval/1", text="b")]
    for method, outputs in texts.items():
        for index, tokens in enumerate(outputs):
            store.save(Sample(method, index, 0, 0, 0, tokens, 1.0, 4), prompts[index])
    proc = ran(run_script("coupled_text.py", str(run)))
    lines = proc.stdout.splitlines()
    assert "torch prompt 1: 2 different texts from 2 methods, first difference at new token 2" in lines
    assert ("torch: 1/2 prompts gave one text across spec:model:coupled:k=2:policy=static, "
            "spec:ngram:coupled:k=2:policy=static") in lines
    assert "llamacpp: 2/2 prompts gave one text across spec:model:coupled:k=2:policy=static:backend=llamacpp" in lines
    assert len(lines) == 3
    bad = run_script("coupled_text.py", str(tmp_path))  # not a temperature folder
    assert bad.returncode == 2 and "holds no samples/ folder" in bad.stderr


def test_datastore_lookup_runs():
    data = json.loads(ran(run_script("datastore_lookup.py", "--tokens", "20000", "--lookups", "50")).stdout)
    assert data["tokens"] == 20000
    positive_numbers([data["build_seconds"], *data["lookup_ms"].values(), *data["lookup_cpu_ms"].values()])
    assert data["lookup_ms"]["median"] <= data["lookup_ms"]["p99"] <= data["lookup_ms"]["max"]


@pytest.mark.slow
def test_default_overhead_runs(tmp_path):
    need_pack()
    out = tmp_path / "default-overhead.json"
    proc = ran(run_script("default_overhead.py", "--target", PACK, "--draft", PACK, "--backend", "gguf",
                          "--prompts", "humaneval:1,mtbench:1", "--pairs", "2", "--max-new-tokens", "6",
                          "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert data["backend"] == "gguf" and [r["prompt"].split("/")[0] for r in data["rows"]] == ["HumanEval", "mtbench"]
    for row in data["rows"]:
        positive_numbers(row["wall_ratios"], 2)
        positive_numbers(row["pass_ratios"], 2)
        assert row["ar_forwards"] == 6 and 1 <= row["default_forwards"] <= 6
        assert row["identical"] is True  # greedy: the default's text is plain decoding's
    assert "default/ar wall" in proc.stdout


@pytest.mark.slow
def test_draft_cost_runs(tmp_path):
    need_pack()
    out = tmp_path / "draft-cost.json"
    committed = BENCHMARKS / "draft-cost.json"
    before = committed.read_bytes() if committed.exists() else None
    ran(run_script("draft_cost.py", "--target", PACK, "--draft", PACK, "--prompts", "1", "--repeats", "1",
                   "--tokens", "4", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert list(data["median_ms"]) == ["target, transformers", "target, lean bf16", "draft, transformers",
                                       "draft, lean bf16", "draft, lean int8"]
    positive_numbers(data["median_ms"].values())
    assert data["tokens"] == 4 and data["repeats"] == 1 and data["threads"] == 1
    assert set(data["agreement"]) == {"lean bf16", "lean int8"}
    assert all(0.0 <= v <= 1.0 for v in data["agreement"].values())
    assert data["agreement"]["lean bf16"] == 1.0  # the draft is the target, in the same bf16 weights
    assert data["table"].startswith("| forward of one token |")
    assert (committed.read_bytes() if committed.exists() else None) == before  # --out, not the committed file


@pytest.mark.slow
def test_forward_cost_runs(tmp_path):
    need_pack()
    out = tmp_path / "forward-cost.json"
    ran(run_script("forward_cost.py", "--model", PACK, "--repeats", "1", "--context", "16", "--threads", THREADS,
                   "--out", str(out)))
    data = read_json(out)
    assert (data["model"], data["context"], data["repeats"]) == (PACK, 16, 1)
    for kernels in ("torch", "specdec"):
        assert list(data["median_ms"][kernels]) == ["1", "2", "3", "5", "8", "12", "16"]
        positive_numbers(data["median_ms"][kernels].values())
    assert data["table"].count("\n") == 8  # header, rule, 7 sizes


@pytest.mark.slow
def test_freed_memory_runs(tmp_path):
    need_pack()
    out = tmp_path / "freed-memory.json"
    proc = ran(run_script("freed_memory.py", "--target", PACK, "--draft", PACK, "--rounds", "1", "--tokens", "4",
                          "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert list(data["methods"]) == ["ar", "spec:block:policy=confidence", "spec:tree"]
    for figures in data["methods"].values():
        positive_numbers([figures["seconds_system"], figures["seconds_kept"], figures["speed_up"]])
        assert figures["speed_up"] == pytest.approx(figures["seconds_system"] / figures["seconds_kept"])
    assert data["identical_tokens"] is True and data["prompts"] == 2
    assert "--target smollm2-135m --draft smollm2-135m" in data["command"]
    assert proc.stdout.splitlines()[:2][0].startswith("system ")  # round 0: glibc's defaults first


def test_gguf_compute_floor_runs(tmp_path):
    need_pack()
    out = tmp_path / "floor.json"
    ran(run_script("gguf_compute_floor.py", "--model", PACK, "--threads", THREADS, "--seconds", "0.05",
                   "--resident-mib", "1", "--streamed-mib", "2", "--read-mib", "16", "--out", str(out)))
    data = read_json(out)
    machine_recorded(data["machine"])
    assert data["sizes_mib"] == {"cache-resident": 1, "streamed": 2} and data["model_weights_per_token"] > 0
    for name in ("Q4_K", "Q6_K"):
        for size in ("cache-resident", "streamed"):
            times = data["ms"][name][size]
            assert list(times) == ["1", "2", "4", "8", "16"]
            positive_numbers(times.values())
            assert isinstance(data["extra_row_ms_projected"][name][size], float)


@pytest.mark.slow
def test_gguf_row_cost_runs(tmp_path):
    need_pack()
    out = tmp_path / "gguf-row-cost.json"
    with_llamacpp = llamacpp.available()
    ran(run_script("gguf_row_cost.py", "--model", PACK, "--rows", "1,2", "--repeats", "1", "--context", "8",
                   "--threads", THREADS, "--read-mib", "16", "--out", str(out),
                   *([] if with_llamacpp else ["--no-llamacpp"])))
    data = read_json(out)
    machine_recorded(data["machine"])
    backends = ["specdec", "llama.cpp"] if with_llamacpp else ["specdec"]
    assert list(data["median_ms"]) == backends and data["model"].endswith(".gguf")
    for name in backends:
        assert list(data["median_ms"][name]) == ["1", "2"]
        positive_numbers(data["median_ms"][name].values())
        assert data["ratio_to_one_row"][name]["1"] == 1.0
    assert data["kernel_path"] in ("portable", "avx2", "avx512vnni", "avxvnni", "amx")  # specdec.backends.gguf.PATHS


def test_multi_turn_stops_at_its_arguments_without_llama_server(tmp_path):
    """A default (llama.cpp) user without llama-server gets the error that says how to build one,
    before any tokenizer, model or server loads (it used to fail reading a tokenizer from a torch
    conversion such a user never has)."""
    missing = {"SPECDEC_LLAMA_SERVER": str(tmp_path / "no-llama-server")}
    proc = run_script("multi_turn.py", "--out", str(tmp_path / "multi-turn.json"), env=missing)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"multi_turn.py: error: $SPECDEC_LLAMA_SERVER names {tmp_path / 'no-llama-server'}, which is not "
                    "a file (this script compares specdec serve with llama-server)")
    assert "Traceback" not in proc.stderr and "HFValidationError" not in proc.stderr
    assert not (tmp_path / "multi-turn.json").exists()
    for args, message in (
        (["--conversations", "humaneval:1"], "--conversations: no conversations for 'humaneval': choose mtbench or edit"),
        (["--target", str(tmp_path / "nothing.gguf")], "--target: "),
        (["--max-tokens", "0"], "--max-tokens and --threads take positive integers"),
    ):
        bad = run_script("multi_turn.py", *args, env=missing)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.slow
def test_multi_turn_runs(tmp_path):
    need_llamacpp()
    from specdec.bench.servers import ServerMissing, llama_server_binary

    try:
        llama_server_binary()
    except ServerMissing as err:
        pytest.skip(str(err))
    out = tmp_path / "multi-turn.json"
    ran(run_script("multi_turn.py", "--target", PACK, "--draft", PACK, "--conversations", "mtbench:1",
                   "--max-tokens", "4", "--threads", THREADS, "--out", str(out), timeout=600))
    data = read_json(out)
    spec, plain = "specdec serve --backend llamacpp --method spec", "specdec serve --backend llamacpp --draft none"
    assert list(data["summary"]) == [spec, plain, "llama-server", "llama-server --spec-default"]
    assert data["summary"]["llama-server"]["vs_llama_server"] == pytest.approx(1.0)
    assert data["summary"][plain]["vs_plain"] == pytest.approx(1.0)
    assert data["summary"][plain]["answers_equal_plain"] == [4, 4]  # greedy: each of the 4 turns against itself
    for figures in data["summary"].values():
        positive_numbers([figures["tokens_per_second"], figures["vs_llama_server"]])
        assert 0.0 <= figures["cached_share_later_turns"] <= 1.0
    positive_numbers([data["summary"][spec]["vs_plain"], data["summary"][spec]["tokens_per_pass"]])
    assert len(data["runs"]) == 4 and all(len(r["turns"]) == 4 for r in data["runs"])
    assert data["settings"]["target"] == PACK
    # the table is reprinted from the saved run, the same figures
    again = ran(run_script("multi_turn.py", "--report", str(out)))
    assert again.stdout.splitlines()[2].startswith(f"| `{spec}` | {data['summary'][spec]['tokens_per_second']:.1f} |")


@pytest.mark.slow
def test_prefill_beside_runs(tmp_path):
    """One round of both budgets (none, the default): a 4-token short request alone and beside a
    cold 128-token prompt, on a 2-slot server of the SmolLM2 GGUF."""
    need_pack()
    from specdec.backends.shared import PASS_BUDGET

    out = tmp_path / "prefill-beside.json"
    ran(run_script("prefill_beside.py", "--target", PACK, "--draft", PACK, "--parallel", "2", "--long-tokens", "128",
                   "--short-tokens", "4", "--delay", "0.2", "--rounds", "1", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert (data["parallel"], data["long_prompt_tokens"], data["short_tokens"]) == (2, 128, 4)
    assert [(r["round"], r["budget"]) for r in data["runs"]] == [(0, None), (0, PASS_BUDGET)]
    for run in data["runs"]:
        for short in (run["short_alone"], run["short_beside"]):
            assert short["tokens"] == 4  # end of text ignored
            positive_numbers([short["seconds"], short["first_token"]])
            assert short["first_token"] <= short["seconds"]
        assert 1 <= run["long"]["tokens"] <= 8
        positive_numbers([run["long"]["seconds"], run["long"]["first_token"]])
    assert set(data["summary"]) == {"None", str(PASS_BUDGET)}
    for figures in data["summary"].values():
        positive_numbers(figures.values(), count=3)
    assert data["machine"]["one_row_step"] == {"skipped": "not measured here"}


@pytest.mark.slow
def test_prefill_runs(tmp_path):
    need_pack()
    out = tmp_path / "prefill.json"
    ran(run_script("prefill.py", "--model", PACK, "--tokens", "32", "--repeats", "1", "--threads", THREADS,
                   "--out", str(out)))
    data = read_json(out)
    ways = ["torch kernels", "invariant kernels for every row", "specdec default (fast prefill)"]
    assert (data["model"], data["tokens"], data["repeats"]) == (PACK, 32, 1)
    assert list(data["median_seconds"]) == ways
    positive_numbers(data["median_seconds"].values())
    assert all(len(data["seconds"][way]) == 1 for way in ways)


@pytest.mark.slow
def test_prefill_layouts_runs(tmp_path):
    need_llamacpp()
    out = tmp_path / "prefill-layouts.json"
    proc = ran(run_script("prefill_layouts.py", "--model", PACK, "--rows", "1,4", "--repeats", "1",
                          "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert data["model"] == PACK and data["file"].endswith(".gguf")
    assert list(data["seconds"]) == ["1", "4"]
    for row in data["seconds"].values():
        assert set(row) == {"repacked", "file"}
        positive_numbers(row.values())
    assert "| n rows | 1 | 4 |" in proc.stdout
    bad = run_script("prefill_layouts.py", "--rows", "1,x")
    assert bad.returncode == 2 and "--rows: takes positive integers" in bad.stderr


@pytest.mark.slow
def test_request_path_runs(tmp_path):
    need_llamacpp()
    out = tmp_path / "request-path.json"
    ran(run_script("request_path.py", "--model", PACK, "--tokens", "4", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert (data["model"], data["tokens"], data["threads"]) == (PACK, 4, 1)
    assert isinstance(data["prompt_tokens"], int) and data["prompt_tokens"] > 0
    assert list(data["per_token_ms"]) == ["llama_decode", "batch_and_logits_copy", "sampling", "text", "rest_of_step"]
    assert all(isinstance(v, (int, float)) for v in data["per_token_ms"].values())
    assert data["per_token_ms"]["llama_decode"] > 0 and data["step_ms"] > 0
    for key in ("main_thread_step_ms", "second_thread_after_main_step_ms", "only_thread_step_ms"):
        positive_numbers(data[key], count=2)


@pytest.mark.slow
def test_one_client_slots_runs(tmp_path):
    out = tmp_path / "one-client.json"
    ran(run_script("one_client_slots.py", "--target", PACK, "--draft", PACK, "--prompts", "mtbench:1", "--repeats", "1",
                   "--max-tokens", "4", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    summary = data["summary"]
    assert summary["requests"] == 1 and summary["identical_text"] == 1  # both servers: the same greedy answer
    assert set(summary["median_tokens_per_second"]) == {"default", "parallel-1"}
    row = data["rows"][0]
    assert row["default"]["tokens"] == row["parallel-1"]["tokens"] == 4  # end of text ignored
    low, high = summary["ratio_default_to_parallel_1"]["bootstrap_95"]
    assert low == high == summary["ratio_default_to_parallel_1"]["median"]  # one pair: no spread
    assert data["machine"]["gguf_kernel_path"] in ("portable", "avx2", "avx512vnni", "avxvnni", "amx")


@pytest.mark.slow
def test_shared_pass_parts_runs(tmp_path):
    out = tmp_path / "parts.json"
    ran(run_script("shared_pass_parts.py", "--target", PACK, "--draft", PACK, "--prompts", "mtbench:2",
                   "--sequences", "1", "2", "--methods", "ar", "--max-new-tokens", "4", "--threads", THREADS,
                   "--out", str(out)))
    runs = read_json(out)["runs"]
    assert [(r["method"], r["sequences"], r["tokens"]) for r in runs] == [("ar", 1, 4), ("ar", 2, 8)]
    for run in runs:
        target = run["passes"]["target"]
        assert target["passes"] >= 4 and target["rows"] >= run["tokens"]  # a row per token at least, prefill too
        assert 0 < target["seconds"] < run["wall_seconds"] and run["outside_passes_seconds"] > 0
        assert "draft" not in run["passes"]  # ar: the draft model never runs


def test_sampler_cost_runs(tmp_path):
    out = tmp_path / "sampler-cost.json"
    ran(run_script("sampler_cost.py", "--rounds", "1", "--rows", "2", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert data["vocab"] == 151936
    assert len(data["cases"]) == 6
    assert {name.split(",")[0] for name in data["cases"]} == {"inversion", "Gumbel-max"}
    for case in data["cases"].values():
        positive_numbers(case["ms_per_row"], count=1)
        assert case["ms_per_row_median"] == case["ms_per_row"][0]


@pytest.mark.slow
def test_tree_vs_chain_runs(tmp_path):
    need_pack()
    out = tmp_path / "tree-vs-chain.json"
    ran(run_script("tree_vs_chain.py", "--target", PACK, "--draft", PACK, "--prompts", "1", "--tokens", "3",
                   "--every", "3", "--draws", "1", "--repeats", "1", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert (data["contexts"], data["draws"]) == (1, 1)  # one prompt, a context every 3 of its 3 tokens, one draw
    for key in ("tree_tokens_per_forward", "chain_tokens_per_forward"):
        assert isinstance(data[key], float) and 1.0 <= data[key] <= 1 + data["tree_nodes"]
    assert data["tree_nodes"] >= data["chain_nodes"] >= 1
    assert data["gain"] == pytest.approx(data["tree_tokens_per_forward"] - data["chain_tokens_per_forward"])
    assert list(data["verify_ms_by_rows"]) == [str(r) for r in range(1, int(data["tree_nodes"]) + 2)]
    positive_numbers(data["verify_ms_by_rows"].values())
    positive_numbers([data["draft_ms_per_level"], data["step_ms"]["tree"], data["step_ms"]["chain"]])
    assert data["command"].endswith("--target smollm2-135m --draft smollm2-135m --prompts 1")


@pytest.mark.slow
def test_trimmed_head_runs(tmp_path):
    """Heads ship for the 1.5B target only: random heads for SmolLM2 (--heads), scoring 8 ids."""
    need_pack()
    import torch

    from specdec.drafters.medusa import HeadsConfig, MedusaHeads

    heads = tmp_path / "heads"
    kept = torch.tensor([0, 7, 14, 21, 28, 35, 42, 49])
    MedusaHeads(HeadsConfig(num_heads=2, hidden_size=576, vocab_size=49152, kept_tokens=8, target=PACK), kept).save(heads)
    results = tmp_path / "results.json"  # a bench run's results: ar's tokens, 3 of 4 in the kept set
    results.write_text(json.dumps({"settings": {"temperature": 0.0}, "samples": [
        {"method": "ar", "token_ids": [0, 7, 13, 49]}, {"method": "spec", "token_ids": [13, 13]}]}))
    out = tmp_path / "trimmed-head.json"
    ran(run_script("trimmed_head.py", "--target", PACK, "--heads", str(heads), "--results", str(results),
                   "--repeats", "1", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert (data["target"], data["vocab"], data["kept"]) == (PACK, 49152, 8)
    assert data["target_tokens_in_kept_set"] == {str(results): {"temperature": 0.0, "tokens": 4, "in_kept_set": 0.75}}
    assert list(data["lm_head_ms_median"]) == ["1 row(s)", "4 row(s)"]
    for timing in data["lm_head_ms_median"].values():
        assert set(timing) == {"full", "trimmed"}
        positive_numbers(timing.values())


@pytest.mark.slow
def test_draft_vocab_runs(tmp_path):
    """SmolLM2 as target and draft on the kernel, heads of 1,024 and 4,096 ids, one HumanEval prompt's
    greedy tokens as the held-out text, a small ranking corpus; the draft named by its file, with
    ``--draft-quant`` (SmolLM2's Q4_1 layers have nothing to requantize: the same weights)."""
    need_pack()
    from specdec import models

    draft = str(models.gguf_path(PACK))
    results = tmp_path / "results.json"  # a bench run's results: the kernel's ar tokens on one prompt
    results.write_text(json.dumps({"prompts": [{"set": "humaneval", "id": "HumanEval/0", "chat": False}], "samples": [
        {"method": "ar:backend=gguf", "prompt": 0, "token_ids": [198, 260, 1345, 30, 28]},
        {"method": "spec:model:backend=gguf", "prompt": 0, "token_ids": [13, 13]}]}))
    out = tmp_path / "draft-vocab.json"
    ran(run_script("draft_vocab.py", "--target", PACK, "--draft", draft, "--results", str(results), "--sizes", "1024,4096",
                   "--rounds", "1", "--steps", "1", "--samples", "1", "--threads", THREADS, "--corpus-chars", "100000",
                   "--draft-quant", "q4_0", "--out", str(out)))
    data = read_json(out)
    assert (data["target"], data["draft"], data["vocab"]) == (PACK, draft, 49152)
    assert set(data["step_ms_median"]) == {"target", "draft, all", "draft, 1024", "draft, 4096", "draft, q4_0 all",
                                           "draft, q4_0 1024", "draft, q4_0 4096"}
    positive_numbers([*data["step_ms_median"].values(), *data["head_ms_median"].values()])
    assert set(data["draft_token_over_target_step"]) == {"all", "1024", "4096", "q4_0 all", "q4_0 1024", "q4_0 4096"}
    held = data["held_out"][str(results)]
    assert (held["prompts"], held["tokens"]) == (1, 5) and set(held["coverage"]) == {"1024", "4096"}
    assert set(held["greedy_agreement"]) == {"all", "1024", "4096", "q4_0 all", "q4_0 1024", "q4_0 4096"}
    assert held["greedy_agreement"]["q4_0 all"] == held["greedy_agreement"]["all"]  # the same weights here
    assert all(0 <= v <= 1 for v in [*held["coverage"].values(), *held["greedy_agreement"].values()])
    assert data["ranking"]["corpus"]["characters"] == 100000 and "--corpus-chars 100000" in data["command"]


@pytest.mark.slow
def test_draft_vocab_end_to_end_runs(tmp_path):
    """SmolLM2 as target and draft, its head trimmed to 4,096 ids, one and two clients, greedy."""
    need_pack()
    out = tmp_path / "e2e.json"
    proc = ran(run_script("draft_vocab_end_to_end.py", "--target", PACK, "--draft", PACK, "--draft-vocab", "4096",
                          "--prompts", "mtbench:2", "--clients", "1", "2", "--rounds", "2", "--max-new-tokens", "6",
                          "--temperature", "0", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert data["draft_vocab"] >= 4096 and [r["clients"] for r in data["rows"]] == [1, 1, 2]
    for row in data["rows"]:
        positive_numbers(row["trimmed_over_full"], 2)
        positive_numbers(list(row["tokens_per_second"].values()), 3)
        assert row["ar_forwards"] == 6 * len(row["prompts"]) and row["ar_drafted"] == 0
        assert row["identical"] is True  # greedy: both drafts leave plain decoding's text
    assert [(s["clients"], s["identical"]) for s in data["summary"]] == [(1, True), (2, True)]
    assert "trimmed/full" in proc.stdout


def test_kernel_paths_runs(tmp_path):
    """SmolLM2, the portable and AVX2 paths (what every x86 machine here has), one round: each
    path's times, relative to its one-row pass, and the logits checked equal; a path the CPU
    lacks is a one-line error naming it."""
    need_pack()
    out = tmp_path / "paths.json"
    proc = ran(run_script("kernel_paths.py", "--model", PACK, "--paths", "portable,avx2", "--rows", "1,9",
                          "--rounds", "1", "--context", "8", "--threads", THREADS, "--out", str(out)))
    data = read_json(out)
    assert data["paths"] == ["portable", "avx2"] and data["identical_logits"] is True
    for path in ("portable", "avx2"):
        positive_numbers(list(data["ms"][path].values()), 2)
        assert data["x_one_row"][path]["1"] == 1.0
    assert "| 9 |" in proc.stdout
    proc = run_script("kernel_paths.py", "--model", PACK, "--paths", "sse9", "--out", str(tmp_path / "no.json"))
    assert proc.returncode == 2 and "lacks the path(s) sse9" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_draft_token_parts_runs(tmp_path):
    """SmolLM2 as target and (by its file) as draft, a head of 4,096 ids, one round: every model's
    parts, bytes and floors are reported, and the parts add up to the step."""
    need_pack()
    from specdec import models

    out = tmp_path / "parts.json"
    proc = ran(run_script("draft_token_parts.py", "--target", PACK, "--draft", str(models.gguf_path(PACK)),
                          "--draft-vocab", "4096", "--rounds", "1", "--steps", "2", "--threads", THREADS,
                          "--out", str(out)))
    data = read_json(out)
    names = ["target", "draft", "draft, head 4096", "draft, Q4_0 layers", "draft, Q4_0 layers, head 4096"]
    assert list(data["ms"]) == names and "| draft, head 4096 |" in proc.stdout
    for name in names:
        parts = data["ms"][name]
        positive_numbers([parts["step"], parts["layers"], parts["head"]], 3)
        assert parts["rest"] == pytest.approx(parts["step"] - parts["layers"] - parts["head"], abs=0.002)
        assert ("chain greedy" in parts) == (name != "target")
        assert data["bytes"][name]["layers"] > 0 and data["floor_ms"][name]["head"] > 0
    assert data["bytes"]["draft, head 4096"]["head"] * 12 == data["bytes"]["draft"]["head"]  # 4,096 of 49,152 rows
    assert data["over_target_step"]["target"]["step"] == 1.0


# ------------------------------------------------------------------------------------------------
# specdec bench --help: the server methods and the llama-server peers


def test_bench_help_tells_how_to_run_the_servers():
    proc = subprocess.run([sys.executable, "-m", "specdec", "bench", "--help"], capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="100"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\s+", " ", re.sub(r"-\n\s*", "-", proc.stdout))  # as one line, words split at hyphens joined
    for needed in ("via=serve", "specdec serve", "llama-server-md", "llama-server-spec-default",
                   "llama-server (plain decoding)", "benchmarks/build_llama_server.sh", "$SPECDEC_LLAMA_SERVER",
                   "~/.cache/specdec/llama-server/bin/llama-server",
                   "--methods ar:via=serve,spec:via=serve,llama-server,llama-server-md,llama-server-spec-default"):
        assert needed in text, needed
    assert "  benchmarks/build_llama_server.sh   # once\n" in proc.stdout  # the example keeps its lines


# ------------------------------------------------------------------------------------------------
# The results header states what ran


def _gguf(path: Path, architecture: str, file_type: int) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # a string array before the file type
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("file_type, named", [(15, "qwen2 Q4_K - Medium"), (3, "qwen2 Q4_1"), (1, "qwen2 F16"),
                                               (7, "qwen2 Q8_0"), (14, "qwen2 Q4_K - Small"), (0, "qwen2 all F32")])
def test_gguf_weights_reads_the_file_type_from_the_header(tmp_path, file_type, named):
    from specdec.bench import report

    assert report.gguf_weights(_gguf(tmp_path / "m.gguf", "qwen2", file_type)) == named
    loaded = SimpleNamespace(weights=SimpleNamespace(description="qwen2 1.5B Q4_K - Medium"))
    assert report.gguf_weights(tmp_path / "m.gguf", loaded) == "qwen2 1.5B Q4_K - Medium"  # llama.cpp's own words first
    assert report.gguf_weights(tmp_path / "missing.gguf") is None
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    assert report.gguf_weights(tmp_path / "bad.gguf") is None


def test_gguf_weights_of_the_smollm2_pack():
    need_pack()
    from specdec.bench import report

    assert report.gguf_weights(packs.PACKS[PACK].parts[0].locate()) == "llama Q4_1"


def _run(methods: str, backends: tuple[str, ...]):
    from specdec.bench.methods import parse_methods
    from specdec.bench.runner import BenchRun, BenchSettings
    from specdec.bench.sample import Sample
    from specdec.prompts import Prompt

    specs = parse_methods(methods, backends)
    samples = [Sample(m.name, 0, 0, 0, 0, [1, 2, 3], 1.0, 3) for m in specs]
    return BenchRun(BenchSettings(max_new_tokens=3), specs, {}, {}, [Prompt("humaneval", "HumanEval/0", text="x")],
                    [2], samples, 1.0)


LLAMACPP_INFO = {"target_gguf": "t.gguf", "draft_gguf": "d.gguf", "target_weights": "qwen2 1.5B Q4_K - Medium",
                 "draft_weights": "qwen2 0.5B Q4_K - Medium", "threads": 2, "prefill_layout": None}


@pytest.mark.parametrize("methods, backends, llamacpp_info, dtype, header", [
    ("spec:ngram:block:k=2:policy=static", ("torch",), None, "bfloat16", None),
    ("spec:ngram:block:k=2:policy=static", ("llamacpp",), LLAMACPP_INFO, None,
     "qwen2 1.5B Q4_K - Medium GGUF (draft: qwen2 0.5B Q4_K - Medium) via llama.cpp"),
    ("llama-server,llama-server-spec-default", ("llamacpp",), LLAMACPP_INFO | {"draft_weights": None}, None,
     "qwen2 1.5B Q4_K - Medium GGUF via llama.cpp"),
    ("spec:ngram:block:k=2:policy=static", ("torch", "llamacpp"), LLAMACPP_INFO | {"draft_weights": None},
     "bfloat16", "bfloat16 on torch and qwen2 1.5B Q4_K - Medium GGUF via llama.cpp"),
])
def test_results_header_states_what_ran(methods, backends, llamacpp_info, dtype, header):
    from specdec.bench import report

    models = {"target": {"name": "qwen2.5-coder-1.5b"}, "draft": None}
    if llamacpp_info is not None:
        models["llamacpp"] = llamacpp_info
    data = report.results(_run(methods, backends), {"dtype": "bfloat16", "command": "specdec bench"}, models)
    # as `specdec generate --json` says it: "weights" where llama.cpp ran, "dtype" where torch did
    assert data["environment"].get("weights") == header
    assert data["environment"].get("dtype") == dtype
    header = header or "bfloat16"
    assert report.title(data).startswith(f"target qwen2.5-coder-1.5b, {header}, greedy, 3 new tokens")
    assert report.markdown(data).startswith(f"**target qwen2.5-coder-1.5b, {header}, greedy")
    assert ("bfloat16" in report.markdown(data)) == ("torch" in backends)


def test_a_header_from_a_torch_run_says_its_dtype():
    from specdec.bench import report

    data = {"settings": {"greedy": True, "temperature": 0.0, "max_new_tokens": 3, "repeats": 1},
            "models": {"target": {"name": "t"}, "draft": None}, "environment": {"dtype": "bfloat16"},
            "prompts": [{"set": "humaneval", "id": "HumanEval/0"}]}
    assert report.title(data) == "target t, bfloat16, greedy, 3 new tokens, 1 humaneval prompts, 1 repeat(s)"


@pytest.mark.slow
def test_a_llamacpp_bench_run_states_the_gguf_in_its_header(tmp_path):
    """One llama.cpp run end to end: results.json and results.md say what llama.cpp ran, no bfloat16."""
    need_llamacpp()
    import torch

    from specdec.cli.bench import main

    before = torch.get_num_threads()
    try:
        assert main(["--target", PACK, "--draft", "none", "--backend", "llamacpp", "--methods", "ar",
                     "--prompts", "humaneval:1", "--max-new-tokens", "4", "--warmup-tokens", "0",
                     "--threads", THREADS, "--no-progress", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(before)
    data = read_json(tmp_path / "greedy" / "results.json")
    described = data["models"]["llamacpp"]["target_weights"]
    assert described.startswith("llama ") and described.endswith(" Q4_1")  # llama.cpp's words: 'llama 256M Q4_1'
    assert data["environment"]["weights"] == f"{described} GGUF via llama.cpp"
    assert "dtype" not in data["environment"]
    first = (tmp_path / "greedy" / "results.md").read_text().splitlines()[0]
    assert first.startswith(f"**target {PACK}, {described} GGUF via llama.cpp, greedy, 4 new tokens")
    assert "bfloat16" not in first


def test_attention_shared_kv_runs(tmp_path):
    """--before: a copy of the kernel built from the current source (a file of its own, so that it
    loads as a second library), which must give the current build's attention bit for bit; two small
    contexts, a step and a 4-row pass, one repeat."""
    import shutil

    from specdec.backends import gguf

    try:
        now = Path(gguf.library()._name)
    except gguf.KernelUnavailable as err:
        pytest.skip(f"specdec's GGUF kernel cannot be built here: {err}")
    before = shutil.copy(now, tmp_path / "linear_gguf-before.so")
    proc = ran(run_script("attention_shared_kv.py", "--before", str(before), "--contexts", "8,64", "--rows", "4",
                          "--repeats", "1", "--threads", THREADS))
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["context"] for line in lines] == [8, 64]
    for line in lines:
        assert line["equal"] is True  # the same source: the same outputs
        for name in ("before_ms", "now_ms"):
            assert list(line[name]) == ["1", "4"]
            positive_numbers(line[name].values())


@pytest.mark.slow
def test_kv_cache_f16_runs(tmp_path):
    """SmolLM2's GGUF, fp32 against fp16 cache: one 16-position context, a step and a 4-row pass,
    one repeat; 4 greedy tokens on each of the three prompts and a 32-token long one."""
    need_pack()
    out = tmp_path / "kv-cache-f16.json"
    ran(run_script("kv_cache_f16.py", "--model", PACK, "--threads", THREADS, "--contexts", "16", "--rows", "4",
                   "--repeats", "1", "--new-tokens", "4", "--long-tokens", "32", "--out", str(out)))
    data = read_json(out)
    assert (data["model"], data["threads"]) == (PACK, 1)
    assert data["fp16_batch_invariant"] is True  # a 4-row pass equals one-token steps bit for bit
    assert data["cache_mib"]["fp16"] == pytest.approx(data["cache_mib"]["fp32"] / 2)
    assert [row["context"] for row in data["timings"]] == [16]
    for name in ("fp32_ms", "fp16_ms"):
        assert list(data["timings"][0][name]) == ["1", "4"]
        positive_numbers(data["timings"][0][name].values())
    assert [row["context"] for row in data["attention"]] == [16] and data["attention"][0]["layers"] == 30
    for name in ("fp32_ms_one_layer", "fp16_ms_one_layer"):
        assert list(data["attention"][0][name]) == ["1", "4"]
        positive_numbers(data["attention"][0][name].values())
    agreement = data["agreement"]
    assert len(agreement) == 4 and agreement[-1]["prompt_tokens"] == 32  # three prompts and the long one
    for item in agreement:
        assert item["rows"] == 4 and 0 <= item["argmax_equal_rows"] <= 4
        assert isinstance(item["greedy_equal"], bool) and (item["parted_at"] is None) == item["greedy_equal"]
        assert 0.0 <= item["mean_logit_diff"] <= item["max_logit_diff"]


@pytest.mark.slow
def test_attention_kernels_runs(tmp_path):
    """On SmolLM2's batch-invariant GGUF a bf16 KV cache leaves no row of a 64-row pass apart from
    one-token steps; an f16 cache's tiled kernel moves rows of that pass (the measured reason
    load_gguf gives such a model a bf16 cache)."""
    need_pack()
    if not llamacpp.available():
        pytest.skip("the llama.cpp binding is not installed")
    out = tmp_path / "attention-kernels.json"
    ran(run_script("attention_kernels.py", "--model", PACK, "--threads", THREADS, "--contexts", "0,8",
                   "--rows", "4,64", "--length", "40", "--repeats", "1", "--out", str(out)))
    data = read_json(out)
    assert data["rows_tried"] == 2 * 68
    assert sum(data["differing"]["bf16"].values()) == 0
    assert data["differing"]["f16"]["8+64"] > 0 and data["differing"]["f16"]["8+4"] == 0
    positive_numbers([data["bf16_over_f16"]["prefill"], data["bf16_over_f16"]["step"]])


def test_edits_set_runs(tmp_path):
    """The edit requests are rebuilt as committed (on the Python whose stdlib they were taken from),
    each a chat request with its prediction, the text it edits; the bug to fix is in the prediction;
    ``--unrelated`` gives each request the next one's text."""
    from specdec.prompts import load_jsonl

    out, unrelated = tmp_path / "edits.jsonl", tmp_path / "edits-unrelated.jsonl"
    ran(run_script("edits_set.py", "--out", str(out)))
    ran(run_script("edits_set.py", "--unrelated", "--out", str(unrelated)))
    requests = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(requests) == 10 and len({r["id"] for r in requests}) == 10
    for r in requests:
        assert r["prediction"] in r["messages"][0]["content"]
        assert 20 <= len(r["prediction"].splitlines()) <= 60 or "package" in r["source"]
    bug = next(r for r in requests if r["id"].endswith("/bug"))
    wrong = bug["messages"][0]["content"].split("`")[1]
    assert wrong in bug["prediction"]
    shifted = [json.loads(line) for line in unrelated.read_text().splitlines()]
    assert [s["prediction"] for s in shifted] == [r["prediction"] for r in requests[1:] + requests[:1]]
    assert [p.prediction for p in load_jsonl(out)] == [r["prediction"] for r in requests]
    if requests[0]["source"]["python"] == json.loads((BENCHMARKS / "edits.jsonl").read_text().splitlines()[0])[
            "source"]["python"]:
        assert out.read_text() == (BENCHMARKS / "edits.jsonl").read_text()
        assert unrelated.read_text() == (BENCHMARKS / "edits-unrelated.jsonl").read_text()


@pytest.mark.slow
def test_ray_ingress_cost_runs(tmp_path):
    """The cluster's ingress and router cost per request, on two requests of a few tokens."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    need_pack()
    out = tmp_path / "ray-ingress-cost.json"
    ran(run_script("ray_ingress_cost.py", "--requests", "2", "--max-tokens", "4", "--out", str(out)))
    data = read_json(out)
    assert {"ingress", "router_tree_calls_ms_per_request", "machine"} <= set(data)


@pytest.mark.slow
def test_ray_overhead_runs(tmp_path):
    """specdec serve alone against the Ray app, SmolLM2, one round of two prompts of a few tokens."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    need_pack()
    out = tmp_path / "ray-overhead.json"
    ran(run_script("ray_overhead.py", "--target", PACK, "--draft", PACK, "--threads", "1", "--clients", "2",
                   "--prompts", "mtbench:2", "--rounds", "1", "--max-tokens", "4", "--out", str(out)))
    data = read_json(out)
    assert {"startup_seconds", "summary", "turns"} <= set(data)


def test_edits_bound_runs(tmp_path):
    """A bench folder of one request with and without the prediction, and a curve, small enough to
    price by hand: each method's passes on the curve, the best a prediction could do, the ratios."""
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"paths": ["amx"], "x_one_row": {"amx": {"1": 1.0, "4": 2.0, "8": 3.0}}}))
    samples = tmp_path / "bench" / "greedy" / "samples"
    samples.mkdir(parents=True)
    common = {"prompt": 0, "new_tokens": 17, "first_step_tokens": 1, "token_ids": list(range(17))}
    # default: after the first pass, passes of 4, 4, 2 and 1 rows; prediction: of 8 and 4 rows
    default = dict(common, seconds=10.0, first_step_seconds=4.0, step_drafted=[0, 3, 3, 1, 0])
    prediction = dict(common, seconds=8.0, first_step_seconds=4.0, step_drafted=[2, 7, 3])
    for name, method, sample in (("d", "spec:ngram+model:via=serve", default),
                                 ("p", "spec:ngram+model:via=serve:prediction=yes", prediction)):
        (samples / f"r0-p0-{name}.json").write_text(json.dumps({"method": method, "sample": sample}))
    (samples / "r0-p0-l.json").write_text(json.dumps({"method": "llama-server", "sample": dict(common, step_drafted=[])}))
    out = tmp_path / "bound.json"
    proc = ran(run_script("edits_bound.py", "--bench", str(tmp_path / "bench"), "--curve", str(curve), "--out", str(out)))
    data = read_json(out)
    (row,) = data["requests"]
    units = 2.0 + 2.0 + (1.0 + (2.0 - 1.0) / 3) + 1.0  # 4, 4, 2 (between 1 and 4) and 1 rows
    assert row["default_units"] == round(units, 2) and row["prediction_units"] == 5.0  # 8 rows 3.0, 4 rows 2.0
    assert data["cheapest_rows"] == 8 and row["ideal_units"] == 16 * 3.0 / 8
    assert row["curve_ratio"] == round(10.0 / (4.0 + 6.0 * 5.0 / units), 3)
    assert row["bound_ratio"] == round(10.0 / (4.0 + 6.0 * 6.0 / units), 3)
    assert row["measured_ratio"] == 1.25 and row["identical"] is True and row["prefill_share"] == 0.4
    assert "| geometric mean |" in proc.stdout
    proc = run_script("edits_bound.py", "--bench", str(tmp_path), "--curve", str(curve))
    assert proc.returncode == 2 and "no request ran both" in proc.stderr and "Traceback" not in proc.stderr
