"""The command line: ``specdec generate`` and ``specdec models``, thin layers over the library.

Subcommands register themselves on the argparse subparsers with ``add_<name>_parser(subparsers)``
and ``set_defaults(func=handler)``; a handler takes the parsed arguments and returns the exit
status. ``specdec bench`` is picked up from ``specdec.bench.cli.add_bench_parser`` when that module
exists. The option groups (:func:`add_model_options`, :func:`add_decoding_options`) and
:func:`load_models` / :func:`decoding_kwargs` are there for such modules to reuse.

Errors a user can fix (a bad option value, an unknown model, a missing pack, mismatched
vocabularies) print one line and a hint on stderr, never a traceback: exit status 2 for bad
options, 1 otherwise. Set ``SPECDEC_DEBUG=1`` to see the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Sequence

from specdec import models, packs
from specdec.config import (
    GROUP_FIELD, NAME_ONLY, OPTIONS, SAMPLING_FIELDS, ConfigError, DecodeConfig, NothingToVerify, Option, option,
)
from specdec.drafters import MODEL_DRAFTERS
from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
from specdec.memory import keep_freed_memory


class CLIError(Exception):
    """A problem the user can fix: ``message`` says what, ``hint`` says how."""

    def __init__(self, message: str, hint: str, code: int = 1) -> None:
        super().__init__(message)
        self.message, self.hint, self.code = message, hint, code


class _Parser(argparse.ArgumentParser):
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


class _Given(argparse.Action):
    """Store the value and remember that the option was given (so a default can be told apart)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the option stored in ``dest`` was typed on the command line (options using :class:`_Given`)."""
    return dest in getattr(args, "given", frozenset())


# ------------------------------------------------------------------------------------------------
# Option groups, shared by subcommands


def add_model_options(parser: argparse.ArgumentParser, *, draft: bool = True) -> None:
    """--target, --dtype, --kernels, --cache-dir, and unless ``draft`` is False --draft and --draft-weights."""
    group = parser.add_argument_group("models")
    packs = ", ".join(models.PACKS)
    group.add_argument("--target", default=models.DEFAULT_TARGET, metavar="MODEL",
                       help=f"pack name ({packs}), local Hugging Face model directory or .gguf file "
                            f"(default: {models.DEFAULT_TARGET})")
    if draft:
        group.add_argument("--draft", default=models.DEFAULT_DRAFT, metavar="MODEL", action=_Given,
                           help=f"draft model, as for --target; must share the target's vocabulary; "
                                f"'none' decodes with the target alone (default: {models.DEFAULT_DRAFT})")
        weights = option("sampling", "draft_weights")
        group.add_argument(weights.flag, default=weights.default, choices=list(weights.choices()), help=weights.help)
    group.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], action=_Given,
                       help="compute dtype (default: bfloat16; on CPU verification is only cheap in bf16)")
    group.add_argument("--kernels", default="auto", choices=["auto", "torch"], action=_Given,
                       help="linear-layer kernels: 'auto' uses specdec's batch-invariant bf16 kernel where "
                            "the CPU and a C compiler allow (a k-token forward then costs little more than "
                            "a 1-token one); 'torch' keeps PyTorch's (default: auto)")
    group.add_argument("--cache-dir", default=None, metavar="DIR",
                       help=f"where converted packs live (default: ${models.CACHE_ENV} or ~/.cache/specdec)")


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    """--backend {auto,torch,llamacpp}, read by :func:`load_models` (bench has its own --backend)."""
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "llamacpp"],
                        help="'llamacpp' runs a pack's or a .gguf file's quantised weights in llama.cpp (needs "
                             "llama-cpp-python); 'torch' converts them to bf16 for transformers; 'auto' picks "
                             "llamacpp for GGUF models when the binding is installed, else torch (default: auto)")


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The decoding options, one per row of :data:`specdec.config.OPTIONS` (--draft-weights is
    among the model options). A method option left out is None, so the config's default applies."""
    group = parser.add_argument_group("decoding")
    for opt in OPTIONS:
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
    for opt in OPTIONS:
        value = getattr(args, opt.dest, None) if opt.dest else None
        if value is None:
            continue
        if opt.group in ("method", "sampling"):
            values[opt.name] = value
        else:
            values.setdefault(GROUP_FIELD[opt.group], {})[opt.name] = value
    has_draft = str(getattr(args, "draft", None)).lower() != "none"
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
    if config.drafter not in MODEL_DRAFTERS and given(args, "draft") and has_draft:
        _note(f"warning: --drafter {config.drafter} drafts without a draft model; --draft {args.draft} is ignored "
              "(drop --draft, or use --drafter model to draft with it)")
    return config


