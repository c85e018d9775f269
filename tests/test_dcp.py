"""torch DCP through MemoryStorageWriter/Reader on real gloo process groups (2 and 4 processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ml_flashpoint_nemo.core import CheckpointSaver, committed_steps, verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.dcp import MemoryStorageReader, MemoryStorageWriter
from ml_flashpoint_nemo.errors import BaseDirError, CorruptCheckpointError
from tests.support.multiproc import run_world


def run(scenario: str, world_size: int, **params) -> list[str]:
    params = {k: str(v) if isinstance(v, Path) else v for k, v in params.items()}
    return run_world("dcp_scenarios", scenario, world_size, params)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dcp_save_load_round_trip(base_dir, world_size):
    run("sync_roundtrip", world_size, base=base_dir)
    assert committed_steps(CheckpointLayout(base_dir)) == [2, 3]
    report = verify_version(base_dir, 3)
    assert report.objects == world_size


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_dcp_async_save_stages_before_training_continues(base_dir, executor):
    run("async_roundtrip", 2, base=base_dir, executor=executor)


def test_resharding_from_four_ranks_to_two(base_dir):
    run("save_only", 4, base=base_dir, step=7)
    run("load_resharded", 2, base=base_dir, step=7)


def test_resharding_from_two_ranks_to_four(base_dir):
    run("save_only", 2, base=base_dir, step=8)
    run("load_resharded", 4, base=base_dir, step=8)


def test_layout_that_cannot_be_loaded_is_refused_on_every_rank(base_dir):
    run("save_only", 2, base=base_dir, step=1)
    outputs = run("load_wrong_shape", 2, base=base_dir, step=1)
    assert all("REFUSED" in out and "replicated.norm" in out for out in outputs), outputs


def test_corrupted_object_is_refused_on_every_rank(base_dir):
    run("save_only", 2, base=base_dir, step=4)
    obj = base_dir / "step-4" / "rank-00001-0.fpo"
    data = bytearray(obj.read_bytes())
    data[200] ^= 0xFF  # inside the first record of rank 1
    obj.write_bytes(bytes(data))
    outputs = run("load_expect_failure", 2, base=base_dir, step=4)
    assert all("REFUSED" in out for out in outputs), outputs
    assert any("ChecksumError" in out or "CRC32C" in out for out in outputs), outputs


def test_failed_write_fails_every_rank_and_keeps_previous_version(small_tmpfs):
    base = small_tmpfs / "base"
    outputs = run("save_fails_then_previous_loads", 2, base=base, payload_numel=4 << 20)  # 16 MiB per rank
    assert all("SAVE FAILED" in out for out in outputs), outputs
    assert any("no space left" in out or "OutOfSpaceError" in out for out in outputs), outputs
    assert committed_steps(CheckpointLayout(base)) == [1]


def test_reader_refuses_versions_not_saved_through_dcp_and_foreign_paths(base_dir, tmp_path):
    """Single-process checks of the reader's and writer's refusals (no process group needed)."""
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, {"w": torch.ones(2)})
    reader = MemoryStorageReader(base_dir)
    reader.reset(base_dir / "step-1")
    with pytest.raises(CorruptCheckpointError, match="not saved through DCP"):
        reader.read_metadata()
    with pytest.raises(BaseDirError, match="step-<N>"):
        reader.reset(tmp_path / "step-1")  # right name, other directory
    with pytest.raises(BaseDirError, match="step-<N>"):
        MemoryStorageWriter(base_dir).reset(base_dir / "latest")
    with pytest.raises(BaseDirError, match="needs checkpoint_id"):
        MemoryStorageWriter(base_dir).reset(None)
