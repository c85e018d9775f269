"""Every flashpoint resource alive in this process, so that an in-process restart can close them all.

An in-process restart (NVRx's ``inprocess.Wrapper``) runs the training function again in
the same process. Whatever the aborted run left open - the background save workers, the
Manager process, the replication thread and transfer server, the buffer pools' mappings
and locks - would otherwise pile up with every restart. So each of them registers here
when it is created and unregisters when it is closed, and :func:`close_live_resources`
closes whatever is still open: newest first, without any collective (other ranks may be
gone), each failure logged and skipped, the whole bounded in time.

The registry holds weak references only: it never keeps anything alive, and an object that
was garbage-collected has nothing left to close. Stdlib only, so the Manager's server
process can import its neighbours cheaply.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

DEFAULT_CLOSE_TIMEOUT_S = 30.0

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    ref: "weakref.ref[Any]"
    close: Callable[[Any], object]
    what: str
    first: bool = False  # closed before every resource registered without it


# An RLock: a garbage collection inside a locked section may run a weakref callback of this module.
_lock = threading.RLock()
_order = itertools.count()
_entries: dict[int, _Entry] = {}  # registration number -> entry; iterate over list() copies only


def register(resource: T, close: Callable[[T], object], what: str | None = None, *, first: bool = False) -> None:
    """Track `resource` until it is unregistered or garbage-collected; registering it again changes nothing.

    `close(resource)` must be idempotent, must not run collectives, and must be safe to call from
    another thread than the one using the resource (an abort runs in NVRx's monitor thread).
    first: close it before the others whatever its age (what stops writers before their buffers go).
    """
    with _lock:
        if any(entry.ref() is resource for entry in list(_entries.values())):
            return
        key = next(_order)

        def forget(_: object, key: int = key) -> None:
            _entries.pop(key, None)  # atomic; no lock, since a collection can run this anywhere

        _entries[key] = _Entry(weakref.ref(resource, forget), close, what or _describe(resource), first)


def unregister(resource: object) -> None:
    """Stop tracking `resource` (it was closed); harmless if it is not tracked."""
    with _lock:
        for key in [k for k, entry in list(_entries.items()) if entry.ref() is resource]:
            _entries.pop(key, None)


def live_resources() -> list[str]:
    """What is registered and still alive, oldest first (for logs and tests)."""
    entries = [entry for _, entry in sorted(list(_entries.items()))]
    return [entry.what for entry in entries if entry.ref() is not None]


@dataclass(frozen=True)
class CloseReport:
    """What close_live_resources did."""

    closed: tuple[str, ...]
    failed: tuple[str, ...]  # "<what>: <exception type>: <message>"
    unfinished: tuple[str, ...]  # still closing, in a daemon thread, when the time ran out
    seconds: float

    def summary(self) -> str:
        parts = [f"closed {len(self.closed)} flashpoint resource(s) in {self.seconds:.2f} s"
                 + (f" ({', '.join(self.closed)})" if self.closed else "")]
        if self.failed:
            parts.append(f"{len(self.failed)} failed ({'; '.join(self.failed)})")
        if self.unfinished:
            parts.append(f"{len(self.unfinished)} still closing at the time limit ({', '.join(self.unfinished)})")
        return ", ".join(parts)


def close_live_resources(timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> CloseReport:
    """Close every registered resource, those registered `first` first, each group newest first; never raises,
    returns within about `timeout` s.

    Each resource is claimed (unregistered) before it is closed, so two concurrent calls never
    close the same one twice. A close that raises is logged with its reason and the rest go on;
    closes still running at the time limit carry on in a daemon thread and are reported as
    unfinished, so an abort path is never held up longer than `timeout`.
    """
    started = time.monotonic()
    with _lock:
        claimed = [entry for _, entry in sorted(list(_entries.items()), key=lambda kv: (not kv[1].first, -kv[0]))]
        _entries.clear()
    claimed = [entry for entry in claimed if entry.ref() is not None]
    closed: list[str] = []
    failed: list[str] = []
    progress = [0]  # how many of `claimed` were handled; the closes run one after the other

    def close_all() -> None:
        for entry in claimed:
            resource = entry.ref()
            try:
                if resource is not None:
                    entry.close(resource)
                    closed.append(entry.what)
            except Exception as exc:  # noqa: BLE001 - one failed close must not keep the others open
                failed.append(f"{entry.what}: {type(exc).__name__}: {exc}")
                logger.error("Closing %s failed; what it holds may stay open until the process exits",
                             entry.what, exc_info=True)
            finally:
                resource = None
                progress[0] += 1

    if claimed:
        worker = threading.Thread(target=close_all, name="flashpoint-close", daemon=True)
        worker.start()
        worker.join(timeout)
    unfinished = tuple(entry.what for entry in claimed[progress[0]:])
    if unfinished:
        logger.error("Closing flashpoint resources took longer than %.1f s; still closing in the background: %s",
                     timeout, ", ".join(unfinished))
    return CloseReport(tuple(closed), tuple(failed), unfinished, time.monotonic() - started)


def _describe(resource: object) -> str:
    return f"{type(resource).__name__} at {id(resource):#x}"
