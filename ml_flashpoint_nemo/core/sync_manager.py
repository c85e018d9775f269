"""The spawn-context multiprocessing SyncManager that async saves need, started off the critical path.

(Not a checkpoint manager: a `multiprocessing.managers.SyncManager`, whose proxies carry results
between Megatron's save worker and its finalize step.)

Starting a spawn-context ``torch.multiprocessing`` Manager launches a fresh Python
process, which takes seconds; trainer setup must not wait for it. So
:func:`start_manager_warmup` starts it in a daemon thread and returns a
:class:`SyncManagerFuture` at once. Three properties make that future safe to hand to a
writer (docs/design.md, "Saving"):

* It never leaves a save hanging. Any failure in the thread goes into the future, and
  every wait is bounded (``FLASHPOINT_MANAGER_TIMEOUT_S``, default 120 s, counted from
  the start). At the deadline the start is abandoned: the half-started process is
  killed and every wait raises :class:`~ml_flashpoint_nemo.errors.ManagerStartError`.
* The Manager process does not re-run the user's main script. Spawned children
  normally re-import ``__main__``; a script without an ``if __name__ == "__main__":``
  guard would then re-run training in the child and hang. Our Manager serves only
  built-in proxies, so its child skips that import (see
  :func:`main_module_not_reimported`).
* The Manager process dies with the process that started it, SIGKILL included: an
  orphan could outlive an in-job restart. See :func:`_server_init`. And it never keeps
  that process from exiting: a start still in progress at exit is abandoned (core/exits.py).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn as _mp_spawn
import os
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from multiprocessing.managers import SyncManager
from typing import Any, Callable, Iterator, Protocol

from ml_flashpoint_nemo.core import exits, lifecycle
from ml_flashpoint_nemo.core.parent_death import tie_to_parent
from ml_flashpoint_nemo.errors import ManagerStartError

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "FLASHPOINT_MANAGER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0

_FIND_CHILD_S = 2.0  # how long an abandon waits for a starting thread to reveal its child's pid
_REAP_S = 5.0
_SETTLE_S = 5.0  # bound on waiting for a future that another thread is completing right now

_GUARD_HINT = (
    "The most common cause is a main script whose top level is not guarded by "
    '`if __name__ == "__main__":`: spawned processes re-import the main module, and training code at its '
    "top level then runs again in the child and hangs. Put the script's top-level code under that guard. "
    f"If the machine is merely slow or overloaded, raise {TIMEOUT_ENV} (seconds)."
)


class SyncManagerFuture(Future[SyncManager]):
    """A future of the started Manager whose every wait is bounded and ends in ManagerStartError.

    A wait that times out abandons the start for good (the half-started process is
    killed), so later waits fail at once instead of waiting again; poll with
    :meth:`done` to check without waiting.
    """

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout
        self._began = time.monotonic()
        self._deadline = self._began + timeout
        self._lock = threading.Lock()
        self._manager: SyncManager | None = None  # set before start(), so an abandon can find the child
        self._settled = False  # whoever sets it first completes the future; the others back off
        self._closed = False
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None

    @property
    def pid(self) -> int | None:
        """Pid of the Manager's server process, once it has been launched."""
        process = _server_process(self._manager)
        return process.pid if process is not None else None

    def result(self, timeout: float | None = None, *, what: str = "a RAM checkpoint save") -> SyncManager:
        """Wait for the Manager, at most `timeout` s (default: until the start deadline).

        Raises ManagerStartError if the start failed, was abandoned, or does not finish in time;
        `what` names the waiter in that message.
        """
        bound = self._deadline - time.monotonic() if timeout is None else timeout
        try:
            return super().result(timeout=max(bound, 0.0))
        except FutureTimeoutError:
            waited = time.monotonic() - self._began
            self._abandon(
                ManagerStartError(
                    f"the multiprocessing Manager needed by {what} was not running {waited:.1f} s after its "
                    f"start began (limit {bound if timeout is not None else self.timeout:.1f} s); the start was "
                    f"abandoned and its half-started process killed. {_GUARD_HINT}"
                )
            )
            return super().result(timeout=_SETTLE_S)  # the stored error, or the Manager if the start won

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Like Future.exception, but bounded the same way as :meth:`result`."""
        try:
            self.result(timeout)
        except ManagerStartError as exc:
            return exc
        return None

    def close(self) -> None:
        """Shut the Manager down if it started; abandon a start still in progress.

        Harmless after a failed start, and callable any number of times.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        lifecycle.unregister(self)
        if self._abandon(ManagerStartError("the multiprocessing Manager was closed before it had started")):
            return
        try:
            manager = super().result(timeout=_SETTLE_S)  # already settled; at most being set right now
        except BaseException:  # noqa: BLE001 - a failed start has nothing left to shut down
            return
        manager.shutdown()  # a multiprocessing Finalize: runs once, bounded, kills the server if it must
        logger.debug("Multiprocessing Manager shut down")

    def _begin(self, server_hook: Callable[[], Any] | None) -> None:
        self.set_running_or_notify_cancel()  # from now on cancel() is a no-op; close() abandons instead
        lifecycle.register(self, SyncManagerFuture.close, f"multiprocessing Manager (future at {id(self):#x})")
        # Until it is up, its half-started process has no shutdown finalizer: multiprocessing's exit would join it.
        exits.stop_at_exit(self, SyncManagerFuture.close, f"multiprocessing Manager (future at {id(self):#x})")
        self._timer = threading.Timer(self.timeout, self._expire)
        self._timer.name = "flashpoint-manager-deadline"
        self._timer.daemon = True
        self._thread = threading.Thread(
            target=self._run, args=(server_hook,), name="flashpoint-manager", daemon=True
        )
        self._timer.start()
        self._thread.start()

    def _run(self, server_hook: Callable[[], Any] | None) -> None:
        manager: SyncManager | None = None
        try:
            import torch.multiprocessing as torch_mp  # torch registers its tensor reductions on import

            manager = SyncManager(ctx=torch_mp.get_context("spawn"))  # what get_context("spawn").Manager() builds
            with self._lock:
                if self._settled:  # abandoned before we began
                    return
                self._manager = manager
            with main_module_not_reimported():
                manager.start(_server_init, (os.getpid(), server_hook))
        except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever waits
            exitcode = _reap_failed_child(manager)
            if exitcode is None:
                hint = _GUARD_HINT
            else:  # the child died: our Manager never re-imports __main__, so the guard is not the cause
                hint = (f"Its process ({_mp_spawn.get_executable()}) exited with code {exitcode}; its traceback, if "
                        "any, is on stderr. Check that this interpreter starts in the job's environment, and the "
                        "process and memory limits (ulimit -u, cgroup) of the job.")
            error = ManagerStartError(
                f"the multiprocessing Manager needed by async saves failed to start "
                f"({type(exc).__name__}: {exc}). {hint}"
            )
            error.__cause__ = exc
            self._settle(error=error)
            return
        if not self._settle(manager=manager):  # abandoned while the child was coming up: do not leave it running
            manager.shutdown()
            return
        logger.info(
            "Multiprocessing Manager ready (pid %s) %.2f s after the warm-up began",
            self.pid,
            time.monotonic() - self._began,
        )
        process = _server_process(manager)
        if process is not None:  # always, once start() returned
            _stay_until_exit(process)

    def _expire(self) -> None:
        self._abandon(
            ManagerStartError(
                f"the multiprocessing Manager needed by async saves did not start within {self.timeout:.1f} s; "
                f"the start was abandoned and its half-started process killed. {_GUARD_HINT}"
            )
        )

    def _settle(self, *, manager: SyncManager | None = None, error: ManagerStartError | None = None) -> bool:
        """Complete the future unless someone already did; True if this call completed it.

        The decision is taken under our lock, but set_result/set_exception (which run
        done-callbacks) are called outside it, so a callback may call close().
        """
        with self._lock:
            if self._settled:
                return False
            self._settled = True
        self._cancel_timer()
        if error is not None:
            self.set_exception(error)
        else:
            assert manager is not None, "a settle without an error carries the Manager"
            self.set_result(manager)
        return True

    def _abandon(self, error: ManagerStartError) -> bool:
        """Fail the future with `error` and kill any half-started child; False if it had already finished."""
        if not self._settle(error=error):
            return False
        self._kill_half_started()
        return True

    def _kill_half_started(self) -> None:
        # The starting thread publishes the manager before start() and forks inside it; wait briefly for the
        # pid to appear. Only SIGKILL here: the starting thread reaps the child when its start() fails.
        give_up = time.monotonic() + _FIND_CHILD_S
        while True:
            process = _server_process(self._manager)
            if process is not None and process.pid is not None:
                try:
                    process.kill()  # a no-op once the child has been reaped, so never hits a reused pid
                    logger.warning("Killed the half-started multiprocessing Manager process %d", process.pid)
                except (OSError, ValueError):  # gone, or its handle already closed
                    pass
                return
            alive = self._thread is not None and self._thread.is_alive()
            if self._manager is None or not alive or time.monotonic() > give_up:
                return
            time.sleep(0.01)

    def _cancel_timer(self) -> None:
        """Stop the deadline timer and wait until its thread is gone, before the future completes.

        A waiter may fork (a Megatron worker per save) as soon as it wakes; on Python < 3.11.10
        a thread ending at that moment can deadlock the child (CPython gh-112275).
        """
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
            self._timer.join(_SETTLE_S)


