"""``specdec bench``: run the benchmark from the command line and write its results.

For each temperature the run writes ``<out>/greedy/`` or ``<out>/t<T>/`` holding results.json,
results.md and the plots, and ``<out>/README.md`` gathers the command and every table. Each
timed run is saved as it ends, so an interrupted run resumes when the same command runs again;
a run into an ``--out`` that holds another run's results is refused without ``--overwrite``
(:mod:`specdec.bench.resume`). ``python -m specdec.bench`` runs :func:`main`, the same command.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from specdec import drafters, models, packs
from specdec.cli import common
from specdec.backends import llamacpp as llamacpp_backend
from specdec.backends import table as backend_table
from specdec.backends.table import GGUF, LLAMACPP, TORCH
from specdec.bench import concurrency, markdown as bench_markdown, report, resume
from specdec.bench.methods import MethodSpec, parse_method, parse_methods
from specdec.prompts import load_prompts
from specdec.bench.runner import BenchBackends, BenchSettings, GGUFs, run_bench
from specdec.bench.servers import (
    BUILD_SCRIPT, DEFAULT_BINARY, LLAMA_SERVER_ENV, LLAMA_SERVER_FLAGS, ServerMissing, Servers, llama_server_binary,
)
from specdec.memory import keep_freed_memory
from specdec.models import Pair
from specdec.cli.common import (
    CLIError, Parser, add_model_options, check_threads, fail, non_negative_float, non_negative_int, positive_int,
    prepare_folder, seed_int,
)
from specdec.paths import write_atomic

DEFAULT_METHODS = (  # the default method (spec), fixed-length chains under each verifier, a policy, the lookup
    "ar,spec,spec:model:greedy:k=4:policy=static,spec:model:token:k=4:policy=static,"
    "spec:model:block:k=2:policy=static,spec:model:block:k=4:policy=static,spec:model:block:k=4:policy=theory,"
    "spec:ngram:block:k=4:policy=static,hf-assisted,hf-prompt-lookup"
)
DEFAULT_PROMPTS = "humaneval:8,mtbench:8"
# --backend: each of the bench's backends alone, or two of them (both: torch and llama.cpp)
BACKEND_CHOICES = {name: (name,) for name in backend_table.NAMES} | {"both": (TORCH, LLAMACPP),
                                                                     "gguf+llamacpp": (GGUF, LLAMACPP)}
DESCRIPTION = (
    "Time the project's speculative methods against the target alone (ar) and against "
    "transformers' assisted generation and prompt lookup, on the same models, prompts and "
    "settings, interleaved prompt by prompt. Writes results.json, results.md and plots per "
    "temperature under --out, and --out/README.md with the command and all tables."
)
_HOME = str(Path.home())
EPILOG = (
    "Servers: a project method with via=serve (e.g. ar:via=serve, spec:via=serve, "
    "spec:model:block:k=4:backend=llamacpp:via=serve) runs through a `specdec serve` process of its own, "
    "started with that method as its default (ar's with --draft none), instead of the library, so the "
    "server path is what is timed; with via=ray (and replicas=N, default 1) through `specdec serve --ray` "
    "instead, the models deployed on a Ray Serve of its own, the run's threads and slots divided among the "
    "replicas (pip install 'specdec[ray]'). The llama-server peers run llama.cpp's own server on the target's GGUF: "
    "llama-server (plain decoding), llama-server-md (with the draft's GGUF: "
    f"{' '.join(LLAMA_SERVER_FLAGS['llama-server-md']).replace('{draft}', 'DRAFT')}) and llama-server-spec-default "
    f"({' '.join(LLAMA_SERVER_FLAGS['llama-server-spec-default'])}, its n-gram drafter) and llama-server-ngram "
    f"({' '.join(LLAMA_SERVER_FLAGS['llama-server-ngram'])}, its prompt lookup). Every server is its own "
    "process on a loopback port, with the run's --threads and the same context, called by one HTTP client the "
    "same way (streamed /v1/completions), started afresh for each temperature; the llama-server peers and "
    "via=serve methods on llama.cpp run GGUFs (give a pack or a .gguf file as --target and --draft). "
    "A spec method with via=serve also takes prediction=yes: its requests carry the predicted output of the "
    "prompts that have one (a prompt file's \"prediction\", e.g. benchmarks/edits.jsonl), as OpenAI's Predicted "
    "Outputs; the report then gives per request each method's speed and the prediction tokens accepted and rejected."
    "\n\n"
    f"The llama-server peers need a llama-server binary: build one with {BUILD_SCRIPT} (from the llama.cpp "
    "source that the installed llama-cpp-python vendors; about 4 minutes on 2 cores; it writes "
    f"{str(DEFAULT_BINARY).replace(_HOME, '~', 1)}), or set ${LLAMA_SERVER_ENV} to a llama-server binary "
    "(else one on PATH is used). Without one the bench stops before loading any model and says so. "
    "specdec serve against llama-server, as in the README:"
    "\n\n"
    f"  {BUILD_SCRIPT}   # once\n"
    "  specdec bench --backend llamacpp --threads 2 --out benchmarks/servers \\\n"
    "    --methods ar:via=serve,spec:via=serve,llama-server,llama-server-md,llama-server-spec-default"
)


class HelpFormatter(argparse.HelpFormatter):
    """Fills each paragraph of the description and epilog on its own; a paragraph of indented lines
    (a command) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            "\n".join(indent + line for line in part.splitlines()) if part.startswith("  ")
            else super(HelpFormatter, self)._fill_text(part, width, indent)
            for part in text.split("\n\n"))


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on an ``argparse`` subparsers object.

    The parser's default ``func`` is :func:`bench_command` (takes the namespace, returns an exit code).
    """
    parser = subparsers.add_parser(
        "bench",
        help="measure speed-ups against ar and against transformers' speculative methods",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=bench_command)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)  # --target, --draft (here 'none' goes without), --dtype, --cache-dir
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS,
                        help="prompt sets and counts: humaneval, edit (rewrite a HumanEval solution), mtbench, sharegpt, "
                             "extract (JSON extraction, each answer constrained to its JSON schema; reports the "
                             "outputs that parse and follow it) or a .jsonl file (its lines may carry a "
                             "\"prediction\": see prediction=yes in --methods), "
                             f"e.g. humaneval:8,my.jsonl:4 (default: {DEFAULT_PROMPTS})")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated: ar, spec:[<drafter>:]<verifier>[:k=N][:policy=P][:option=V...] "
                             f"(drafters: {', '.join(drafters.names())}), spec:tree[:budget=N], hf-assisted[:k=N], "
                             "hf-prompt-lookup[:k=N], hf-ar, llamacpp-ar, and llama.cpp's own server: llama-server, "
                             "llama-server-md, llama-server-spec-default, llama-server-ngram (they need a llama-server binary: see "
                             "Servers below); ar and spec take backend=torch|llamacpp|gguf, and via=serve to run through "
                             "a specdec serve process instead of the library, via=ray[:replicas=N] through specdec "
                             "serve --ray (spec then also prediction=yes, which "
                             "sends each prompt's predicted output); ar is always run, on each backend "
                             "used (default: %(default)s)")
    parser.add_argument("--backend", choices=tuple(BACKEND_CHOICES), default=TORCH,
                        help="where ar and spec methods without backend= run: torch (transformers' weights), "
                             "llamacpp (the GGUF, through llama.cpp), gguf (the GGUF on specdec's own kernel), "
                             "both (torch and llamacpp) or gguf+llamacpp (each such method on each, interleaved "
                             "in one run) (default: torch)")
    parser.add_argument("--temperature", type=non_negative_float, nargs="+", default=[0.0],
                        help="one run per value; 0 is greedy; top_k 0 and top_p 1 throughout (default: 0)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="(default: 128)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="timed runs of each method on each prompt (default: 1)")
    parser.add_argument("--warmup-tokens", type=non_negative_int, default=16,
                        help="tokens of the untimed warm-up run per method; 0: none (default: 16)")
    parser.add_argument("--seed", type=seed_int, default=0, help="picks the prompts and seeds sampling (default: 0)")
    parser.add_argument("--server-endpoint", choices=("completions", "chat"), default="completions",
                        help="how server methods (llama-server peers, via=serve) get chat prompts: 'completions' "
                             "sends the token ids with neutral sampling fields; 'chat' sends the messages to "
                             "/v1/chat/completions with an OpenAI client's default fields, each server sampling "
                             "with its own defaults (default: completions)")
    parser.add_argument("--eos", choices=("ignore", "stop"), default="ignore",
                        help="ignore: every run makes exactly --max-new-tokens tokens; stop: end at EOS (default: ignore)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks/latest",
                        help="output folder; a run interrupted there resumes when run again with the same "
                             "arguments (default: benchmarks/latest)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results --out holds from another run (without it, a run into an --out "
                             "holding results of other arguments is refused)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=None, metavar="N",
                        help="time servers under N clients at once instead: for each N (and N=1, the answers each "
                             "concurrent one must equal), each server of --methods (server methods only; default: "
                             f"{concurrency.DEFAULT_METHODS}) is started alone with N slots (specdec serve "
                             "--parallel N, llama-server -np N) and N clients send their share of the prompts, all "
                             "starting together; reports aggregate tok/s, request and first-token percentiles and "
                             "the answers identical to N=1's (--repeats and --server-endpoint do not apply)")


def bench_command(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the benchmark described by ``args``; return the exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if getattr(args, "concurrency", None):
        return _concurrency_command(args, argv)
    methods, prompts, settings = _plan(args)
    out = Path(args.out)
    saved = _prepare_output(args, out, methods, prompts, settings)  # before any model work
    planned = len(prompts) * args.repeats * sum(not m.runs_at(s.temperature) for s in settings for m in methods)
    if (have := sum(map(len, saved.values()))) >= planned > 0:
        print(f"specdec bench: all {planned} timed runs are saved in {out} by an earlier invocation of this command: "
              "only writing the report; add --overwrite to run them anew", file=sys.stderr)
    elif have:
        print(f"specdec bench: resuming: {have} of {planned} timed runs are saved in {out}; running the other "
              f"{planned - have}", file=sys.stderr)
    try:
        return _run(args, argv, out, methods, prompts, saved)
    except KeyboardInterrupt:  # Ctrl-C: every finished run is saved already
        have = sum(map(len, saved.values()))
        again = "run the same command again without --overwrite" if args.overwrite else "run the same command again"
        print(f"\nspecdec: interrupted: {have} of {planned} timed runs are saved in {out}", file=sys.stderr)
        print(f"hint: {again} to resume; it runs only the {max(planned - have, 0)} left", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, argv: Sequence[str] | None, out: Path, methods: list[MethodSpec],
         prompts: list[Any], saved: dict[Any, Any]) -> int:
    """Load the models, run each temperature (taking the runs ``saved`` holds) and write the reports."""
    import torch
    import transformers

    check_threads(args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    command = _command(argv)
    env = report.environment(command, args.dtype)
    env["resolved_command"] = _resolved_command(args)
    # the GGUFs first: a missing binding or GGUF, or an argument that cannot hold, fails before any model
    # loads and before the busy-machine warning, so a refusal is the one error it is
    ggufs, servers = gguf_files(args, methods), bench_servers(args, methods)
    _warn_if_busy(env)
    backends = BenchBackends(args.draft_weights, ggufs=ggufs, n_threads=args.threads or torch.get_num_threads(),
                             servers=servers, draft_vocab=args.draft_vocab, draft_quant=args.draft_quant)
    try:
        env["machine"] = report.machine_record(args.threads or torch.get_num_threads(), _target_gguf(backends),
                                               why_no_target="no method runs a GGUF")
        return _run_all(args, command, env, out, methods, prompts, saved, backends)
    finally:
        if backends.servers is not None:
            backends.servers.close()


def _run_all(args: argparse.Namespace, command: str, env: dict[str, Any], out: Path, methods: list[MethodSpec],
             prompts: list[Any], saved: dict[Any, Any], backends: BenchBackends) -> int:
    pair = torch_pair(args, methods)
    info = {"target": report.model_info(pair.target, pair.target_name),
            "draft": report.model_info(pair.draft, pair.draft_name)}
    if info["draft"] is not None:
        info["draft"]["weights"] = backends.draft_weights
    runs = []
    for s, store in saved.items():
        before = _load_average()
        run = run_bench(pair, methods, prompts, s, backends, progress=not args.no_progress, done=store.load(prompts),
                        on_sample=lambda x, store=store: store.save(x, prompts[x.prompt]))
        for backend in backends.ggufs:  # after the run: what its models were loaded with
            info[backend] = report.gguf_info(backends, backend)
        if backends.servers is not None:  # llama-server keeps earlier prompts in RAM: each temperature starts afresh
            backends.servers.stop()
        data = report.results(run, env | {"load_average_run": [before, _load_average()]}, info)
        if run.resumed:  # whether the invocation that made them finished this temperature
            data["resumed_from"] = store.earlier
        folder = _save(lambda where: report.write_run(data, where), out / _run_folder(s), _run_folder(s))
        print(report.markdown(data) + f"\n\n(written to {folder})\n")
        runs.append(data)
    _save(lambda where: write_atomic(where / "README.md", report.summary_markdown(runs, command)), out, "")
    return 0


def _plan(args: argparse.Namespace) -> tuple[list[MethodSpec], list[Any], list[Any]]:
    """(methods, prompts, settings per temperature) from the options; :class:`CLIError` if they are wrong."""
    try:
        methods = parse_methods(args.methods, BACKEND_CHOICES[getattr(args, "backend", TORCH)])
    except ValueError as e:
        raise CLIError(f"--methods: {e}", "write methods like ar,spec:block:k=4,hf-assisted (see 'specdec bench "
                       "--help'; the grammar: the docstring of specdec.bench.methods)", code=2) from None
    try:
        prompts = load_prompts(args.prompts, seed=args.seed)
    except ValueError as e:
        raise CLIError(str(e), 'write prompt sets like humaneval:8,mtbench:8, or a .jsonl file with one '
                       '{"prompt": "..."} object per line', code=2) from None
    settings = [BenchSettings(max_new_tokens=args.max_new_tokens, temperature=t, repeats=args.repeats,
                              warmup_tokens=args.warmup_tokens, seed=args.seed, ignore_eos=args.eos == "ignore",
                              endpoint=args.server_endpoint)
                for t in dict.fromkeys(args.temperature)]
    drafted = [m.name for m in methods if m.needs_draft_model]
    if drafted and args.draft is None:
        raise CLIError(f"{', '.join(drafted)} need{'s' if len(drafted) == 1 else ''} a draft model, but --draft is none",
                       "give --draft MODEL, or leave those methods out of --methods", code=2)
    return methods, prompts, settings


# ------------------------------------------------------------------------------------------
# --concurrency: N clients at once against servers with N slots (specdec.bench.concurrency)


def _concurrency_command(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``specdec bench --concurrency N ...``: plan, check --out, run each temperature, write the reports."""
    methods, prompts, settings = _plan_concurrency(args)
    out = Path(args.out)
    saved = _prepare_output(args, out, methods, prompts, settings)
    try:
        return _run_concurrency(args, argv, out, methods, prompts, saved)
    except KeyboardInterrupt:  # every finished (server, N) run is saved already
        print(f"\nspecdec: interrupted: the finished (server, N) runs are saved in {out}", file=sys.stderr)
        print("hint: run the same command again to resume; it runs only the others", file=sys.stderr)
        return 130


