"""Outcomes of background writes (core/save_worker.py) carried to finalize (megatron/worker_reports.py)."""

from __future__ import annotations

import os
import queue

import pytest

from ml_flashpoint_nemo.core.save_worker import seal_and_report
from ml_flashpoint_nemo.core.seal import SealJob
from ml_flashpoint_nemo.core.sync_manager import shutdown_manager, start_manager_warmup, wait_for_manager
from ml_flashpoint_nemo.errors import FlashpointError
from ml_flashpoint_nemo.megatron import worker_reports
from ml_flashpoint_nemo.megatron.worker_reports import WorkerReports

MISSING_OBJECT = SealJob(path="/nonexistent/flashpoint-object", rank=0, plan=None, crcs=None,  # type: ignore[arg-type]
                         checksum=True)


def test_a_failed_write_is_reported_under_its_token():
    reports = WorkerReports(queue.Queue())
    seal_and_report(MISSING_OBJECT, 1, reports.queue, "save-a", os.getpid())
    with pytest.raises(FlashpointError, match="background write failed: FileNotFoundError"):
        reports.raise_if_failed("save-a")
    with pytest.raises(FlashpointError, match="ended without reporting"):
        reports.raise_if_failed("save-b")


def test_a_worker_whose_manager_is_gone_does_not_raise(capfd):
    """A raise would end Megatron's persistent worker loop unsignalled and hang its blocking finalize."""
    future = start_manager_warmup()
    report_queue = wait_for_manager(future, timeout=60).Queue()
    shutdown_manager(future)
    seal_and_report(MISSING_OBJECT, 1, report_queue, "save-a", os.getpid())  # must return
    assert "could not report its outcome (FileNotFoundError" in capfd.readouterr().err


def test_unclaimed_reports_are_bounded_oldest_dropped_first(monkeypatch):
    monkeypatch.setattr(worker_reports, "MAX_UNCLAIMED_REPORTS", 3)
    reports = WorkerReports(queue.Queue())
    for n in range(5):
        reports.queue.put((f"save-{n}", None if n != 4 else "OSError: disk"))
    reports.raise_if_failed("save-2")  # drains all five, keeps the newest three
    with pytest.raises(FlashpointError, match="ended without reporting"):
        reports.raise_if_failed("save-0")  # an abandoned save's report, dropped
    reports.raise_if_failed("save-3")
    with pytest.raises(FlashpointError, match="OSError: disk"):
        reports.raise_if_failed("save-4")
