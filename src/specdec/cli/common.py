"""The command line's shared option table and helpers, for every entry point under :mod:`specdec.cli`.

The option groups (:func:`add_model_options`, :func:`add_backend_option`,
:func:`add_decoding_options`, the decoding options built from :func:`specdec.config.options`), the
number types argparse checks values with, :func:`decode_config` (the options to a
:class:`~specdec.config.DecodeConfig`), :func:`load_models` (names to a loaded
:class:`~specdec.models.Pair`, with notes on what loads) and the way a command reports: a problem
the user can fix is a :class:`CLIError` (one line and a hint, :func:`fail`), a note or warning one
``specdec: ...`` line on stderr (:func:`note`, :func:`one_line_warnings`).

This module imports only the library; the sub-commands import it and never each other.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

from specdec import models, packs, requantize
from specdec.backends import llamacpp
from specdec.backends import table as backend_table
from specdec.backends.table import AUTO, TORCH
from specdec.config import GROUP_FIELD, NAME_ONLY, ConfigError, DecodeConfig, NothingToVerify, option, options
from specdec.constraints import ConstraintError, Constraints, check_logprobs
from specdec.options import Option


class CLIError(Exception):
    """A problem the user can fix: ``message`` says what, ``hint`` says how."""

    def __init__(self, message: str, hint: str, code: int = 1) -> None:
        super().__init__(message)
        self.message, self.hint, self.code = message, hint, code


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line plus a hint (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CLIError(message, f"run '{self.prog} --help' to see the options", code=2)


# ------------------------------------------------------------------------------------------------
# Option types: each raises ArgumentTypeError, which argparse turns into "argument -k: <message>".


def _number(kind: Callable[[str], Any], test: Callable[[Any], bool], wanted: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    parse.__name__ = wanted
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
non_negative_float = _number(float, lambda v: math.isfinite(v) and v >= 0.0, "a finite number >= 0")  # no NaN, inf
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0.0, "a finite number > 0")
probability = _number(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
seed_int = _number(int, lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)")  # what torch.manual_seed takes
context_tokens = _number(int, lambda v: v >= models.MIN_CONTEXT, f"a number of tokens >= {models.MIN_CONTEXT}")


def draft_vocab(text: str) -> int | str:
    """--draft-vocab's type: ``all`` (any case), or a positive number of ids."""
    if text.strip().lower() == models.ALL_IDS:
        return models.ALL_IDS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive number of ids or 'all', got {text!r}")
    return value


def draft_name(text: str) -> str | None:
    """--draft's type: None for ``none`` (any case: the target decodes alone), else the model's name.
    The command line reads ``args.draft is None``, never the word."""
    return None if text.lower() == "none" else text


class Given(argparse.Action):
    """Store the value and remember that the option was given (so a default can be told apart)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the option stored in ``dest`` was typed on the command line (options using :class:`Given`)."""
    return dest in getattr(args, "given", frozenset())


# ------------------------------------------------------------------------------------------------
# Option groups, shared by subcommands


