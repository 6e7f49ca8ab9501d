"""What ``--out`` keeps between invocations, so an interrupted benchmark resumes.

``<out>/arguments.json`` records what defines the run set: every option that changes what is run
or how it is timed, with the methods as parsed and the prompts as loaded (set, id and a digest of
the text). Each timed run is saved as it ends, one JSON file per run in
``<out>/<greedy|t<T>>/samples/``, written to a temporary file in that folder and renamed over its
name, so a file is either whole or absent. A rerun with the same arguments loads those runs and
runs only the others; a rerun with other arguments is refused while the folder holds anything of
the old run, unless told to overwrite it. A temperature's ``results.json`` is written when all its
runs are made, so its presence tells runs an earlier invocation made and reported (a rerun only
writes the report again) from runs an interrupted one left (:attr:`SavedRuns.earlier`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from specdec.prompts import Prompt
from specdec.bench.report import PLOTS
from specdec.bench.sample import Sample
from specdec.paths import write_atomic

ARGUMENTS = "arguments.json"
SAMPLES = "samples"
RUN_FOLDER = re.compile(r"greedy|t\d[\d.e+-]*")  # the per-temperature folders the bench writes
RunKey = tuple[str, int, int]  # (method, prompt index, repeat): one timed run within a temperature


class OutputInUse(Exception):
    """``--out`` holds results that a run with these arguments would replace."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def prompt_digest(prompt: Prompt) -> str:
    """A short digest of what the model is given for ``prompt``: a changed prompt file changes it."""
    content = json.dumps({"text": prompt.text, "messages": list(prompt.messages)}
                         | ({"prediction": prompt.prediction} if prompt.prediction else {}), sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def prepare(out: Path, arguments: dict[str, Any], command: str, *, overwrite: bool) -> None:
    """Make ``out`` ready for the run ``arguments`` describe (option name -> value, JSON types):
    a run with the same arguments resumes, and so takes ``out`` as it is. With ``overwrite``, what
    ``out`` holds of an earlier run is removed first. :class:`OutputInUse` if ``out`` holds results
    of another run (or of a run that recorded no arguments). ``command`` is recorded beside the
    arguments, for the hint of a later refusal."""
    if overwrite:
        clear(out)
    recorded = _read(out / ARGUMENTS)
    arguments = json.loads(json.dumps(arguments))  # tuples as lists, as read back
    if recorded is not None and recorded.get("arguments") == arguments:
        return
    if holds_results(out):
        if recorded is None:
            raise OutputInUse(f"--out {out} already holds benchmark results",
                              "add --overwrite to replace them, or give another --out")
        raise OutputInUse(
            f"--out {out} holds a run with other arguments ({_differences(recorded.get('arguments', {}), arguments)})",
            f"to resume that run, run it as recorded in {out / ARGUMENTS} ({recorded.get('command')}); "
            "add --overwrite to replace it, or give another --out",
        )
    write_atomic(out / ARGUMENTS, json.dumps({"command": command, "arguments": arguments}, indent=1) + "\n")


def holds_results(out: Path) -> bool:
    """Whether ``out`` holds a report or a saved run (an empty record of arguments is nothing to lose)."""
    return (out / "README.md").exists() or any(
        (folder / "results.json").exists() or any((folder / SAMPLES).glob("*.json"))
        for folder in _run_folders(out)
    )


def clear(out: Path) -> None:
    """Remove what the bench wrote into ``out``: the record of arguments, README.md, and in each
    per-temperature folder the results, the table, the plots and the saved runs. Other files stay."""
    for name in (ARGUMENTS, "README.md"):
        (out / name).unlink(missing_ok=True)
    for folder in _run_folders(out):
        for name in ("results.json", "results.md", *PLOTS):
            (folder / name).unlink(missing_ok=True)
        shutil.rmtree(folder / SAMPLES, ignore_errors=True)
        if not any(folder.iterdir()):
            folder.rmdir()


class SavedRuns:
    """One temperature's finished timed runs, one JSON file each in ``<folder>/samples/``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / SAMPLES
        self.warned = False
        # where the invocation that saved these runs stopped: "reported" if it made them all and wrote
        # this temperature's report (results.json, written last), else "interrupted" (before that)
        self.earlier = "reported" if (folder / "results.json").is_file() else "interrupted"

    def __len__(self) -> int:
        return sum(1 for _ in self.folder.glob("*.json")) if self.folder.is_dir() else 0

    def load(self, prompts: Sequence[Prompt]) -> dict[RunKey, Sample]:
        """The saved runs by (method, prompt, repeat); a file that is not a run of these prompts
        (unreadable, or naming another prompt at its index) is left out and runs again."""
        fields = {f.name for f in dataclasses.fields(Sample)}
        done: dict[RunKey, Sample] = {}
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                record = json.loads(path.read_text())
                p = record["prompt"]
                if not (0 <= p < len(prompts) and record["prompt_id"] == prompts[p].id):
                    continue
                sample = Sample(**{k: v for k, v in record["sample"].items() if k in fields})
            except (OSError, ValueError, KeyError, TypeError):
                continue
            done[sample.method, sample.prompt, sample.repeat] = sample
        return done

    def save(self, sample: Sample, prompt: Prompt) -> None:
        """Save one finished run. A failure to write is a warning (once): the run goes on, and only
        resuming it after an interrupt would run this sample again."""
        record = {"method": sample.method, "prompt": sample.prompt, "prompt_id": prompt.id,
                  "repeat": sample.repeat, "sample": sample.to_dict()}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / _file_name(sample), json.dumps(record) + "\n")
        except OSError as e:
            if not self.warned:
                print(f"specdec bench: warning: cannot save finished runs into {self.folder} ({e}); "
                      "an interrupted run will not resume them", file=sys.stderr)
                self.warned = True


def _file_name(sample: Sample) -> str:
    """``r<repeat>-p<prompt>-<method>-<digest>.json``: readable, and one name per method however
    it is spelled (method names hold ':', '|' and '/')."""
    readable = re.sub(r"[^A-Za-z0-9=.+-]+", "_", sample.method)[:60]
    digest = hashlib.sha256(sample.method.encode()).hexdigest()[:8]
    return f"r{sample.repeat}-p{sample.prompt}-{readable}-{digest}.json"


def _run_folders(out: Path) -> list[Path]:
    if not out.is_dir():
        return []
    return [d for d in sorted(out.iterdir()) if d.is_dir() and RUN_FOLDER.fullmatch(d.name)]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _differences(recorded: dict[str, Any], arguments: dict[str, Any]) -> str:
    """``--repeats 1 there, 2 here; --prompts ...``: the options whose values differ."""
    parts = []
    for key in dict.fromkeys([*recorded, *arguments]):
        old, new = recorded.get(key), arguments.get(key)
        if old != new:
            flag = "--" + key.replace("_", "-")
            shown = "picks other prompts" if key == "prompts" else f"{_show(old)} there, {_show(new)} here"
            parts.append(f"{flag} {shown}")
    return "; ".join(parts)


def _show(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
