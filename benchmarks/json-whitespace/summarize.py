"""Every answer of the bench runs in specdec/ (decoded) and of llama-server (llama-server/answers.jsonl,
written by llama_server_answers.py), with whether it parses, follows its schema and ended before
max_tokens: answers.jsonl (one line an answer) and summary.md.
Run from the repository root: python benchmarks/json-whitespace/summarize.py"""

from __future__ import annotations

import json
from pathlib import Path

from specdec import models
from specdec.bench import schema_check
from specdec.prompts import load_set

HERE = Path(__file__).parent
RUNS = [HERE / "specdec" / temp for temp in ("greedy", "t1")]
PEER = HERE / "llama-server" / "answers.jsonl"


def main() -> None:
    tokenizer = models.load_tokenizer("qwen2.5-coder-1.5b")
    prompts = {p.id: p for p in load_set(str(HERE / "prompts.jsonl"))}
    rows = []
    for folder in RUNS:
        results = folder / "results.json"
        if not results.exists():
            continue
        data = json.loads(results.read_text(encoding="utf-8"))
        limit = data["settings"]["max_new_tokens"]
        for sample in sorted(data["samples"], key=lambda s: (s["method"], s["prompt"])):
            ids = sample["token_ids"] if isinstance(sample["token_ids"], list) else json.loads(sample["token_ids"])
            pid = data["prompts"][sample["prompt"]]["id"]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            check = schema_check.check_output(text, prompts[pid].schema)
            rows.append({"method": sample["method"], "temperature": data["settings"]["temperature"], "prompt": pid,
                         "tokens": sample["new_tokens"], "hit_max_tokens": sample["new_tokens"] >= limit,
                         "json_parsed": check.parsed, "schema_valid": check.valid, "error": check.error, "text": text})
    if PEER.exists():
        rows += [json.loads(line) for line in PEER.open(encoding="utf-8")]
    with open(HERE / "answers.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (HERE / "summary.md").write_text(table(rows), encoding="utf-8")
    print(table(rows))


def table(rows: list[dict]) -> str:
    methods = sorted({(r["temperature"], r["method"]) for r in rows})
    pids = sorted({r["prompt"] for r in rows})
    head = "| prompt | " + " | ".join(f"{m} T={t:g}" for t, m in methods) + " |"
    lines = [head, "|---|" + "---:|" * len(methods)]
    for pid in pids:
        cells = []
        for t, m in methods:
            found = [r for r in rows if r["prompt"] == pid and r["method"] == m and r["temperature"] == t]
            cells.append(" ".join(cell(r) for r in found) or "-")
        lines.append(f"| {pid.split('/')[-1]} | " + " | ".join(cells) + " |")
    valid = [f"{m} T={t:g}: {sum(r['schema_valid'] and not r['hit_max_tokens'] for r in rows if (r['temperature'], r['method']) == (t, m))}"
             f"/{sum((r['temperature'], r['method']) == (t, m) for r in rows)}" for t, m in methods]
    return ("Tokens of each answer; ✓ it parses, follows its schema and ended before max_tokens, "
            "✗ otherwise (max: it ran to max_tokens).\n\n" + "\n".join(lines) + "\n\nValid and ended: "
            + ", ".join(valid) + "\n")


def cell(row: dict) -> str:
    ok = row["schema_valid"] and not row["hit_max_tokens"]
    return f"{row['tokens']} {'✓' if ok else '✗'}{' max' if row['hit_max_tokens'] else ''}"


if __name__ == "__main__":
    main()