ManagerFuture = SyncManagerFuture  # the name of releases up to 0.1.0 (ml_flashpoint_nemo.core exports it)


def start_manager_warmup(
    *, timeout: float | None = None, _server_hook: Callable[[], Any] | None = None
) -> SyncManagerFuture:
    """Start a spawn-context torch.multiprocessing Manager in a daemon thread; returns its future at once.

    `timeout` (default: ``FLASHPOINT_MANAGER_TIMEOUT_S``, else 120 s) bounds the start and every wait.
    `_server_hook` is for tests only: a picklable module-level callable run in the server before it serves.
    """
    future = SyncManagerFuture(_resolve_timeout(timeout))
    future._begin(_server_hook)
    return future


def unguarded_main_script() -> str | None:
    """The main script's path if its top level has no ``if __name__ == "__main__":`` block, else None.

    Processes that other libraries spawn (Megatron's persistent async worker, DataLoader
    workers) re-run such a script's training code and hang; our own Manager is protected,
    theirs are not, so callers warn about it up front.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return None  # interactive, -c, or a frozen entry point: nothing is re-run
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            return None
    return str(path)


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(values) == 1


def wait_for_manager(
    future: SyncManagerFuture, timeout: float | None = None, *, what: str = "a RAM checkpoint save"
) -> SyncManager:
    """The started Manager; raises ManagerStartError if it failed or is not up within the bound."""
    return future.result(timeout, what=what)


def shutdown_manager(future: SyncManagerFuture | None) -> None:
    """Shut down the Manager behind `future` if it started; harmless if not, failed, or already closed."""
    if future is not None:
        future.close()


def _resolve_timeout(timeout: float | None) -> float:
    source = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        source = TIMEOUT_ENV
        try:
            timeout = float(raw)
        except ValueError:
            timeout = float("nan")
    if not timeout > 0 or timeout == float("inf"):
        raise ManagerStartError(
            f"{source}={timeout!r} is not a usable bound for the Manager start; give a positive number of seconds"
        )
    return float(timeout)


def _reap_failed_child(manager: SyncManager | None) -> int | None:
    """Wait for (then kill) the child of a failed start, so nothing is left behind; its exit code."""
    process = _server_process(manager)
    if process is None or process.pid is None:
        return None
    process.join(_REAP_S)
    if process.exitcode is None:
        process.kill()
        process.join(_REAP_S)
    return process.exitcode


def _server_process(manager: SyncManager | None) -> multiprocessing.process.BaseProcess | None:
    """The Manager's server process once launched (the stdlib keeps it in the private ``_process``)."""
    return getattr(manager, "_process", None)


