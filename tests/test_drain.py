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
from tests.test_nemo_e2e import STEPS, link_reference, reference, train  # noqa: F401 - reference is a fixture

sys.path.insert(0, str(REPO / "examples"))

from quickstart import compare  # noqa: E402


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


def test_plain_nemo_resumes_bit_exact_after_a_crash_mid_drain(reference, tmp_path, shm_dir):  # noqa: F811
    """Drains of steps 2 and 4 land; the job is SIGKILLed while step 6 drains (throttled): no step-6
    checkpoint is visible, step 4's is intact, and plain NeMo resumes from it bit for bit."""
    link_reference(reference, tmp_path)
    drained = tmp_path / "drained"
    checkpoints = drained / "tiny" / "checkpoints"
    train(tmp_path, "crash", shm_dir, "--every", "2", "--drain-every", "2", "--drain-log", str(drained),
          "--drain-modelcheckpoint", "--drain-rate", "2e6", "--kill-mid-drain-of", "6", expect=-9)
    found = visible(checkpoints)
    assert sorted(found) == [2, 4], sorted(p.name for p in checkpoints.iterdir())
    assert list(checkpoints.glob(".drain-*-step-6/weights/*.distcp")), "the kill came mid-drain"
    for path in found.values():
        assert_nemo_layout(path)
    assert found[4].name == "tiny--step=3-consumed_samples=16.0-last", found[4].name  # as ModelCheckpoint names it
    resumed = train(tmp_path, "resume", shm_dir, "--plain-resume", str(drained))
    assert resumed["ckpt_path"] and Path(resumed["ckpt_path"]).parent == found[4], resumed["ckpt_path"]
    assert [step for step, _ in resumed["losses"]] == list(range(5, STEPS + 1))
    assert compare(tmp_path, resumed_from=None) == []
