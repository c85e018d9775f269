"""Keeping Python's cyclic garbage collector out of the short phases that block training.

A save walks and creates thousands of small objects (write items, records, futures), which
triggers generation-0/1/2 collections in the middle of the staging copy; on a state of a few
hundred tensors a full collection costs tens of milliseconds that training waits for. Pausing
the collector for those phases only defers that work (it runs at the next allocation after the
pause), as Megatron does for its own async-save scheduling.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Callable, Iterator, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_depth = 0  # pauses in progress, over every thread
_was_enabled = False  # the collector's state when the outermost pause began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the collector inside the block; the state found by the outermost pause is restored.

    Nests and may be used from several threads at once: the collector stays off until the
    last pause ends, and is turned back on only if it was on when the first one began.
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def without_gc(function: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of gc_paused, for methods that run while training waits."""

    @functools.wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return function(*args, **kwargs)

    return paused
