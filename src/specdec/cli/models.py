"""``specdec models``: list the model packs, whether each is installed, and what is prepared for
each backend: the GGUF the GGUF backends run (a single-part pack's installed file, a chunked
pack's file joined into the cache on first use) and the bf16 conversion the torch backend runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdec import models, packs
from specdec.paths import cache_root
from specdec.cli.common import check_cache_dir, console


def add_models_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "models", help="list the model packs: installed or not, and what is prepared for each backend, where",
        description="List the offline model packs. A pack is installed when all its pip packages "
                    "are. The GGUF backends (llama.cpp, specdec's GGUF kernel) run its GGUF: a pack in "
                    "one part runs its installed file, a pack in several parts is joined into the cache "
                    "on first use. The torch backend runs a bf16 conversion, made in the cache on its "
                    "first use.",
    )
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help=f"where joined and converted packs live (default: ${models.CACHE_ENV} or ~/.cache/specdec)")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(func=run_models)


def run_models(args: argparse.Namespace) -> int:
    check_cache_dir(args.cache_dir, create=False)
    rows = [{**row, "prepared": prepared(row, args.cache_dir)} for row in packs.describe(args.cache_dir)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("pack", "role", "installed", "GGUF (llama.cpp, gguf kernel)", "bf16 conversion (torch)"):
        table.add_column(column)
    for row in rows:
        missing = len(row["missing_parts"])
        total = len(models.PACKS[row["name"]].parts)
        installed = "yes" if not missing else ("no" if missing == total else f"{missing} of {total} parts missing")
        ready = row["prepared"]
        gguf = ready["gguf"] or "not yet (joined into the cache on first use)"
        converted = ready["torch"] or ("damaged (redone on first use)" if row["damaged"] else
                                       "not yet (converted on first use of --backend torch)")
        table.add_row(row["name"], row["default"] or "", installed, gguf, converted)
    screen = console(sys.stdout)
    if not screen.is_terminal:
        screen.width = 250  # piped: keep whole paths, whatever the width rich guesses
    screen.print(table)
    for row in rows:
        if row["missing_parts"]:
            screen.print(f"to install {row['name']}: {row['install']}", soft_wrap=True)
        if row["damaged"]:
            screen.print(f"{row['name']}: damaged: {row['damaged']}; the next use converts it again "
                         f"(or delete {row['path']})", soft_wrap=True)
    return 0


def prepared(row: dict[str, Any], cache_dir: str | None) -> dict[str, str | None]:
    """What is ready for each kind of backend of the pack ``row`` describes (a row of
    :func:`specdec.packs.describe`): ``{"gguf": the GGUF file the GGUF backends run, "torch": the
    bf16 conversion's folder}``, each a path that exists, or None where it is not made yet."""
    pack = models.PACKS[row["name"]]
    if row["missing_parts"]:
        gguf = None
    elif len(pack.parts) == 1:  # run in place (its sha256 is checked when a model loads)
        gguf = pack.parts[0].locate()
    else:  # joined once into the cache, with a stamp of the checked file
        gguf = packs._checked_join(pack, cache_root(cache_dir))
    return {"gguf": str(gguf) if gguf is not None else None, "torch": row["path"] if row["converted"] else None}