def load_models(args: argparse.Namespace, *, draft: bool = True) -> models.Pair:
    """The target and, unless ``draft`` is False or --draft is none, the draft, as a
    :class:`~specdec.models.Pair` (:func:`specdec.models.load_pair`, which checks the two share a
    vocabulary); notes on stderr say what loads, and a pack error is a :class:`CLIError`."""
    names = [args.target] + ([args.draft] if draft and args.draft is not None else [])
    _check_torch_options(args, [n for n in names if n.lower() != "none"])

    def loading(name: str, backend: str) -> None:
        _note(f"loading {name} ({args.dtype if backend == 'torch' else 'GGUF via llama.cpp'})")

    try:
        pair = models.load_pair(args.target, args.draft if draft else None,
                                backend=getattr(args, "backend", "torch"), cache_dir=getattr(args, "cache_dir", None),
                                dtype=args.dtype, kernels=getattr(args, "kernels", "auto"),
                                n_threads=getattr(args, "threads", None), on_load=loading)
    except models.ModelPackError as err:
        raise CLIError(err.message, err.hint) from None
    _loaded_notes(pair.target_name, pair.target, pair.backend)
    if pair.draft_name is not None and pair.draft_name != pair.target_name:  # the same name: the target's weights
        _loaded_notes(pair.draft_name, pair.draft, backend_of(pair.draft_name, args))
    return pair


def _loaded_notes(name: str, model: Any, backend: str) -> None:
    """What a loaded model runs: a GGUF's weights on llama.cpp, and the prefill layout it chose."""
    if backend == "llamacpp":
        _note(f"{name}: {gguf_weights(model)}")
    choice = getattr(model, "prefill_choice", None)
    if choice and choice.get("layout") == "file" and "seconds" in choice:
        t = choice["seconds"]
        _note(f"{name}: prompts prefill on the GGUF's stored weight layout, decoding on llama.cpp's repacked one "
              f"({choice['rows']} rows took {t['file']:.2f} s against {t['repacked']:.2f} s; {choice['source']})")


def _check_cache_dir(args: argparse.Namespace, *, create: bool) -> None:
    try:
        packs.check_cache_dir(getattr(args, "cache_dir", None), create=create)
    except models.ModelPackError as err:
        raise CLIError(err.message, err.hint) from None


def backend_of(name: str, args: argparse.Namespace) -> str:
    """``torch`` or ``llamacpp``: where model ``name`` runs under --backend."""
    try:
        return models.resolve_backend(name, getattr(args, "backend", "torch"))
    except models.ModelPackError as err:
        raise CLIError(err.message, err.hint) from None


def _check_torch_options(args: argparse.Namespace, names: list[str]) -> None:
    """--dtype and --kernels shape transformers models: refused when given and every model runs on llama.cpp."""
    if not names or any(backend_of(name, args) == "torch" for name in names):
        return
    for option, dest in (("--dtype", "dtype"), ("--kernels", "kernels")):
        if given(args, dest):
            raise CLIError(f"{option} is an option of the torch backend, but {names[0]} runs on llama.cpp "
                           "(its GGUF's own weights)",
                           f"drop {option}, or add --backend torch to run the model in transformers", code=2)


def gguf_weights(model: Any) -> str:
    """What a model loaded on llama.cpp runs, as llama.cpp describes it: 'llama 256M Q4_1 GGUF via llama.cpp'."""
    return f"{model.weights.description} GGUF via llama.cpp"