def add_model_options(parser: argparse.ArgumentParser, *, draft: bool = True) -> None:
    """--target, --dtype, --kernels, --cache-dir, and unless ``draft`` is False --draft and --draft-weights."""
    group = parser.add_argument_group("models")
    pack_names = ", ".join(models.PACKS)
    group.add_argument("--target", default=models.DEFAULT_TARGET, metavar="MODEL",
                       help=f"pack name ({pack_names}), local Hugging Face model directory or .gguf file "
                            f"(default: {models.DEFAULT_TARGET})")
    if draft:
        group.add_argument("--draft", default=models.DEFAULT_DRAFT, metavar="MODEL", type=draft_name, action=Given,
                           help=f"draft model, as for --target; must share the target's vocabulary; "
                                f"'none' decodes with the target alone (default: {models.DEFAULT_DRAFT})")
        weights = option("sampling", "draft_weights")
        group.add_argument(weights.flag, default=weights.default, choices=list(weights.choices()), help=weights.help)
        group.add_argument("--draft-vocab", type=draft_vocab, default=None, metavar="N|all", action=Given,
                           help="how many ids of its vocabulary a draft model on specdec's GGUF kernel scores: the N "
                                "most frequent (in Python's own source and documentation; its special and chat tokens "
                                "always), so its head reads N of its rows; 'all' scores every id. Output stays the "
                                "target's; a target token outside the N cannot be drafted (default: all; "
                                f"{models.DRAFT_VOCAB} measured best per draft token for the default pair)")
        group.add_argument("--draft-quant", type=str.lower, choices=list(requantize.FORMATS), default=None,
                           action=Given,
                           help="run a draft model's GGUF with its layers' Q5_0/Q5_1/Q8_0 tensors requantized to "
                                "this type (made once into the cache): fewer bytes read per draft token, some "
                                "agreement with the target lost; output stays the target's (default: the file's "
                                "own types)")
    group.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], action=Given,
                       help="compute dtype (default: bfloat16; on CPU verification is only cheap in bf16)")
    group.add_argument("--kernels", default="auto", choices=["auto", "torch"], action=Given,
                       help="linear-layer kernels: 'auto' uses specdec's batch-invariant bf16 kernel where "
                            "the CPU and a C compiler allow (a k-token forward then costs little more than "
                            "a 1-token one); 'torch' keeps PyTorch's (default: auto)")
    group.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="where converted packs and the compiled kernels live "
                            f"(default: ${models.CACHE_ENV} or ~/.cache/specdec)")


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    """--backend {auto,torch,llamacpp,gguf}, read by :func:`load_models_from` (bench has its own --backend)."""
    parser.add_argument("--backend", default=backend_table.AUTO, choices=list(backend_table.CHOICES),
                        help="'llamacpp' runs a pack's or a .gguf file's quantised weights in llama.cpp (needs "
                             "llama-cpp-python); 'gguf' runs them on specdec's own batch-invariant kernel "
                             "(llama, qwen2, qwen3, phi3 and gemma3 models; a verification pass of a few rows costs little more "
                             "than one row, and every row is computed as a one-token step computes it, so greedy and seeded "
                             "output is plain decoding's token for token); 'torch' converts them to bf16 for "
                             "transformers; 'auto' runs a GGUF on the kernel wherever it runs the file, else on "
                             "llama.cpp where its binding is installed (else it says to install it), and says which "
                             "and why (default: auto)")


def add_context_option(group: Any, *, per: str = "the generation") -> None:
    """-c/--ctx-size: the context, in tokens, of the GGUF backends' KV caches (one per ``per``)."""
    group.add_argument("-c", "--ctx-size", type=context_tokens, default=None, metavar="N", dest="ctx_size",
                       help=f"tokens of context for {per} on a GGUF backend (llama.cpp's n_ctx): prompt and output "
                            f"together; at least {models.MIN_CONTEXT}, at most what the model was trained on, read "
                            "from the GGUF (32768 for the default pair). Each cache of the default pair takes "
                            "80 KiB a token on specdec's kernel: 340 MiB at 4096, 2.7 GB at 32768 (its pages are "
                            "taken as it fills) (default: 4096, or the model's trained context if shorter)")


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The decoding options, one per row of :func:`specdec.config.options` (--draft-weights is
    among the model options). A method option left out is None, so the config's default applies."""
    group = parser.add_argument_group("decoding")
    for opt in options():
        if opt.flag is None or opt.name == "draft_weights":
            continue
        kwargs: dict[str, Any] = dict(dest=opt.dest, help=opt.help,
                                      default=opt.default if opt.group == "sampling" else None)
        if opt.choices is not None:
            kwargs.update(choices=list(opt.choices()), metavar=None)
        else:
            kwargs.update(type=_option_type(opt), metavar=opt.name.upper() if len(opt.flag) > 2 else "K")
        if opt.name == "choices":
            kwargs.update(nargs="?", const=_option_type(opt)("default"), metavar="PATHS")
        group.add_argument(opt.flag, **kwargs)
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="end generation at this text (repeatable)")


