"""The `strata` console script: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes `register(subparsers)`; this module only lists them,
importing each lazily so `strata inspect` never pays for torch or kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import version

# (subcommand, module that implements it); the module's register() adds the parser and sets `run`.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("inspect", "strata.gguf.command"),
    ("plan", "strata.operator.plan_command"),
    ("operator", "strata.operator.command"),
    ("stage-worker", "strata.stage_worker.command"),
    ("gateway", "strata.gateway.command"),
    ("serve", "strata.gateway.serve_command"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Serve GGUF models split across a GPU node pool.")
    parser.add_argument("--version", action="version", version=f"strata {version('strata')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 1
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
