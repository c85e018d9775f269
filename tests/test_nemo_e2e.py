"""Real NeMo trainers on 2 CPU ranks: train, RAM checkpoints, SIGKILL, restart, resume - and the fallbacks.

Each run is 2 real rank processes (gloo) started by examples/launch.py, forked from a process that has NeMo
imported already (tests/support/fork_server.py; the quickstart test starts real interpreters); the CPU stand-ins for
CUDA-only calls come from ml_flashpoint_nemo/testing/cpu_shims.py (no GPU here). A resumed run must match an
uninterrupted one bit for bit: losses, parameters and optimizer state.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ml_flashpoint_nemo.core import committed_steps
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from tests.support.fork_server import nemo_popen
from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402
from quickstart import compare  # noqa: E402

from tests.support.nemo_reference import REFERENCE_STEPS, link_reference  # noqa: E402

STEPS = REFERENCE_STEPS


def train(out: Path, phase: str, base: Path, *flags: str, expect: int = 0, steps: int = STEPS, nproc: int = 2) -> dict:
    code = launch_ranks(str(REPO / "tests" / "support" / "nemo_train.py"),
                        ["--steps", str(steps), "--out", str(out / phase), "--base", str(base), *flags],
                        nproc=nproc, timeout=400, log_dir=out / phase, popen=nemo_popen)
    log = (out / phase / "rank-0.log").read_text()
    assert code == expect, f"{phase} exited with {code}, expected {expect}\n{log[-4000:]}"
    result = out / phase / "result.json"
    return {"log": log, **(json.loads(result.read_text()) if result.exists() else {})}


@pytest.mark.unmeasured  # six fresh NeMo interpreters; what they run, the tests below measure
def test_quickstart_recovers_from_ram_bit_exact(tmp_path):
    done = subprocess.run([sys.executable, "examples/quickstart.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "PASS: training after the crash matches the uninterrupted run bit for bit" in done.stdout
    # step 6 if its async save was finalized before the SIGKILL after step 8, else step 3 (a busy machine)
    assert re.search(r"resumed from RAM step [36] ", done.stdout), done.stdout[-2000:]
    assert re.search(r"stall per save: median \d+\.\d ms over \d+ saves", done.stdout), done.stdout[-2000:]


@pytest.mark.parametrize(
    "case, ram_every, kill_at, expected",
    [
        ("ram newer", 2, 5, ("ram", ["step-4"])),  # RAM step 4, durable step 3
        ("ram lost", 2, 5, ("durable", ["step=2"])),  # durable step 3 (NeMo names it step=2)
        ("durable newer", 4, 7, ("durable", ["step=5"])),  # RAM step 4, durable step 6
        # async saves: the SIGKILL leaves NeMo's newest "-last" checkpoint unfinished, so NeMo's AutoResume
        # refuses to resume at all; FlashpointAutoResume resumes from RAM. The kill comes first in step 5's
        # batch-end callbacks; the RAM save of step 4 is committed only if NeMo's async finalizer callback
        # found its write done at step 5's start, else step 2 is the newest committed.
        ("async durable unfinished", 2, 5, ("ram", ["step-2", "step-4"])),
    ],
)
@pytest.mark.unmeasured  # two NeMo runs each, of paths the other tests measure (conftest)
def test_durable_checkpoint_is_the_fallback_and_the_newer_one_wins(nemo_reference, tmp_path, shm_dir, case, ram_every,
                                                                   kill_at, expected):
    link_reference(nemo_reference, tmp_path)
    flags = ("--durable-every", "3", "--durable-dir", str(tmp_path / "durable"), "--every", str(ram_every),
             # async RAM saves commit only once the persistent save worker is up: with ranks forked from a warm
             # interpreter this tiny model reaches the kill before the worker has booted (a real job's first save
             # comes minutes after set-up)
             *(["--async-save", "--save-worker-up"] if case.startswith("async") else []))
    train(tmp_path, "crash", shm_dir, *flags, "--kill-at", str(kill_at), expect=-9)
    if case == "ram lost":  # the node lost its RAM (reboot, another job cleaned /dev/shm, ...)
        for version in shm_dir.glob("step-*"):
            subprocess.run(["rm", "-rf", str(version)], check=True)
    resumed = train(tmp_path, "resume", shm_dir, *flags)
    source, path_parts = expected
    assert resumed["resumed_from"] == source, resumed["resumed_path"]
    assert any(part in resumed["resumed_path"] for part in path_parts), resumed["resumed_path"]
    # A RAM version is read by every rank from its own node; a durable one as NeMo reads it (parallel load on)
    assert resumed["parallel_loads"] == (0 if source == "ram" else 1), resumed["parallel_loads"]
    if case == "ram lost":
        assert "falling back to the durable checkpoint" in resumed["log"]
    if case.startswith("async"):
        assert "Last checkpoint is unfinished" in resumed["log"], resumed["log"][-3000:]
    assert compare(tmp_path, resumed_from=source) == []


def test_restart_on_two_nodes_loads_in_parallel_from_what_each_rank_saved(nemo_reference, tmp_path, shm_dir):
    """Each rank its own node: after the crash the RAM version is read with Megatron's parallel load (each rank
    reads the part of the replicated tensors it saved, the rest arrives over the process group), bit-exact."""
    link_reference(nemo_reference, tmp_path)
    train(tmp_path, "crash", shm_dir / "node{rank}", "--every", "2", "--kill-at", "5", expect=-9)
    resumed = train(tmp_path, "resume", shm_dir / "node{rank}", "--every", "2")
    assert resumed["resumed_from"] == "ram" and resumed["resumed_path"].endswith("step-4"), resumed["resumed_path"]
    assert resumed["parallel_loads"] == 1, resumed["parallel_loads"]
    assert compare(tmp_path) == []


def test_overlapped_save_every_step_commits_before_the_next_optimizer_step_and_resumes_exact(
        nemo_reference, tmp_path, shm_dir):
    """A save every step with overlap_capture: step 4's save commits during step 5 (before its optimizer step),
    so the SIGKILL after step 5 (the first batch-end callback) finds it committed, not step 3's; the restart
    from it matches the uninterrupted run bit for bit, although each save's copy overlapped the next step.
    Each rank waits until its write is sealed before the optimizer step, so the commit depends on the hooks."""
    link_reference(nemo_reference, tmp_path)
    flags = ("--every", "1", "--async-save", "--save-worker-up", "--sealed-before-optimizer", "--overlap-capture")
    train(tmp_path, "crash", shm_dir, *flags, "--kill-at", "5", expect=-9)
    assert committed_steps(CheckpointLayout(shm_dir))[-1] == 4, committed_steps(CheckpointLayout(shm_dir))
    resumed = train(tmp_path, "resume", shm_dir, *flags)
    assert resumed["resumed_from"] == "ram" and resumed["resumed_path"].endswith("step-4"), resumed["resumed_path"]
    assert compare(tmp_path) == []


def test_overlapped_versions_equal_the_state_after_their_step_although_the_copy_is_slow(tmp_path, shm_dir):
    """The guard before the optimizer step, on real NeMo training: each save's background copy starts 0.4 s late,
    so the next step's forward and backward run during it (checked), and only the wait before its optimizer step
    keeps that step from writing into the tensors being copied. Every committed version must equal, bit for bit,
    what its save captured (cloned when the save began, after its own optimizer step)."""
    train(tmp_path, "run", shm_dir, "--every", "1", "--keep", "10", "--async-save",
          "--overlap-capture", "--slow-copy-s", "0.4", "--check-versions", steps=4)
    for rank in (0, 1):
        checked = json.loads((tmp_path / "run" / f"versions-{rank}.json").read_text())
        assert all(keys == [] for keys in checked["differing"].values()), checked
        # a save due while the previous one seals is deferred: not every step's is taken, but some committed
        # version's copy was still running when the next step began
        assert {int(step) for step in checked["differing"]} & set(checked["overlapped"]), checked


def test_corrupted_ram_version_falls_back_to_the_older_one_with_a_warning(nemo_reference, tmp_path, shm_dir):
    link_reference(nemo_reference, tmp_path)
    train(tmp_path, "crash", shm_dir, "--every", "2", "--kill-at", "5", expect=-9)
    obj = shm_dir / "step-4" / "rank-00001-0.fpo"
    data = bytearray(obj.read_bytes())
    data[100] ^= 0x08  # inside rank 1's first record
    obj.write_bytes(bytes(data))
    resumed = train(tmp_path, "resume", shm_dir, "--every", "2")
    assert resumed["resumed_from"] == "ram" and resumed["resumed_path"].endswith("step-2"), resumed["resumed_path"]
    assert "RAM checkpoint step 4 is not used" in resumed["log"] and "ChecksumError" in resumed["log"]
    assert compare(tmp_path) == []


def test_callback_config_alone_wires_the_trainer_and_resumes_from_ram(nemo_reference, tmp_path, shm_dir):
    link_reference(nemo_reference, tmp_path)
    train(tmp_path, "crash", shm_dir, "--route", "callback_config", "--every", "2", "--kill-at", "5", expect=-9)
    resumed = train(tmp_path, "resume", shm_dir, "--route", "callback_config", "--every", "2",
                    "--csv-logger", str(tmp_path / "csv"))
    assert resumed["resumed_from"] == "ram", resumed
    assert [s["step"] for s in resumed["saves"]] == [6, 8], resumed["saves"]
    assert compare(tmp_path) == []
    # every committed save was reported through the trainer's logger
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics" / "version_0" / "metrics.csv").open()))
    committed = [row for row in rows if row.get("flashpoint/committed_step")]
    assert [float(row["flashpoint/committed_step"]) for row in committed] == [6.0, 8.0], rows
    assert all(float(row["flashpoint/bytes"]) > 0 and float(row["flashpoint/blocking_s"]) > 0 for row in committed)


def test_replication_state_is_reported_through_the_trainers_logger(tmp_path, shm_dir):
    """Each rank its own node (its own base dir): every committed save also logs the newest version
    replicated on every rank and how many ranks' newest push left a peer without its copy."""
    train(tmp_path, "nodes", shm_dir / "node{rank}", "--route", "callback_config", "--every", "2",
          "--csv-logger", str(tmp_path / "csv"))
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics" / "version_0" / "metrics.csv").open()))
    committed = [row for row in rows if row.get("flashpoint/committed_step")]
    assert [float(row["flashpoint/committed_step"]) for row in committed] == [2.0, 4.0, 6.0, 8.0], rows
    replicated = [float(row["flashpoint/replicated_step"]) for row in committed]
    assert replicated == sorted(replicated) and replicated[-1] >= 4, replicated
    assert all(r <= c for r, c in zip(replicated, [2, 4, 6, 8])), replicated  # never ahead of the commits
    assert all(float(row["flashpoint/under_replicated_ranks"]) == 0 for row in committed), committed
    assert all(shm_dir.joinpath(f"node{r}", "step-8", "COMMIT").is_file() for r in (0, 1))