def _plan_concurrency(args: argparse.Namespace) -> tuple[list[MethodSpec], list[Any], list[Any]]:
    """(server methods, prompts, settings per temperature) of a --concurrency run; a
    :class:`CLIError` for a method that is no server or a specdec server that cannot decode
    requests at once."""
    if args.methods == DEFAULT_METHODS:  # not typed: the servers --concurrency compares by default
        args.methods = concurrency.DEFAULT_METHODS
    methods, prompts, _ = _plan(args)
    typed = {parse_method(part, backend).name for part in args.methods.split(",") if part.strip()
             for backend in BACKEND_CHOICES[args.backend]}  # not the library's ar that _plan adds
    in_process = [m.name for m in methods if not m.is_server and (m.kind != "ar" or m.name in typed)]
    methods = [m for m in methods if m.is_server]
    if in_process:
        raise CLIError(f"--concurrency times servers, and {', '.join(in_process)} run{'s' * (len(in_process) == 1)} "
                       "in the bench's process",
                       "add :via=serve to a project method, or name llama-server peers (--methods "
                       f"{concurrency.DEFAULT_METHODS})", code=2)
    serial = [m.name for m in methods if not m.is_peer and not backend_table.BY_NAME[m.backend].shares_passes]
    if serial and max(args.concurrency) > 1:
        raise CLIError(f"--concurrency {max(args.concurrency)}: {', '.join(serial)} would run on a backend that "
                       "serves one request at a time",
                       "add --backend gguf (specdec serve --parallel N decodes on the GGUF kernel)", code=2)
    settings = [concurrency.ConcurrencySettings(
        levels=tuple(args.concurrency), max_new_tokens=args.max_new_tokens, temperature=t, seed=args.seed,
        ignore_eos=args.eos == "ignore", warmup_tokens=args.warmup_tokens) for t in dict.fromkeys(args.temperature)]
    return methods, prompts, settings