def add_constraint_options(parser: argparse.ArgumentParser) -> None:
    """What each generation constrains or reports (:class:`~specdec.constraints.Constraints`):
    options of the generation, not of the decoding method."""
    group = parser.add_argument_group("constraints")
    shape = group.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema file")
    shape.add_argument("--regex", metavar="RE", help="the whole output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this llguidance Lark grammar file")
    group.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                       help="add BIAS (-100..100) to token ID's logit (repeatable)")
    group.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                       help="subtract P (-2..2) from the logit of every token already generated (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                       help="subtract F (-2..2) per occurrence from the logit of every generated token (default: 0)")
    group.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R",
                       help="llama.cpp's: divide the positive logits (multiply the others) of the last "
                            "--repeat-last-n tokens by R (default: 1, off)")
    group.add_argument("--repeat-last-n", type=int, default=64, metavar="N",
                       help="tokens of prompt and output --repeat-penalty looks at (-1: all, 0: off; default: 64)")
    group.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help="report each token's log-probability and the N (0..20) most likely tokens (in --json's "
                            "report, else printed after the text)")


def constraints_from(args: argparse.Namespace) -> tuple[Constraints | None, int | None]:
    """The :class:`~specdec.constraints.Constraints` and logprobs the constraint options describe
    (None where none is given), checked here, before any model loads (the vocabulary-dependent
    checks come with the model)."""
    bias = {}
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise CLIError(f"--logit-bias {item!r} is not ID=BIAS", "write a token id and a number, e.g. --logit-bias 42=-100",
                           code=2) from None
    def read(path: str | None, flag: str, what: str) -> str | None:
        if path is None:
            return None
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CLIError(f"{flag} {path}: cannot read it ({err})", f"give {flag} the path of {what} (UTF-8 text)",
                           code=2) from None
    schema = read(args.json_schema, "--json-schema", "a JSON Schema file, e.g. examples/person.json in specdec's repository")
    constraints = Constraints(json_schema=schema, regex=args.regex,
                              grammar=read(args.grammar, "--grammar", "an llguidance Lark grammar file"), logit_bias=bias,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n)
    try:
        constraints.check(vocab_size=1 << 31)
        check_logprobs(args.logprobs)
    except ConstraintError as err:
        raise constraint_cli_error(err) from None
    return (constraints if constraints.active else None), args.logprobs


def constraint_cli_error(err: ConstraintError) -> CLIError:
    """A :class:`~specdec.constraints.ConstraintError` as the command line says it, naming the flag."""
    flag = "--" + err.field.replace("_", "-")
    return CLIError(str(err).replace(f"{err.field}:", f"{flag}:", 1), f"see 'specdec generate --help' for {flag}", code=2)


def _option_type(opt: Option) -> Callable[[str], Any]:
    """An argparse type for ``opt``: its reader, whose ValueError becomes "expected <what it takes>"."""
    def parse(text: str) -> Any:
        try:
            return opt.value(text)
        except ValueError as err:
            message = str(err) if opt.name == "choices" else f"expected {opt.accepts}, got {text!r}"
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = opt.accepts
    return parse


def cli_spelling(group: str, name: str, value: Any) -> str:
    """How the command line names an option (:class:`~specdec.config.ConfigError`): ``--verify tree``."""
    flag = option(group, name).flag or f"--{name.replace('_', '-')}"
    return flag if value is NAME_ONLY else f"{flag} {value}"


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    """The :class:`~specdec.config.DecodeConfig` the decoding options describe, its default drafter
    named for --draft; checked here, before any model loads."""
    values: dict[str, Any] = {"stop": args.stop}
    for opt in options():
        value = getattr(args, opt.dest, None) if opt.dest else None
        if value is None:
            continue
        if opt.group in ("method", "sampling"):
            values[opt.name] = value
        else:
            values.setdefault(GROUP_FIELD[opt.group], {})[opt.name] = value
    has_draft = getattr(args, "draft", None) is not None
    try:
        config = DecodeConfig(**values).resolve(has_draft, draft_flag="--draft")
    except NothingToVerify as err:
        shown = cli_spelling("method", err.name, err.value)
        raise CLIError(f"--draft none decodes with the target alone, so {shown} has nothing to act on",
                       f"drop {cli_spelling('method', err.name, NAME_ONLY)}, or give a draft (--draft "
                       f"{models.DEFAULT_DRAFT}) or a drafter that needs none (--drafter ngram)", code=2) from None
    except ConfigError as err:
        message, hint = err.render(cli_spelling)
        raise CLIError(message, hint or "see 'specdec generate --help'", code=2) from None
    except (TypeError, ValueError) as err:
        raise CLIError(str(err), "see 'specdec generate --help'", code=2) from None
    if not config.uses_draft_model and given(args, "draft") and has_draft:
        note(f"warning: --drafter {config.drafter} drafts without a draft model; --draft {args.draft} is ignored "
             "(drop --draft, or use --drafter model to draft with it)")
    return config