def check_threads(threads: int | None) -> None:
    """Warn when --threads asks for more threads than the CPUs this process may run on."""
    from specdec.backends import llamacpp

    cpus = llamacpp.default_threads()
    if threads is not None and threads > cpus:
        _note(f"warning: --threads {threads} is more than the {cpus} CPUs this process may run on; threads "
              f"beyond them only contend (use --threads {cpus} or fewer)")


# ------------------------------------------------------------------------------------------------
# specdec generate


def add_generate_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text with speculative decoding",
        description="Generate a continuation of PROMPT from the target, speculatively: the draft "
                    "proposes tokens and the target verifies them. The output follows the target's "
                    "distribution exactly (greedy: the same tokens as the target alone).",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue (or the user message with --chat)")
    add_model_options(parser)
    add_backend_option(parser)
    add_decoding_options(parser)
    group = parser.add_argument_group("output")
    group.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true",
                      help="print tokens as they are accepted (in a terminal, draft tokens in green)")
    mode.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    group.add_argument("--compare-ar", action="store_true",
                       help="also decode the target alone; report the speed-up and whether the output is identical")
    group.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads for torch (default: torch's choice, one per core; on a busy "
                            "machine 1 avoids contention)")
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from specdec import api

    check_prompt_text(args.prompt, allow_blank=args.chat)
    config = decode_config(args)
    _hint_escaped_stops(args.stop)
    check_threads(args.threads)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    uses_model = config.drafter in MODEL_DRAFTERS
    pair = load_models(args, draft=uses_model)
    prompt = _prompt(args, pair.tokenizer)
    common = dict(tokenizer=pair.tokenizer, config=config)
    drafting = dict(draft=pair.draft) if uses_model else {}
    _note("generating")
    if args.stream:
        result = _stream(api.stream(pair.target, prompt, **drafting, **common), pair.tokenizer, args, config)
    else:
        result = api.generate(pair.target, prompt, **drafting, **common)
    ar = divergence = None
    if args.compare_ar:
        _note("decoding the target alone (--compare-ar)")
        ar_config = DecodeConfig.parse("ar", **{f: getattr(config, f) for f in SAMPLING_FIELDS})
        ar = api.generate(pair.target, prompt, tokenizer=pair.tokenizer, config=ar_config)
        if config.temperature == 0 and ar.token_ids != result.token_ids:
            _note("replaying both runs to explain the difference (--compare-ar)")
            divergence = explain_divergence(pair.target, prompt, pair.tokenizer, (config, drafting), (ar_config, {}),
                                               result.token_ids, ar.token_ids, getattr(args, "cache_dir", None))

    if args.json:
        print(json.dumps(_report(args, pair.target, result, ar, divergence), ensure_ascii=False))
    else:
        if not args.stream:
            _print_text(args, result.text)
        _print_summary(result, ar, args, config, divergence)
    return 0


def explain_divergence(target: Any, prompt: Any, tokenizer: Any, spec: tuple[Any, dict], ar: tuple[Any, dict],
                       tokens: list[int], ar_tokens: list[int], cache_dir: Any = None) -> dict[str, Any]:
    """Why a greedy speculative output left the target's own: both runs replayed untimed with the
    target's logits recorded (greedy runs are deterministic), and the first differing position,
    the two tokens, the target's top-2 logit margin there as each pass computed it, the largest
    logit difference between the two rows, and whether the backend is batch invariant for this
    model (measured, cached) (:func:`specdec.divergence.explain`). ``{"error": ...}`` if a
    replay fails."""
    from specdec import api
    from specdec.build import as_backend
    from specdec.divergence import LogitsRecorder, batch_invariance, decisive_position, explain

    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if isinstance(prompt, str) else list(prompt)
    at = decisive_position(ids, tokens, ar_tokens)
    recorders = []
    try:
        for (config, extra), want in ((spec, tokens), (ar, ar_tokens)):
            recorders.append(LogitsRecorder(as_backend(target), keep={at}))
            again = api.generate(recorders[-1], ids, tokenizer=tokenizer, config=config, **extra)
            if again.token_ids != want:
                return {"error": "a replay did not reproduce its run, so its margins would not explain it"}
        invariance = batch_invariance(recorders[0].backend, cache_dir=cache_dir)
    except (ValueError, TypeError) as err:  # e.g. a drafter that needs the transformers model itself
        return {"error": f"could not replay the runs: {err}"}
    found = explain(ids, tokens, ar_tokens, *recorders, invariance=invariance)
    out = found.to_dict() if found is not None else {}
    for key in ("token", "ar_token"):
        if out.get(key) is not None:
            out[f"{key}_text"] = tokenizer.decode([out[key]])
    return out


