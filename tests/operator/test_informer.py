"""The informer against a scripted API: what it lists, where a watch resumes, and what it reports after a 410.

The script plays the API server's answers in order (a list page, a watch's event lines); the informer runs on the
test's thread and stops when the script has nothing more to say.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from strata.operator.informer import Informer


def node(name: str, version: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": labels}}


def listing(version: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"list": {"metadata": {"resourceVersion": version}, "items": list(items)}}


def watching(*events: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"watch": [{"type": kind, "object": body} for kind, body in events]}


GONE = ("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})


class _Stream:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._payload = "".join(json.dumps(e) + "\n" for e in events).encode()

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        yield self._payload

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class _Listing:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()


class ScriptedApi:
    """A list method that answers from the script and records how it was called."""

    def __init__(self, script: list[dict[str, Any]]) -> None:
        self.script = list(script)
        self.calls: list[dict[str, Any]] = []
        self.informer: Informer | None = None

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if not self.script:
            assert self.informer is not None
            self.informer.stop()
            return _Stream([])
        step = self.script.pop(0)
        if kwargs.get("watch"):
            assert "watch" in step, f"the informer watched where the script lists: {step}"
            return _Stream(step["watch"])
        assert "list" in step, f"the informer listed where the script watches: {step}"
        return _Listing(step["list"])


def names(store: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {n["metadata"]["name"]: n["metadata"]["labels"] for n in store}


def keep_labels(body: Any) -> dict[str, Any] | None:
    meta = body["metadata"]
    if meta["labels"].get("skip"):
        return None
    return {"metadata": {"name": meta["name"], "labels": meta["labels"]}}


CASES = [
    pytest.param(
        [listing("10", node("a", "9")), watching(("BOOKMARK", node("a", "15")))],
        {"a": {}},
        [("a", False, True)],
        ["list", "watch from 10", "watch from 15"],
        id="a watch that ends resumes from its last bookmark without listing",
    ),
    pytest.param(
        [
            listing("10", node("a", "9"), node("b", "9")),
            watching(("MODIFIED", node("a", "11", pool="x")), GONE),
            listing("20", node("a", "11", pool="x"), node("c", "19")),
        ],
        {"a": {"pool": "x"}, "c": {}},
        [("a", False, True), ("b", False, True), ("a", True, True), ("b", True, False), ("c", False, True)],
        ["list", "watch from 10", "list", "watch from 20"],
        id="an expired watch lists again and reports what went while it was disconnected",
    ),
    pytest.param(
        [
            listing("10", node("a", "9")),
            watching(
                ("MODIFIED", node("a", "11")), ("ADDED", node("s", "12", skip="yes")), ("DELETED", node("a", "13"))
            ),
        ],
        {},
        [("a", False, True), ("a", True, False)],
        ["list", "watch from 10", "watch from 13"],
        id="an unchanged projection reports nothing, a left-out object is never stored",
    ),
]


@pytest.mark.parametrize(("script", "store", "changes", "calls"), CASES)
def test_the_informer_keeps_the_store_the_api_describes(
    script: list[dict[str, Any]],
    store: dict[str, dict[str, str]],
    changes: list[tuple[str, bool, bool]],
    calls: list[str],
) -> None:
    api = ScriptedApi(script)
    seen: list[tuple[str, bool, bool]] = []
    informer = Informer(
        name="nodes",
        list_call=api,
        project=keep_labels,
        on_change=lambda key, old, new: seen.append((key, old is not None, new is not None)),
    )
    api.informer = informer
    informer.run()
    assert names(informer.items()) == store
    assert seen == changes
    made = ["list" if not c.get("watch") else f"watch from {c['resource_version']}" for c in api.calls]
    assert made[: len(calls)] == calls
    assert informer.synced
