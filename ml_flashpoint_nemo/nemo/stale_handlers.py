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
or by the end of its training). A trainer whose IO is open, one still training, keeps its handlers.
Flashpoint's own handlers are OwnedHandlers, which carry that test themselves.

Only the handler on top of each signal is looked at, and then what it replaced. NeMo's
PreemptionCallback installs its handler over Lightning's at train start; when that lies over a
stale handler, its context is exited as its on_train_end would. A handler that other code
installed over a stale one hides it, and Lightning's handler of a trainer flashpoint did not wire
is not recognised. A finalize step of the restart that puts back the handlers from before the
first trainer covers those cases too.
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
        self.previous: Any = signal.signal(number, self)  # main thread only, as signal.signal itself

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self._handle(signum, frame)

    def put_back(self) -> bool:
        """Install the handler this one replaced, if this one is still installed; True if it was put back.

        Only once, and only from the top: a handler installed over this one keeps this one as its own
        previous, and this one keeps its previous until it is itself on top again.
        """
        installed: object = signal.getsignal(self.number)
        if self.previous is None or installed is not self:
            return False
        try:
            signal.signal(self.number, self.previous)
        except (ValueError, TypeError):  # not the main thread
            return False
        self.previous = None  # nor holds on to it
        return True


def release_stale_signal_handlers(new_trainer: Any) -> int:
    """Put back the handlers that finished flashpoint trainers left installed; how many were put back.

    Main thread only (the only thread that may set handlers); in any other it does nothing. Never
    raises: this frees memory, and must not stop a trainer from starting.
    """
    if threading.current_thread() is not threading.main_thread():
        return 0
    released: list[str] = []
    try:
        for _ in range(_LONGEST_CHAIN):
            what = _release_one(new_trainer)
            if what is None:
                break
            released.append(what)
    except Exception:  # noqa: BLE001 - see the docstring
        logger.warning("Could not check for signal handlers left by earlier trainers", exc_info=True)
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
        if isinstance(handler, OwnedHandler):
            if handler.owner_finished() and handler.put_back():
                return f"{handler.what} of signal {_signal_name(number)}"
            continue
        previous = _replaced_by_a_finished_trainer(handler, number, new_trainer)
        if previous is not None:
            signal.signal(number, previous)
            return f"Lightning's handler of signal {_signal_name(number)}"
        if _close_nemo_preemption_handler_over_stale(handler, number, new_trainer):
            return f"NeMo's PreemptionCallback handler of signal {_signal_name(number)}"
    return None


def _is_stale(handler: Any, number: int, new_trainer: Any) -> bool:
    """Whether _release_one would put back what handler replaced."""
    if isinstance(handler, OwnedHandler):
        return handler.owner_finished() and handler.previous is not None
    return _replaced_by_a_finished_trainer(handler, number, new_trainer) is not None


def _close_nemo_preemption_handler_over_stale(handler: Any, number: int, new_trainer: Any) -> bool:
    """Exit the handler context of NeMo's PreemptionCallback (as its on_train_end would) when it lies over a stale
    handler; True if it did.

    On NeMo's master rank the callback installs a closure over itself at train start; its suspended context keeps
    the handler it replaced, Lightning's of that trainer, so a fit cut short before on_train_end keeps the trainer.
    (Its handler on the other ranks holds nothing, and so hides nothing that stays alive.)
    """
    try:
        from nemo.lightning.pytorch.callbacks.preemption import PreemptionCallback
    except ImportError:  # pragma: no cover - NeMo is what this package wires
        return False
    owner = _closure_value(handler, "self")
    if not isinstance(owner, PreemptionCallback) or getattr(owner, "sig", None) != number:
        return False
    context = owner._handler_context  # noqa: SLF001 - what its on_train_end would exit
    frame = getattr(getattr(context, "gen", None), "gi_frame", None)
    if frame is None or not _is_stale(frame.f_locals.get("original_handler"), number, new_trainer):
        return False
    context.__exit__(None, None, None)  # its own clean-up: puts back the handler it replaced
    owner._handler_context = None  # noqa: SLF001
    return signal.getsignal(number) is not handler


def _replaced_by_a_finished_trainer(handler: Any, number: int, new_trainer: Any) -> Any:
    """What the handler replaced, if it is Lightning's handler of a finished flashpoint trainer and that can be put
    back; else None."""
    connector = _lightning_connector_of(handler)
    if connector is None or connector.trainer is new_trainer:
        return None
    wiring = wiring_of(connector.trainer)
    if wiring is None or not wiring.io.closed:
        return None
    previous = connector._original_handlers.get(number)  # noqa: SLF001 - what Lightning's teardown would put back
    # None: a handler installed outside Python, which Lightning's teardown leaves too. The connector's own handler:
    # it registered twice without a teardown in between, and what came before is lost.
    if previous is None or previous is handler or _lightning_connector_of(previous) is connector:
        return None
    return previous


def _closure_value(function: Any, name: str) -> Any:
    """The value of a free variable of a Python function (None if it has no such variable or it is unset)."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    if code is None or name not in code.co_freevars or len(cells) != len(code.co_freevars):
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return str(int(number))


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
