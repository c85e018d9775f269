"""Durable checkpoints drained from RAM, on real NeMo trainers (2 CPU ranks, gloo), resumed by plain NeMo.

The drained checkpoint must be one NeMo resumes from without this package: the resume phase runs
with `--plain-resume` (no flashpoint at all, NeMo's own AutoResume and MegatronCheckpointIO) and
must match an uninterrupted run bit for bit (losses, parameters, optimizer state).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.multiproc import REPO
from tests.support.nemo_reference import link_reference
from tests.test_nemo_e2e import STEPS, train

sys.path.insert(0, str(REPO / "examples"))

from quickstart import compare  # noqa: E402


@pytest.mark.parametrize("options, message", [
    ({"durable_every_n_steps": 4}, "needs durable_dir"),
    ({"durable_every_n_steps": 0, "durable_dir": "/tmp/d"}, "durable_every_n_steps must be None or an integer >= 1"),
    ({"durable_every_n_steps": 4, "durable_dir": "/tmp/d", "durable_bytes_per_s": -1}, "durable_bytes_per_s"),
    ({"durable_keep": 0}, "durable_keep must be an integer >= 1"),
    ({"preemption_signal": "SIGKILL"}, "catchable signal"),
    ({"preemption_signal": "TERM"}, "catchable signal"),
    ({"preemption_grace_s": 0}, "preemption_grace_s must be a number > 0"),
])
def test_bad_drain_options_are_refused_up_front(options, message):
    from ml_flashpoint_nemo.errors import TrainerSetupError
    from ml_flashpoint_nemo.nemo.settings import FlashpointSettings

    with pytest.raises(TrainerSetupError, match=message):
        FlashpointSettings.create("/dev/shm/unused-base", **options)


def test_a_durable_dir_inside_the_ram_base_is_refused(shm_dir):
    from ml_flashpoint_nemo.errors import TrainerSetupError
    from ml_flashpoint_nemo.nemo.settings import FlashpointSettings

    with pytest.raises(TrainerSetupError, match="overlaps the RAM checkpoint directory"):
        FlashpointSettings.create(shm_dir, durable_every_n_steps=2, durable_dir=str(shm_dir / "durable"))
    assert list(shm_dir.iterdir()) == [], "nothing created"


def test_a_held_version_is_not_retired_until_its_hold_is_released(shm_dir):
    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.core.versions import committed_steps, delete_superseded

    layout = CheckpointLayout(shm_dir)
    for step in (2, 4, 6):
        layout.version_dir(step).mkdir()
        layout.commit_path(step).write_bytes(b"")
    layout.hold_path(2, 1).touch()  # rank 1 drains step 2
    assert delete_superseded(shm_dir, keep=1, rank=0) == [4]
    assert committed_steps(layout) == [2, 6] and layout.hold_path(2, 1).is_file()
    layout.hold_path(2, 1).unlink()
    assert delete_superseded(shm_dir, keep=1, rank=0) == [2]
    assert committed_steps(layout) == [6]


def test_the_drain_thread_runs_at_the_lowest_cpu_priority_and_the_trainer_keeps_its_own(shm_dir, tmp_path):
    """The drain takes only the CPU training leaves idle: its thread is niced, the process's other threads not."""
    import os
    import threading
    import time

    from ml_flashpoint_nemo.nemo.drain import DRAIN_NICE, DurableDrain

    trainer_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    drain = DurableDrain(base_dir=shm_dir, durable_dir=tmp_path / "durable", rank=0, world_size=1, token="t", keep=1,
                         bytes_per_s=None, timeout_s=5)
    try:
        tid = drain._thread.native_id
        assert tid is not None
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, tid) != DRAIN_NICE and time.monotonic() < deadline:
            time.sleep(0.01)  # polled: the thread lowers its own priority as it starts
        assert os.getpriority(os.PRIO_PROCESS, tid) == DRAIN_NICE != trainer_nice
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == trainer_nice
    finally:
        drain.close(timeout_s=5)


def test_an_abort_stops_the_drain_thread_and_releases_its_queued_hold(shm_dir, tmp_path):
    """close_live_resources (what FlashpointAbort runs) stops a drain whose callback's teardown was cut short."""
    import threading

    from ml_flashpoint_nemo.core import close_live_resources, live_resources
    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.nemo.drain import DrainRequest, DurableDrain

    release = threading.Event()
    drain = DurableDrain(base_dir=shm_dir, durable_dir=tmp_path / "durable", rank=0, world_size=1, token="t", keep=1,
                         bytes_per_s=None, timeout_s=5, prepare=lambda: release.wait(30))  # busy until released
    layout = CheckpointLayout(shm_dir)
    layout.version_dir(4).mkdir()
    drain.submit(DrainRequest(4, "step=4"))  # queued behind the preparation
    assert any("DurableDrain" in what for what in live_resources())
    report = close_live_resources(timeout=5)
    assert "DurableDrain" in report.summary() and not report.failed
    assert not layout.hold_path(4, 0).exists(), "the queued drain's hold outlived the abort"
    release.set()
    drain._thread.join(10)
    assert not drain._thread.is_alive() and drain.busy_with() == []
    assert drain._prepare is None  # it may hold the trainer (NeMo's context): not kept past its run
    assert not any("DurableDrain" in what for what in live_resources())
    # A stale preemption handler of the aborted run submitting to its drain: nothing is held, nobody waits.
    drain.submit(DrainRequest(4, "step=4"))
    assert not layout.hold_path(4, 0).exists() and drain.wait(4, timeout_s=0)


