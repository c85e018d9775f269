"""The background check ahead of recovery keeps only its newest results (in-process restarts repeat it)."""

from __future__ import annotations

import torch

from ml_flashpoint_nemo.core import CheckpointSaver
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.versions import read_commit
from ml_flashpoint_nemo.replication import preverify


def test_each_check_replaces_the_last_and_a_rewritten_object_does_not_count(shm_dir):
    base = shm_dir / "base"
    layout = CheckpointLayout(base)
    with CheckpointSaver(base, rank=0) as saver:
        for step in range(1, 6):
            saver.save(step, {"w": torch.full((64,), float(step))}, keep=2)
            preverify.verify_ahead(base, 0)
            (record,) = read_commit(layout, step).objects
            path = layout.object_path(step, record.name)
            assert preverify.verified_ahead(base, 0, path, record)  # waits for the check
            table = preverify._passed[(str(base.resolve()), 0)]
            assert list(table) == [(str(path.resolve()), record)], step  # this version's object only
    older = read_commit(layout, 4).objects[0]
    assert not preverify.verified_ahead(base, 0, layout.object_path(4, older.name), older)  # checked earlier, replaced
    path.write_bytes(path.read_bytes())  # the same bytes, rewritten: another file as far as the check knows
    assert not preverify.verified_ahead(base, 0, path, record)
