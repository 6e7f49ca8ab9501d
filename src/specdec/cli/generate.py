"""``specdec generate``: continue a prompt with speculative decoding and print the text and its statistics.

With --compare-ar the target alone decodes the same prompt too, and a greedy output that leaves
the target's own is explained (:func:`explain_divergence`, :mod:`specdec.divergence`).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any, Sequence

from specdec import api
from specdec.api import GenerationResult
from specdec.build import as_backend
from specdec.config import DecodeConfig
from specdec.divergence import LogitsRecorder, cause, decisive_position, explain, first_difference
from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
from specdec.measurements import batch_invariance
from specdec.backends import table as backend_table
from specdec.models import Pair
from specdec.cli.common import (
    CLIError, add_backend_option, add_constraint_options, add_context_option, add_decoding_options, add_model_options,
    check_threads, console, constraint_cli_error, constraints_from, decode_config, gguf_weights, load_models_from, note, positive_int,
)
from specdec.constraints import ConstraintError
from specdec.policies.auto import summary_line
from specdec.stats import GenerationStats


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
    add_context_option(parser)
    add_decoding_options(parser)
    add_constraint_options(parser)
    group = parser.add_argument_group("output")
    group.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    group.add_argument("--prediction-file", metavar="PATH", default=None,
                       help="text the output is expected to repeat (a file to be sent back edited): drafted from "
                            "where the output follows it; it changes the speed, never the output")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true",
                      help="print tokens as they are accepted (in a terminal, draft tokens in green)")
    mode.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    group.add_argument("--compare-ar", action="store_true",
                       help="also decode the target alone; report the speed-up and whether the output is identical")
    group.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads the model runs on: specdec's GGUF kernel's or llama.cpp's threads for "
                            "a GGUF, torch's for transformers (default: every CPU this process may use; torch: "
                            "its choice, one per core; on a busy machine 1 avoids contention)")
    parser.set_defaults(func=run_generate)


def _prediction(path: str | None) -> str | None:
    """The text of ``--prediction-file`` (None without one)."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CLIError(f"--prediction-file {path}: cannot read it ({err})",
                       "give --prediction-file the path of a UTF-8 text file", code=2) from None


def run_generate(args: argparse.Namespace) -> int:
    check_prompt_text(args.prompt, allow_blank=args.chat)
    prediction = _prediction(args.prediction_file)  # read before any model loads
    config = decode_config(args)
    constraints, logprobs = constraints_from(args)
    if config.gumbel and config.seed is None and args.compare_ar:  # both runs draw with the same noise
        config = config.replace(seed=secrets.randbits(64))
    _hint_escaped_stops(args.stop)
    check_threads(args.threads)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    uses_model = config.uses_draft_model
    pair = load_models_from(args, draft=uses_model)
    prompt = _prompt(args, pair.tokenizer)
    check_prompt_fits(prompt, pair, config.max_new_tokens)
    common = dict(tokenizer=pair.tokenizer, config=config, constraints=constraints, logprobs=logprobs,
                  prediction=prediction)
    drafting = dict(draft=pair.draft) if uses_model else {}
    try:
        # what generate() does, in its two steps: the inputs checked and the run built (a bad input
        # stops here), then "generating" said and the tokens decoded
        run = api._Run.build(pair.target, prompt, draft=drafting.get("draft"), **common)
        note("generating")
        if args.stream:
            result = _stream(run.events(), pair.tokenizer, args, config)
        else:
            for _ in run.events():
                pass
            result = run.result()
    except ConstraintError as err:  # a logit_bias id outside this model's vocabulary
        raise constraint_cli_error(err) from None
    ar = divergence = None
    if args.compare_ar:
        note("decoding the target alone (--compare-ar)")
        ar_config = DecodeConfig.parse("ar", **config.sampling_fields())
        ar = api.generate(pair.target, prompt, tokenizer=pair.tokenizer, config=ar_config, constraints=constraints)
        if (config.temperature == 0 or config.gumbel) and ar.token_ids != result.token_ids:  # deterministic runs
            note("replaying both runs to explain the difference (--compare-ar)")
            replay = {"constraints": constraints}
            divergence = explain_divergence(pair.target, prompt, pair.tokenizer, (config, {**drafting, **replay}),
                                            (ar_config, replay), result.token_ids, ar.token_ids,
                                            getattr(args, "cache_dir", None))

    if args.json:
        print(json.dumps(_report(args, pair, result, ar, divergence), ensure_ascii=False))
    else:
        if not args.stream:
            _print_text(args, result.text)
        if result.logprobs is not None:
            _print_logprobs(result.logprobs, pair.tokenizer)
        _print_summary(result, ar, args, config, divergence)
    return 0