def _stay_until_exit(process: multiprocessing.process.BaseProcess) -> None:
    """Keep the thread that launched the Manager alive until the Manager process exits.

    Linux sends PR_SET_PDEATHSIG when the *thread* that forked the child exits, not the
    process; this thread forked the server, so returning now would SIGKILL it. Waiting on
    the process sentinel (a pipe that hits EOF when the server exits) does not reap the
    child, so it cannot race ``manager.shutdown()``, which does.
    """
    try:
        multiprocessing.connection.wait([process.sentinel])
    except (OSError, ValueError):  # sentinel closed: the process is gone anyway
        pass


_patch_lock = threading.Lock()
_patch_users = 0


class _PreparationData(Protocol):
    """The signature of ``multiprocessing.spawn.get_preparation_data``."""

    def __call__(self, name: str) -> dict[str, Any]: ...


class _WrappedPreparationData(_PreparationData, Protocol):
    """Our wrapper of it: ``functools.wraps`` keeps the original in ``__wrapped__``."""

    __wrapped__: _PreparationData


_installed_wrapper: _WrappedPreparationData | None = None
_this_thread = threading.local()


@contextlib.contextmanager
def main_module_not_reimported() -> Iterator[None]:
    """While active, processes spawned *by this thread* do not re-import the main module.

    The spawn start method sends the child ``get_preparation_data()``; its keys
    ``init_main_from_name`` / ``init_main_from_path`` make the child import ``__main__``
    as ``__mp_main__``, re-running an unguarded script. We wrap
    ``multiprocessing.spawn.get_preparation_data`` (looked up at call time by the spawn
    Popen) so that it drops those keys, but only when called from a thread that is
    inside this context; every other caller gets the stdlib's answer unchanged. This
    beats hiding ``__main__.__file__`` / ``__spec__`` while our Manager starts: that
    would also change what concurrent spawns from other threads (e.g. DataLoader
    workers) send. The wrapper is installed for the duration of our starts only
    (reference counted), and if the stdlib stops calling the hook the start still ends
    in the bounded wait and its clear error.
    """
    global _patch_users, _installed_wrapper
    with _patch_lock:
        if _patch_users == 0:
            _installed_wrapper = _skip_main_for_our_thread(_mp_spawn.get_preparation_data)
            _mp_spawn.get_preparation_data = _installed_wrapper
        _patch_users += 1
    _this_thread.skip_main = True
    try:
        yield
    finally:
        _this_thread.skip_main = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0 and _mp_spawn.get_preparation_data is _installed_wrapper:
                _mp_spawn.get_preparation_data = _installed_wrapper.__wrapped__


def _skip_main_for_our_thread(original: _PreparationData) -> _WrappedPreparationData:
    @functools.wraps(original)
    def get_preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if getattr(_this_thread, "skip_main", False):
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    return get_preparation_data


def _server_init(parent_pid: int, server_hook: Callable[[], Any] | None) -> None:
    """Runs in the Manager's server process before it serves: tie its life to `parent_pid`.

    The launching thread stays alive for PR_SET_PDEATHSIG's sake, see :func:`_stay_until_exit`.
    """
    tie_to_parent(parent_pid, watchdog_name="flashpoint-manager-watchdog")
    if server_hook is not None:
        server_hook()
