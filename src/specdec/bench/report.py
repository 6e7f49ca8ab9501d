"""Turn a :class:`~specdec.bench.runner.BenchRun` into what a reader gets: results.json, results.md
and the plots.

Each piece has its own module, and what the command line and the tests use is re-exported here:
the figures per method and their definitions (:mod:`specdec.bench.figures`), the environment
(:mod:`specdec.bench.environment`), the machine's speeds (:mod:`specdec.bench.machine`), the
weights' description (:mod:`specdec.bench.weights`), the Markdown table
(:mod:`specdec.bench.markdown`) and the plots (:mod:`specdec.bench.plots`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.backends.table import BY_NAME, GGUF_NAMES
from specdec.bench import schema_check
from specdec.bench.environment import environment, gguf_info, model_info
from specdec.bench.figures import prediction_figures, summarize
from specdec.bench.machine import machine_record
from specdec.bench.markdown import markdown, summary_markdown, title
from specdec.bench.plots import PLOTS, plot
from specdec.bench.runner import BenchRun
from specdec.bench.weights import gguf_weights, run_weights
from specdec.paths import write_atomic

__all__ = [
    "PLOTS", "environment", "gguf_info", "gguf_weights", "machine_record", "markdown", "model_info", "plot",
    "results", "run_weights", "summarize", "summary_markdown", "title", "write_run",
]


def results(run: BenchRun, env: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    """The whole run as plain data: what results.json holds."""
    s = run.settings
    if any(m.backend in GGUF_NAMES for m in run.methods):  # as `specdec generate --json` says it: "weights"
        env = env | {"weights": run_weights(run.methods, env.get("dtype"), models)}
        if all(BY_NAME[m.backend].runs_gguf for m in run.methods):  # and no torch dtype where torch ran nothing
            env = {k: v for k, v in env.items() if k != "dtype"}
    return {
        "environment": env,
        "models": models,
        "settings": {
            "temperature": s.temperature, "greedy": s.greedy, "top_k": 0, "top_p": 1.0,
            "max_new_tokens": s.max_new_tokens, "repeats": s.repeats, "warmup_tokens": s.warmup_tokens,
            "seed": s.seed, "eos": "ignored" if s.ignore_eos else "stops", "order": "interleaved by prompt",
            **({"server_endpoint": "chat: messages to /v1/chat/completions, each server's default sampler fields"}
               if s.endpoint == "chat" else {}),
        },
        "prompts": [p.to_dict() | {"tokens": n} for p, n in zip(run.prompts, run.prompt_tokens)],
        "methods": _with_schema_figures(summarize(run), run.samples),
        **({"predictions": predictions} if (predictions := prediction_figures(run)) else {}),
        "skipped": run.skipped,
        "failed": run.failed,
        "wall_seconds": run.seconds,
        "resumed_samples": run.resumed,
        "samples": [x.to_dict() for x in run.samples],
    }


def _with_schema_figures(methods: dict[str, Any], samples: list[Any]) -> dict[str, Any]:
    """Each method's figures, with those of its outputs on prompts with a JSON schema
    (:func:`specdec.bench.schema_check.method_figures`: the share that parse and follow their
    schema, the share of tokens the grammar forced) where it has such runs."""
    for name, values in schema_check.method_figures(samples).items():
        if name in methods:
            methods[name].update(values)
    return methods


def write_run(data: dict[str, Any], out_dir: str | Path) -> Path:
    """Write results.json, results.md and the plots for one run into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", json.dumps(data, indent=1) + "\n")
    write_atomic(out / "results.md", markdown(data) + "\n")
    plot(data, out)
    return out
