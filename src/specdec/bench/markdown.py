"""A benchmark run's results (:func:`specdec.bench.report.results`) as Markdown: a line saying what
ran, a line saying on what machine, one table row per method, the per-set speed-ups, the
per-request figures of the methods that sent predicted outputs, and a line per divergent output."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from specdec.bench import schema_check
from specdec.bench.machine import BACKENDS
from specdec.divergence import cause
from specdec.measurements import CPU_FEATURES


def title(data: dict[str, Any]) -> str:
    s, m = data["settings"], data["models"]
    mode = "greedy" if s["greedy"] else f"temperature {s['temperature']:g}"
    draft = f" / draft {m['draft']['name']}" if m.get("draft") else ""
    sets = Counter(p["set"] for p in data["prompts"])
    prompts = ", ".join(f"{n} {name}" for name, n in sets.items())
    env = data["environment"]
    weights = env.get("weights") or env.get("dtype")  # "weights" where a method ran on llama.cpp
    return (f"target {m['target']['name']}{draft}, {weights}, {mode}, "
            f"{s['max_new_tokens']} new tokens, {prompts} prompts, {s['repeats']} repeat(s)")


def machine_line(record: dict[str, Any] | None) -> str | None:
    """The machine a run was measured on (:func:`specdec.bench.machine.machine_record`) in one line:
    its CPU and vector features, its memory read speed and each GGUF backend's one-token step."""
    if not record:
        return None
    features = record.get("features")
    if features is None:
        vectors = "vector features unknown"
    else:
        has = [label for flag, label in CPU_FEATURES.items() if features.get(flag)]
        lacks = [label for flag, label in CPU_FEATURES.items() if not features.get(flag)]
        vectors = ", ".join(has) or "none of " + ", ".join(CPU_FEATURES.values())
        vectors += f" (not {', '.join(lacks)})" if has and lacks else ""
    read = record.get("memory_read") or {}
    memory = (f"memory read {read['gb_per_s']:.1f} GB/s ({_threads(read['threads'])})" if "gb_per_s" in read
              else f"memory read speed not measured ({read.get('skipped', 'not recorded')})")
    path = f"; specdec's GGUF kernel on its {record['gguf_kernel_path']} path" if record.get("gguf_kernel_path") else ""
    return (f"Machine: {record.get('cpu', 'unknown CPU')}; {vectors}; {memory}; "
            f"{_steps(record.get('one_row_step') or {})}{path}.")


def _steps(steps: dict[str, Any]) -> str:
    """Each GGUF backend's one-token step, or why it was not timed."""
    if "ms" not in steps:
        return f"one-token step not timed ({steps.get('skipped', 'not recorded')})"
    timed = [f"{BACKENDS.get(name, name)} {ms:.1f} ms" for name, ms in steps["ms"].items()]
    untimed = [f"{BACKENDS.get(name, name)} not timed ({why})" for name, why in (steps.get("skipped") or {}).items()]
    return (f"one-token step on {steps['model']} after {steps['context']} tokens ({_threads(steps['threads'])}): "
            + ", ".join(timed + untimed))


def _threads(n: int) -> str:
    return f"{n} thread{'s' * (n != 1)}"


COLUMNS = [
    ("method", None),
    ("tok/s", "tokens_per_second"),
    ("ms/token", "ms_per_token"),
    ("speed-up vs ar", "speedup_vs_ar"),
    ("geomean", "speedup_vs_ar_geomean"),
    ("vs llamacpp-ar", "speedup_vs_llamacpp_ar"),
    ("geomean (worst)", "speedup_vs_llamacpp_ar_geomean"),
    ("decoding speed-up", "decode_speedup_vs_ar"),
    ("decoding vs llamacpp-ar", "decode_speedup_vs_llamacpp_ar"),
    ("first step (s)", "first_step_seconds"),
    ("tokens/forward", "mean_accepted_per_forward"),
    ("acceptance", "acceptance_rate"),
    ("α", "alpha"),
    ("k", "mean_drafted_per_step"),
    ("c", "cost_ratio_c"),
    ("predicted", "predicted_speedup"),
    ("draft / verify / other", None),
    ("identical to ar", "identical_prompts"),
    ("vs peer", "vs_peer"),
]


