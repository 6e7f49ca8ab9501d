"""``python -m specdec.bench``: the same as ``specdec bench`` (:mod:`specdec.cli.bench`)."""

import sys

from specdec.cli.bench import main

sys.exit(main())
