"""Ray Serve's entry to specdec: ``serve run specdec.ray:app target=... draft=... parallel=...``
and the ``import_path`` of a ``serve deploy`` config (examples/ray-serve.yaml).

Each ``key=value`` is the ``specdec serve`` option ``--key value`` (``_`` and ``-`` alike; a flag
such as ``no_prompt_cache=true`` is given as true), read by the same parser, so every option means
what it means for one server: ``replicas``, ``min_replicas``, ``max_replicas``, ``threads`` (each
replica's CPUs), ``router`` and ``router_imbalance`` shape the cluster (:mod:`specdec.cluster`), the rest its
replicas and its ingress. Ray Serve's own ``--address`` and HTTP options say where it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from specdec import cluster
from specdec.cli.common import CLIError, Parser
from specdec.cli.serve import add_serve_parser, api_key, cluster_options, default_method, load_engine


def app(args: dict[str, Any]) -> Any:
    """The application ``serve run`` and ``serve deploy`` deploy, from their ``key=value`` arguments
    (a ValueError says what is wrong with them)."""
    try:
        options = parse(args)
        return cluster.application(load_engine, options,
                                   cluster_options(options, default_method(options), api_key(options)))
    except CLIError as err:
        raise ValueError(f"{err.message} ({err.hint})") from None


def parse(args: dict[str, Any]) -> argparse.Namespace:
    """``specdec serve``'s options from ``key=value`` arguments (a CLIError as the command line's)."""
    argv: list[str] = []
    for key, value in args.items():
        flag, text = "--" + str(key).replace("_", "-"), str(value)
        if text.lower() == "true":  # a flag
            argv.append(flag)
        elif text.lower() != "false":
            argv += [flag, text]
    subparsers = Parser(prog="serve run specdec.ray:app").add_subparsers()
    add_serve_parser(subparsers)
    return subparsers.choices["serve"].parse_args(argv)
