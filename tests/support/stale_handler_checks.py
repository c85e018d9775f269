"""In a fresh process (signal handlers are process-wide): handlers of trainers cut short, put back at the next wiring.

Each trainer's fit is stood in for by what Lightning's _run does with signals
(trainer._signal_connector.register_signal_handlers()) and, for the preemption handler, by what
FlashpointCallback._start_drain does. The teardown that would put them back never runs, as when
NVRx's RankShouldRestart cuts it short. "Aborted" means close_live_resources(), what FlashpointAbort
runs. Prints one line per check for tests/test_stale_handlers.py.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import Any


def original_handler(signum: int, frame: FrameType | None) -> None:
    """The job's own SIGTERM handler, installed before any trainer."""


def trainer(callbacks: list[Any] | None = None) -> Any:
    from nemo import lightning as nl

    return nl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      strategy=nl.MegatronStrategy(ckpt_async_save=False), callbacks=callbacks)


def say(*parts: object) -> None:
    """One line in one write: logging (on stdout too, for the test) writes from other threads meanwhile."""
    sys.stdout.write(" ".join(map(str, parts)) + "\n")
    sys.stdout.flush()


def describe(handler: Any) -> str:
    if handler is original_handler:
        return "original"
    return handler.name if isinstance(handler, signal.Handlers) else type(handler).__name__


def wired_and_fitting(base: str, *, preemption: bool = False, nemo_preemption: bool = False) -> Any:
    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint

    if nemo_preemption:
        from nemo.lightning.pytorch.callbacks import PreemptionCallback
    started = trainer([PreemptionCallback()] if nemo_preemption else None)
    wrap_trainer_with_flashpoint(started, base_dir=base)
    started._signal_connector.register_signal_handlers()  # as Lightning's _run, after the setup hook
    if nemo_preemption:  # its on_train_start, after Lightning's registration
        next(c for c in started.callbacks if isinstance(c, PreemptionCallback)).on_train_start(started, None)
    if preemption:  # as FlashpointCallback._start_drain does with preemption_signal="SIGTERM"
        started._flashpoint.callback._install_preemption_handler(signal.SIGTERM)
    return started


