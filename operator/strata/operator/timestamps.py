"""Times in status fields: RFC 3339 in UTC to the second, as Kubernetes writes its own (a condition's
lastTransitionTime), read back into seconds since the epoch for the pure decisions that count on them."""

from __future__ import annotations

import datetime as dt

_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def stamp(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime(_FORMAT)


def seconds(text: str) -> float:
    return dt.datetime.strptime(text, _FORMAT).replace(tzinfo=dt.UTC).timestamp()