def _divergence_words(d: dict[str, Any]) -> str:
    from specdec.divergence import cause

    if "error" in d:
        return d["error"]
    def margin(m: Any) -> str:
        return "not recorded" if m is None else f"{m:.3f}"
    return (f"speculative chose {d.get('token_text')!r}, autoregressive {d.get('ar_token_text')!r}; the target's "
            f"top-2 logit margin there was {margin(d.get('margin'))} in the speculative pass and "
            f"{margin(d.get('ar_margin'))} in the one-token step; {cause(d)}")


def check_prompt_text(prompt: str, *, allow_blank: bool = False) -> None:
    """A prompt must be UTF-8 text (the shell passes undecodable bytes as lone surrogates) with
    something to continue."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        char = prompt[err.start]
        what = (f"the byte 0x{ord(char) - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= ord(char) <= 0xDCFF
                else f"a lone surrogate U+{ord(char):04X}")
        raise CLIError(f"the prompt is not valid text: character {err.start} is {what}",
                       "pass the prompt as UTF-8 text (e.g. convert the file with iconv -t UTF-8)", code=2) from None
    if allow_blank or prompt.strip():
        return
    if not prompt:
        raise CLIError("the prompt is empty", "give some text to continue", code=2)
    raise CLIError(f"the prompt is whitespace-only ({len(prompt)} whitespace characters)",
                   "give some text to continue", code=2)


_ESCAPES = {"\\n": "newline", "\\t": "tab", "\\r": "carriage return"}


def _hint_escaped_stops(stops: Sequence[str]) -> None:
    """The shell passes --stop '\\n' as a backslash and an n, which never ends a line: say so (the
    stop string is kept as given)."""
    for stop in stops:
        escape = next((e for e in _ESCAPES if e in stop), None)
        if escape is not None:
            what = _ESCAPES[escape]
            _note(f"warning: --stop '{stop}' holds {escape} as two characters (a backslash and '{escape[1]}'), "
                  f"not a {what}; to stop at a {what} pass --stop $'{stop}' (bash)")


def _prompt(args: argparse.Namespace, tokenizer: Any) -> str | list[int]:
    if not args.chat:
        return args.prompt
    if not getattr(tokenizer, "chat_template", None):
        raise CLIError(f"{args.target} has no chat template", "drop --chat to continue PROMPT as plain text")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
    )
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]


def _stream(events: Any, tokenizer: Any, args: argparse.Namespace, config: DecodeConfig) -> Any:
    """Print each event's text as it comes; colour kept draft tokens when stdout is a terminal."""
    from specdec.api import GenerationResult
    from specdec.stats import GenerationStats

    console = _console(sys.stdout) if sys.stdout.isatty() else None
    if console is not None:
        from rich.text import Text

        _note("green: draft tokens the target accepted; default colour: tokens the target chose")
        if not args.chat:
            console.print(Text(args.prompt, style="dim"), end="")
    ids: list[int] = []
    shown = ""
    last = None
    for event in events:
        last = event
        n_draft = sum(event.from_draft)
        before = ids[:]
        ids += event.token_ids
        if console is None:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        else:
            # The event's text ends with the text of the target's token(s); before it, the draft's.
            if n_draft == 0:
                cut = 0
            elif n_draft == len(event.token_ids):
                cut = len(event.text)
            else:
                def decoded(tokens: list[int]) -> int:
                    return len(tokenizer.decode(tokens, skip_special_tokens=True))

                cut = len(event.text) - (decoded(ids) - decoded(before + event.token_ids[:n_draft]))
                cut = max(0, min(len(event.text), cut))
            text = Text()
            text.append(event.text[:cut], style="green")
            text.append(event.text[cut:])
            console.print(text, end="")
        shown += event.text
    if console is None:
        sys.stdout.write("\n")
    else:
        console.print()
    stats = last.stats if last is not None else GenerationStats()
    return GenerationResult(ids, shown, stats, method="ar" if config.is_ar else str(config))