# ------------------------------------------------------------------------------------------------
# Loading models


def load_models(target: str, draft: str | None = None, *, backend: str = TORCH, cache_dir: str | None = None,
                dtype: str = "bfloat16", kernels: str = "auto", threads: int | None = None,
                draft_weights: str = "int8", typed: Collection[str] = (), ctx_size: int | None = None,
                draft_vocab: int | str | None = None, draft_quant: str | None = None) -> models.Pair:
    """The target and, unless ``draft`` is None, the draft, as a
    :class:`~specdec.models.Pair` (:func:`specdec.models.load_pair`, which checks the two share a
    vocabulary): what every sub-command that decodes holds. Notes on stderr say what loads, and a
    pack error is a :class:`CLIError`.

    backend: --backend ('auto', 'torch', 'llamacpp' or 'gguf'); threads: the GGUF backends' thread
    count (None: their default); ctx_size: --ctx-size, their context (None: their default);
    draft_vocab: --draft-vocab (None: the default; :func:`specdec.models.trim_draft`);
    draft_quant: --draft-quant (None: the draft's file as it is; :func:`specdec.models.requantized_draft`);
    draft_weights: --draft-weights, kept in the pair. typed: the
    options the user typed (``args.given``): a typed --dtype or --kernels is refused when every
    model runs a GGUF's own weights, where they do not apply."""
    names = [target] + ([draft] if draft is not None else [])
    _check_torch_options(names, backend, typed)

    def loading(name: str, where: str) -> None:
        weights = backend_table.BY_NAME[where].weights  # None: transformers, in --dtype
        if weights is None and models.is_gguf_source(name):
            weights = f"its GGUF dequantized to {dtype} for transformers"
        note(f"loading {name} ({weights or dtype})")

    try:
        pair = models.load_pair(target, draft, backend=backend, cache_dir=cache_dir, dtype=dtype, kernels=kernels,
                                n_threads=threads, n_ctx=ctx_size, draft_vocab=draft_vocab, draft_quant=draft_quant,
                                on_load=loading)
    except (models.ModelPackError, models.ContextSizeError) as err:
        raise CLIError(err.message, err.hint) from None
    pair.draft_weights = draft_weights
    if backend == AUTO and backend_table.BY_NAME[pair.backend].runs_gguf:
        note(f"{pair.target_name} runs on {pair.backend_why}")
    elif pair.backend_why != "asked for":  # a named backend whose output may differ from plain decoding
        note(f"{pair.target_name} runs on {backend_table.LABELS[pair.backend]} ({pair.backend_why})")
    _loaded_notes(pair.target_name, pair.target, pair.backend)
    if pair.draft_name is not None and pair.draft_name != pair.target_name:  # the same name: the target's weights
        _loaded_notes(pair.draft_name, pair.draft, pair.draft_backend)
    if pair.draft_vocab is not None:
        note(f"{pair.draft_name} drafts over the {pair.draft_vocab:,} most frequent of its {pair.draft.vocab_size:,} ids "
             "(--draft-vocab all: every id)")
    if pair.draft_quant is not None:
        note(f"{pair.draft_name}'s layers run requantized to {pair.draft_quant.upper()} (--draft-quant)")
    return pair


def load_models_from(args: argparse.Namespace, *, draft: bool = True) -> models.Pair:
    """:func:`load_models` with what the parsed options say: --target, --draft (unless ``draft`` is
    False), --backend (torch where the command has none), --cache-dir, --dtype, --kernels, --threads,
    --ctx-size, --draft-weights, --draft-vocab."""
    return load_models(args.target, args.draft if draft else None, backend=getattr(args, "backend", TORCH),
                       cache_dir=getattr(args, "cache_dir", None), dtype=args.dtype,
                       kernels=getattr(args, "kernels", "auto"), threads=getattr(args, "threads", None),
                       draft_weights=getattr(args, "draft_weights", "int8"), typed=getattr(args, "given", frozenset()),
                       ctx_size=getattr(args, "ctx_size", None), draft_vocab=getattr(args, "draft_vocab", None),
                       draft_quant=getattr(args, "draft_quant", None))


