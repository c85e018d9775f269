"""A restart under a real elastic launcher, and no orphans after a rank is SIGKILLed.

2 ranks of the tiny NeMo GPT (tests/support/nemo_train.py, through tests/support/restart_rank.py)
run under nvidia-resiliency-ext's `ft_launcher` (and, with FLASHPOINT_ALL_LAUNCHERS=1, torch's `torchrun`:
the same elastic agent underneath, ~90 s more, so CI runs ft_launcher alone) with
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
dead). The job also writes NeMo's async durable checkpoints (--durable-every 3 --async-save), so
Megatron's async-save helpers run in the killed rank too. Both launchers stop a worker group with
os.killpg(<rank pid>, SIGTERM) (torch elastic's SubprocessHandler starts each rank in its own
session), which would also kill a dead rank's helpers and hide an orphan; so the launchers run with
--monitor-interval 10, the test polls the helpers every 0.1 s after the kill, and it asserts that
our Manager was gone before the launcher logged the failure ("failed (exitcode: ..."). What cleans up is therefore the
helpers' own mechanism: our Manager (ml_flashpoint_nemo.core.sync_manager) has PR_SET_PDEATHSIG(SIGKILL)
and a parent-pipe watchdog; the stdlib resource tracker exits when the last process holding its
pipe (the rank and its spawned children) is gone. The test asserts on our Manager; other helpers
are printed, and the resource tracker is asserted only when no other helper survived (it
legitimately lives as long as any spawned child holds its pipe).

Known orphan, not ours (printed, not asserted): Megatron's results-queue Manager. Its async durable
save calls megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue(),
i.e. mp.get_context("spawn").Manager().Queue(): a stdlib SyncManager server process
("python -B -c from multiprocessing.spawn import spawn_main; ...") with no parent-death signal and no
parent watch; the stdlib stops it only through its Finalize/shutdown in the parent, which a SIGKILL
never runs, so it keeps serving after the rank died and holds the resource tracker's pipe (the
tracker stays alive as well). It goes away only when the launcher kill()s the dead rank's process
group (or the test's cleanup). Megatron's fork()ed async caller and writer processes do exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.multiproc import REPO, free_port

sys.path.insert(0, str(REPO / "examples"))

from quickstart import compare  # noqa: E402

from tests.support.nemo_reference import REFERENCE_STEPS, link_reference  # noqa: E402

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)

BIN = Path(sys.executable).parent
STEPS, EVERY, KILL_AT, KILL_RANK = REFERENCE_STEPS, 2, 5, 1
TRAIN_FLAGS = ["--steps", str(STEPS), "--every", str(EVERY), "--async-save"]
ORPHAN_GRACE_S = 5.0
MONITOR_INTERVAL_S = 10  # the launcher notices the dead rank only after the orphan check (see the docstring)
TIMEOUT_S = 240
DURABLE_EVERY = 3
# torchrun's c10d rendezvous shares its TCPStore with the ranks (TORCHELASTIC_USE_AGENT_STORE=True) and the store
# outlives a restart, so gloo's connectFullMesh in incarnation 1 reads the peer address incarnation 0 left there:
# "Gloo connectFullMesh failed ... timed out connecting: SO_ERROR: Connection refused" (pytorch/pytorch#135712,
# #167288). ft_launcher sets TORCHELASTIC_USE_AGENT_STORE only for the static rendezvous, so it is not affected.
# what both launchers log when their monitor finds a failed rank, before they stop the worker group
LAUNCHER_NOTICED = "failed (exitcode: "
LAUNCHER_ENV = {"ft_launcher": {}, "torchrun": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}


def alive(entry: dict[str, Any]) -> bool:
    """Whether the process recorded in entry (pid + create time, so a reused pid does not count) still runs."""
    try:
        proc = psutil.Process(entry["pid"])
        return abs(proc.create_time() - entry["create_time"]) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch_helpers(helpers: list[dict[str, Any]], kill_time: float, log_path: Path) -> dict[int, tuple[float, bool]]:
    """Poll helpers from the kill until ORPHAN_GRACE_S after it: pid -> (seconds after the kill it was found dead,
    whether the launcher had already noticed the failure then - its killpg could have done it)."""
    deaths: dict[int, tuple[float, bool]] = {}
    while True:
        now = time.time()
        dead = [entry["pid"] for entry in helpers if entry["pid"] not in deaths and not alive(entry)]
        noticed = LAUNCHER_NOTICED in log_path.read_text()  # read after the check: absent now, absent at the death
        deaths.update((pid, (now - kill_time, noticed)) for pid in dead)
        if now >= kill_time + ORPHAN_GRACE_S:
            return deaths
        time.sleep(0.1)


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
    env = dict(os.environ, OMP_NUM_THREADS="1", **LAUNCHER_ENV[launcher], RESTART_KILL_RANK=str(KILL_RANK), RESTART_KILL_AT=str(KILL_AT),
               RESTART_PIDS_FILE=str(pids_file), PYTHONPATH=str(REPO))
    command = [*launcher_command(launcher, free_port()), str(REPO / "tests" / "support" / "restart_rank.py"),
               *TRAIN_FLAGS, "--out", str(out / "resume"), "--base", str(base),
               # NeMo's async durable checkpoints too, so Megatron's async-save helpers run in the killed rank
               "--durable-every", str(DURABLE_EVERY), "--durable-dir", str(out / "durable")]
    killed: dict[str, Any] | None = None
    survivors: list[dict[str, Any]] = []
    deaths: dict[int, tuple[float, bool]] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if killed is None and pids_file.exists():
                killed = json.loads(pids_file.read_text())
                deaths = watch_helpers(killed["descendants"], pids_file.stat().st_mtime, log_path)
                survivors = [entry for entry in killed["descendants"] if entry["pid"] not in deaths]
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
            "deaths": deaths,
            "result": json.loads(result_path.read_text()) if result_path.exists() else None}


LAUNCHERS = ["ft_launcher", "torchrun"] if os.environ.get("FLASHPOINT_ALL_LAUNCHERS") == "1" else ["ft_launcher"]


@pytest.fixture(scope="module", params=LAUNCHERS)
def elastic_run(request, nemo_reference, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"restart-{request.param}")
    link_reference(nemo_reference, out)
    # Unique per run: pytest's tmp names repeat across sessions, and a session killed before its cleanup
    # would leave committed versions that the next one resumes from, skipping the crash under test.
    base = Path("/dev/shm") / f"flashpoint-test-restart-{out.name}-{uuid.uuid4().hex[:12]}"
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
    descendants, deaths = killed["descendants"], elastic_run["deaths"]
    print(f"{elastic_run['launcher']}: rank {killed['rank']} (pid {killed['pid']}) had {len(descendants)} descendants:")
    for entry in descendants:
        seconds, noticed = deaths.get(entry["pid"], (None, None))
        state = (f"ALIVE after {ORPHAN_GRACE_S:.0f} s" if seconds is None else
                 f"gone after {seconds:.1f} s{' (launcher had noticed)' if noticed else ''}")
        print(f"  {state:34} {entry['owner']:16} pid {entry['pid']} ppid {entry['ppid']}: {' '.join(entry['cmdline'])}")
    assert any(entry["owner"] == "flashpoint" for entry in descendants), "our Manager was not running"
    ours = [entry for entry in elastic_run["survivors"] if entry["owner"] == "flashpoint"]
    by_launcher = [entry for entry in descendants if entry["owner"] == "flashpoint" and deaths[entry["pid"]][1]]
    assert by_launcher == [], ("our Manager was still alive when the launcher noticed the failure (its killpg may "
                               f"have ended it, not our own mechanism); raise MONITOR_INTERVAL_S: {by_launcher}")
    others = [entry for entry in elastic_run["survivors"] if entry["owner"] not in ("flashpoint", "resource_tracker")]
    tracker = [entry for entry in elastic_run["survivors"] if entry["owner"] == "resource_tracker"]
    assert ours == [], f"our Manager outlived the SIGKILLed rank by {ORPHAN_GRACE_S} s: {ours}"
    if not others:
        assert tracker == [], f"the resource tracker outlived the rank and every other helper: {tracker}"