def _run_concurrency(args: argparse.Namespace, argv: Sequence[str] | None, out: Path, methods: list[MethodSpec],
                     prompts: list[Any], saved: dict[Any, Any]) -> int:
    import torch

    check_threads(args.threads)
    command = _command(argv)
    env = {k: v for k, v in report.environment(command, None).items() if k != "dtype"}
    env["resolved_command"] = _resolved_command(args)
    servers = bench_servers(args, methods)
    assert servers is not None  # every method is a server's
    _warn_if_busy(env)
    try:
        env["machine"] = report.machine_record(args.threads or torch.get_num_threads(), servers.target_gguf,
                                               why_no_target="no server runs a GGUF")
        models = {"target": _gguf_info(args.target, servers.target_gguf),
                  "draft": _gguf_info(args.draft, servers.draft_gguf) if servers.draft_gguf else None}
        runs = []
        for s, store in saved.items():
            skipped = {m.name: why for m in methods if (why := m.runs_at(s.temperature))}
            before = _load_average()
            cells = concurrency.run(servers, [m for m in methods if m.name not in skipped], prompts, s,
                                    done=_saved_cells(store.folder, prompts),
                                    on_run=lambda cell, store=store: _save_cell(store.folder, cell, prompts))
            data = concurrency.results(cells, s, prompts, env | {"load_average_run": [before, _load_average()]},
                                       models, skipped)
            text = bench_markdown.concurrency_markdown(data)
            folder = _save(lambda where: _write_concurrency(data, text, where), out / _run_folder(s), _run_folder(s))
            print(text + f"\n\n(written to {folder})\n")
            runs.append(data)
    finally:
        servers.close()
    _save(lambda where: write_atomic(where / "README.md", bench_markdown.concurrency_summary(runs, command)), out, "")
    return 0


