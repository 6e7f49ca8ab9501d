"""specdec bench --concurrency: the clients, the figures' arithmetic, identity, the table, a run on SmolLM2."""

from __future__ import annotations

import argparse
import json
import threading

import pytest
from helpers import THREADS, PACK, assert_one_line_error

from specdec import cli, packs
from specdec.bench import concurrency, servers
from specdec.bench.concurrency import (
    Answer, ConcurrencySettings, figures, first_difference, identity, percentile, run_clients, shares,
)
from specdec.bench.markdown import concurrency_markdown
from specdec.bench.methods import parse_method
from specdec.cli import bench as bench_cli


def answer(prompt, sent, seconds, first, tokens=10, ids=(), text=""):
    return Answer(prompt=prompt, client=0, sent=sent, seconds=seconds, first_token=first, tokens=tokens,
                  token_ids=list(ids), text=text)


# ----------------------------------------------------------------------------------------------
# The arithmetic, on made-up timings


def test_percentiles_interpolate_linearly_between_the_nearest_ranks():
    assert percentile([4, 1, 3, 2, 5], 50) == 3  # rank 2
    assert percentile([4, 1, 3, 2, 5], 95) == 4.8  # rank 3.8: 4 + 0.8 (5 - 4)
    assert percentile([10.0, 20.0], 95) == 19.5  # rank 0.95
    assert percentile([10.0, 20.0], 50) == 15.0
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_figures_of_a_run():
    answers = [answer(0, 0.0, 2.0, 0.5), answer(1, 0.0, 3.0, 1.0), answer(2, 2.0, 2.0, 0.25),
               answer(3, 3.0, 1.0, 0.5), answer(4, 1.0, 2.5, None, tokens=0)]  # an empty answer: no first token
    got = figures(answers)
    assert got["requests"] == 5 and got["tokens"] == 40
    assert got["wall_seconds"] == 4.0  # the first send at 0, the last end at 3 + 1
    assert got["tokens_per_second"] == 10.0
    # request seconds [1, 2, 2, 2.5, 3]: p50 at rank 2, p95 at rank 3.8
    assert got["request_seconds"] == {"p50": 2.0, "p95": 2.5 + 0.5 * 80 / 100}
    # first tokens [0.25, 0.5, 0.5, 1.0]: p50 at rank 1.5, p95 at rank 2.85
    assert got["first_token_seconds"] == {"p50": 0.5, "p95": 0.5 + 0.5 * 85 / 100}


def test_inter_token_latency_divides_each_chunks_wait_among_its_tokens():
    # chunks at 0.5 s (2 tokens: the first chunk, no wait before it), 0.75 s (1), 1.5 s (3), 1.75 s (1)
    assert concurrency.token_gaps([(0.5, 2), (0.75, 1), (1.5, 3), (1.75, 1)]) == [0.25, 0.25, 0.25, 0.25, 0.25]
    assert concurrency.token_gaps([(0.5, 1), (2.5, 4)]) == [0.5] * 4
    assert concurrency.token_gaps([(0.5, 3)]) == [] and concurrency.token_gaps([]) == []
    answers = [answer(0, 0.0, 2.0, 0.5), answer(1, 0.0, 3.0, 1.0)]
    answers[0].token_gaps = [0.1, 0.1, 0.1, 0.5]
    answers[1].token_gaps = [0.2, 0.3]
    got = figures(answers)  # pooled over every token: [0.1, 0.1, 0.1, 0.2, 0.3, 0.5], p50 at rank 2.5, p95 at 4.75
    assert got["inter_token_seconds"] == {"p50": pytest.approx(0.15), "p95": pytest.approx(0.3 + 0.2 * 0.75)}
    assert figures([answer(0, 0.0, 2.0, 0.5)])["inter_token_seconds"] == {"p50": None, "p95": None}
    # from a stream: specdec's chunks carry token ids, llama-server's chat chunks text only (a token each)
    done = servers.Completion(token_ids=[1, 2, 3, 4], arrivals=[(0.5, 1), (1.0, 2), (1.25, 1)], seconds=1.5)
    assert concurrency.answer_of(done, 0, 0).token_gaps == [0.25, 0.25, 0.25]
    text_only = servers.Completion(text="abc", text_arrivals=[0.25, 0.5, 1.0], usage={"completion_tokens": 3})
    assert concurrency.answer_of(text_only, 0, 0).token_gaps == [0.25, 0.5]


