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


def trainer() -> Any:
    from nemo import lightning as nl

    return nl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      strategy=nl.MegatronStrategy(ckpt_async_save=False))


def describe(handler: Any) -> str:
    if handler is original_handler:
        return "original"
    return handler.name if isinstance(handler, signal.Handlers) else type(handler).__name__


def wired_and_fitting(base: str, *, preemption: bool = False) -> Any:
    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint

    started = trainer()
    wrap_trainer_with_flashpoint(started, base_dir=base)
    started._signal_connector.register_signal_handlers()  # as Lightning's _run, after the setup hook
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
        print(label, "installed", installed, "kept_alive_before", kept_alive,
              "sigterm_after", describe(signal.getsignal(signal.SIGTERM)), "freed", former() is None, flush=True)
        callback._stop_drain()  # the aborted fit's callback, reused or torn down late: it must put back nothing now
        print(label + "_LATE_STOP", "sigterm", describe(signal.getsignal(signal.SIGTERM)), flush=True)
        del callback
        following._flashpoint.io.close(finalize=False)

    # NeMo's PreemptionCallback (which NeMo-Run's PreemptionPlugin adds) over Lightning's handler, at train start;
    # it needs a process group, as in training.
    import torch.distributed as dist
    from nemo.lightning.pytorch.callbacks import PreemptionCallback

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    aborted = wired_and_fitting(base)
    preemption = PreemptionCallback()
    preemption.on_train_start(aborted, None)
    installed = describe(signal.getsignal(signal.SIGTERM))
    close_live_resources()
    former = weakref.ref(aborted)
    del aborted
    following = trainer()
    wrap_trainer_with_flashpoint(following, base_dir=base)
    print("NEMO_PREEMPTION installed", installed, "sigterm_after", describe(signal.getsignal(signal.SIGTERM)),
          "freed", former() is None, "context_left", preemption._handler_context is not None, flush=True)
    preemption.on_train_end(None, None)  # as if its on_train_end ran late: nothing more to put back
    print("NEMO_PREEMPTION_LATE_END sigterm", describe(signal.getsignal(signal.SIGTERM)), flush=True)
    following._flashpoint.io.close(finalize=False)
    dist.destroy_process_group()

    running = wired_and_fitting(base)  # its IO is open: still training, e.g. a second trainer made during its fit
    other = trainer()
    wrap_trainer_with_flashpoint(other, base_dir=base)
    handler = signal.getsignal(signal.SIGTERM)
    owner = getattr(handler.signal_handlers[0], "__self__", None)
    print("RUNNING kept", owner is not None and owner.trainer is running, flush=True)
    running._signal_connector.teardown()  # its own teardown puts the original back
    close_live_resources()

    stale = wired_and_fitting(base)
    stale._flashpoint.io.close(finalize=False)
    counts: list[int] = []
    thread = threading.Thread(target=lambda: counts.append(release_stale_signal_handlers(trainer())))
    thread.start()
    thread.join()
    print("OTHER_THREAD released", counts[0], "sigterm", describe(signal.getsignal(signal.SIGTERM)), flush=True)
    print("MAIN_THREAD released", release_stale_signal_handlers(trainer()),
          "sigterm", describe(signal.getsignal(signal.SIGTERM)), flush=True)
    close_live_resources()

    from ml_flashpoint_nemo.nemo.stale_handlers import OwnedHandler

    realtime = signal.SIGRTMIN + 1  # no name in signal.Signals
    OwnedHandler(realtime, original_handler, owner_finished=lambda: True, what="a finished owner's handler")
    print("REALTIME released", release_stale_signal_handlers(trainer()),
          "handler", describe(signal.getsignal(realtime)), flush=True)
    stuck = OwnedHandler(realtime, original_handler, owner_finished=lambda: True, what="a finished owner's handler")
    stuck.previous = None  # it replaced a handler installed outside Python: nothing to put back
    print("NOTHING_TO_PUT_BACK released", release_stale_signal_handlers(trainer()),
          "handler", describe(signal.getsignal(realtime)), flush=True)
    signal.signal(realtime, signal.SIG_DFL)


if __name__ == "__main__":
    main()