def _print_text(args: argparse.Namespace, text: str | None) -> None:
    if sys.stdout.isatty() and not args.chat:
        from rich.text import Text

        out = Text()
        out.append(args.prompt, style="dim")
        out.append(text or "")
        _console(sys.stdout).print(out)
    else:
        print(text or "")


def _report(args: argparse.Namespace, target: Any, result: Any, ar: Any,
            divergence: dict | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "text": result.text,
        "token_ids": result.token_ids,
        "prompt": args.prompt,
        "target": args.target,
        "draft": args.draft,
        "draft_weights": args.draft_weights,
        **({"weights": gguf_weights(target)} if backend_of(args.target, args) == "llamacpp"
           else {"dtype": args.dtype}),
        "method": result.method,
        "exact": result.exact,
        "stats": result.stats.to_dict(),
    }
    if ar is not None:
        report["ar"] = {
            "text": ar.text,
            "token_ids": ar.token_ids,
            "new_tokens": ar.stats.new_tokens,
            "seconds": ar.stats.seconds,
            "tokens_per_second": ar.stats.tokens_per_second,
            "identical": ar.token_ids == result.token_ids,
            "first_difference": _first_difference(result.token_ids, ar.token_ids),
            "divergence": divergence,
            "speedup": _speedup(result, ar),
        }
    return report


def _print_summary(result: Any, ar: Any, args: argparse.Namespace, config: DecodeConfig,
                   divergence: dict | None = None) -> None:
    s = result.stats
    if result.method == "ar":
        lines = [f"autoregressive: {s.new_tokens} tokens in {s.seconds:.1f} s = {s.tokens_per_second:.2f} tokens/s"]
    else:
        lines = [
            f"speculative ({method_label(config)}): {s.new_tokens} tokens in {s.seconds:.1f} s = "
            f"{s.tokens_per_second:.2f} tokens/s; {s.mean_accepted_per_forward:.2f} tokens per target "
            f"forward; {s.acceptance_rate:.0%} of draft tokens accepted"
        ]
    if ar is not None:
        a = ar.stats
        same = ar.token_ids == result.token_ids
        verdict = "yes" if same else f"no (first difference at token {_first_difference(result.token_ids, ar.token_ids)})"
        if not same and args.temperature > 0:
            verdict += "; expected when sampling: the outputs share a distribution, not a sample"
        elif divergence:
            verdict += f": {_divergence_words(divergence)}"
        lines.append(
            f"autoregressive: {a.new_tokens} tokens in {a.seconds:.1f} s = {a.tokens_per_second:.2f} tokens/s; "
            f"speed-up {_speedup(result, ar):.2f}x; identical output: {verdict}"
        )
    if s.policy.get("name") == "auto":
        from specdec.policies.auto import summary_line

        lines.append(summary_line(s.policy))
    for line in lines:
        print(line, file=sys.stderr)


def method_label(config: DecodeConfig) -> str:
    """How the run drafts and verifies, in words: 'ngram+model drafter, block, k=4, policy auto' or the tree's shape."""
    words = [f"{config.drafter} drafter"]
    if config.verify != "tree":
        return ", ".join(words + [config.verify, f"k={config.k}", f"policy {config.policy}"])
    tree = TreeDrafter(None, **(config.tree or DEFAULT_TREE))  # only its shape is read
    if tree.choices is not None:
        words.append(f"static tree: {len(tree.choices)} nodes, depth {tree.depth}")
    elif tree.threshold is not None:
        words.append(f"confident tree: threshold {tree.threshold:g}, width {tree.width}, depth up to {tree.depth}, "
                     f"up to {tree.budget} nodes")
    else:
        words.append(f"dynamic tree: depth {tree.depth}, width {tree.width}, up to {tree.budget} nodes")
    return ", ".join(words)