def test_the_wall_time_starts_at_the_first_send():
    got = figures([answer(0, 1.0, 2.0, 0.5), answer(1, 1.5, 0.5, 0.25)])
    assert got["wall_seconds"] == 2.0 and got["tokens_per_second"] == 10.0


def test_each_client_gets_every_nth_prompt():
    assert shares(5, 2) == [[0, 2, 4], [1, 3]]
    assert shares(4, 1) == [[0, 1, 2, 3]]
    assert shares(2, 4) == [[0], [1], [], []]


def test_the_levels_always_include_one_and_ascend():
    assert ConcurrencySettings(levels=(8, 4)).levels == (1, 4, 8)
    assert ConcurrencySettings(levels=(1, 2, 2)).levels == (1, 2)
    with pytest.raises(ValueError):
        ConcurrencySettings(levels=(0, 2))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: where the shorter ends
    assert first_difference("abc", "abd") == 2


def test_identity_compares_token_ids_where_both_have_them_else_text():
    alone = [answer(0, 0, 1, 0.1, ids=[5, 6, 7]), answer(1, 0, 1, 0.1, ids=[8, 9]),
             answer(2, 0, 1, 0.1, text="hello world")]
    together = [answer(1, 0, 1, 0.1, ids=[8, 4]), answer(0, 0, 1, 0.1, ids=[5, 6, 7], text="other text"),
                answer(2, 0, 1, 0.1, text="hello there")]
    assert identity(together, alone) == {
        "identical": 1, "total": 3,
        "differ": [{"prompt": 1, "position": 1, "unit": "token"}, {"prompt": 2, "position": 6, "unit": "character"}]}


# ----------------------------------------------------------------------------------------------
# The clients


def test_clients_start_together_after_every_warm_up_and_send_their_shares_in_turn():
    events, lock = [], threading.Lock()

    def warm_up(c):
        with lock:
            events.append(("warm", c))

    def send(c, p):
        with lock:
            events.append(("send", c, p))
        return answer(p, 0.0, 1.0, 0.5)

    got = run_clients(3, 7, send, warm_up)
    assert [a.prompt for a in got] == list(range(7))
    assert all(a.sent >= 0 for a in got)
    kinds = [e[0] for e in events]
    assert kinds == ["warm"] * 3 + ["send"] * 7  # no request before every client is warm
    for c in range(3):
        assert [e[2] for e in events if e[0] == "send" and e[1] == c] == shares(7, 3)[c]


def test_a_failing_client_stops_the_run_with_its_error():
    def send(c, p):
        if p == 1:
            raise RuntimeError("server answered 500")
        return answer(p, 0.0, 1.0, 0.5)

    with pytest.raises(RuntimeError, match="server answered 500"):
        run_clients(2, 6, send)

    def warm_up(c):
        if c == 1:
            raise RuntimeError("no warm-up")

    with pytest.raises(RuntimeError, match="no warm-up"):  # the other client is not left at the start
        run_clients(2, 2, lambda c, p: answer(p, 0.0, 1.0, 0.5), warm_up)


