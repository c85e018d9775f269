"""FlashpointLocalCheckpointManager (NVRx's manager interface) on real gloo ranks, SIGKILL and restart.

Each job is 2 rank processes forked with Megatron-core imported (tests/support/fork_server.py) running
tests/support/nvrx_rank.py; what they save and load is megatron-core's MCoreTensorAwareStateDict.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from ml_flashpoint_nemo.core import committed_steps
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name
from ml_flashpoint_nemo.core.versions import read_commit
from tests.support.fork_server import MEGATRON_PRELOAD, popen_preloaded
from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402

RANK_SCRIPT = str(REPO / "tests" / "support" / "nvrx_rank.py")
SESSION = "job"


def job(out: Path, base: Path, phase: str, *flags: str, expect: int = 0, nproc: int = 2) -> list[dict]:
    log_dir = out / f"{phase}-logs"
    for old in out.glob(f"{phase}-rank-*.json"):  # a job of the same phase before this one
        old.unlink()
    code = launch_ranks(
        RANK_SCRIPT,
        ["--base", str(base), "--phase", phase, "--out", str(out), *flags],
        nproc=nproc,
        timeout=120,
        log_dir=log_dir,
        stop_on_failure=expect != 0,
        popen=functools.partial(popen_preloaded, MEGATRON_PRELOAD),
    )
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("rank-*.log")))
    assert code == expect, f"{phase} exited with {code}, expected {expect}\n{logs}"
    if expect != 0:
        return []
    return [json.loads((out / f"{phase}-rank-{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.parametrize("mode, algo", [("sync", "atomic"), ("nvrx", "atomic"), ("megatron", "fully_parallel")])
def test_sigkilled_rank_then_restart_loads_the_newest_committed_version_bit_exact(tmp_path, base_dir, mode, algo):
    job(tmp_path, base_dir, "save", "--mode", mode, "--algo", algo, "--kill-rank", "1", expect=-9)
    layout = CheckpointLayout(base_dir / SESSION)
    assert committed_steps(layout) == [3]  # keep=1; step 4 was staged but never committed
    results = job(tmp_path, base_dir, "resume", "--algo", algo)
    assert [r["latest"] for r in results] == [3, 3], results
    assert [r["ckpt_id"] for r in results] == [[3, 0, SESSION], [3, 1, SESSION]]
    assert all(r["checked"] for r in results)


DP_RESHARDABLE = json.dumps({"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True})
FULLY_RESHARDABLE = json.dumps({"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True})


def test_a_damaged_newest_version_falls_back_to_the_older_one_on_every_rank(tmp_path, base_dir):
    job(tmp_path, base_dir, "save", "--mode", "nvrx", "--saves", "2", "--content-metadata", DP_RESHARDABLE)
    layout = CheckpointLayout(base_dir / SESSION)
    assert committed_steps(layout) == [1, 2]  # the older one stays until the next save retires it
    obj = layout.object_path(2, object_name(1))
    data = bytearray(obj.read_bytes())
    data[200] ^= 0x10  # inside rank 1's records: only rank 1 can see it
    obj.write_bytes(bytes(data))
    results = job(tmp_path, base_dir, "resume", "--content-metadata", DP_RESHARDABLE)  # as saved: offered
    assert [r["latest"] for r in results] == [1, 1], results
    assert all(r["checked"] for r in results)


def test_a_version_saved_under_another_optimizer_sharding_is_not_offered_on_any_rank(tmp_path, base_dir):
    """NeMo builds the state dict to load from its current sharding metadata: a RAM version saved under another
    (here the distributed optimizer's dp_reshardable, now fully_reshardable) must not be loaded into it."""
    from ml_flashpoint_nemo.nvrx.manager import CONTENT_METADATA_KEY

    job(tmp_path, base_dir, "save", "--saves", "1", "--content-metadata", DP_RESHARDABLE)
    layout = CheckpointLayout(base_dir / SESSION)
    assert read_commit(layout, 1).metadata[CONTENT_METADATA_KEY] == json.loads(DP_RESHARDABLE)
    results = job(tmp_path, base_dir, "resume", "--content-metadata", FULLY_RESHARDABLE)
    assert [r["latest"] for r in results] == [-1, -1], results
    for rank in range(2):
        log = (tmp_path / "resume-logs" / f"rank-{rank}.log").read_text()
        assert "Local checkpoint iteration 1 is not used: it was saved with content metadata" in log, log[-3000:]
        assert '"fully_reshardable"' in log and "Restore the settings it was saved with" in log, log[-3000:]
    assert committed_steps(layout) == [1]  # nothing lost: the version is kept for a job with its settings


def test_a_version_saved_by_another_number_of_ranks_hides_no_older_one(tmp_path, base_dir):
    """Each rank loads its own state dict, so a version saved by another world size is skipped: on one rank (every
    object checked on the node) and on two (settled at the saved layout), the older version of the job's size is
    found and loaded bit for bit, and nothing of the other one is fetched or loaded."""
    layout = CheckpointLayout(base_dir / SESSION)
    job(tmp_path, base_dir, "save", "--saves", "1", nproc=1)  # iteration 1 by 1 rank
    job(tmp_path, base_dir, "save", "--first", "2", "--saves", "1")  # iteration 2 by 2 ranks
    assert committed_steps(layout) == [1, 2]
    (alone,) = job(tmp_path, base_dir, "resume-save", "--first", "3", "--saves", "1", nproc=1)
    assert alone["latest"] == 1 and alone["checked"] and alone["saved"] == [3], alone
    assert committed_steps(layout) == [2, 3]  # iteration 3 by 1 rank; its save retired 1
    results = job(tmp_path, base_dir, "resume")
    assert [r["latest"] for r in results] == [2, 2] and all(r["checked"] for r in results), results


def test_a_root_unusable_on_one_node_fails_the_save_on_every_rank_without_a_hang(tmp_path, base_dir):
    results = job(tmp_path, base_dir, "save", "--unusable-root-rank", "1")
    assert all("not usable on every rank" in r.get("error", "") for r in results), results
    assert all("rank 1: BaseDirError" in r["error"] for r in results), results
    assert not (base_dir / SESSION).exists() or committed_steps(CheckpointLayout(base_dir / SESSION)) == []


def test_bad_arguments_are_refused_with_what_to_do_instead(base_dir):
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import CheckpointingException
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    from ml_flashpoint_nemo.errors import FlashpointError
    from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager, LocalCheckpointingError

    assert issubclass(LocalCheckpointingError, CheckpointingException)  # NVRx's callers catch it as before
    assert issubclass(LocalCheckpointingError, FlashpointError)
    strategy = CliqueReplicationStrategy.__new__(CliqueReplicationStrategy)  # its __init__ needs a process group
    with pytest.raises(LocalCheckpointingError, match="pass replication=ReplicationConfig"):
        FlashpointLocalCheckpointManager(base_dir, repl_strategy=strategy)
    for session in ("../other", "a/b", ".."):
        with pytest.raises(LocalCheckpointingError, match="plain directory name"):
            FlashpointLocalCheckpointManager(base_dir, session_id=session)
    with pytest.raises(LocalCheckpointingError, match="keep must be >= 1"):
        FlashpointLocalCheckpointManager(base_dir, keep=0)
    manager = FlashpointLocalCheckpointManager(base_dir, session_id=SESSION)
    assert manager.local_ckpt_dir == base_dir / SESSION  # Megatron-LM's and Bridge's save_dir of a local save
    with pytest.raises(LocalCheckpointingError, match=r"call find_latest\(\) before load\(\)"):
        manager.load()
    manager.latest_iteration = 5  # as find_latest leaves it
    with pytest.raises(LocalCheckpointingError, match="not newer than the local checkpoint found"):
        manager.save(None, 5)  # type: ignore[arg-type]  # refused before the state dict is looked at
    assert manager.latest_iteration == 5 and not base_dir.exists()  # nothing written, the choice kept