def test_training_ends_when_the_last_pushes_outlast_their_bound(tmp_path, shm_dir):
    """Rank 0's pushes start 3 s late and the ranks wait at most 0.5 s for them at the end of training: the run
    still ends normally, rank 0 says that it was still pushing, and every rank's own RAM versions are kept."""
    done = train(tmp_path, "saved", shm_dir / "node{rank}", "--every", "2", "--delay-pushes-of-rank", "0",
                 "--last-pushes-wait-s", "0.5", steps=4)
    assert [s["step"] for s in done["saves"]] == [2, 4], done["saves"]
    assert "Replication of the last RAM checkpoint still runs after 0.5 s on this rank" in done["log"], \
        done["log"][-3000:]
    assert all(shm_dir.joinpath(f"node{r}", "step-4", "COMMIT").is_file() for r in (0, 1))


def saved_and_resumed_states(out: Path) -> tuple[dict, dict]:
    import torch

    return (torch.load(out / "saved" / "state.pt", weights_only=True),
            torch.load(out / "resume" / "resumed_state.pt", weights_only=True))


@pytest.mark.parametrize("replica_kept", [True, False], ids=["replica-on-survivor", "piece-lost"])
def test_trainer_restarted_on_fewer_ranks_resumes_from_ram_when_every_piece_is_held(tmp_path, shm_dir, replica_kept):
    """Two nodes (a base directory per rank) train 4 steps, RAM saves every 2, replicated to each other; rank 0
    starts its pushes 3 s late, so rank 1 ends its run first and must keep its transfer server up until rank 0's
    last push landed. Node 0 is then lost for good and the job restarts as 1 rank on node 1. With node 0's objects
    replicated there, it resumes from RAM step 4 with exactly the saved parameters and optimizer state
    (resharded from 2 data-parallel ranks to 1); with a piece lost, it falls back and logs why."""
    saved = train(tmp_path, "saved", shm_dir / "node{rank}", "--every", "2", "--delay-pushes-of-rank", "0", steps=4)
    assert [s["step"] for s in saved["saves"]] == [2, 4], saved["saves"]
    survivor = shm_dir / "node1"
    assert (survivor / "step-4" / "rank-00000-0.fpo").is_file(), "replication did not reach node 1"
    subprocess.run(["rm", "-rf", str(shm_dir / "node0")], check=True)  # the lost node and its RAM
    if not replica_kept:
        for replica in survivor.glob("step-*/rank-00000-*.fpo"):
            replica.unlink()
    resumed = train(tmp_path, "resume", survivor, "--every", "2", "--dump-resumed-state", steps=6, nproc=1)
    if not replica_kept:
        assert resumed["resumed_from"] == "none", resumed["resumed_path"]
        assert "RAM checkpoint step 4 is not used" in resumed["log"], resumed["log"][-3000:]
        assert "objects are not on this node, e.g. rank-00000-0.fpo" in resumed["log"], resumed["log"][-3000:]
        assert "No RAM checkpoint usable on every rank" in resumed["log"], resumed["log"][-3000:]
        return
    assert resumed["resumed_from"] == "ram" and resumed["resumed_path"].endswith("step-4"), resumed
    before, after = saved_and_resumed_states(tmp_path)
    assert after["step"] == 4
    for part in ("model", "optimizer"):
        assert before[part].keys() == after[part].keys(), part
        differ = [k for k, t in before[part].items() if not torch_equal(t, after[part][k])]
        assert not differ, f"{part} tensors differ after the resume: {differ}"
    assert [step for step, _ in resumed["losses"]] == [5, 6], resumed["losses"]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