def _gguf_info(name: str, path: Path) -> dict[str, Any]:
    return {"name": name, "gguf": path.name, "weights": report.gguf_weights(path)}


def _write_concurrency(data: dict[str, Any], text: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "results.json", json.dumps(data, indent=1) + "\n")
    write_atomic(folder / "results.md", text + "\n")


def _cell_file(folder: Path, method: str, n: int) -> Path:
    """``n<N>-<method>-<digest>.json`` (method names hold ':' and '+')."""
    readable = re.sub(r"[^A-Za-z0-9=.+-]+", "_", method)[:60]
    return folder / f"n{n}-{readable}-{hashlib.sha256(method.encode()).hexdigest()[:8]}.json"


def _save_cell(folder: Path, cell: dict[str, Any], prompts: Sequence[Any]) -> None:
    """Keep a finished (server, N) run, so that an interrupted invocation resumes after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(_cell_file(folder, cell["method"], cell["concurrency"]),
                     json.dumps({"prompt_ids": [p.id for p in prompts], "run": cell}) + "\n")
    except OSError as e:
        print(f"specdec bench: warning: cannot save a finished run into {folder} ({e})", file=sys.stderr)


def _saved_cells(folder: Path, prompts: Sequence[Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The saved (server, N) runs of these prompts, by (method, N); any other file is left out."""
    done = {}
    for path in sorted(folder.glob("n*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            if record["prompt_ids"] != [p.id for p in prompts]:
                continue
            cell = record["run"]
            done[cell["method"], int(cell["concurrency"])] = cell
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return done


def _run_folder(settings: Any) -> str:
    return "greedy" if settings.greedy else f"t{settings.temperature:g}"


# Options that change neither what runs nor how it is timed: a rerun may change them and resume.
# The methods, prompts and temperatures are recorded as parsed instead of as typed.
_NOT_DEFINING = ("out", "overwrite", "no_progress", "cache_dir", "methods", "backend", "prompts", "temperature")


def _prepare_output(args: argparse.Namespace, out: Path, methods: list[MethodSpec], prompts: list[Any],
                    settings: list[Any]) -> dict[Any, Any]:
    """Check ``out`` can take this run (:func:`specdec.bench.resume.prepare`) and make its folders;
    the saved runs of each temperature (:class:`~specdec.bench.resume.SavedRuns`) by its settings."""
    defaults = argparse.ArgumentParser()
    _add_arguments(defaults)
    arguments = {key: getattr(args, key) for key in vars(defaults.parse_args([])) if key not in _NOT_DEFINING}
    arguments |= {"methods": [m.name for m in methods], "temperature": [s.temperature for s in settings],
                  "prompts": [[p.set, p.id, resume.prompt_digest(p)] for p in prompts]}
    if not arguments.get("concurrency"):  # as recorded before --concurrency existed: such a run resumes
        arguments.pop("concurrency", None)
    if arguments.get("draft_quant") is None:  # as recorded before --draft-quant existed: such a run resumes
        arguments.pop("draft_quant", None)
    prepare_folder(out)
    try:
        resume.prepare(out, arguments, _resolved_command(args), overwrite=args.overwrite)
    except resume.OutputInUse as e:
        raise CLIError(e.message, e.hint, code=2) from None
    except OSError as e:
        raise CLIError(f"--out: cannot write into {out} ({e.strerror or e})",
                       "give --out a folder you can write to", code=2) from None
    return {s: resume.SavedRuns(prepare_folder(out / _run_folder(s))) for s in settings}


def _save(write: Any, folder: Path, name: str) -> Path:
    """``write(folder)``; if that fails, ``write`` into a new temporary folder instead and say where,
    so a finished run is never lost."""
    try:
        write(folder)
        return folder
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix="specdec-bench-")) / name
        fallback.mkdir(parents=True, exist_ok=True)
        print(f"specdec bench: warning: could not write into {folder} ({e}); writing to {fallback} instead",
              file=sys.stderr)
        write(fallback)
        return fallback


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


