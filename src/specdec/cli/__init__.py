"""The ``specdec`` command: one dispatcher over the sub-commands, thin layers over the library.

:func:`main` loads :mod:`specdec.cli.commands` (the parser, and through it torch and the library)
inside its own ``try``, so that Ctrl-C during those first seconds ends the command quietly with
status 130, as it does later, instead of printing a traceback from the middle of an import.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``specdec`` command (``python -m specdec``): the exit status."""
    try:
        run = importlib.import_module("specdec.cli.commands").run
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return run(argv)