def test_a_chat_prompt_goes_to_the_chat_endpoint_and_raw_text_to_completions():
    from specdec.prompts import Prompt

    settings = ConcurrencySettings(levels=(2,), max_new_tokens=32, temperature=1.0)
    path, body = concurrency.request(Prompt("mtbench", "mtbench/1", messages=({"role": "user", "content": "Hi"},)),
                                     settings, 7)
    assert path == "/v1/chat/completions"
    assert body == {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 1.0, "seed": 7,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    path, body = concurrency.request(Prompt("humaneval", "HumanEval/0", text="def f():"), settings, 3, 4)
    assert path == "/v1/completions"
    assert body == {"prompt": "def f():", "max_tokens": 4, "temperature": 1.0, "seed": 3, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}


def test_an_answers_tokens_come_from_its_ids_else_its_usage_else_llama_servers_timings():
    done = servers.Completion(token_ids=[1, 2, 3], arrivals=[(0.5, 2), (0.75, 1)], seconds=1.0)
    got = concurrency.answer_of(done, 4, 1)
    assert (got.prompt, got.client, got.tokens, got.first_token, got.seconds) == (4, 1, 3, 0.5, 1.0)
    text_only = servers.Completion(text="ab", text_arrivals=[0.25, 0.5], usage={"completion_tokens": 2}, seconds=1.0)
    assert concurrency.answer_of(text_only, 0, 0).tokens == 2
    assert concurrency.answer_of(text_only, 0, 0).first_token == 0.25
    timed = servers.Completion(text="ab", text_arrivals=[0.25], timings={"predicted_n": 5}, seconds=1.0)
    assert concurrency.answer_of(timed, 0, 0).tokens == 5
    with pytest.raises(RuntimeError, match="neither its token ids"):
        concurrency.answer_of(servers.Completion(text="ab", seconds=1.0), 0, 0)


# ----------------------------------------------------------------------------------------------
# Results and the table


def cell(method, n, answers):
    return {"method": method, "concurrency": n, "argv": ["server"], "answers": [vars(a) for a in answers]}


def test_results_compare_with_llama_server_at_the_same_n_and_with_the_servers_own_answers_alone():
    from specdec.prompts import Prompt

    prompts = [Prompt("mtbench", f"mtbench/{i}", messages=({"role": "user", "content": str(i)},)) for i in range(2)]
    spec, peer = "spec:backend=gguf:via=serve", "llama-server"
    cells = [
        cell(spec, 1, [answer(0, 0.0, 1.0, 0.25, ids=[1, 2]), answer(1, 1.0, 1.0, 0.25, ids=[3, 4])]),  # 20 tok/2 s
        cell(peer, 1, [answer(0, 0.0, 2.0, 0.5, text="ab"), answer(1, 2.0, 2.0, 0.5, text="cd")]),  # 20 tok/4 s
        cell(spec, 2, [answer(0, 0.0, 1.0, 0.25, ids=[1, 2]), answer(1, 0.0, 1.0, 0.25, ids=[3, 5])]),  # 20 tok/1 s
        cell(peer, 2, [answer(0, 0.0, 4.0, 0.5, text="ab"), answer(1, 0.0, 4.0, 0.5, text="cd")]),  # 20 tok/4 s
    ]
    data = concurrency.results(cells, ConcurrencySettings(levels=(2,), max_new_tokens=10), prompts,
                               {"machine": None}, {"target": {"name": "t", "weights": "llama Q4_1"}, "draft": None},
                               {"spec:model:greedy:via=serve": "greedy verification needs temperature 0"})
    rows = {(r["method"], r["concurrency"]): r for r in data["runs"]}
    assert rows[spec, 1]["tokens_per_second"] == 10.0 and rows[spec, 1]["vs_llama-server"] == 2.0
    assert rows[spec, 2]["tokens_per_second"] == 20.0 and rows[spec, 2]["vs_llama-server"] == 4.0
    assert "vs_llama-server" not in rows[peer, 2]
    assert "identity" not in rows[spec, 1]
    assert rows[spec, 2]["identity"] == {"identical": 1, "total": 2,
                                         "differ": [{"prompt": 1, "position": 1, "unit": "token"}]}
    assert rows[peer, 2]["identity"] == {"identical": 2, "total": 2, "differ": []}
    assert rows[spec, 1]["inter_token_seconds"] == {"p50": None, "p95": None}  # one chunk each: no gaps
    assert rows[spec, 1]["answers"][0]["inter_token_seconds"] == {"p50": None, "p95": None}
    assert data["settings"]["concurrency"] == [1, 2]
    json.dumps(data)  # plain data

    table = concurrency_markdown(data)
    lines = table.splitlines()
    assert lines[0] == "**target t, llama Q4_1, greedy, 10 new tokens, 2 mtbench prompts, concurrency 1, 2**"
    assert f"| 2 | `{spec}` | 20.0 | 4.00× | 1.00 | 1.00 | 0.25 | 0.25 | – | – | 1/2 |" in lines
    assert f"| 1 | `{peer}` | 5.00 | – | 2.00 | 2.00 | 0.50 | 0.50 | – | – | – |" in lines
    assert f"| 2 | `{peer}` | 5.00 | – | 4.00 | 4.00 | 0.50 | 0.50 | – | – | 2/2 |" in lines
    assert f"`{spec}` at N=2: 1 of 2 answers differ from its answers at N=1: mtbench/1 from token 1." in table
    assert "`spec:model:greedy:via=serve` not run: greedy verification needs temperature 0." in table


def test_without_llama_server_the_table_has_no_column_for_it():
    from specdec.prompts import Prompt

    spec = "spec:backend=gguf:via=serve"
    cells = [cell(spec, n, [answer(0, 0.0, 2.0, 0.5, ids=[1])]) for n in (1, 2)]
    data = concurrency.results(cells, ConcurrencySettings(levels=(2,), max_new_tokens=10),
                               [Prompt("humaneval", "HumanEval/0", text="def f():")], {},
                               {"target": {"name": "t"}, "draft": {"name": "d"}})
    lines = concurrency_markdown(data).splitlines()
    assert lines[0] == "**target t / draft d, greedy, 10 new tokens, 1 humaneval prompts, concurrency 1, 2**"
    assert lines[2] == ("| N | server | tok/s | request p50 (s) | request p95 (s) | first token p50 (s) "
                        "| first token p95 (s) | inter-token p50 (ms) | inter-token p95 (ms) | identical to N=1 |")
    assert f"| 2 | `{spec}` | 5.00 | 2.00 | 2.00 | 0.50 | 0.50 | – | – | 1/1 |" in lines
    assert "llama-server" not in lines[-1].split("tok/s:")[1].split("Request")[0]


# ----------------------------------------------------------------------------------------------
# The servers' flags, the command line's checks


def test_servers_start_with_n_slots_and_llama_server_with_n_times_the_context(monkeypatch, tmp_path):
    monkeypatch.setattr(servers, "llama_server_binary", lambda: tmp_path / "llama-server")
    run = servers.Servers(tmp_path / "t.gguf", None, ["--target", "t", "--draft", "d"], n_threads=THREADS, n_ctx=4096)
    key = f"specdec:gguf:{parse_method('spec', 'gguf').config}"
    assert "--parallel" not in run._argv(key)  # not set: specdec serve's default slots
    one = run._argv("llama-server")
    assert one[one.index("-np") + 1] == "1" and one[one.index("-c") + 1] == "4096"
    run.parallel = 1
    argv = run._argv(key)
    assert argv[argv.index("--parallel") + 1] == "1"  # one client's run: one slot, said
    run.parallel = 4
    argv = run._argv(key)
    assert argv[argv.index("--parallel") + 1] == "4"
    argv = run._argv("llama-server")
    assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "16384"  # 4096 per slot


def test_the_table_says_how_many_prediction_tokens_each_run_kept_and_rejected():
    from specdec.prompts import Prompt

    spec, sent = "spec:backend=gguf:via=serve", "spec:backend=gguf:via=serve:prediction=yes"
    predicted = [answer(0, 0.0, 1.0, 0.5, ids=[1]), answer(1, 0.0, 1.0, 0.5, ids=[2])]
    predicted[0].prediction_accepted, predicted[0].prediction_rejected = 7, 1
    predicted[1].prediction_accepted, predicted[1].prediction_rejected = 3, 0
    cells = [cell(spec, 1, [answer(0, 0.0, 1.0, 0.5, ids=[1]), answer(1, 1.0, 1.0, 0.5, ids=[2])]),
             cell(sent, 1, predicted)]
    data = concurrency.results(cells, ConcurrencySettings(levels=(1,), max_new_tokens=10),
                               [Prompt("edits", f"e/{i}", text="x") for i in range(2)], {},
                               {"target": {"name": "t"}, "draft": {"name": "d"}})
    table = concurrency_markdown(data)
    assert (f"`{sent}` at N=1: of the prediction tokens it drafted, 10 kept and 1 rejected (the usage of its 2 "
            "answers with a prediction).") in table
    assert f"`{spec}` at N=1: of the prediction" not in table  # it sent none


def test_a_method_via_ray_runs_specdec_serve_on_ray_its_replicas_sharing_threads_and_slots(tmp_path):
    from specdec.bench.methods import method_of_record

    method = parse_method("spec:via=ray:replicas=2", "gguf")
    assert method.is_server and method.replicas == 2
    assert parse_method(method.name, "gguf") == method == method_of_record(method.record())
    assert parse_method("spec:via=ray", "gguf").replicas == 1 and parse_method("spec:via=ray", "gguf").name.endswith(":via=ray")
    run = servers.Servers(tmp_path / "t.gguf", None, ["--target", "t", "--draft", "d"], n_threads=2, n_ctx=4096)
    run.parallel = 4
    key = servers.server_key(method)
    assert key != servers.server_key(parse_method("spec:via=serve", "gguf"))  # a server of its own
    argv = run._argv(key)
    assert argv[argv.index("--ray") + 1:argv.index("--ray") + 3] == ["--replicas", "2"]
    assert argv[argv.index("--threads") + 1] == "1" and argv[argv.index("--parallel") + 1] == "2"  # per replica
    assert argv[argv.index("--method") + 1] == str(method.config)
    assert servers.key_method(key) == servers.key_method(key + "/load") == str(method.config)
    load = run._argv(key + "/load")  # benchmarks/multi_turn.py's cluster that routes by load alone
    assert load[load.index("--ray"):load.index("--ray") + 5] == ["--ray", "--replicas", "2", "--router", "load"]
    alone = run._argv(servers.server_key(parse_method("spec:via=serve", "gguf")))
    assert "--ray" not in alone and alone[alone.index("--threads") + 1] == "2"
    for bad, says in (("spec:via=serve:replicas=2", "via=ray"), ("spec:via=ray:replicas=0", "positive"),
                      ("llama-server:via=ray", "via=")):
        with pytest.raises(ValueError, match=says):
            parse_method(bad, "gguf")


def test_concurrency_times_servers_only(capsys, tmp_path):
    code = cli.main(["bench", "--target", PACK, "--draft", "none", "--concurrency", "2", "--methods", "ar",
                     "--backend", "gguf", "--out", str(tmp_path / "out")])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, contains="--concurrency times servers")