def main() -> None:
    # Imported before any trainer exists: a first import inside a function that holds a trainer can leave its frame
    # (and so the trainer) in a traceback some library keeps of an optional import that failed.
    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint
    from ml_flashpoint_nemo.core import close_live_resources
    from ml_flashpoint_nemo.nemo.stale_handlers import release_stale_signal_handlers

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(message)s")
    base = sys.argv[1]
    signal.signal(signal.SIGTERM, original_handler)

    for label, preemption in (("LIGHTNING", False), ("WITH_PREEMPTION", True)):
        aborted = wired_and_fitting(base, preemption=preemption)
        callback = aborted._flashpoint.callback
        installed = describe(signal.getsignal(signal.SIGTERM))
        close_live_resources()
        former = weakref.ref(aborted)
        del aborted
        gc.collect()
        kept_alive = former() is not None
        following = trainer()
        wrap_trainer_with_flashpoint(following, base_dir=base)
        say(label, "installed", installed, "kept_alive_before", kept_alive,
              "sigterm_after", describe(signal.getsignal(signal.SIGTERM)), "freed", former() is None)
        callback._stop_drain()  # the aborted fit's callback, reused or torn down late: it must put back nothing now
        say(label + "_LATE_STOP", "sigterm", describe(signal.getsignal(signal.SIGTERM)))
        del callback
        following._flashpoint.io.close(finalize=False)

    # NeMo's PreemptionCallback (which NeMo-Run's PreemptionPlugin adds) over Lightning's handler, at train start;
    # it needs a process group, as in training. On NeMo's master rank its handler is a closure over itself, on the
    # others a plain function (rank 1 is stood in for by torch.distributed.get_rank returning 1).
    import torch.distributed as dist
    from nemo.lightning.pytorch.callbacks import PreemptionCallback

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    real_get_rank = dist.get_rank
    for label, rank in (("NEMO_PREEMPTION", 0), ("NEMO_PREEMPTION_OTHER_RANK", 1)):
        dist.get_rank = lambda *unused, rank=rank: rank  # type: ignore[misc]
        aborted = wired_and_fitting(base, nemo_preemption=True)
        dist.get_rank = real_get_rank
        preemption = next(c for c in aborted.callbacks if isinstance(c, PreemptionCallback))
        installed = getattr(signal.getsignal(signal.SIGTERM), "__name__", "?")
        close_live_resources()
        former = weakref.ref(aborted)
        del aborted
        following = trainer()
        wrap_trainer_with_flashpoint(following, base_dir=base)
        following._signal_connector.register_signal_handlers()  # the next fit
        del preemption
        gc.collect()  # the aborted trainer's callbacks collected: nothing of theirs may come back
        say(label, "installed", installed, "freed", former() is None, "after_collection",
              describe(signal.getsignal(signal.SIGTERM)),
              "chains_original", original_handler in signal.getsignal(signal.SIGTERM).signal_handlers)
        following._signal_connector.teardown()
        following._flashpoint.io.close(finalize=False)

    running = wired_and_fitting(base, nemo_preemption=True)  # its IO is open: its handlers stay
    other = trainer()
    wrap_trainer_with_flashpoint(other, base_dir=base)
    say("RUNNING_NEMO kept", getattr(signal.getsignal(signal.SIGTERM), "__name__", "?"))
    next(c for c in running.callbacks if isinstance(c, PreemptionCallback)).on_train_end(running, None)
    running._signal_connector.teardown()
    say("RUNNING_NEMO_ENDED sigterm", describe(signal.getsignal(signal.SIGTERM)))
    close_live_resources()
    dist.destroy_process_group()

    running = wired_and_fitting(base)  # its IO is open: still training, e.g. a second trainer made during its fit
    other = trainer()
    wrap_trainer_with_flashpoint(other, base_dir=base)
    handler = signal.getsignal(signal.SIGTERM)
    owner = getattr(handler.signal_handlers[0], "__self__", None)
    say("RUNNING kept", owner is not None and owner.trainer is running)
    running._signal_connector.teardown()  # its own teardown puts the original back
    close_live_resources()

    stale = wired_and_fitting(base)
    stale._flashpoint.io.close(finalize=False)
    counts: list[int] = []
    thread = threading.Thread(target=lambda: counts.append(release_stale_signal_handlers(trainer())))
    thread.start()
    thread.join()
    say("OTHER_THREAD released", counts[0], "sigterm", describe(signal.getsignal(signal.SIGTERM)))
    say("MAIN_THREAD released", release_stale_signal_handlers(trainer()),
          "sigterm", describe(signal.getsignal(signal.SIGTERM)))
    close_live_resources()

    from ml_flashpoint_nemo.nemo.stale_handlers import OwnedHandler

    realtime = signal.SIGRTMIN + 1  # no name in signal.Signals
    OwnedHandler(realtime, original_handler, owner_finished=lambda: True, what="a finished owner's handler")
    say("REALTIME released", release_stale_signal_handlers(trainer()),
          "handler", describe(signal.getsignal(realtime)))
    stuck = OwnedHandler(realtime, original_handler, owner_finished=lambda: True, what="a finished owner's handler")
    stuck.previous = None  # it replaced a handler installed outside Python: nothing to put back
    say("NOTHING_TO_PUT_BACK released", release_stale_signal_handlers(trainer()),
          "handler", describe(signal.getsignal(realtime)))
    signal.signal(realtime, signal.SIG_DFL)
    failing = OwnedHandler(realtime, original_handler, owner_finished=lambda: 1 / 0, what="a broken owner's handler")
    say("OWNER_CHECK_FAILS released", release_stale_signal_handlers(trainer()),
        "handler", describe(signal.getsignal(realtime)))
    put_back: list[bool] = []
    elsewhere = threading.Thread(target=lambda: put_back.append(failing.put_back()))
    elsewhere.start()
    elsewhere.join()
    say("PUT_BACK_OTHER_THREAD", put_back[0], "handler", describe(signal.getsignal(realtime)))
    signal.signal(realtime, signal.SIG_DFL)


if __name__ == "__main__":
    main()
