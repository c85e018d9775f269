"""Closing every flashpoint resource of a process for an in-process restart (core.lifecycle, FlashpointAbort).

The registry itself is tested on plain objects; the closes of real resources (Manager process, buffer pool and
its lock, Megatron's async save workers) on real gloo ranks, in tests/support/lifecycle_scenarios.py. The whole
NVRx in-process restart of a NeMo job is tests/test_inprocess_restart.py.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time

import pytest

from ml_flashpoint_nemo.core import lifecycle
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.pool import BufferPool
from ml_flashpoint_nemo.core.sync_manager import start_manager_warmup, wait_for_manager
from tests.support.multiproc import run_world


class Resource:
    """A closeable thing that records the order it was closed in."""

    def __init__(self, name: str, closed: list[str], fail: bool = False, block: threading.Event | None = None):
        self.name, self.closed, self.fail, self.block = name, closed, fail, block
        lifecycle.register(self, Resource.close, name)

    def close(self) -> None:
        if self.block is not None:
            self.block.wait()
        if self.fail:
            raise RuntimeError(f"{self.name} cannot close")
        self.closed.append(self.name)


@pytest.fixture(autouse=True)
def nothing_registered_before():
    lifecycle.close_live_resources()  # whatever earlier tests of this process left open
    yield


def test_close_live_resources_closes_newest_first_and_forgets_what_is_closed_or_collected():
    closed: list[str] = []
    first, second, third = Resource("first", closed), Resource("second", closed), Resource("third", closed)
    lifecycle.register(second, Resource.close, "second again")  # a second registration changes nothing
    lifecycle.unregister(first)  # closed by its owner
    del third
    gc.collect()  # a collected object has nothing left to close
    assert lifecycle.live_resources() == ["second"]
    report = lifecycle.close_live_resources()
    assert (report.closed, report.failed, report.unfinished) == (("second",), (), ())
    assert closed == ["second"] and lifecycle.live_resources() == []
    newest_first = [Resource(name, closed) for name in ("a", "b", "c")]
    lifecycle.close_live_resources()
    assert closed[1:] == ["c", "b", "a"], newest_first


def test_resources_registered_first_are_closed_before_the_others():
    """The NeMo IO registers with first=True: its async-save workers stop before the pools they write into go."""
    closed: list[str] = []
    pools = [Resource("old pool", closed)]
    io = Resource("io", closed)
    lifecycle.register(io, Resource.close, "io", first=True)  # already registered: no change...
    lifecycle.unregister(io)
    lifecycle.register(io, Resource.close, "io", first=True)  # ...until it registers again
    pools.append(Resource("new pool", closed))
    lifecycle.close_live_resources()
    assert closed == ["io", "new pool", "old pool"], closed


def test_a_failing_close_is_logged_and_the_others_still_close(caplog):
    closed: list[str] = []
    kept = [Resource("before", closed), Resource("broken", closed, fail=True), Resource("after", closed)]
    with caplog.at_level(logging.ERROR, logger="ml_flashpoint_nemo.core.lifecycle"):
        report = lifecycle.close_live_resources()
    assert closed == ["after", "before"], kept
    assert report.failed == ("broken: RuntimeError: broken cannot close",)
    assert "Closing broken failed" in caplog.text and "broken cannot close" in caplog.text


def test_closing_is_bounded_in_time_and_each_resource_is_closed_once():
    closed: list[str] = []
    release = threading.Event()
    kept = [Resource("quick", closed), Resource("stuck", closed, block=release)]
    started = time.monotonic()
    report = lifecycle.close_live_resources(timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert report.unfinished == ("stuck", "quick") and "still closing" in report.summary()
    assert lifecycle.close_live_resources().closed == ()  # claimed by the first call: never closed twice
    release.set()
    deadline = time.monotonic() + 5
    while closed != ["stuck", "quick"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == ["stuck", "quick"], kept


def test_flashpoint_abort_returns_the_state_and_never_raises(caplog):
    from nvidia_resiliency_ext.inprocess.state import State

    from ml_flashpoint_nemo import FlashpointAbort

    closed: list[str] = []
    kept = [Resource("fine", closed), Resource("broken", closed, fail=True)]
    state = State(rank=3, world_size=4).freeze()
    with caplog.at_level(logging.INFO, logger="ml_flashpoint_nemo"):
        assert FlashpointAbort()(state) is state
    assert closed == ["fine"], kept
    assert "Rank 3, restart iteration 0: closed 1 flashpoint resource(s)" in caplog.text
    assert "1 failed (broken: RuntimeError: broken cannot close)" in caplog.text
    with pytest.raises(ValueError, match="positive number of seconds"):
        FlashpointAbort(timeout=0)


def test_a_pool_and_a_manager_register_themselves_and_are_closed_for_a_restart(shm_dir):
    pool = BufferPool(CheckpointLayout(shm_dir), rank=0)
    future = start_manager_warmup()
    wait_for_manager(future, 60)
    process = future._manager._process  # noqa: SLF001 - the stdlib keeps the server process here
    assert {f"buffer pool {pool.directory}", f"multiprocessing Manager (future at {id(future):#x})"} <= set(
        lifecycle.live_resources())
    report = lifecycle.close_live_resources()
    assert not report.failed and len(report.closed) >= 2
    assert pool.closed and not process.is_alive()
    BufferPool(CheckpointLayout(shm_dir), rank=0).close()  # the pool lock was released
    assert lifecycle.live_resources() == []


def _results(outputs: list[str]) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for out in outputs for line in out.splitlines()
            if line.startswith("RESULT ")]


def test_flashpoint_abort_from_another_thread_while_the_main_thread_waits_in_a_collective(base_dir):
    results = _results(run_world("lifecycle_scenarios", "abort_while_blocked", 2, {"base": str(base_dir)}))
    by_rank = {result["rank"]: result for result in results}
    blocked = by_rank[0]
    assert blocked["main_thread_blocked"] and blocked["state_returned"], blocked
    assert blocked["abort_s"] < 10, blocked
    assert any(what.startswith("multiprocessing Manager") for what in blocked["before"]), blocked
    assert any(what.startswith("buffer pool") for what in blocked["before"]), blocked
    assert blocked["live_after"] == [] and not blocked["manager_alive_after"], blocked
    for result in by_rank.values():  # saved and loaded again in the same processes, nothing left open
        assert result["committed"] == [1, 2] and result["live_at_end"] == [], result


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_unfinalized_async_save_workers_are_stopped_without_a_process_group(base_dir, persistent):
    (result,) = _results(run_world("lifecycle_scenarios", "stop_workers", 1,
                                   {"base": str(base_dir), "persistent": persistent}))
    assert len(result["workers"]) == 1 and result["stopped"] == 1, result
    assert result["workers_alive"] == [] and not result["marker_written"], result
    assert result["seconds"] < 5 and result["unraisable"] == [], result


def test_a_strategy_closes_only_the_pools_of_its_own_bases(base_dir):
    """A late close (after an abort's time limit) must not take the pools a newer run is saving into."""
    for result in _results(run_world("lifecycle_scenarios", "close_takes_only_its_own_pools", 2,
                                     {"base": str(base_dir)})):
        pools = result["pools_after_first_close"]
        assert len(pools) == 1 and f"{base_dir}/second" in pools[0], result
        assert result["live_at_end"] == [], result
