"""Settings for the processes the operator starts: a flag, else an environment variable, else a default.

The operator configures stage and gateway pods through STRATA_* variables; a person running the same command by
hand passes flags. Both commands declare their settings as one table of Options and share this resolution, so a
missing or malformed setting is reported the same way, naming both spellings.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# gRPC channel and server options shared by every hop of the pipeline: keepalives notice a dead peer in seconds,
# and messages carry a prefill chunk's activations, far above gRPC's 4 MiB default. A server takes a ping without
# data as abuse unless it is at least min_recv_ping_interval apart (5 minutes by default) and, after two such
# strikes, closes the connection with GOAWAY "too_many_pings": an idle Forward stream died two minutes after the
# last request. Servers here accept the pings that their clients send. A channel whose peer went away dials again
# with a backoff that gRPC grows to 2 minutes by default; a restarted stage (a pod brought back, `strata serve`
# restarting a stage) listens again within seconds, so the backoff stops at a second and it is found at once.
KEEPALIVE_MS = 10_000
RECONNECT_BACKOFF_MAX_MS = 1_000
GRPC_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS // 4),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
]


@dataclass(frozen=True)
class Option:
    flag: str
    env: str
    kind: Callable[[str], Any]
    default: object  # None: required

    @property
    def name(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    for option in options:
        parser.add_argument(
            option.flag, type=option.kind, default=None, help=f"(env {option.env}; default {option.default!r})"
        )


def resolve_options(
    options: Sequence[Option], values: Mapping[str, object], environ: Mapping[str, str], *, command: str
) -> dict[str, object]:
    """Flag, else environment (an empty variable counts as unset), else default."""
    resolved: dict[str, object] = {}
    for option in options:
        value = values.get(option.name)
        raw = environ.get(option.env, "")
        if value is None and raw != "":
            try:
                value = option.kind(raw)
            except ValueError as exc:
                raise SystemExit(
                    f"strata {command}: {option.env}={raw!r} is not a valid {option.kind.__name__}"
                ) from exc
        if value is None:
            if option.default is None:
                raise SystemExit(f"strata {command}: set {option.flag} or {option.env}")
            value = option.default
        resolved[option.name] = value
    return resolved
