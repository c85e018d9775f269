"""The conversion before a local save checks the sharding on the first save and after it changed, never on a steady one.

2 gloo ranks run tests/support/nvrx_conversion_rank.py: 10 saves whose sharding stays, changes on
rank 1 only, is broken on rank 1 (Megatron's check fails on rank 0 alone), is back, then cannot be
converted on rank 1, then cannot be pickled for the check on rank 1. Counted:
the object collectives Megatron's check makes while converting (an all_gather_object of every
rank's shards and a broadcast_object_list of the common state), which Megatron's from_state_dict,
as NeMo's hierarchical IO calls it, makes on every save.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from tests.support.fork_server import MEGATRON_PRELOAD, NEMO_PRELOAD, popen_preloaded
from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402

RANK_SCRIPT = str(REPO / "tests" / "support" / "nvrx_conversion_rank.py")
CHECKED = (1, 4, 7)  # the first save, rank 1's new object, the sharding back after the failed save
BROKEN = 6
UNCONVERTIBLE = 9
UNPICKLABLE = 10


def saves_of(tmp_path: Path, base: Path, via: str, algo: str) -> list[list[dict]]:
    log_dir = tmp_path / "logs"
    code = launch_ranks(
        RANK_SCRIPT,
        ["--base", str(base), "--out", str(tmp_path), "--via", via, "--algo", algo],
        nproc=2,
        timeout=120,
        log_dir=log_dir,
        popen=functools.partial(popen_preloaded, NEMO_PRELOAD if via == "io" else MEGATRON_PRELOAD),
    )
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("rank-*.log")))
    assert code == 0, f"the ranks exited with {code}\n{logs}"
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [r["latest"] for r in ranks] == [8, 8], ranks  # and loaded back bit for bit (9 failed)
    assert all(r["sharding_of_checked"] for r in ranks), ranks
    return [r["saves"] for r in ranks]


@pytest.mark.parametrize("via, algo", [("conversion", "atomic"), ("conversion", "fully_parallel"),
                                       ("io", "fully_parallel")])
def test_sharding_is_checked_when_it_changed_on_any_rank_and_a_broken_one_fails_every_rank(
        tmp_path, base_dir, via, algo):
    for rank, saves in enumerate(saves_of(tmp_path, base_dir, via, algo)):
        for save in saves:
            iteration, where = save["iteration"], f"rank {rank}, save {save['iteration']} ({save['kind']}): {save}"
            if iteration == BROKEN:
                assert "does not shard its tensors correctly" in save.get("error", ""), where
                assert "rank 0: CheckpointingException: Invalid access pattern" in save["error"], where
                assert save["checks"] == 0, where
            elif iteration == UNCONVERTIBLE:
                assert "cannot be converted for a local checkpoint" in save.get("error", ""), where
                assert "rank 1: ValueError: this factory fails on purpose" in save["error"], where
                assert save["checks"] == 0 and save["broadcast_object_list"] == 0, where
            elif iteration == UNPICKLABLE:  # before Megatron's all-gather, which would raise on rank 1 alone
                assert "metadata (key, shape, offset, replica id) cannot be pickled" in save.get("error", ""), where
                assert "rank 1: TypeError: cannot pickle '_thread.lock' object" in save["error"], where
                assert save["checks"] == 0 and save["broadcast_object_list"] == 0, where
            elif iteration in CHECKED:
                assert "error" not in save and save["checks"] == 1, where
                assert save["all_gather_object"] >= 1 and save["broadcast_object_list"] == 1, where
            else:  # steady: no object collective at all, the check's or the distribution's
                assert "error" not in save and save["checks"] == 0, where
                assert save["all_gather_object"] == 0 and save["broadcast_object_list"] == 0, where

