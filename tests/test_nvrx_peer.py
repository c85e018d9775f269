"""Peer check: the scenarios of NVRx's own local-manager tests, run against our manager.

NVRx's tests/checkpointing/unit/test_basic_local.py (its repository at commit 0c8637d) saves and loads through
LocalCheckpointManager on a RAM disk and on disk, synchronously and through the returned async
request; docs/reliability.md records which of its checks hold for FlashpointLocalCheckpointManager,
which do not apply, and why. 2 gloo ranks forked with torch imported (tests/support/fork_server.py).
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.fork_server import MEGATRON_PRELOAD, popen_preloaded
from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402

CASES = ["root0-async", "root0-sync", "root1-async", "root1-sync"]


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("nvrx-peer")
    shm = Path("/dev/shm") / f"flashpoint-peer-{out.name}"  # NVRx's use_ramdisk case
    try:
        code = launch_ranks(
            str(REPO / "tests" / "support" / "nvrx_peer_rank.py"),
            ["--root", str(out / "disk"), "--root", str(shm), "--out", str(out)],
            nproc=2,
            timeout=120,
            log_dir=out / "logs",
            popen=functools.partial(popen_preloaded, MEGATRON_PRELOAD),
        )
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("rank-*.log")))
        assert code == 0, logs
        return [json.loads((out / f"peer-rank-{rank}.json").read_text()) for rank in range(2)]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("case", CASES)
def test_save_then_load_without_a_restart(seen, case):
    for rank, results in enumerate(seen):
        result = results[case]
        assert result["latest_without_restart"] == 1 and result["equal_without_restart"], result
        assert result["id_without_restart"] == [1, rank, ""], result


@pytest.mark.parametrize("case", CASES)
def test_a_new_manager_on_the_same_directory_loads_the_saved_iteration(seen, case):
    for rank, results in enumerate(seen):
        result = results[case]
        assert result["latest_after_restart"] == 1 and result["equal_after_restart"], result
        assert result["id_after_restart"] == [1, rank, ""], result


@pytest.mark.parametrize("case", CASES)
def test_no_iteration_is_offered_once_every_rank_lost_its_object(seen, case):
    assert [results[case]["latest_after_loss"] for results in seen] == [-1, -1]


@pytest.mark.parametrize("case", CASES)
def test_several_saves_keep_the_newest_and_retire_the_older_at_the_next_save(seen, case):
    """NVRx removes iteration 1 once 2 is saved; ours keeps it until the save of 3 starts (keep=1), so that
    a failure during that save still leaves a complete version: the difference docs/nvrx.md lists."""
    for results in seen:
        result = results[case]
        assert result["committed_after_two_saves"] == [1, 2], result
        assert result["committed_after_three_saves"] == [2, 3], result
        assert result["latest_after_saves"] == 3 and result["equal_after_saves"], result
