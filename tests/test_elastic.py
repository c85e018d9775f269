"""Elastic resume from RAM: a version saved by one Megatron layout loads into another.

Each case saves with one world (real gloo ranks, FlashpointSaveStrategy), then a second,
differently sized or sharded world chooses the version as a restart does (choose_version)
and loads it through FlashpointLoadStrategy; every shard is compared with what the global
model says it must hold. Regular and flattened (distributed-optimizer) ShardedTensors.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from ml_flashpoint_nemo.core import committed_steps, verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from tests.support.multiproc import run_world


def run(scenario: str, world_size: int, **params) -> list[str]:
    return run_world("elastic_scenarios", scenario, world_size,
                     {k: str(v) if hasattr(v, "__fspath__") else v for k, v in params.items()})


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ((2, 2), (2, 1)),  # 2 ranks TP2 -> 2 ranks DP2
        ((2, 1), (2, 2)),  # 2 ranks DP2 -> 2 ranks TP2
        ((2, 2), (1, 1)),  # 2 ranks -> 1 rank
        ((1, 1), (2, 2)),  # 1 rank -> 2 ranks TP2
        ((2, 1), (1, 1)),  # 2 ranks DP2 (flattened optimizer state split over DP) -> 1 rank
    ],
    ids=lambda layout: f"world{layout[0]}-tp{layout[1]}",
)
def test_version_saved_in_one_layout_loads_into_another(base_dir, saved, loaded):
    (save_world, save_tp), (load_world, load_tp) = saved, loaded
    run("save_layout", save_world, base=base_dir, step=3, tp=save_tp)
    outputs = run("load_layout", load_world, base=base_dir, step=3, tp=load_tp)
    assert all(f"LOADED 3 tp {load_tp} world {load_world}" in out for out in outputs), outputs


def test_an_elastic_choice_discovers_and_fetches_with_the_jobs_replication_config(base_dir):
    """Saved by 1 rank, chosen by 2: the elastic path's node discoveries and fetches get the job's config (host,
    timeouts, failure domain), not the defaults; its failure-domain callable wins over a malformed variable."""
    run("save_layout", 1, base=base_dir, step=3, tp=1)
    outputs = run("load_layout", 2, base=base_dir, step=3, tp=2, domain_from_config=True)
    assert all("LOADED 3 tp 2 world 2" in out for out in outputs), outputs


def test_fully_parallel_load_reshards_too(base_dir):
    run("save_layout", 2, base=base_dir, step=1, tp=2)
    outputs = run("load_layout", 2, base=base_dir, step=1, tp=1, fully_parallel=True)
    assert all("LOADED 1 tp 1 world 2" in out for out in outputs), outputs


@pytest.fixture(scope="module")
def saved_tp2_with_torch_dist(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """Step 1 saved once by 2 ranks in TP2, through ours (a RAM base) and through torch_dist (a durable dir); each
    case below loads from its own copy of both. The torch_dist save starts Megatron's results-queue Manager, a
    spawned interpreter per rank that imports the scenario module again: most of a case's time."""
    base = Path("/dev/shm") / f"flashpoint-test-{uuid.uuid4().hex[:12]}"
    durable = tmp_path_factory.mktemp("elastic-durable") / "durable"
    try:
        run("save_layout", 2, base=base, step=1, tp=2, durable=durable)
        yield base, durable
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("kind", ["global_shape", "missing_key", "flattened_shape"])
def test_request_the_version_cannot_satisfy_fails_clearly_as_with_torch_dist(saved_tp2_with_torch_dist, base_dir,
                                                                            tmp_path, kind):
    saved, saved_durable = saved_tp2_with_torch_dist
    shutil.copytree(saved, base_dir)  # neither holds a path of its own (torch_dist's .metadata names it, unread)
    shutil.copytree(saved_durable, tmp_path / "durable")
    outputs = run("unsatisfiable_load_is_refused", 1, base=base_dir, durable=tmp_path / "durable", step=1, tp=1,
                  kind=kind)
    for out in outputs:
        assert "REFUSED ours" in out and "REFUSED torch_dist" in out, out
    assert committed_steps(CheckpointLayout(base_dir)) == [1]


@pytest.mark.parametrize("kind, message", [
    # same volume, inside the tensor, but overlapping rank 1's chunk: refused as a tiling lie before any read
    # (a record whose shape differs from a chunk that tiles: tests/test_hostile_metadata.py)
    ("record_shape", "lists chunks of w_col that overlap"),
    ("outside", "outside the tensor's shape [8, 6]"),
    ("negative", "not non-negative integers"),
    ("chunk_missing", "holding 24 elements, but the tensor [8, 6] has 48: part of it was not saved"),
])
def test_chunk_offsets_and_sizes_from_the_metadata_are_checked_before_use(base_dir, kind, message):
    """Resharding reads parts of stored chunks where .metadata says they are: a lie there (its checksum
    recomputed, so only validation can catch it) is a clear CorruptCheckpointError, never garbage."""
    run("save_layout", 2, base=base_dir, step=1, tp=2)
    outputs = run("forged_chunk_is_refused", 1, base=base_dir, step=1, tp=1, kind=kind)
    assert "CorruptCheckpointError" in outputs[0] and message in outputs[0], outputs[0]
    assert "UNTOUCHED True" in outputs[0], outputs[0]  # refused before any record is read
    assert verify_version(base_dir, 1).objects == 2  # the stored objects are intact


def test_versions_of_a_larger_world_are_retired_whole_after_the_job_shrank(base_dir):
    """Objects of ranks that no longer exist are retired with their version: no tmpfs memory leaks."""
    run("save_layout", 2, base=base_dir, step=1, tp=2)
    run("save_layout", 1, base=base_dir, steps=[2, 3], tp=1)
    assert committed_steps(CheckpointLayout(base_dir)) == [2, 3]
    assert not (base_dir / "step-1").exists(), sorted(p.name for p in (base_dir / "step-1").iterdir())