def torch_pair(args: argparse.Namespace, methods: Sequence[MethodSpec]) -> Pair:
    """The transformers target, and the draft when a method on torch needs one, loaded as ``specdec
    generate`` loads them (:func:`specdec.cli.common.load_models`; the bench's --backend says where
    methods run, not how these load). The pair names the draft when a method on any backend drafts
    with it."""
    has_draft = args.draft is not None
    wants_draft = has_draft and any(m.needs_draft_model and not backend_table.BY_NAME[m.backend].runs_gguf for m in methods)
    pair = common.load_models(args.target, args.draft if wants_draft else None, backend=TORCH,
                               cache_dir=args.cache_dir, dtype=args.dtype, kernels=args.kernels, threads=args.threads)
    draft = pair.draft
    if draft is pair.target:  # the peers' forward hooks must tell the two apart
        draft = copy.deepcopy(pair.target)
    drafts = has_draft and any(m.needs_draft_model for m in methods)
    return dataclasses.replace(pair, draft=draft, draft_name=args.draft if draft is not None or drafts else None)


def gguf_files(args: argparse.Namespace, methods: Sequence[MethodSpec]) -> dict[str, GGUFs]:
    """For each GGUF backend a method, peer or server runs on, the GGUFs it runs (the runner loads
    them, once, when it knows the context): the target's, and the draft's where a method there
    drafts with a model. A :class:`CLIError` when a backend is not available here (llama.cpp's
    binding missing) or a model has no GGUF (:func:`located_gguf`)."""
    ggufs = {}
    for row in backend_table.TABLE:
        on_it = [m for m in methods if m.backend == row.name]
        if not row.runs_gguf or not on_it:
            continue
        if not row.available():
            raise CLIError(f"{', '.join(m.name for m in on_it)} run on {row.label}, which needs its binding",
                           f"install it ({llamacpp_backend.INSTALL}), or leave out the {row.label} methods "
                           "(--backend torch, no llamacpp-ar)", code=2)
        draft = args.draft is not None and any(m.needs_draft_model for m in on_it)
        if draft and isinstance(args.draft_vocab, int) and not row.trims_draft_head:
            raise CLIError(f"--draft-vocab trims the head of a draft on specdec's GGUF kernel, but "
                           f"{', '.join(m.name for m in on_it if m.needs_draft_model)} draft on {row.label}",
                           "run those methods with backend=gguf, or leave --draft-vocab out", code=2)
        if draft and args.draft_quant is not None and args.draft == args.target:
            raise CLIError(f"--draft-quant requantizes a draft model's own weights, but the draft {args.draft} is the "
                           "target", "leave --draft-quant out, or name another draft", code=2)
        ggufs[row.name] = GGUFs(located_gguf(args.target, args), located_gguf(args.draft, args) if draft else None)
    return ggufs


