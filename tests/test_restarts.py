"""A restart under a real elastic launcher, and no orphans after a rank is SIGKILLed.

2 ranks of the tiny NeMo GPT (tests/support/nemo_train.py, through tests/support/restart_rank.py)
run under nvidia-resiliency-ext's `ft_launcher` (and, for comparison, torch's `torchrun`) with
--max-restarts 1 and a c10d rendezvous on 127.0.0.1. In the first incarnation
(TORCHELASTIC_RESTART_COUNT=0) rank 1 SIGKILLs itself after step 5; rank 0 then fails on the
broken gloo connection, the launcher stops the worker group and starts it again
(TORCHELASTIC_RESTART_COUNT=1); both ranks resume from the RAM checkpoint under the same --base
and train to step 8. The result must equal an uninterrupted reference run bit for bit
(examples/quickstart.compare: losses, parameters, optimizer state).

ft_launcher runs on CPU without a fault-tolerance config file when given
--ignore-missing-fault-tol-cfg (the ranks do not use RankMonitorClient, so no heartbeat timeout
applies); it logs NVML errors ("NVML Shared Library Not Found") and disables its GPU health checks,
which is harmless here.

Orphans: right before its SIGKILL, rank 1 writes its descendants (pid, create time, cmdline, owner)
to a file; 5 s after that, the test checks that none of them is still alive (a zombie counts as
dead). Both launchers stop a worker group with os.killpg(<rank pid>, SIGTERM) (torch elastic's
SubprocessHandler starts each rank in its own session), which would also kill a dead rank's
helpers and hide an orphan; so the launchers run with --monitor-interval 10 and the test asserts
that the check happened before the launcher noticed the failure. What cleans up is therefore the
helpers' own mechanism: our Manager (ml_flashpoint_nemo.core.manager) has PR_SET_PDEATHSIG(SIGKILL)
and a parent-pipe watchdog; the stdlib resource tracker exits when the last process holding its
pipe (the rank and its spawned children) is gone. The test asserts on our Manager; other helpers
(Megatron's async-save processes, if any) are printed, and the resource tracker is asserted only
when no other helper survived (it legitimately lives as long as any spawned child holds its pipe).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.multiproc import REPO, free_port

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402
from quickstart import compare  # noqa: E402

BIN = Path(sys.executable).parent
STEPS, EVERY, KILL_AT, KILL_RANK = 8, 2, 5, 1
TRAIN_FLAGS = ["--steps", str(STEPS), "--every", str(EVERY), "--async-save"]
ORPHAN_GRACE_S = 5.0
MONITOR_INTERVAL_S = 10  # the launcher notices the dead rank only after the orphan check (see the docstring)
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run (no flashpoint), under out/reference as quickstart.compare expects."""
    out = tmp_path_factory.mktemp("restart-reference")
    code = launch_ranks(str(REPO / "tests" / "support" / "nemo_train.py"),
                        [*TRAIN_FLAGS, "--out", str(out / "reference"), "--base", str(out / "unused-base"),
                         "--route", "none"], timeout=300, log_dir=out / "reference")
    assert code == 0, (out / "reference" / "rank-0.log").read_text()[-4000:]
    return out


def alive(entry: dict[str, Any]) -> bool:
    """Whether the process recorded in entry (pid + create time, so a reused pid does not count) still runs."""
    try:
        proc = psutil.Process(entry["pid"])
        return abs(proc.create_time() - entry["create_time"]) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def launcher_command(launcher: str, port: int) -> list[str]:
    command = [str(BIN / launcher), "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"restart-{port}",
               "--monitor-interval", str(MONITOR_INTERVAL_S)]
    if launcher == "ft_launcher":
        command.append("--ignore-missing-fault-tol-cfg")
    return command


