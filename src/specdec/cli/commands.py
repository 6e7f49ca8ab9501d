"""The ``specdec`` command's parser and dispatcher (:func:`specdec.cli.main` loads this module).

Each sub-command is a module here that registers its parser with ``add_<name>_parser(subparsers)``
and ``set_defaults(func=handler)``; a handler takes the parsed arguments and returns the exit
status. ``specdec generate`` (:mod:`specdec.cli.generate`), ``specdec models``
(:mod:`specdec.cli.models`), ``specdec bench`` (:mod:`specdec.cli.bench`), ``specdec serve``
(:mod:`specdec.cli.serve`), ``specdec train-heads`` (:mod:`specdec.cli.train_heads`) and ``specdec index``
(:mod:`specdec.cli.index`). They share
the option table and helpers of :mod:`specdec.cli.common` and import the library, never each other.

Errors a user can fix (a bad option value, an unknown model, a missing pack, mismatched
vocabularies) print one line and a hint on stderr, never a traceback: exit status 2 for bad
options, 1 otherwise. Set ``SPECDEC_DEBUG=1`` to see the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from specdec.cli.bench import add_bench_parser
from specdec.cli.generate import add_generate_parser
from specdec.cli.index import add_index_parser
from specdec.cli.models import add_models_parser
from specdec.cli.serve import add_serve_parser
from specdec.cli.train_heads import add_train_heads_parser
from specdec.engine import NonFiniteLogitsError
from specdec.memory import keep_freed_memory
from specdec.cli.common import CLIError, Parser, fail, one_line_warnings, quiet_libraries


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="specdec",
        description="Exact speculative decoding for GGUF files and Hugging Face causal LMs, with offline model packs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (add_generate_parser, add_models_parser, add_bench_parser, add_train_heads_parser, add_serve_parser,
                add_index_parser):
        add(subparsers)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command; the exit status."""
    command = "generate"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = args.command
        quiet_libraries()
        keep_freed_memory()  # vocabulary-sized tensors every step: see specdec.memory
        with one_line_warnings():
            return int(args.func(args) or 0)
    except CLIError as err:
        return fail(err.message, err.hint, err.code)
    except NonFiniteLogitsError as err:  # a damaged model, found while decoding
        return fail(err.message, err.hint, 1)
    except ValueError as err:  # the library's promise for bad input
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        return fail(str(err), f"see 'specdec {command} --help'", 1)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
