"""Objects a load reads that live on another node: fetched when the load first needs them.

After a restart at the saved layout, recovery makes sure every rank's own objects are on its
own node, and nothing more: a node does not copy the whole checkpoint. A load may still read
another rank's object (a replicated tensor stored once, by the rank that saved its main
replica); the loaders ask `ensure_local` before opening an object, and when the file is not
on this node the fetcher that recovery registered for the base directory brings it, checked
against its commit record entry, from the node of the rank that saved it. So a node receives
exactly the objects its ranks read.

The fetcher is registered by replication (a layer above this one) and runs on the loading
thread; with none registered (a single node, or no recovery ran) a missing object stays
missing and the loader reports it as it always did.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from ml_flashpoint_nemo.core.format import ObjectRecord

logger = logging.getLogger(__name__)

# fetch(step, record): make the object `record` of version `step` present and checked on this node, or raise.
Fetcher = Callable[[int, ObjectRecord], None]

_lock = threading.Lock()
_fetchers: dict[str, tuple[Fetcher, Callable[[], None]]] = {}  # realpath of a base directory -> (fetch, stop)


def register_fetcher(base_dir: str | os.PathLike[str], fetch: Fetcher, stop: Callable[[], None]) -> None:
    """Let loads of base_dir's versions fetch the objects this node lacks, until stop_fetching(base_dir).

    stop: ends what serves the fetches (no collective); an earlier fetcher of base_dir is stopped first.
    """
    with _lock:
        earlier = _fetchers.pop(os.path.realpath(base_dir), None)
    if earlier is not None:
        earlier[1]()
    with _lock:
        _fetchers[os.path.realpath(base_dir)] = (fetch, stop)


def unregister_fetcher(base_dir: str | os.PathLike[str], fetch: Fetcher) -> None:
    """Forget base_dir's fetcher if it is `fetch` (a newer one stays); stops nothing."""
    key = os.path.realpath(base_dir)
    with _lock:
        if key in _fetchers and _fetchers[key][0] == fetch:
            del _fetchers[key]


def stop_fetching(base_dir: str | os.PathLike[str]) -> None:
    """Stop and forget base_dir's fetcher, if any (no collective).

    Only once every rank of the job has loaded: another rank's load may still fetch from this
    rank's node. The next save's replication does it (training steps synchronise the ranks first).
    """
    with _lock:
        registered = _fetchers.pop(os.path.realpath(base_dir), None)
    if registered is not None:
        registered[1]()


def fetching(base_dir: str | os.PathLike[str]) -> bool:
    """Whether a recovery serves base_dir's loads: the job restarted on several nodes, each holding its own objects."""
    with _lock:
        return os.path.realpath(base_dir) in _fetchers


def stop_all() -> None:
    """Stop every fetcher of this process (at exit)."""
    with _lock:
        registered = list(_fetchers.values())
        _fetchers.clear()
    for _, stop in registered:
        stop()


def ensure_local(base_dir: str | os.PathLike[str], step: int, record: ObjectRecord) -> None:
    """Before a load opens the object `record` of version `step`: let the registered fetcher check or fetch it; without one, do nothing.

    The fetcher checks an object that another rank saved before its first use here (a replica
    or an earlier fetch may be damaged) and fetches it when it is absent or was damaged. A fetch
    that fails raises its error (the load fails on this rank as an absent object would).
    """
    with _lock:
        registered = _fetchers.get(os.path.realpath(base_dir))
    if registered is None:
        return
    fetch = registered[0]
    logger.debug("checking %s of step %d before the load reads it", record.name, step)
    fetch(step, record)