def test_a_drain_whose_priority_cannot_be_lowered_keeps_its_thread_and_says_why(shm_dir, tmp_path, monkeypatch,
                                                                                caplog):
    """A sandbox may forbid setpriority (EPERM; this root test process cannot be refused for real, so the call
    is replaced): the drain thread logs why at DEBUG, stays up waiting for requests at normal priority, and
    closes cleanly; the trainer's own priority is untouched."""
    import logging
    import os
    import threading

    from ml_flashpoint_nemo.nemo import drain as drain_module

    def refused(*_args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    trainer_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monkeypatch.setattr(drain_module.os, "setpriority", refused)
    caplog.set_level(logging.DEBUG, logger=drain_module.logger.name)
    drain = drain_module.DurableDrain(base_dir=shm_dir, durable_dir=tmp_path / "durable", rank=0, world_size=1,
                                      token="t", keep=1, bytes_per_s=None, timeout_s=5)
    try:
        assert drain._thread.is_alive()
    finally:
        drain.close(timeout_s=5)
    assert not drain._thread.is_alive()  # it waited for requests and closed cleanly: the refusal did not kill it
    assert "Durable drain keeps its CPU priority" in caplog.text and "Operation not permitted" in caplog.text
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == trainer_nice


def test_the_durable_dir_is_prepared_by_the_drain_thread_and_a_failure_there_is_logged(shm_dir, tmp_path, caplog):
    """Rank 0's preparation (stale drains removed, NeMo's context staged) runs first in the drain thread, not on
    training's path; when it fails, the thread says so and goes on waiting for drains, and closes cleanly."""
    import logging
    import threading

    from ml_flashpoint_nemo.nemo import drain as drain_module

    ran_in: list[str] = []

    def prepare() -> None:
        ran_in.append(threading.current_thread().name)
        raise OSError("injected: the durable directory cannot be written")

    caplog.set_level(logging.WARNING, logger=drain_module.logger.name)
    drain = drain_module.DurableDrain(base_dir=shm_dir, durable_dir=tmp_path / "durable", rank=0, world_size=1,
                                      token="t", keep=1, bytes_per_s=None, timeout_s=5, prepare=prepare)
    try:
        assert drain._thread.is_alive()
    finally:
        drain.close(timeout_s=5)
    assert not drain._thread.is_alive()
    assert ran_in == ["flashpoint-drain-0"]
    assert "Could not prepare" in caplog.text and "injected: the durable directory cannot be written" in caplog.text


def test_a_trainer_without_a_nemo_context_is_prepared_for_drains_without_one_and_says_why(tmp_path, caplog):
    """NeMo's own TrainerContext.from_trainer refuses a plain Lightning trainer: the capture logs why, and the
    preparation still makes the directory and removes earlier runs' drains, staging no context."""
    import logging

    import lightning.pytorch as pl

    from ml_flashpoint_nemo.nemo import callback

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
                         devices=1)
    durable, context = tmp_path / "durable", tmp_path / "context"
    caplog.set_level(logging.WARNING, logger=callback.logger.name)
    prepare = callback._durable_dir_preparer(trainer, durable, context, token="now")
    assert "Could not capture the NeMo context for drained checkpoints" in caplog.text
    assert "Trainer from nemo" in caplog.text  # NeMo's own reason
    assert not durable.exists()  # nothing touched before the drain thread runs it
    durable.mkdir()
    (durable / ".drain-earlier-4").mkdir()
    (durable / ".drain-now-6").mkdir()
    prepare()
    assert sorted(p.name for p in durable.iterdir()) == [".drain-now-6"] and not context.exists()


def visible(checkpoints: Path) -> dict[int, Path]:
    """Drained checkpoints NeMo can see: RAM step -> directory (hidden drains in progress excluded)."""
    found = {}
    for mark in checkpoints.glob("*/.flashpoint-drained"):
        if not mark.parent.name.startswith("."):
            found[json.loads(mark.read_text())["step"]] = mark.parent
    return found


