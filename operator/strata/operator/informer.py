"""A list-then-watch cache of one resource, as client-go's informers keep: one LIST at start, then one WATCH.

The store holds a projection of each object (only the fields the operator reads), so ten thousand pods that hold no
GPU cost nothing but the parsing of their events. A watch that ends (its timeout, a dropped connection) resumes
from the last resourceVersion it saw, bookmarks keep that version fresh, and only a 410 Gone (the version fell out
of the API server's window) makes it LIST again: the new list replaces the store and every difference to the old
one, deletions missed while disconnected included, is reported as a change.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

Manifest = dict[str, Any]
Project = Callable[[Mapping[str, Any]], Manifest | None]
OnChange = Callable[[str, Manifest | None, Manifest | None], None]

LIST_PAGE = 500
WATCH_SECONDS = 300  # the API server ends a watch after this; a random share of it spreads the re-watches
RETRY_SECONDS = 1.0
GONE = 410

log = logging.getLogger("strata.operator.informer")


class Expired(Exception):
    """The watch's resourceVersion is older than the API server keeps: only a new LIST can continue."""


def key_of(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if namespace else str(meta["name"])


class Informer:
    """`list_call` is a kubernetes client list method (list_node, list_namespaced_pod with its namespace bound...);
    `project` keeps what matters of an object, or None to leave it out; `on_change(key, old, new)` runs on the
    informer's thread for every projection that changes, after the store holds the new one."""

    def __init__(
        self,
        *,
        name: str,
        list_call: Callable[..., Any],
        project: Project,
        on_change: OnChange | None = None,
        selectors: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self._list_call = list_call
        self._project = project
        self._on_change = on_change
        self._selectors = dict(selectors or {})
        self._store: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._stopped = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self.lists = 0  # how many LISTs this informer made: one, plus one per expired watch

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        response = self._response
        if response is not None:
            response.close()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def items(self) -> list[Manifest]:
        with self._lock:
            return list(self._store.values())

    def get(self, key: str) -> Manifest | None:
        with self._lock:
            return self._store.get(key)

    def run(self) -> None:
        """List, then watch, until stopped; start() runs this on a thread of its own."""
        version: str | None = None
        while not self._stopped.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._watch(version)
            except Expired:
                log.info("%s: watch expired, listing again", self.name)
                version = None
            except Exception as e:  # the API server restarting, a reset connection: resume after a pause
                if self._stopped.is_set():
                    return
                log.warning("%s: watch failed (%s); resuming in %.0f s", self.name, e, RETRY_SECONDS)
                self._stopped.wait(RETRY_SECONDS)

    def _relist(self) -> str:
        fresh: dict[str, Manifest] = {}
        token: str | None = None
        while True:
            page = self._call(limit=LIST_PAGE, _continue=token)
            for item in page.get("items") or ():
                projected = self._project(item)
                if projected is not None:
                    fresh[key_of(item)] = projected
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        self.lists += 1
        with self._lock:
            old, self._store = self._store, fresh
        for key in sorted(old.keys() | fresh.keys()):
            self._changed(key, old.get(key), fresh.get(key))
        self._synced.set()
        return str(meta["resourceVersion"])

    def _watch(self, version: str) -> str:
        timeout = int(WATCH_SECONDS * random.uniform(0.8, 1.0))  # noqa: S311 - spreads re-watches, guards nothing
        response = self._call(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(10, timeout + 30),
        )
        self._response = response
        try:
            for line in self._lines(response):
                event = json.loads(line)
                kind, body = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if body.get("code") == GONE:
                        raise Expired(body.get("message", ""))
                    raise ApiException(status=body.get("code"), reason=body.get("message"))
                version = (body.get("metadata") or {}).get("resourceVersion") or version
                if kind != "BOOKMARK":
                    self._apply(kind, body)
        finally:
            self._response = None
            response.release_conn()
        return version

    def _call(self, **kwargs: Any) -> Any:
        """The raw response (watch) or the parsed JSON (list): typed models would cost seconds per 10,000 pods."""
        try:
            response = self._list_call(**self._selectors, _preload_content=False, **kwargs)
        except ApiException as e:
            if e.status == GONE:
                raise Expired(str(e.reason)) from e
            raise
        if kwargs.get("watch"):
            return response
        return json.loads(response.data)

    def _lines(self, response: Any) -> Iterator[str]:
        for line in iter_resp_lines(response):
            if self._stopped.is_set():
                return
            if line:
                yield line

    def _apply(self, kind: str | None, body: Mapping[str, Any]) -> None:
        key = key_of(body)
        projected = None if kind == "DELETED" else self._project(body)
        with self._lock:
            old = self._store.get(key)
            if projected is None:
                self._store.pop(key, None)
            else:
                self._store[key] = projected
        self._changed(key, old, projected)

    def _changed(self, key: str, old: Manifest | None, new: Manifest | None) -> None:
        if old == new or self._on_change is None:
            return
        try:
            self._on_change(key, old, new)
        except Exception:
            log.exception("%s: reacting to a change of %s failed", self.name, key)
