"""``specdec models``: list the model packs, whether each is installed and converted, and where."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdec import models, packs
from specdec.cli.common import check_cache_dir, console


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
    check_cache_dir(args.cache_dir, create=False)
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
    screen = console(sys.stdout)
    if not screen.is_terminal:
        screen.width = 200  # piped: keep whole paths, whatever the width rich guesses
    screen.print(table)
    for row in rows:
        if row["missing_parts"]:
            screen.print(f"to install {row['name']}: {row['install']}", soft_wrap=True)
        if row["damaged"]:
            screen.print(f"{row['name']}: damaged: {row['damaged']}; the next use converts it again "
                         f"(or delete {row['path']})", soft_wrap=True)
    return 0