def _loaded_notes(name: str, model: Any, backend: str) -> None:
    """What a loaded model runs: a GGUF's weights on llama.cpp, and the prefill layout it chose."""
    if backend in backend_table.GGUF_NAMES:
        note(f"{name}: {gguf_weights(model)}")
    choice = getattr(model, "prefill_choice", None)
    if choice and choice.get("layout") == "file" and "seconds" in choice:
        t = choice["seconds"]
        note(f"{name}: prompts prefill on the GGUF's stored weight layout, decoding on llama.cpp's repacked one "
             f"({choice['rows']} rows took {t['file']:.2f} s against {t['repacked']:.2f} s; {choice['source']})")


def check_cache_dir(cache_dir: str | None, *, create: bool) -> None:
    """--cache-dir is usable (:func:`specdec.packs.check_cache_dir`), else a :class:`CLIError`."""
    try:
        packs.check_cache_dir(cache_dir, create=create)
    except models.ModelPackError as err:
        raise CLIError(err.message, err.hint) from None


def _check_torch_options(names: list[str], backend: str, typed: Collection[str]) -> None:
    """--dtype and --kernels shape transformers models: refused when typed and every model runs a
    GGUF's own weights (whether the backend runs the models at all, :func:`specdec.models.load_pair` checks)."""
    row = backend_table.BY_NAME.get(backend)  # None: auto, which runs a GGUF's own weights
    runs_gguf = row is None or row.runs_gguf
    if not names or not runs_gguf or not all(models.is_gguf_source(name) for name in names):
        return
    where = backend_table.LABELS[backend] if backend in backend_table.GGUF_NAMES else "a GGUF backend"
    for flag, dest in (("--dtype", "dtype"), ("--kernels", "kernels")):
        if dest in typed:
            raise CLIError(f"{flag} is an option of the torch backend, but {names[0]} runs on "
                           f"{where} (its GGUF's own weights)",
                           f"drop {flag}, or add --backend torch to run the model in transformers", code=2)


def gguf_weights(model: Any) -> str:
    """What a model loaded from a GGUF runs: 'llama 135M Q4_1 GGUF via llama.cpp' (as llama.cpp
    describes it), or 'llama 30x576 (Q4_1/Q6_K) GGUF on specdec kernels (avx2 path)': the kernel's
    path, the instructions its products run on here (:data:`specdec.backends.gguf.PATHS`)."""
    row = backend_table.row_of(model)
    path = row.kernel_path(model)  # the kernel's, as it says
    path = f" ({path} path)" if path is not None else ""
    return f"{model.weights.description} {row.weights}{path}"


def check_threads(threads: int | None) -> None:
    """Warn when --threads asks for more threads than the CPUs this process may run on."""
    cpus = llamacpp.default_threads()
    if threads is not None and threads > cpus:
        note(f"warning: --threads {threads} is more than the {cpus} CPUs this process may run on; threads "
             f"beyond them only contend (use --threads {cpus} or fewer)")


def prepare_folder(folder: Path) -> Path:
    """Create ``folder`` (and its parents) and check files can be written in it: --out's check."""
    for parent in (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            raise CLIError(f"--out: {parent} is a file, not a folder",
                           "give --out a folder path (it is created if missing)", code=2)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise CLIError(f"--out: cannot write into {folder} ({e.strerror or e})",
                       "give --out a folder you can write to", code=2) from None
    return folder


# ------------------------------------------------------------------------------------------------
# Reporting: errors, notes, warnings


def fail(message: str, hint: str, code: int) -> int:
    """Print an error and its hint, as every command does, and return the exit status ``code``."""
    print(f"specdec: error: {message}", file=sys.stderr)
    print(f"hint: {hint}", file=sys.stderr)
    return code


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Warnings (e.g. the library's: the context leaves less room than --max-new-tokens) as
    'specdec: warning: ...' lines, without the source line Python adds."""
    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"specdec: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def note(message: str) -> None:
    """One 'specdec: ...' line on stderr (what loads, what runs, a warning)."""
    print(f"specdec: {message}", file=sys.stderr, flush=True)


def console(file: Any) -> Any:
    """A rich console on ``file`` that neither highlights nor wraps."""
    from rich.console import Console

    return Console(file=file, highlight=False, soft_wrap=True)


def quiet_libraries() -> None:
    """transformers' advisory warnings are noise on a command line."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
