"""The `strata` console script: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes `register(subparsers)`; this module only lists them,
importing each lazily so `strata inspect` never pays for torch or kopf.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from typing import NoReturn

# gRPC's fork handlers (on by default in grpcio's builds) restart its poller in a forked child; `strata serve` forks
# stage processes (a preexec_fn makes Popen fork, not vfork) while its channels are open, and Popen's close_fds then
# closes the poller's epoll fd under it: the child aborts before exec, one start in a few (grpc/grpc#43055). Nothing
# here forks without exec, so the handlers are off. Set before any subcommand imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# (subcommand, module that implements it); the module's register() adds the parser and sets `run`.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("inspect", "strata.gguf.command"),
    ("plan", "strata.operator.plan_command"),
    ("operator", "strata.operator.command"),
    ("stage-worker", "strata.stage_worker.command"),
    ("gateway", "strata.gateway.command"),
    ("serve", "strata.gateway.serve_command"),
)

# A command line that does not parse is bad input. argparse exits 2 for it, the status `strata plan` gives a model
# that does not fit, so a script could not tell a typo from a shortfall.
EXIT_USAGE = 1


class StrataArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors exiting EXIT_USAGE; subparsers inherit the class, so every subcommand does too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = StrataArgumentParser(prog="strata", description="Serve GGUF models split across a GPU node pool.")
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