def run_elastic(launcher: str, out: Path, base: Path) -> dict[str, Any]:
    """Run the crash-and-restart job under launcher; check the killed rank's helpers on the way."""
    pids_file = out / "killed-rank.json"
    log_path = out / "launcher.log"
    (out / "resume").mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", RESTART_KILL_RANK=str(KILL_RANK), RESTART_KILL_AT=str(KILL_AT),
               RESTART_PIDS_FILE=str(pids_file), PYTHONPATH=str(REPO))
    command = [*launcher_command(launcher, free_port()), str(REPO / "tests" / "support" / "restart_rank.py"),
               *TRAIN_FLAGS, "--out", str(out / "resume"), "--base", str(base)]
    killed: dict[str, Any] | None = None
    survivors: list[dict[str, Any]] = []
    launcher_noticed_first = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if killed is None and pids_file.exists():
                killed = json.loads(pids_file.read_text())
                time.sleep(max(0.0, pids_file.stat().st_mtime + ORPHAN_GRACE_S - time.time()))
                survivors = [entry for entry in killed["descendants"] if alive(entry)]
                launcher_noticed_first = "exitcode: -9" in log_path.read_text()
            time.sleep(0.2)
        timed_out = proc.poll() is None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher (the ranks have sessions of their own)
        except ProcessLookupError:
            pass
        proc.wait()
        for entry in (killed or {}).get("descendants", []):  # whatever this test left behind
            if alive(entry):
                os.kill(entry["pid"], signal.SIGKILL)
    log_text = log_path.read_text()
    assert not timed_out, f"{launcher} did not finish within {TIMEOUT_S} s\n{log_text[-5000:]}"
    result_path = out / "resume" / "result.json"
    return {"code": proc.returncode, "log": log_text, "killed": killed, "survivors": survivors,
            "launcher_noticed_first": launcher_noticed_first,
            "result": json.loads(result_path.read_text()) if result_path.exists() else None}


@pytest.fixture(scope="module", params=["ft_launcher", "torchrun"])
def elastic_run(request, reference, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"restart-{request.param}")
    (out / "reference").symlink_to(reference / "reference")
    base = Path("/dev/shm") / f"flashpoint-test-restart-{out.name}"
    try:
        run = run_elastic(request.param, out, base)
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    return {"launcher": request.param, "out": out, **run}


def test_restarted_worker_group_resumes_from_ram_bit_exact(elastic_run):
    log = elastic_run["log"]
    assert elastic_run["code"] == 0, f"{elastic_run['launcher']} exited with {elastic_run['code']}\n{log[-5000:]}"
    assert f"rank {KILL_RANK} SIGKILLs itself after step {KILL_AT}" in log, log[-5000:]
    assert log.count("incarnation 1") == 2, log[-5000:]  # the launcher started both ranks again
    result = elastic_run["result"]
    assert result is not None and result["resumed_from"] == "ram", result
    assert result["losses"][0][0] == int(Path(result["resumed_path"]).name.split("-")[1]) + 1, result
    assert compare(elastic_run["out"], resumed_from="ram") == []


def test_no_helper_of_a_sigkilled_rank_outlives_it(elastic_run):
    killed = elastic_run["killed"]
    assert killed is not None, "the rank never wrote its pids before the SIGKILL\n" + elastic_run["log"][-3000:]
    assert elastic_run["launcher_noticed_first"] is False, (
        "the launcher had already stopped the worker group (killpg) when the orphan check ran; "
        "raise MONITOR_INTERVAL_S")
    descendants = killed["descendants"]
    print(f"{elastic_run['launcher']}: rank {killed['rank']} (pid {killed['pid']}) had {len(descendants)} descendants:")
    for entry in descendants:
        state = "ALIVE" if entry in elastic_run["survivors"] else "gone"
        print(f"  {state} {entry['owner']:16} pid {entry['pid']} ppid {entry['ppid']}: {' '.join(entry['cmdline'])}")
    assert any(entry["owner"] == "flashpoint" for entry in descendants), "our Manager was not running"
    ours = [entry for entry in elastic_run["survivors"] if entry["owner"] == "flashpoint"]
    others = [entry for entry in elastic_run["survivors"] if entry["owner"] == "other"]
    tracker = [entry for entry in elastic_run["survivors"] if entry["owner"] == "resource_tracker"]
    assert ours == [], f"our Manager outlived the SIGKILLed rank by {ORPHAN_GRACE_S} s: {ours}"
    if not others:
        assert tracker == [], f"the resource tracker outlived the rank and every other helper: {tracker}"