def test_concurrency_refuses_specdec_serve_on_a_backend_that_serves_one_request_at_a_time(capsys, tmp_path):
    code = cli.main(["bench", "--target", PACK, "--draft", "none", "--concurrency", "1", "2", "--methods",
                     "ar:via=serve", "--out", str(tmp_path / "out")])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, contains="serves one request at a time")


def test_a_run_without_concurrency_records_its_arguments_as_before(tmp_path):
    """A run recorded before --concurrency existed has no such argument, and still resumes."""
    parser = argparse.ArgumentParser()
    bench_cli._add_arguments(parser)
    args = parser.parse_args(["--target", PACK, "--methods", "ar", "--out", str(tmp_path)])
    methods, prompts, settings = bench_cli._plan(args)
    bench_cli._prepare_output(args, tmp_path, methods, prompts, settings)
    recorded = json.loads((tmp_path / "arguments.json").read_text())["arguments"]
    assert "concurrency" not in recorded and recorded["methods"] == ["ar"]


def test_a_run_without_draft_quant_records_its_arguments_as_before_and_one_with_it_names_it(tmp_path):
    """A run recorded before --draft-quant existed has no such argument, and still resumes."""
    parser = argparse.ArgumentParser()
    bench_cli._add_arguments(parser)
    for extra, out in (([], tmp_path / "a"), (["--draft-quant", "q4_0"], tmp_path / "b")):
        args = parser.parse_args(["--target", PACK, "--methods", "ar", "--out", str(out), *extra])
        methods, prompts, settings = bench_cli._plan(args)
        bench_cli._prepare_output(args, out, methods, prompts, settings)
        recorded = json.loads((out / "arguments.json").read_text())["arguments"]
        assert recorded.get("draft_quant", "absent") == ("q4_0" if extra else "absent")