def assert_nemo_layout(checkpoint: Path) -> None:
    weights = checkpoint / "weights"
    assert json.loads((weights / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (weights / ".metadata").is_file() and (weights / "common.pt").is_file()
    assert {p.name.split("_")[2] for p in weights.glob("__*.distcp")} == {"0", "1"}, "each rank wrote its share"
    assert (checkpoint / "context").is_dir(), "NeMo's context/ of the trainer"
    assert checkpoint.name.endswith("-last") and not (checkpoint.parent / f"{checkpoint.name}-unfinished").exists()


def test_plain_nemo_resumes_bit_exact_after_a_crash_mid_drain(nemo_reference, tmp_path, shm_dir):
    """Drains of steps 2 and 4 land; the job is SIGKILLed while step 6 drains (throttled): no step-6
    checkpoint is visible, step 4's is intact, and plain NeMo resumes from it bit for bit."""
    link_reference(nemo_reference, tmp_path)
    drained = tmp_path / "drained"
    checkpoints = drained / "tiny" / "checkpoints"
    train(tmp_path, "crash", shm_dir, "--every", "2", "--drain-every", "2", "--drain-log", str(drained),
          "--drain-modelcheckpoint", "--drain-rate", "2e6", "--kill-mid-drain-of", "6", expect=-9)
    found = visible(checkpoints)
    assert sorted(found) == [2, 4], sorted(p.name for p in checkpoints.iterdir())
    assert list(checkpoints.glob(".drain-*-6/weights/*.distcp")), "the kill came mid-drain"
    for path in found.values():
        assert_nemo_layout(path)
    assert found[4].name == "tiny--step=3-consumed_samples=16.0-last", found[4].name  # as ModelCheckpoint names it
    resumed = train(tmp_path, "resume", shm_dir, "--plain-resume", str(drained))
    assert resumed["ckpt_path"] and Path(resumed["ckpt_path"]).parent == found[4], resumed["ckpt_path"]
    assert [step for step, _ in resumed["losses"]] == list(range(5, STEPS + 1))
    assert compare(tmp_path, resumed_from=None) == []


def test_a_full_durable_filesystem_fails_drains_on_every_rank_training_goes_on_and_the_next_drain_retries(
        nemo_reference, tmp_path, shm_dir, small_tmpfs):
    """The durable directory lies on a real 16 MiB tmpfs filled up to 200 KB: the drains of steps 2 and 4
    fail with ENOSPC (logged on both ranks), training goes on unchanged; once space is back, 6 and 8 land."""
    import os

    drained = small_tmpfs / "drained"
    checkpoints = drained / "tiny" / "checkpoints"
    checkpoints.mkdir(parents=True)
    filler = small_tmpfs / "filler"
    stat = os.statvfs(small_tmpfs)
    filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - (200 << 10)))
    run = train(tmp_path, "full", shm_dir, "--every", "2", "--drain-every", "2", "--drain-log", str(drained),
                "--unblock-at", "6", "--filler", str(filler))
    expected = json.loads((nemo_reference / "reference" / "result.json").read_text())["losses"]
    assert run["losses"] == expected, "training went on exactly as without checkpoints"
    for rank in (0, 1):
        log = (tmp_path / "full" / f"rank-{rank}.log").read_text()
        for step in (2, 4):
            assert f"Durable drain of step {step} to {checkpoints} failed on rank {rank}" in log, log[-3000:]
        assert "MB free on the durable filesystem" in log, log[-3000:]
    found = visible(checkpoints)
    assert sorted(found) == [6, 8], sorted(p.name for p in checkpoints.iterdir())
    assert found[8].name == "step=8-last"  # no ModelCheckpoint in this run to name it
    leftovers = [p.name for p in checkpoints.iterdir() if (p.name.startswith(".drain-") and not p.name.endswith("-context")) or p.name.endswith("-unfinished")]
    assert leftovers == [], leftovers
    for rank in (0, 1):  # every hold released: retention may retire every drained RAM version again
        assert not list(shm_dir.glob(f"step-*/.drain-hold-{rank}"))


def test_sigterm_on_both_ranks_drains_the_newest_ram_version_and_plain_nemo_resumes_from_it_bit_exact(
        nemo_reference, tmp_path, shm_dir):
    """Drains every 4 steps; a real SIGTERM to both ranks after step 7 drains RAM step 6 (not due before
    step 8), then each rank dies of the signal. Plain NeMo resumes from step 6's checkpoint bit for bit."""
    link_reference(nemo_reference, tmp_path)
    drained = tmp_path / "drained"
    checkpoints = drained / "tiny" / "checkpoints"
    crash = train(tmp_path, "crash", shm_dir, "--every", "2", "--drain-every", "4", "--drain-log", str(drained),
                  "--drain-modelcheckpoint", "--sigterm-at", "7", expect=-15)
    assert "Exiting on signal 15 after the durable drain" in crash["log"]
    found = visible(checkpoints)
    assert sorted(found) == [4, 6], sorted(p.name for p in checkpoints.iterdir())
    assert_nemo_layout(found[6])
    resumed = train(tmp_path, "resume", shm_dir, "--plain-resume", str(drained))
    assert resumed["ckpt_path"] and Path(resumed["ckpt_path"]).parent == found[6], resumed["ckpt_path"]
    assert [step for step, _ in resumed["losses"]] == [7, 8]
    assert compare(tmp_path, resumed_from=None) == []
