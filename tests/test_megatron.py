"""megatron.core.dist_checkpointing with the flashpoint strategies, on real gloo process groups."""

from __future__ import annotations

import pytest

from ml_flashpoint_nemo.core import committed_steps, verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from tests.support.multiproc import run_world


def run(scenario: str, world_size: int, **params) -> list[str]:
    return run_world("megatron_scenarios", scenario, world_size,
                     {k: str(v) if hasattr(v, "__fspath__") else v for k, v in params.items()})


@pytest.mark.parametrize(
    "world_size, mode, fully_parallel",
    [
        (2, "sync", False),
        (4, "sync", True),
        (2, "temporal", False),  # AsyncCallsQueue with a forked worker per save
        (2, "persistent", True),  # AsyncCallsQueue with a spawned persistent worker
    ],
)
def test_megatron_save_load_round_trip(base_dir, world_size, mode, fully_parallel):
    run("roundtrip", world_size, base=base_dir, mode=mode, fully_parallel=fully_parallel)
    assert committed_steps(CheckpointLayout(base_dir)) == [2, 3]
    assert verify_version(base_dir, 3).objects == world_size
    assert (base_dir / "step-3" / "metadata.json").is_file()


def test_megatron_corrupted_object_is_refused(base_dir):
    outputs = run("save_then_corrupt_is_refused", 2, base=base_dir)
    assert all("REFUSED" in out for out in outputs), outputs


def test_failed_background_write_fails_every_rank_and_keeps_previous(base_dir):
    outputs = run("failed_background_write_fails_every_rank", 2, base=base_dir)
    assert all("SAVE FAILED" in out and "rank 1" in out for out in outputs), outputs
    assert committed_steps(CheckpointLayout(base_dir)) == [1]


@pytest.mark.parametrize("hook, timeout", [("fail", None), ("hang", 5)])
def test_manager_failure_on_one_rank_fails_the_first_save_on_every_rank(base_dir, hook, timeout):
    outputs = run("manager_failure_fails_first_save_everywhere", 2, base=base_dir, manager=hook,
                  manager_timeout=timeout)
    assert all("SAVE FAILED: ManagerStartError" in out and "rank 1" in out for out in outputs), outputs
    assert committed_steps(CheckpointLayout(base_dir)) == []


def test_cached_plan_is_dropped_when_one_rank_changes_structure(base_dir):
    run("plan_reused_only_while_structure_is_unchanged", 2, base=base_dir)
