"""Signal handlers left installed by a trainer whose teardown was cut short, put back when the next one is wired.

When fit starts, Lightning installs a SIGTERM handler made of the trainer's own methods. The handler
it replaced is put back only by the trainer's teardown. FlashpointCallback does the same for its
preemption signal. NVRx's in-process restart raises RankShouldRestart into the main thread wherever
that thread is, sometimes inside this teardown. The handler then stays installed. CPython keeps
signal handlers outside any object the garbage collector sees, so the handler keeps the aborted
trainer (model, optimizer, process groups) alive, and the next trainer chains it into its own. On
a GPU that is a second copy of the model on every restart.

wire_trainer calls release_stale_signal_handlers for every new trainer, from the main thread,
before its fit installs handlers. It puts back what such a trainer replaced. "Such a trainer" means
a trainer that flashpoint wired and whose checkpoint IO has been closed since (by FlashpointAbort,
or by the end of its training). A trainer still training keeps its handlers. Flashpoint's own
handlers are OwnedHandlers, which carry that test themselves.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable

from ml_flashpoint_nemo.nemo.settings import wiring_of

logger = logging.getLogger(__name__)

_LONGEST_CHAIN = 64  # handlers put back per call at most: each restart left at most a few


class OwnedHandler:
    """A signal handler flashpoint installs: it knows what it replaced and whether its owner has finished."""

    def __init__(self, number: int, handle: Callable[[int, FrameType | None], object], *,
                 owner_finished: Callable[[], bool], what: str) -> None:
        self.number, self.what = number, what
        self._handle, self.owner_finished = handle, owner_finished
        self.previous = signal.signal(number, self)  # main thread only, as signal.signal itself

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self._handle(signum, frame)

    def put_back(self) -> None:
        """Install the handler this one replaced (main thread; elsewhere, or for a handler Python did not
        install, nothing changes)."""
        try:
            signal.signal(self.number, self.previous)
        except (ValueError, TypeError):
            pass


def release_stale_signal_handlers(new_trainer: Any) -> int:
    """Put back the handlers that finished flashpoint trainers left installed; how many were put back.

    Main thread only (the only thread that may set handlers); in any other it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return 0
    released: list[str] = []
    for _ in range(_LONGEST_CHAIN):
        what = _release_one(new_trainer)
        if what is None:
            break
        released.append(what)
    if released:
        gc.collect()  # the trainers are reference cycles, by now in the oldest generation: free them before a new model
        logger.info("Put back %d signal handler(s) that trainers cut short had left installed (%s); those trainers "
                    "can be freed now", len(released), ", ".join(released))
    return len(released)


def _release_one(new_trainer: Any) -> str | None:
    """Put back one stale handler (the installed one of some signal); what it was, or None when none is left."""
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (OSError, ValueError):  # pragma: no cover - a number this platform cannot query
            continue
        previous = _handler_replaced_by_finished_trainer(handler, number, new_trainer)
        if previous is not None:
            restore, what = previous
            restore()
            return f"{what} of signal {signal.Signals(number).name}"
    return None


def _handler_replaced_by_finished_trainer(handler: Any, number: int,
                                          new_trainer: Any) -> tuple[Callable[[], object], str] | None:
    """(how to put back what handler replaced, what handler is), if a finished trainer installed it."""
    if isinstance(handler, OwnedHandler):
        return (handler.put_back, handler.what) if handler.owner_finished() else None
    connector = _lightning_connector_of(handler)
    if connector is None or connector.trainer is new_trainer:
        return None
    wiring = wiring_of(connector.trainer)
    previous = connector._original_handlers.get(number)  # noqa: SLF001 - what Lightning's teardown would put back
    if wiring is None or not wiring.io.closed or previous is None:
        return None
    return (lambda: signal.signal(number, previous)), "Lightning's handler"


def _lightning_connector_of(handler: Any) -> Any:
    """The Lightning _SignalConnector whose methods the handler calls, if it is Lightning's handler."""
    try:
        from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
    except ImportError:  # pragma: no cover - another Lightning: nothing to recognise
        return None
    if not isinstance(handler, _HandlersCompose):
        return None
    for part in handler.signal_handlers:
        owner = getattr(part, "__self__", None)
        if isinstance(owner, _SignalConnector):
            return owner
    return None
