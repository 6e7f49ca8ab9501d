"""The benchmark: the project's methods against autoregressive decoding and transformers' own
speculative methods, on the same models, prompts and settings, in one run.

``specdec bench --help`` (or ``python -m specdec.bench --help``) runs it from the command line
(:mod:`specdec.cli.bench`); :func:`run_bench` and :mod:`specdec.bench.report` are the pieces it composes.
"""

from specdec.bench.methods import MethodSpec, parse_method, parse_methods
from specdec.prompts import Prompt, load_prompts
from specdec.bench.runner import BenchBackends, BenchRun, BenchSettings, run_bench

__all__ = [
    "BenchBackends", "BenchRun", "BenchSettings", "MethodSpec", "Prompt",
    "load_prompts", "parse_method", "parse_methods", "run_bench",
]
