"""FlashpointAbort: the abort step that NVRx's in-process restart needs for flashpoint checkpoints.

    from nvidia_resiliency_ext import inprocess
    from ml_flashpoint_nemo import FlashpointAbort

    train = inprocess.Wrapper(abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), FlashpointAbort()))(train)

``inprocess.Wrapper`` restarts the training function in the same process after a fault. The
aborted run's async save workers, Manager process, replication thread and transfer server and
buffer pools (mappings, pool locks) would outlive it and pile up with every restart; the
abort step closes all of them (core.lifecycle keeps track of what is alive), so the next run
starts clean, wraps its new trainer again and resumes from the newest RAM version. It runs
no collective (other ranks may be gone), returns within its time limit and never raises into
the Wrapper's abort path: a close that fails is logged with its reason.
"""

from __future__ import annotations

import datetime
import logging

from ml_flashpoint_nemo.core.lifecycle import DEFAULT_CLOSE_TIMEOUT_S, close_live_resources

try:
    from nvidia_resiliency_ext.inprocess.abort import Abort
    from nvidia_resiliency_ext.inprocess.state import FrozenState
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "FlashpointAbort plugs into nvidia-resiliency-ext's in-process restart, which is not installed: "
        "pip install nvidia-resiliency-ext"
    ) from exc

logger = logging.getLogger(__name__)


class FlashpointAbort(Abort):
    """Closes every flashpoint resource of this process when NVRx aborts a run (no collectives).

    timeout: how long the abort may wait for the closes (seconds or a timedelta); what is still
    closing then carries on in the background and is logged. Pass it to ``inprocess.Wrapper``
    through ``inprocess.Compose`` next to ``AbortTorchDistributed``; neither needs the other.
    """

    def __init__(self, timeout: float | datetime.timedelta = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        if not seconds > 0:
            raise ValueError(f"FlashpointAbort timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = seconds

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            report = close_live_resources(self.timeout)
        except Exception:  # noqa: BLE001 - a bug of ours must not stop the rest of the Wrapper's abort
            logger.exception("Rank %s: closing the flashpoint resources for a restart failed", state.rank)
            return state
        level = logging.WARNING if report.failed or report.unfinished else logging.INFO
        logger.log(level, "Rank %s, restart iteration %s: %s", state.rank, state.iteration, report.summary())
        return state
