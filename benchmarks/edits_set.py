"""Edit requests the project did not write: real code and JSON, an editor's instruction, the original as the prediction.

Each request is a chat message of the kind an editor or an agent sends (rename a variable, add a
docstring, add type hints to a signature, fix a one-character bug, comment the loops, requote the
strings, reformat or update a JSON document), followed by the text to edit; its ``prediction``
(OpenAI's Predicted Outputs) is that text as the client holds it. The texts come from installed
packages by a fixed rule, never edited by hand:

- code: for each module of :data:`MODULES` in turn, with the edit kind beside it, the first
  top-level function of the module's source whose length is 20-60 lines and to which that kind
  applies (:func:`applies`: a local name used three times or more to rename, no docstring to add
  one to, a comparison to break, a loop to comment, a single-quoted string to requote);
- JSON: the documents of :data:`JSON_FILES` in the ``jsonschema-specifications`` package.

A "fix the bug" request sends the function with its first comparison operator turned into its
neighbour (``<`` into ``<=``, ``==`` into ``!=``, ...), names the line and says what it should be:
the prediction is the broken function (what the client holds), the answer the function as it was.
The functions depend on the Python that runs this script (the stdlib's source), the JSON documents
on the package's version: both are recorded in each request's ``source``, with the sha256 of the text.

    python benchmarks/edits_set.py                  # writes benchmarks/edits.jsonl
    python benchmarks/edits_set.py --unrelated      # writes benchmarks/edits-unrelated.jsonl

``--unrelated`` writes the same requests with each one's prediction taken from the next request
(the last from the first): a prediction that does not match the answer, to check that sending
one costs nothing where it is useless. ``specdec bench --prompts benchmarks/edits.jsonl`` reads
either file (:func:`specdec.prompts.load_jsonl`); benchmarks/README.md has the commands.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import platform
import tokenize
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
LINES = (20, 60)  # a function's length in lines, its docstring included
# (module, edit kind): the first function of each module that the kind applies to
MODULES = (
    ("textwrap", "rename"), ("gettext", "docstring"), ("difflib", "signature"), ("base64", "bug"),
    ("glob", "comment"), ("urllib.parse", "requote"), ("ipaddress", "rename"), ("linecache", "bug"),
)
JSON_PACKAGE = ("jsonschema_specifications", "jsonschema-specifications")  # (import name, distribution)
JSON_FILES = (("schemas/draft202012/metaschema.json", "reformat"),
              ("schemas/draft202012/vocabularies/meta-data", "describe"))
ANSWER = "Answer with the whole {what} in a code block."
INSTRUCTIONS = {
    "rename": "Rename the variable `{old}` to `{new}` everywhere in this function and change nothing else.",
    "docstring": "Add a docstring to this function that says what it does, its parameters and what it "
                 "returns, and change nothing else.",
    "signature": "Add type hints to every parameter and to the return value of this function, and change "
                 "nothing else.",
    "bug": "This function has a bug on line {line}: `{wrong}` should be `{right}`. Fix it and change nothing else.",
    "comment": "Add a short comment above each loop of this function that says what the loop does, and "
               "change nothing else.",
    "requote": "Change every single-quoted string in this function to use double quotes, and change nothing else.",
    "reformat": "Reformat this JSON document with an indentation of 2 spaces, one key per line, keeping the "
                "keys in their order and every value as it is.",
    "describe": "Add a \"description\" key right after \"title\" in this JSON document that says in one sentence "
                "what the document defines, and change nothing else.",
}
# a comparison turned into its neighbour: the "bug" a request asks to fix
BROKEN = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "=="}


def functions(module: str) -> tuple[Path, list[tuple[ast.FunctionDef, str]]]:
    """The module's source file and its top-level functions of :data:`LINES` lines, with their text."""
    path = Path(importlib.util.find_spec(module).origin)
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.decorator_list:
            if LINES[0] <= node.end_lineno - node.lineno + 1 <= LINES[1]:
                found.append((node, "".join(lines[node.lineno - 1:node.end_lineno]).rstrip() + "\n"))
    return path, found


def most_used_local(node: ast.FunctionDef) -> str | None:
    """The local name (assigned in the body, not a parameter) used most often, three times or more
    (the first such name in the text on a tie)."""
    params = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
    stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    uses: dict[str, int] = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in stored - params and len(n.id) > 1:
            uses[n.id] = uses.get(n.id, 0) + 1
    best = max(uses.values(), default=0)
    return next((name for name, count in uses.items() if count == best), None) if best >= 3 else None


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(text).readline))