def explain_divergence(target: Any, prompt: Any, tokenizer: Any, spec: tuple[Any, dict], ar: tuple[Any, dict],
                       tokens: list[int], ar_tokens: list[int], cache_dir: Any = None) -> dict[str, Any]:
    """Why a greedy (or Gumbel-max, seeded) speculative output left the target's own: both runs
    replayed untimed with the target's logits recorded (such runs are deterministic), and the first
    differing position,
    the two tokens, the target's top-2 logit margin there as each pass computed it, the largest
    logit difference between the two rows, and whether the backend is batch invariant for this
    model (measured, cached) (:func:`specdec.divergence.explain`). ``{"error": ...}`` if a
    replay fails."""
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
    config = spec[0]
    gumbel = config.sampling if config.gumbel and config.temperature > 0 else None
    found = explain(ids, tokens, ar_tokens, *recorders, invariance=invariance, gumbel=gumbel)
    out = (found.to_dict() | {"scores": "gumbel" if gumbel is not None else "logits"}) if found is not None else {}
    for key in ("token", "ar_token"):
        if out.get(key) is not None:
            out[f"{key}_text"] = tokenizer.decode([out[key]])
    return out


def _divergence_words(d: dict[str, Any]) -> str:
    if "error" in d:
        return d["error"]
    def margin(m: Any) -> str:
        return "not recorded" if m is None else f"{m:.3f}"
    scores = "Gumbel-max scores'" if d.get("scores") == "gumbel" else "target's top-2 logit"
    return (f"speculative chose {d.get('token_text')!r}, autoregressive {d.get('ar_token_text')!r}; the {scores} "
            f"margin there was {margin(d.get('margin'))} in the speculative pass and "
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


def check_prompt_fits(prompt: str | list[int], pair: Pair, max_new_tokens: int) -> None:
    """A prompt that leaves no room in the target's context for a new token is refused, with the
    numbers: its tokens, --max-new-tokens and the context (--ctx-size). One that leaves some room,
    but less than --max-new-tokens, is generated up to the context's end (the library warns)."""
    context = pair.target.max_context if hasattr(pair.target, "forward") and hasattr(pair.target, "trim") else None
    if context is None:  # a transformers model: its context is the model's own (the library checks it)
        return
    tokens = len(prompt) if isinstance(prompt, list) else len(pair.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if tokens < context:
        return
    need, trained = tokens + max_new_tokens, int(getattr(getattr(pair.target, "weights", None), "n_ctx_train", 0))
    if trained and trained <= context:
        hint = f"shorten the prompt: the context is already the {trained} tokens the model was trained on"
    elif trained:
        hint = f"shorten the prompt, or give --ctx-size {min(need, trained)} (the model was trained on {trained} tokens)"
    else:
        hint = f"shorten the prompt, or give --ctx-size {need}"
    raise CLIError(f"the prompt has {tokens} tokens and --max-new-tokens asks for {max_new_tokens} more, {need} in "
                   f"all, but the context holds {context} tokens", hint, code=2)


_ESCAPES = {"\\n": "newline", "\\t": "tab", "\\r": "carriage return"}


def _hint_escaped_stops(stops: Sequence[str]) -> None:
    """The shell passes --stop '\\n' as a backslash and an n, which never ends a line: say so (the
    stop string is kept as given)."""
    for stop in stops:
        escape = next((e for e in _ESCAPES if e in stop), None)
        if escape is not None:
            what = _ESCAPES[escape]
            note(f"warning: --stop '{stop}' holds {escape} as two characters (a backslash and '{escape[1]}'), "
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
    screen = console(sys.stdout) if sys.stdout.isatty() else None
    if screen is not None:
        from rich.text import Text

        note("green: draft tokens the target accepted; default colour: tokens the target chose")
        if not args.chat:
            screen.print(Text(args.prompt, style="dim"), end="")
    ids: list[int] = []
    shown = ""
    last = None
    logprobs = None
    for event in events:
        last = event
        if event.logprobs is not None:
            logprobs = (logprobs or []) + event.logprobs
        n_draft = sum(event.from_draft)
        before = ids[:]
        ids += event.token_ids
        if screen is None:
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
            screen.print(text, end="")
        shown += event.text
    if screen is None:
        sys.stdout.write("\n")
    else:
        screen.print()
    stats = last.stats if last is not None else GenerationStats()
    return GenerationResult(ids, shown, stats, method=str(config.as_run), exact=config.exact, logprobs=logprobs)


def _print_text(args: argparse.Namespace, text: str | None) -> None:
    if sys.stdout.isatty() and not args.chat:
        from rich.text import Text

        out = Text()
        out.append(args.prompt, style="dim")
        out.append(text or "")
        console(sys.stdout).print(out)
    else:
        print(text or "")


def _report(args: argparse.Namespace, pair: Pair, result: Any, ar: Any,
            divergence: dict | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "text": result.text,
        "token_ids": result.token_ids,
        "prompt": args.prompt,
        "target": args.target,
        "draft": args.draft,
        "draft_weights": args.draft_weights,
        "draft_vocab": pair.draft_vocab,  # ids the draft's head scores (None: every id)
        "draft_quant": pair.draft_quant,  # the type the draft's layers were requantized to (None: the file's)
        "backend": {"name": pair.backend, "why": pair.backend_why,
                    **({"kernel_path": path} if (path := backend_table.BY_NAME[pair.backend].kernel_path(pair.target))
                       is not None else {})},
        **({"weights": gguf_weights(pair.target)} if pair.backend in backend_table.GGUF_NAMES else {"dtype": args.dtype}),
        "method": result.method,
        "exact": result.exact,  # the verification rule keeps the target's law (docs/exactness.md)
        # greedy and seeded output is plain decoding's token for token on this backend (else its caveat is in backend.why)
        "token_identical": backend_table.BY_NAME[pair.backend].token_identical,
        "stats": result.stats.to_dict(),
    }
    if result.logprobs is not None:
        report["logprobs"] = _logprobs(result.logprobs, pair.tokenizer)
    if ar is not None:
        report["ar"] = {
            "text": ar.text,
            "token_ids": ar.token_ids,
            "new_tokens": ar.stats.new_tokens,
            "seconds": ar.stats.seconds,
            "tokens_per_second": ar.stats.tokens_per_second,
            "identical": ar.token_ids == result.token_ids,
            "first_difference": first_difference(result.token_ids, ar.token_ids),
            "divergence": divergence,
            "speedup": _speedup(result, ar),
        }
    return report


def _logprobs(logprobs: Sequence[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Each token's id, text and log-probability, and its ``top`` as [id, logprob, text] lists."""
    def text(token: int) -> str:
        return tokenizer.decode([token])

    return [{"token": lp.token, "text": text(lp.token), "logprob": lp.logprob,
             "top": [[t, logprob, text(t)] for t, logprob in lp.top]} for lp in logprobs]


def _print_logprobs(logprobs: Sequence[Any], tokenizer: Any) -> None:
    """``--logprobs`` without ``--json``: after the text (on stderr, with the summary, so that
    stdout stays the text), one line per token: its position, text and log-probability, then the
    most likely tokens there."""
    lines = [f"logprobs of the {len(logprobs)} tokens (position, token, log-probability; then the most likely tokens):"]
    for i, entry in enumerate(_logprobs(logprobs, tokenizer)):
        top = ", ".join(f"{text!r} {logprob:.4f}" for _, logprob, text in entry["top"])
        lines.append(f"{i:>5}  {entry['text']!r} {entry['logprob']:.4f}" + (f"  top: {top}" if top else ""))
    for line in lines:
        print(line, file=sys.stderr)


def _print_summary(result: Any, ar: Any, args: argparse.Namespace, config: DecodeConfig,
                   divergence: dict | None = None) -> None:
    s = result.stats
    if result.method == "ar":
        lines = [f"autoregressive: {s.new_tokens} tokens in {s.seconds:.1f} s = {s.tokens_per_second:.2f} tokens/s"]
    else:
        lines = [
            f"speculative ({method_label(config, result.shape)}): {s.new_tokens} tokens in {s.seconds:.1f} s = "
            f"{s.tokens_per_second:.2f} tokens/s; {s.mean_accepted_per_forward:.2f} tokens per target "
            f"forward; " + (f"{s.acceptance_rate:.0%} of draft tokens accepted" if s.drafted_tokens
                            else "nothing was drafted")
        ]
    if ar is not None:
        a = ar.stats
        same = ar.token_ids == result.token_ids
        verdict = "yes" if same else f"no (first difference at token {first_difference(result.token_ids, ar.token_ids)})"
        if not same and args.temperature > 0 and not config.gumbel:
            verdict += "; expected when sampling: the outputs share a distribution, not a sample"
        elif divergence:
            verdict += f": {_divergence_words(divergence)}"
        lines.append(
            f"autoregressive: {a.new_tokens} tokens in {a.seconds:.1f} s = {a.tokens_per_second:.2f} tokens/s; "
            f"speed-up {_speedup(result, ar):.2f}x; identical output: {verdict}"
        )
    if s.policy.get("name") == "auto":
        lines.append(summary_line(s.policy))
    if s.gumbel_seed is not None:
        lines.append(f"Gumbel-max sampler, seed {s.gumbel_seed}: --seed {s.gumbel_seed} draws this text again")
    for line in lines:
        print(line, file=sys.stderr)


def method_label(config: DecodeConfig, shape: str = "") -> str:
    """How the run drafts and verifies, in words, the one place a method is put in words: 'ngram+model
    drafter, block, k=4, policy auto', or the tree: the draft model's by its options ('confident tree:
    threshold 0.8, ...'), another's by ``shape``, the shape the build chose (:attr:`GenerationResult.shape`:
    a lookahead window, a Sequoia budget), which the options may leave open."""
    if config.is_ar:
        return "the target alone"
    words = [f"{config.drafter} drafter"]
    if config.verify != "tree":
        lossy = [] if config.exact else ["LOSSY (not the target's distribution)"]
        return ", ".join(words + [config.chain_verifier, f"k={config.k}", f"policy {config.policy}", *lossy])
    tree = TreeDrafter(None, **(config.tree or DEFAULT_TREE)) if config.drafter == "model" else None  # its shape only
    if tree is not None and tree.mode == "static":
        words.append(f"static tree: {len(tree.choices)} nodes, depth {tree.depth}")
    elif tree is not None and tree.mode == "confident":
        words.append(f"confident tree: threshold {tree.threshold:g}, width {tree.width}, depth up to {tree.depth}, "
                     f"up to {tree.budget} nodes")
    elif tree is not None and tree.mode == "dynamic":
        words.append(f"dynamic tree: depth {tree.depth}, width {tree.width}, up to {tree.budget} nodes")
    else:
        words.append(f"tree: {shape.replace(':', ', ')}" if shape else "tree")
    if config.gumbel:
        words.append("coupled")  # the Gumbel-max sampler's walk
    return ", ".join(words)


def _speedup(result: Any, ar: Any) -> float:
    base = ar.stats.tokens_per_second
    return result.stats.tokens_per_second / base if base > 0 else 0.0
