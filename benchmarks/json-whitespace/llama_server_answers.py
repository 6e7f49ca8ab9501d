"""llama.cpp's own llama-server on the same GGUF, prompts and schemas as the bench run in specdec/:
each prompt's messages sent to /v1/chat/completions with its schema as a strict
response_format, as the bench sends them (--server-endpoint chat; the same request body, seed 0),
greedy and at T=1, up to 400 tokens, 2 threads. Every answer goes to llama-server/answers.jsonl as
it arrives: its text, its token count (llama-server's usage), whether it parses and follows its
schema. The bench itself would also run its in-process llama.cpp reference on every prompt; this
runs llama-server alone. Run from the repository root:
python benchmarks/json-whitespace/llama_server_answers.py"""

from __future__ import annotations

import json
from pathlib import Path

from specdec import packs
from specdec.bench.schema_check import check_output
from specdec.bench.servers import Servers, chat_request_body
from specdec.prompts import load_set

HERE = Path(__file__).parent
MAX_TOKENS, SEED, THREADS = 400, 0, 2


def main() -> None:
    out = HERE / "llama-server" / "answers.jsonl"
    out.parent.mkdir(exist_ok=True)
    done = {(r["temperature"], r["prompt"]) for r in map(json.loads, out.open(encoding="utf-8"))} if out.exists() else set()
    prompts = load_set(str(HERE / "prompts.jsonl"))
    servers = Servers(packs.gguf_file("qwen2.5-coder-1.5b", progress=False), None, [], n_threads=THREADS)
    try:
        for temperature in (0.0, 1.0):
            for prompt in prompts:
                if (temperature, prompt.id) in done:
                    continue
                body = chat_request_body(prompt.messages, temperature, MAX_TOKENS, SEED, False, prompt.schema,
                                         prompt.schema_name)
                answer = servers.complete("llama-server", body, "/v1/chat/completions")
                tokens = int(answer.usage.get("completion_tokens", 0))
                check = check_output(answer.text, prompt.schema)
                row = {"method": "llama-server", "temperature": temperature, "prompt": prompt.id, "tokens": tokens,
                       "hit_max_tokens": tokens >= MAX_TOKENS, "json_parsed": check.parsed,
                       "schema_valid": check.valid, "error": check.error, "text": answer.text}
                with out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                print(f"T={temperature:g} {prompt.id}: {tokens} tokens, valid {check.valid}", flush=True)
    finally:
        servers.close()


if __name__ == "__main__":
    main()
