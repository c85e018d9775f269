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
PreemptionCallbacks are remembered at wiring (note_wired_trainer): once their trainer's IO has
closed, their handler contexts are exited as their on_train_end would, which puts back the
handler beneath. A handler that other code installed over a stale one hides it, and Lightning's
handler of a trainer flashpoint did not wire is not recognised. A finalize step of the restart
that puts back the handlers from before the first trainer covers those cases too.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import weakref
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
        released += _exit_preemption_contexts_of_finished_trainers()  # first: they may lie over stale handlers
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


# (a wired trainer's checkpoint IO, that trainer's NeMo PreemptionCallbacks), weakly, until its IO is found closed.
_PREEMPTION_CALLBACKS: list[tuple[weakref.ref[Any], list[weakref.ref[Any]]]] = []


def note_wired_trainer(trainer: Any, io: Any) -> None:
    """Remember the trainer's NeMo PreemptionCallbacks, so that their handlers can be put back once its IO closes.

    NeMo's PreemptionCallback (NeMo-Run's PreemptionPlugin adds it) installs its handler at train start over
    Lightning's, and keeps the handler it replaced in a suspended context that only its on_train_end exits. If
    that never runs, the context keeps Lightning's handler of the trainer, and when the callback is collected the
    context's clean-up installs that stale handler again, over whatever is installed then.
    """
    callback_type = _nemo_preemption_callback_type()
    callbacks = [weakref.ref(c) for c in getattr(trainer, "callbacks", ()) if callback_type and
                 isinstance(c, callback_type)]
    if callbacks:
        _PREEMPTION_CALLBACKS.append((weakref.ref(io), callbacks))


def _exit_preemption_contexts_of_finished_trainers() -> list[str]:
    """Exit, as on_train_end would, the handler contexts of the NeMo PreemptionCallbacks of trainers whose IO has
    closed (or is gone), when their handler is the one installed; what was put back."""
    released = []
    for entry in list(_PREEMPTION_CALLBACKS):
        io = entry[0]()
        if io is not None and not io.closed:
            continue
        _PREEMPTION_CALLBACKS.remove(entry)  # once: a callback reused by a later trainer is that trainer's then
        for callback in (ref() for ref in entry[1]):
            if callback is not None and _exit_preemption_context(callback):
                released.append(f"NeMo's PreemptionCallback handler of signal {_signal_name(callback.sig)}")
    return released


def _exit_preemption_context(callback: Any) -> bool:
    context = callback._handler_context  # noqa: SLF001 - what its on_train_end would exit
    frame = getattr(getattr(context, "gen", None), "gi_frame", None)  # None unless suspended at its yield
    if frame is None:
        return False
    installed: object = signal.getsignal(callback.sig)
    if not any(installed is frame.f_locals.get(name) for name in ("master_handler", "ignoring_handler")):
        return False  # another handler lies over it: exiting would remove that one
    try:
        context.__exit__(None, None, None)  # its own clean-up: puts back the handler it replaced
    finally:
        callback._handler_context = None  # noqa: SLF001
    return True


def _nemo_preemption_callback_type() -> type | None:
    try:
        from nemo.lightning.pytorch.callbacks.preemption import PreemptionCallback
    except ImportError:  # pragma: no cover - NeMo is what this package wires
        return None
    return PreemptionCallback


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
    return None


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