def markdown(data: dict[str, Any]) -> str:
    """The summary table, one row per method, under a line saying what was run."""
    llamacpp_ar = any(m.get("speedup_vs_llamacpp_ar") is not None for m in data["methods"].values())
    columns = [(c, key) for c, key in COLUMNS if llamacpp_ar or "vs_llamacpp_ar" not in (key or "")]
    machine = machine_line(data["environment"].get("machine"))
    lines = [
        f"**{title(data)}**",
        "",
        *([machine, ""] if machine else []),
        "| " + " | ".join(c for c, _ in columns) + " |",
        "|" + "|".join("---" if c == "method" else "---:" for c, _ in columns) + "|",
    ]
    for name, m in data["methods"].items():
        cells = []
        for column, key in columns:
            if column == "method":
                cells.append(f"`{name}`" + ("" if m["exact"] else " (LOSSY)"))
            elif column == "draft / verify / other":
                cells.append(_split(m))
            elif key == "vs_peer":
                cells.append(f"{_fmt(m.get(key), 'x')} {m['peer']}" if m.get("peer") else "–")
            elif key == "speedup_vs_llamacpp_ar_geomean":
                worst = m.get("speedup_vs_llamacpp_ar_min")
                cells.append(_fmt(m.get(key), "x") + (f" ({_fmt(worst, 'x')})" if worst is not None else ""))
            elif key in ("speedup_vs_ar", "speedup_vs_ar_geomean", "predicted_speedup", "decode_speedup_vs_ar",
                         "speedup_vs_llamacpp_ar", "decode_speedup_vs_llamacpp_ar"):
                cells.append(_fmt(m.get(key), "x"))
            elif key in ("acceptance_rate", "alpha"):
                cells.append(_fmt(m.get(key), "%"))
            else:
                cells.append(_fmt(m.get(key)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += _set_lines(data) if llamacpp_ar else []
    lines += _prediction_lines(data)
    lines += _divergence_lines(data)
    shaped = schema_check.markdown({name: m for name, m in data["methods"].items() if m.get("schema_runs")})
    lines += [f"\n{shaped}"] if shaped else []
    for name, why in data.get("skipped", {}).items():
        lines.append(f"\n`{name}` not run: {why}.")
    for name, error in data.get("failed", {}).items():
        lines.append(f"\n`{name}` FAILED and is left out: {error}")
    if resumed := data.get("resumed_samples"):  # where the invocation that made them stopped: SavedRuns.earlier
        reported = data.get("resumed_from") == "reported"
        who = ("made, and reported, by an earlier invocation of the same command" if reported
               else "made by an earlier, interrupted invocation of the same command")
        if resumed >= len(data["samples"]):
            lines.append(f"\nAll {resumed} timed runs were {who}; this one only wrote the report"
                         f"{' again' if reported else ''}.")
        else:
            lines.append(f"\n{resumed} of the {len(data['samples'])} timed runs were {who} "
                         "(`wall_seconds` counts the last one only).")
    lines.append(
        "\nSpeed-up: ratio of tokens per second to `ar` over all prompts (geomean: per prompt); "
        "decoding speed-up: the same after each run's first step, which prefills the prompt "
        "(first step: its mean time). "
        "Speed-ups and identity are against `ar` on the method's own backend (`ar:backend=llamacpp` for "
        "llama.cpp methods and peers). "
        + ("vs llamacpp-ar: ratio of tokens per second to the llama.cpp binding's own generation on the same "
           "GGUF (then: geomean over prompts, the worst prompt in brackets; decoding: after the first step). "
           if llamacpp_ar else "")
        + "tokens/forward: new tokens per target forward. α: per-token acceptance; k: drafts per step; "
        "c: one draft token's time / one `ar` step; predicted: (1-α^(k+1)) / ((1-α)(kc+1)). "
        "vs peer: speed-up over the fastest peer of the same kind (draft model: `hf-assisted`; "
        "n-gram: `hf-prompt-lookup`; none on llama.cpp). Peers' draft/verify are "
        "their models' forward times."
    )
    return "\n".join(lines)


def _set_lines(data: dict[str, Any]) -> list[str]:
    """Per prompt set, each method's geomean speed-up against llamacpp-ar."""
    rows = {name: m["speedup_vs_llamacpp_ar_by_set"] for name, m in data["methods"].items()
            if m.get("speedup_vs_llamacpp_ar_by_set")}
    sets = list(dict.fromkeys(name for by_set in rows.values() for name in by_set))
    if not rows or len(sets) < 2:
        return []
    lines = ["", "Speed-up against `llamacpp-ar` per prompt set (geomean over its prompts):", "",
             "| method | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
    for name, by_set in rows.items():
        lines.append(f"| `{name}` | " + " | ".join(_fmt(by_set.get(x), "x") for x in sets) + " |")
    return lines


def _prediction_lines(data: dict[str, Any]) -> list[str]:
    """Per method that sent the prompts' predicted outputs, a row per request: every method's
    tokens per second, the prediction tokens accepted and rejected, the time to the first token
    (and its share of the request) and identity to ar; then the geometric means of its speed
    against each other method's (:func:`specdec.bench.figures.prediction_figures`)."""
    lines = []
    for name, p in (data.get("predictions") or {}).items():
        others = list(p["geomean_vs"])
        lines += ["", f"Per request, `{name}` (each request carries the prompt's predicted output; the other "
                      "methods get the same requests without it): tokens per second",
                  "", "| request | prompt tokens | new tokens | " + " | ".join(f"`{m}`" for m in [name, *others])
                  + " | accepted / rejected | first token (share) | identical to ar |",
                  "|---|" + "---:|" * (len(others) + 4) + "---|---|"]
        for r in p["requests"]:
            speeds = [_fmt(r["tokens_per_second"].get(m)) for m in [name, *others]]
            counts = f"{_count(r['accepted'])} / {_count(r['rejected'])}" if r["accepted"] is not None else "–"
            first = (f"{_fmt(r['first_token_seconds'])} s ({_fmt(r['prefill_share'], '%')})"
                     if r["first_token_seconds"] is not None else "–")
            same = "–" if r["identical_to_ar"] is None else "yes" if r["identical_to_ar"] else "NO"
            lines.append(f"| {r['prompt_id']} | {r['prompt_tokens']} | {_count(r['new_tokens'])} | "
                         + " | ".join(speeds) + f" | {counts} | {first} | {same} |")
        lines.append("| geomean of the ratio | | | | " + " | ".join(_fmt(p["geomean_vs"][m], "x") for m in others)
                     + " | | | |")
    if lines:
        lines += ["", "accepted / rejected: the prediction's tokens the server drafted and the answer kept / "
                      "did not keep (usage's `completion_tokens_details`); prediction tokens never drafted are "
                      "in neither. first token: the time from sending the request to its first token (the "
                      "prompt's prefill and the first step), its share of the whole request in brackets."]
    return lines


def _count(value: float) -> str:
    """A count, or a mean of counts over repeats: whole where it is whole."""
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def _divergence_lines(data: dict[str, Any]) -> list[str]:
    """One line per greedy run whose output left its backend's ar, and per coupled run whose text
    left the first coupled method's (same seed): where, the tokens, the margins."""
    lines = []
    for name, m in data["methods"].items():
        for d in m.get("divergences") or []:
            base = d.get("base") or m["ar"]
            what = ("the top-2 margin of the Gumbel-max scores (logits / T + noise)" if base != m["ar"]
                    else "the target's top-2 logit margin")
            margins = ", ".join(f"{d[key]:.3g} in {where}" for key, where in
                                (("ar_margin", f"`{base}`'s pass"), ("margin", "its own pass"))
                                if d.get(key) is not None)
            lines.append(
                f"\n`{name}` leaves `{base}` on {d['prompt_id']} (repeat {d['repeat']}) at new token "
                f"{d['position']}: {_token(d, 'token')} instead of {_token(d, 'ar_token')}"
                + (f"; {what} there: {margins}" if margins else "") + f"; {cause(d, peer=m.get('kind') == 'peer')}."
            )
    return lines


def _token(d: dict[str, Any], key: str) -> str:
    """A divergence's token: its id and, when known, its text."""
    if d.get(key) is None:
        return "the end of the output"
    text = d.get(f"{key}_text")
    return f"{d[key]} ({text!r})" if text is not None else str(d[key])


def _split(m: dict[str, Any]) -> str:
    if not m["seconds"]:
        return "–"
    d, v = m["draft_seconds"] / m["seconds"], m["verify_seconds"] / m["seconds"]
    return f"{d:.0%} / {v:.0%} / {max(0.0, 1 - d - v):.0%}"


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if unit == "%":
        return f"{value:.0%}"
    if unit == "x":
        return f"{value:.2f}×"
    if isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def summary_markdown(runs: Sequence[dict[str, Any]], command: str) -> str:
    """One page for a whole invocation: the command and every run's table."""
    parts = ["# Benchmark results", "", "Produced by:", "", "```", command, "```"]
    for data in runs:
        parts += ["", markdown(data)]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------
# Several clients at once (specdec bench --concurrency, :mod:`specdec.bench.concurrency`)


def concurrency_title(data: dict[str, Any]) -> str:
    s, m = data["settings"], data["models"]
    mode = "greedy" if s["greedy"] else f"temperature {s['temperature']:g}"
    draft = f" / draft {m['draft']['name']}" if m.get("draft") else ""
    weights = f", {m['target']['weights']}" if m["target"].get("weights") else ""
    sets = Counter(p["set"] for p in data["prompts"])
    prompts = ", ".join(f"{n} {name}" for name, n in sets.items())
    return (f"target {m['target']['name']}{draft}{weights}, {mode}, {s['max_new_tokens']} new tokens, {prompts} "
            f"prompts, concurrency {', '.join(map(str, s['concurrency']))}")


def _inter_token(run: dict[str, Any]) -> tuple[float | None, float | None]:
    """A concurrency run's inter-token latency percentiles, seconds (None where not recorded)."""
    spread = run.get("inter_token_seconds") or {}
    return spread.get("p50"), spread.get("p95")


def concurrency_markdown(data: dict[str, Any]) -> str:
    """One row per concurrency N and server: aggregate tokens per second, its ratio to llama-server
    at the same N, the request time's and the first token's percentiles, the answers identical to
    the server's own at N = 1; then a line per server and N whose answers differ, and one per
    server and N that sent predictions (the prediction tokens its answers' usage counts)."""
    machine = machine_line(data["environment"].get("machine"))
    peer = any("vs_llama-server" in run for run in data["runs"])  # the column where llama-server ran
    lines = [f"**{concurrency_title(data)}**", "", *([machine, ""] if machine else []),
             "| N | server | tok/s |" + (" vs llama-server |" if peer else "") + " request p50 (s) | request p95 (s) "
             "| first token p50 (s) | first token p95 (s) | inter-token p50 (ms) | inter-token p95 (ms) "
             "| identical to N=1 |",
             "|---:|---|---:|" + ("---:|" if peer else "") + "---:|---:|---:|---:|---:|---:|---:|"]
    for run in data["runs"]:
        same = run.get("identity")
        lines.append(" | ".join([
            f"| {run['concurrency']}", f"`{run['method']}`", _fmt(run["tokens_per_second"]),
            *([_fmt(run.get("vs_llama-server"), "x")] if peer else []), _fmt(run["request_seconds"]["p50"]),
            _fmt(run["request_seconds"]["p95"]), _fmt(run["first_token_seconds"]["p50"]),
            _fmt(run["first_token_seconds"]["p95"]),
            *[_fmt(None if gap is None else gap * 1000) for gap in _inter_token(run)],
            f"{same['identical']}/{same['total']}" if same else "–"]) + " |")
    ids = [p["id"] for p in data["prompts"]]
    for run in data["runs"]:
        differ = (run.get("identity") or {}).get("differ") or []
        if differ:
            where = ", ".join(f"{ids[d['prompt']]} from {d['unit']} {d['position']}" for d in differ)
            lines.append(f"\n`{run['method']}` at N={run['concurrency']}: {len(differ)} of {run['identity']['total']} "
                         f"answers differ from its answers at N=1: {where}.")
    for run in data["runs"]:
        counted = [a for a in run.get("answers", []) if a.get("prediction_accepted") is not None]
        if counted:
            lines.append(f"\n`{run['method']}` at N={run['concurrency']}: of the prediction tokens it drafted, "
                         f"{sum(a['prediction_accepted'] for a in counted)} kept and "
                         f"{sum(a['prediction_rejected'] for a in counted)} rejected (the usage of its "
                         f"{len(counted)} answers with a prediction).")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"\n`{name}` not run: {why}.")
    lines.append(
        "\nEach server ran alone, started with N slots (`specdec serve --parallel N`, `llama-server -np N` with N "
        "times the context), N clients sending their share of the prompts one after another, all starting "
        "together. tok/s: every completion token over the wall time from the first request to the last "
        "answer" + ("; vs llama-server: its ratio to `llama-server`'s at the same N" if peer else "")
        + ". Request: from sending to the stream's end; first token: from sending to the first chunk with a "
        "token; p50/p95: percentiles over the requests; inter-token: each chunk's wait since the one before, "
        "divided among its tokens, percentiles over every token of the run. Identical to N=1: answers equal to the "
        "same server's answer to the same request at N=1, "
        "by token ids where the stream carries them (specdec's), else by text.")
    return "\n".join(lines)


def concurrency_summary(runs: Sequence[dict[str, Any]], command: str) -> str:
    """One page for a whole --concurrency invocation: the command and each temperature's table."""
    parts = ["# Benchmark results: several clients at once", "", "Produced by:", "", "```", command, "```"]
    for data in runs:
        parts += ["", concurrency_markdown(data)]
    return "\n".join(parts) + "\n"