def first_comparison(text: str) -> tokenize.TokenInfo | None:
    return next((t for t in _tokens(text) if t.type == tokenize.OP and t.string in BROKEN), None)


def single_quoted(text: str) -> bool:
    return any(t.type == tokenize.STRING and t.string.lstrip("rbuRBU").startswith("'") for t in _tokens(text))


def applies(kind: str, node: ast.FunctionDef, text: str) -> bool:
    """Whether an edit of ``kind`` has something to do in this function."""
    if kind == "rename":
        return most_used_local(node) is not None
    if kind == "docstring":
        return ast.get_docstring(node) is None
    if kind == "signature":
        return node.returns is None and not any(a.annotation for a in ast.walk(node.args) if isinstance(a, ast.arg))
    if kind == "bug":
        return first_comparison(text) is not None
    if kind == "comment":
        return any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(node))
    if kind == "requote":
        return single_quoted(text)
    raise ValueError(f"unknown edit kind {kind!r}")


def code_request(module: str, kind: str) -> dict[str, Any]:
    """The request of ``module``'s first function that ``kind`` applies to."""
    path, found = functions(module)
    node, text = next(((n, t) for n, t in found if applies(kind, n, t)), (None, None))
    if node is None:
        raise SystemExit(f"{module}: no function of {LINES[0]}-{LINES[1]} lines to {kind}")
    fields: dict[str, Any] = {}
    prediction = text
    if kind == "rename":
        old = most_used_local(node)
        fields = {"old": old, "new": f"{old}_value"}
    elif kind == "bug":
        op = first_comparison(text)
        row, col = op.start
        lines = text.splitlines(keepends=True)
        right_line = lines[row - 1]
        wrong_line = right_line[:col] + BROKEN[op.string] + right_line[op.end[1]:]
        prediction = "".join(lines[:row - 1] + [wrong_line] + lines[row:])
        fields = {"line": row, "wrong": wrong_line.strip(), "right": right_line.strip()}
    instruction = INSTRUCTIONS[kind].format(**fields) + " " + ANSWER.format(what="function")
    return {
        "id": f"edits/{module}.{node.name}/{kind}",
        "messages": [{"role": "user", "content": f"{instruction}\n\n```python\n{prediction}```"}],
        "prediction": prediction,
        "source": {"module": module, "function": node.name, "lines": node.end_lineno - node.lineno + 1,
                   "file": path.name, "python": platform.python_version(), "sha256": _digest(text)},
    }


def json_request(relative: str, kind: str) -> dict[str, Any]:
    """The request to edit one JSON document of :data:`JSON_PACKAGE`."""
    package, distribution = JSON_PACKAGE
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise SystemExit(f"the JSON documents come from the {distribution} package: pip install {distribution}")
    text = (Path(spec.origin).parent / relative).read_text(encoding="utf-8").rstrip() + "\n"
    json.loads(text)  # a JSON document, as the request says
    instruction = INSTRUCTIONS[kind] + " " + ANSWER.format(what="document")
    return {
        "id": f"edits/{relative}/{kind}",
        "messages": [{"role": "user", "content": f"{instruction}\n\n```json\n{text}```"}],
        "prediction": text,
        "source": {"package": distribution, "version": importlib.metadata.version(distribution), "file": relative,
                   "sha256": _digest(text)},
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build(unrelated: bool = False) -> list[dict[str, Any]]:
    """Every request, code first; ``unrelated``: each prediction from the next request instead."""
    requests = [code_request(m, k) for m, k in MODULES] + [json_request(f, k) for f, k in JSON_FILES]
    if unrelated:
        shifted = requests[1:] + requests[:1]
        requests = [r | {"id": r["id"] + "/unrelated", "prediction": other["prediction"]}
                    for r, other in zip(requests, shifted)]
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unrelated", action="store_true",
                        help="each request's prediction from the next request (a useless prediction)")
    parser.add_argument("--out", default=None,
                        help="the file to write (default: benchmarks/edits.jsonl, or edits-unrelated.jsonl)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else HERE / ("edits-unrelated.jsonl" if args.unrelated else "edits.jsonl")
    requests = build(args.unrelated)
    out.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    for r in requests:
        print(f"{r['id']}: {len(r['prediction'].splitlines())} lines")
    print(f"wrote {len(requests)} requests to {out}")


if __name__ == "__main__":
    main()