def test_draft_quant_is_refused_for_a_draft_that_is_the_target(capsys, tmp_path):
    code = cli.main(["bench", "--target", PACK, "--draft", PACK, "--draft-quant", "q4_0", "--methods",
                     "spec:model:backend=gguf", "--out", str(tmp_path / "out")])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, contains="--draft-quant requantizes a draft model's own weights")


def test_finished_runs_are_saved_and_read_back_for_the_same_prompts_only(tmp_path):
    from specdec.prompts import Prompt

    prompts = [Prompt("mtbench", "mtbench/1", messages=({"role": "user", "content": "a"},))]
    made = cell("spec:ngram+model:block:k=4:policy=auto:backend=gguf:via=serve", 4, [answer(0, 0.0, 1.0, 0.5)])
    bench_cli._save_cell(tmp_path, made, prompts)
    assert bench_cli._saved_cells(tmp_path, prompts) == {(made["method"], 4): made}
    other = [Prompt("mtbench", "mtbench/2", messages=({"role": "user", "content": "b"},))]
    assert bench_cli._saved_cells(tmp_path, other) == {}
    (tmp_path / "n2-broken.json").write_text("{")
    assert list(bench_cli._saved_cells(tmp_path, prompts)) == [(made["method"], 4)]


# ----------------------------------------------------------------------------------------------
# A run on SmolLM2: specdec serve (and llama-server where its binary is built)


