"""A generated section of README.md: the text between two marker comments, replaced whole by `make crds`."""

from __future__ import annotations


def with_section(readme: str, *, begin: str, end: str, body: str) -> str:
    """`readme` with the text between the markers `begin` and `end` replaced by `body`."""
    head, found, rest = readme.partition(begin)
    if not found or end not in rest:
        raise ValueError(f"README.md lacks the markers {begin!r} ... {end!r}")
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"