def bench_servers(args: argparse.Namespace, methods: Sequence[MethodSpec]) -> Servers | None:
    """The servers of the run's llama-server peers and ``via=serve`` methods (started when first
    used); None when no method runs through a server. A :class:`CLIError` when llama-server is
    not built."""
    served = [m for m in methods if m.is_server]
    if not served:
        return None
    if any(m.is_peer for m in served):
        try:
            llama_server_binary()
        except ServerMissing as err:
            raise CLIError(str(err), "or leave out the llama-server peers", code=2) from None
    target = gguf_path(args.target, args) if any(m.backend in backend_table.GGUF_NAMES for m in served) else None
    draft = (gguf_path(args.draft, args) if args.draft is not None
             and any(m.needs_draft_model for m in served) else None)
    argv = ["--target", args.target, "--draft", args.draft or "none", *(["--cache-dir", args.cache_dir] if args.cache_dir else [])]
    torch_argv = []  # only what was typed: the torch backend's options, for servers on torch
    for dest in ("dtype", "kernels", "draft_weights"):
        if common.given(args, dest):
            torch_argv += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    if common.given(args, "draft_vocab"):  # the servers' drafts on the GGUF kernel
        argv += ["--draft-vocab", str(args.draft_vocab)]
    if common.given(args, "draft_quant"):
        argv += ["--draft-quant", args.draft_quant]
    return Servers(target, draft, argv, n_threads=args.threads, n_ctx=llamacpp_backend.DEFAULT_CTX,
                   torch_argv=torch_argv)


