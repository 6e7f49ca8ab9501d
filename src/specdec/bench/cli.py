"""``specdec bench``: run the benchmark from the command line and write its results.

For each temperature the run writes ``<out>/greedy/`` or ``<out>/t<T>/`` holding results.json,
results.md and the plots, and ``<out>/README.md`` gathers the command and every table.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from specdec.bench.methods import MethodSpec
    from specdec.bench.runner import BenchModels

DEFAULT_METHODS = (
    "ar,spec:greedy:k=4,spec:token:k=4,spec:block:k=2,spec:block:k=4,spec:block:k=4:policy=theory,"
    "spec:ngram:block:k=4,hf-assisted,hf-prompt-lookup"
)
DEFAULT_PROMPTS = "humaneval:8,mtbench:8"
DESCRIPTION = (
    "Time the project's speculative methods against the target alone (ar) and against "
    "transformers' assisted generation and prompt lookup, on the same models, prompts and "
    "settings, interleaved prompt by prompt. Writes results.json, results.md and plots per "
    "temperature under --out, and --out/README.md with the command and all tables."
)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on an ``argparse`` subparsers object.

    The parser's default ``func`` is :func:`bench_command` (takes the namespace, returns an exit code).
    """
    parser = subparsers.add_parser(
        "bench",
        help="measure speed-ups against ar and against transformers' speculative methods",
        description=DESCRIPTION,
    )
    _add_arguments(parser)
    parser.set_defaults(func=bench_command)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.cli import add_model_options

    add_model_options(parser)  # --target, --draft (here 'none' goes without), --dtype, --cache-dir
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS,
                        help="prompt sets and counts: humaneval, mtbench, sharegpt or a .jsonl file, "
                             f"e.g. humaneval:8,my.jsonl:4 (default: {DEFAULT_PROMPTS})")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated: ar, spec:[<drafter>:]<verifier>[:k=N][:policy=P][:option=V...] "
                             "(drafters: model, ngram, early-exit, layer-skip), spec:tree[:budget=N], hf-assisted[:k=N], "
                             "hf-prompt-lookup[:k=N], hf-ar; ar is always run (default: %(default)s)")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                        help="one run per value; 0 is greedy; top_k 0 and top_p 1 throughout (default: 0)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="(default: 128)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each method on each prompt (default: 1)")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="tokens of the untimed warm-up run per method; 0: none (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts and seeds sampling (default: 0)")
    parser.add_argument("--eos", choices=("ignore", "stop"), default="ignore",
                        help="ignore: every run makes exactly --max-new-tokens tokens; stop: end at EOS (default: ignore)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks/latest", help="output folder (default: benchmarks/latest)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def bench_command(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the benchmark described by ``args``; return the exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from specdec.bench import report
    from specdec.bench.methods import parse_methods
    from specdec.bench.prompts import load_prompts
    from specdec.bench.runner import BenchSettings, run_bench

    try:
        methods = parse_methods(args.methods)
        prompts = load_prompts(args.prompts, seed=args.seed)
        settings = [
            BenchSettings(max_new_tokens=args.max_new_tokens, temperature=t, repeats=args.repeats,
                          warmup_tokens=args.warmup_tokens, seed=args.seed, ignore_eos=args.eos == "ignore")
            for t in args.temperature
        ]
    except ValueError as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    command = _command(argv)
    env = report.environment(command, args.dtype)
    env["resolved_command"] = _resolved_command(args)
    _warn_if_busy(env)
    models = load_models(args, methods)
    info = {"target": report.model_info(models.target, models.target_name),
            "draft": report.model_info(models.draft, models.draft_name)}
    if info["draft"] is not None:
        info["draft"]["weights"] = models.draft_weights
    out = Path(args.out)
    runs = []
    for s in settings:
        before = _load_average()
        run = run_bench(models, methods, prompts, s, progress=not args.no_progress)
        data = report.results(run, env | {"load_average_run": [before, _load_average()]}, info)
        folder = report.write_run(data, out / ("greedy" if s.greedy else f"t{s.temperature:g}"))
        print(report.markdown(data) + f"\n\n(written to {folder})\n")
        runs.append(data)
    (out / "README.md").write_text(report.summary_markdown(runs, command))
    return 0


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _warn_if_busy(env: dict[str, Any]) -> None:
    """Timings on a machine that other work keeps busy are slow and noisy; say so up front."""
    load, cpus = env.get("load_average"), env.get("cpus_available") or env.get("cpu_count")
    if load and cpus and load[0] > 0.5 * cpus:
        print(
            f"specdec bench: warning: load average {load[0]:.1f} on {cpus} CPUs before the run; other "
            "work competes for the CPU, so absolute timings will be noisy (ratios within this run "
            "stay comparable). On a shared machine --threads 1 avoids thread contention.",
            file=sys.stderr,
        )


def load_models(args: argparse.Namespace, methods: Sequence[MethodSpec]) -> BenchModels:
    """Load the target, and the draft when a method needs one, as ``specdec generate`` does."""
    from specdec.bench.runner import BenchModels
    from specdec.cli import load_models as load

    wants_draft = any(m.needs_draft_model for m in methods) and str(args.draft).lower() != "none"
    target, draft, tokenizer = load(args, draft=wants_draft)
    if draft is target:  # the peers' forward hooks must tell the two apart
        draft = copy.deepcopy(target)
    return BenchModels(target, tokenizer, draft, args.target, args.draft if draft is not None else None,
                       getattr(args, "draft_weights", "int8"))


def _command(argv: Sequence[str] | None) -> str:
    """The invocation as typed, as far as it can be recovered."""
    if argv is not None:
        return shlex.join(["specdec", "bench", *argv])
    program = Path(sys.argv[0]).name
    if program in ("__main__.py", "cli.py"):
        program = "python -m specdec.bench"
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


def _resolved_command(args: argparse.Namespace) -> str:
    """The same run with every option spelled out, defaults included."""
    options = argparse.ArgumentParser()
    _add_arguments(options)
    parts = ["specdec", "bench"]
    for key in vars(options.parse_args([])):
        value = getattr(args, key)
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.bench [options]``."""
    parser = argparse.ArgumentParser(prog="python -m specdec.bench", description=DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    from specdec.cli import CLIError

    try:
        return bench_command(args, argv)
    except CLIError as err:
        print(f"specdec bench: {err.message}\nhint: {err.hint}", file=sys.stderr)
        return err.code
