"""Outcomes of background object writes (core/save_worker.py's seal_and_report), carried to the trainer's finalize.

Several saves can be in flight (Megatron forks one worker per save, or queues them on its
persistent worker), and their workers report into one Manager queue in any order. The
finalize of one save may therefore read reports of later saves; those are kept here for
their own finalize, never dropped. Each save is named by a token unique to it (a pool
buffer, and so an object path, is reused by later saves).
"""

from __future__ import annotations

import queue as queue_module
from collections import OrderedDict
from typing import Any

from ml_flashpoint_nemo.errors import FlashpointError

# Reports whose finalize never comes (a save abandoned by an abort) must not pile up forever;
# far more than the saves Megatron ever keeps in flight.
MAX_UNCLAIMED_REPORTS = 256


class WorkerReports:
    """The trainer's side of the report queue: reports by token, kept until their save's finalize takes them."""

    def __init__(self, report_queue: Any) -> None:
        self.queue = report_queue
        self._received: OrderedDict[str, str | None] = OrderedDict()

    def raise_if_failed(self, token: str) -> None:
        """Raise the background write's error, or a clear one if its worker ended without reporting.

        Called once the worker is known to have ended, so its report is already in the queue.
        """
        self._drain()
        if token not in self._received:
            raise FlashpointError("the background write of this rank ended without reporting (was the worker killed?)")
        outcome = self._received.pop(token)
        if outcome is not None:
            raise FlashpointError(f"the background write failed: {outcome}")

    def _drain(self) -> None:
        while True:
            try:
                token, outcome = self.queue.get_nowait()
            except queue_module.Empty:
                return
            self._received[token] = outcome
            while len(self._received) > MAX_UNCLAIMED_REPORTS:
                self._received.popitem(last=False)