def _target_gguf(backends: BenchBackends) -> Path | None:
    """The target's GGUF where a method runs one (on llama.cpp, the GGUF kernel or a server)."""
    paths = [files.target.path for files in backends.ggufs.values()]
    return next(iter(paths), getattr(backends.servers, "target_gguf", None))


def gguf_path(name: str, args: argparse.Namespace) -> Path:
    """The GGUF file a model name stands for on llama.cpp (:func:`located_gguf`)."""
    return located_gguf(name, args).path


def located_gguf(name: str, args: argparse.Namespace) -> models.Located:
    """A model name located (:func:`specdec.models.locate`) as a GGUF to run on llama.cpp or
    specdec's GGUF kernel: a pack's (joined and hash-checked) or a local file."""
    if models.is_gguf_source(name) and (name in models.PACKS or Path(name).expanduser().is_file()):
        try:
            return models.locate(name, args.cache_dir)
        except models.ModelPackError as err:
            raise CLIError(err.message, err.hint) from None
    raise CLIError(f"the llama.cpp backend runs GGUF files, and {name} is neither a model pack nor a .gguf file",
                   f"give a pack ({', '.join(packs.PACKS)}) or a .gguf file, or run the methods on "
                   "--backend torch", code=2)


def _command(argv: Sequence[str] | None) -> str:
    """The invocation as typed, as far as it can be recovered."""
    if argv is not None:
        return shlex.join(["specdec", "bench", *argv])
    program, args = Path(sys.argv[0]).name, sys.argv[1:]
    if program in ("__main__.py", "bench.py"):  # python -m specdec bench ..., or python -m specdec.bench ...
        program = "specdec" if args[:1] == ["bench"] else "python -m specdec.bench"
    return " ".join([program, *map(shlex.quote, args)])


def _resolved_command(args: argparse.Namespace) -> str:
    """The same run with every option spelled out, defaults included."""
    options = argparse.ArgumentParser()
    _add_arguments(options)
    parts = ["specdec", "bench"]
    for key in vars(options.parse_args([])):
        value = getattr(args, key)
        if key == "draft" and value is None:  # --draft none: no draft model
            value = "none"
        if value is None or value is False or key == "overwrite":  # rerun as recorded, it resumes
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
    parser = Parser(prog="python -m specdec.bench", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    _add_arguments(parser)
    keep_freed_memory()  # as the specdec command does (specdec.memory)
    try:
        return bench_command(parser.parse_args(argv), argv)
    except CLIError as err:
        return fail(err.message, err.hint, err.code)