def _speedup(result: Any, ar: Any) -> float:
    base = ar.stats.tokens_per_second
    return result.stats.tokens_per_second / base if base > 0 else 0.0


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------------------------------------
# specdec models


def add_models_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "models", help="list the model packs: installed or not, converted or not, where",
        description="List the offline model packs. A pack is installed when all its pip packages "
                    "are; it is converted into the cache on its first use.",
    )
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help=f"where converted packs live (default: ${models.CACHE_ENV} or ~/.cache/specdec)")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(func=run_models)


def run_models(args: argparse.Namespace) -> int:
    _check_cache_dir(args, create=False)
    rows = packs.describe(args.cache_dir)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("pack", "role", "installed", "converted", "cache directory"):
        table.add_column(column)
    for row in rows:
        missing = len(row["missing_parts"])
        total = len(models.PACKS[row["name"]].parts)
        installed = "yes" if not missing else ("no" if missing == total else f"{missing} of {total} parts missing")
        converted = ("yes" if row["converted"] else "damaged (redone on first use)" if row["damaged"]
                     else "no (on first use)")
        table.add_row(row["name"], row["default"] or "", installed, converted, row["path"])
    console = _console(sys.stdout)
    if not console.is_terminal:
        console.width = 200  # piped: keep whole paths, whatever the width rich guesses
    console.print(table)
    for row in rows:
        if row["missing_parts"]:
            console.print(f"to install {row['name']}: {row['install']}", soft_wrap=True)
        if row["damaged"]:
            console.print(f"{row['name']}: damaged: {row['damaged']}; the next use converts it again "
                          f"(or delete {row['path']})", soft_wrap=True)
    return 0


# ------------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec",
        description="Exact speculative decoding for Hugging Face causal LMs, with offline model packs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(subparsers)
    add_models_parser(subparsers)
    for add in _optional_parsers():
        add(subparsers)
    return parser


def _optional_parsers() -> list[Callable[[Any], None]]:
    """``add_<name>_parser`` functions of subcommands that live in optional modules."""
    found = []
    for package, module, function in [("specdec.bench", "specdec.bench.cli", "add_bench_parser"),
                                      ("specdec.heads", "specdec.heads.cli", "add_train_heads_parser"),
                                      ("specdec.server", "specdec.server.cli", "add_serve_parser")]:
        if importlib.util.find_spec(package) is None or importlib.util.find_spec(module) is None:
            continue
        found.append(getattr(importlib.import_module(module), function))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    command = "generate"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = args.command
        _quiet_libraries()
        keep_freed_memory()  # vocabulary-sized tensors every step: see specdec.memory
        with _one_line_warnings():
            return int(args.func(args) or 0)
    except CLIError as err:
        return _fail(err.message, err.hint, err.code)
    except ValueError as err:  # the library's promise for bad input
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        return _fail(str(err), f"see 'specdec {command} --help'", 1)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _fail(message: str, hint: str, code: int) -> int:
    print(f"specdec: error: {message}", file=sys.stderr)
    print(f"hint: {hint}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Warnings (e.g. the library's: the context leaves less room than --max-new-tokens) as
    'specdec: warning: ...' lines, without the source line Python adds."""
    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"specdec: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _note(message: str) -> None:
    print(f"specdec: {message}", file=sys.stderr, flush=True)


def _console(file: Any) -> Any:
    from rich.console import Console

    return Console(file=file, highlight=False, soft_wrap=True)


def _quiet_libraries() -> None:
    """transformers' advisory warnings are noise on a command line."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


if __name__ == "__main__":
    sys.exit(main())