def llama_server_built() -> bool:
    try:
        servers.llama_server_binary()
    except servers.ServerMissing:
        return False
    return True


@pytest.mark.slow
def test_a_concurrency_run_on_smollm2(tmp_path, capsys):
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    methods = ["spec:via=serve"] + (["llama-server"] if llama_server_built() else [])  # not built: specdec alone
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", PACK, "--draft", PACK, "--backend", "gguf", "--threads", "1",
                     "--prompts", "mtbench:2", "--max-new-tokens", "8", "--warmup-tokens", "4", "--concurrency", "1",
                     "2", "--methods", ",".join(methods), "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads((out / "greedy" / "results.json").read_text())
    spec = parse_method("spec:via=serve", "gguf").name
    names = [spec] + methods[1:]
    assert [(r["method"], r["concurrency"]) for r in data["runs"]] == [(m, n) for n in (1, 2) for m in names]
    assert set(data["environment"]["machine"]) == {"cpu", "features", "memory_read", "one_row_step",
                                                   "gguf_kernel_path"}
    assert data["settings"]["concurrency"] == [1, 2] and len(data["prompts"]) == 2
    for run in data["runs"]:
        n = run["concurrency"]
        flag = "--parallel" if run["method"] == spec else "-np"
        assert run["argv"][run["argv"].index(flag) + 1] == str(n)
        assert run["requests"] == 2 and run["tokens"] == 16  # EOS ignored: every answer 8 tokens
        assert run["tokens_per_second"] == run["tokens"] / run["wall_seconds"]
        assert 0 < run["first_token_seconds"]["p50"] <= run["request_seconds"]["p50"]
        gaps = run["inter_token_seconds"]  # none where every answer came in one chunk (a draft kept whole)
        assert gaps["p50"] is None or 0 < gaps["p50"] <= gaps["p95"] < run["request_seconds"]["p95"]
        assert sorted(a["prompt"] for a in run["answers"]) == [0, 1]
    together = next(r for r in data["runs"] if r["method"] == spec and r["concurrency"] == 2)
    assert together["identity"] == {"identical": 2, "total": 2, "differ": []}  # each answer is its answer alone
    assert all(len(a["token_ids"]) == 8 for a in together["answers"])
    table = (out / "greedy" / "results.md").read_text()
    assert f"| 2 | `{spec}` |" in table and "| identical to N=1 |" in table and "2/2 |" in table
    assert table.strip() in printed
    assert table.strip() in (out / "README.md").read_text()
