"""torch DCP through MemoryStorageWriter/Reader on real gloo process groups (2 and 4 processes)."""

from __future__ import annotations

import ast
import dataclasses
import pickle
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.stateful import Stateful

from ml_flashpoint_nemo.core import CheckpointSaver, committed_steps, verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.version_files import FILES_KEY, describe_bytes
from ml_flashpoint_nemo.core.versions import read_commit, write_commit
from ml_flashpoint_nemo.dcp import MemoryStorageReader, MemoryStorageWriter, storage_info
from ml_flashpoint_nemo.errors import (
    BaseDirError,
    CorruptCheckpointError,
    OutOfSpaceError,
    UnsupportedValueError,
    VersionExistsError,
)
from tests.support.dcp_scenarios import reader_paths
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
    run("load_resharded", 2, base=base_dir, step=7, tp_path="direct")  # whole stored chunks into shard views


def test_resharding_from_two_ranks_to_four(base_dir):
    run("save_only", 2, base=base_dir, step=8)
    run("load_resharded", 4, base=base_dir, step=8, tp_path="copied")  # parts of stored chunks


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


# --- single process, no process group (DCP runs without collectives) -------------------------


def checkpoint_id_table(base_dir: Path, tmp_path: Path) -> list[tuple[Any, int | None, bool]]:
    """(checkpoint_id, its step for a writer/reader on base_dir or None if refused, accepted by the class)."""
    alias = tmp_path / "alias"
    alias.symlink_to(base_dir)
    return [
        (base_dir / "step-1", 1, True),
        (str(base_dir / "step-12") + "/", 12, True),  # a trailing slash names the same directory
        (str(alias / "step-3"), 3, True),  # the same base directory through a symlink
        (base_dir / "sub" / ".." / "step-4", 4, True),
        (f"file://{base_dir}/step-1", None, False),  # a URL, not a local path
        (tmp_path / "elsewhere" / "step-1", None, True),  # the form, but another base directory
        (base_dir / "step-01", None, False),  # not the name version 1 has
        (str(base_dir / "step-\u0661"), None, False),  # a non-ASCII digit
        (base_dir / "latest", None, False),
        (base_dir / "step-1" / "x", None, False),
        (base_dir, None, False),
        (42, None, False),
    ]


def test_validate_checkpoint_id_and_reset_agree_on_every_id(base_dir, tmp_path):
    """One rule: an instance accepts exactly what its reset() accepts; the class, the form any base accepts."""
    for checkpoint_id, step, class_accepts in checkpoint_id_table(base_dir, tmp_path):
        for storage in (MemoryStorageWriter(base_dir), MemoryStorageReader(base_dir)):
            assert storage.validate_checkpoint_id(checkpoint_id) == (step is not None), (storage, checkpoint_id)
            assert type(storage).validate_checkpoint_id(checkpoint_id) == class_accepts, (storage, checkpoint_id)
            if step is None:
                with pytest.raises(BaseDirError, match="step-<N>"):
                    storage.reset(checkpoint_id)
            else:
                storage.reset(checkpoint_id)
                assert storage.step == step, checkpoint_id
            if class_accepts:  # a writer/reader on the id's own directory takes it
                parent = Path(checkpoint_id).absolute().parent
                type(storage)(parent).reset(checkpoint_id)


def test_writer_without_checkpoint_id_fails_at_set_up_saying_what_to_pass(base_dir):
    writer = MemoryStorageWriter(base_dir)
    for save in (lambda: dcp.save({"w": torch.ones(3)}, storage_writer=writer),
                 lambda: dcp.save_state_dict({"w": torch.ones(3)}, writer, no_dist=True)):
        with pytest.raises(CheckpointException, match=r"needs checkpoint_id=.*/step-<N>.*pass it to dcp.save") as info:
            dcp_without_process_group(save)
        assert "set_up_storage_writer" in str(info.value)  # before planning, not inside write_data
    assert list(base_dir.glob("step-*")) == []


def test_deprecated_save_state_dict_and_load_state_dict_keep_the_last_checkpoint_id(base_dir):
    """save_state_dict calls reset() without an id: the writer keeps the one it was given (as FileSystemWriter)."""
    writer, reader = MemoryStorageWriter(base_dir), MemoryStorageReader(base_dir)
    writer.reset(base_dir / "step-5")
    reader.reset(base_dir / "step-5")
    for value in (1.0, 2.0):  # the second save replaces step 5 (overwrite=True, the default)
        save_id = writer.save_id
        dcp_without_process_group(lambda: dcp.save_state_dict({"w": torch.full((3,), value)}, writer, no_dist=True))
        assert writer.save_id != save_id  # a new save id, the same step
        dest = {"w": torch.zeros(3)}
        dcp_without_process_group(lambda: dcp.load_state_dict(dest, reader, no_dist=True))
        assert torch.equal(dest["w"], torch.full((3,), value))
    writer.close()
    assert committed_steps(CheckpointLayout(base_dir)) == [5]


@pytest.mark.parametrize("refusing", [[0, 1], [1]], ids=["every_rank", "one_rank"])
def test_overwrite_false_fails_on_every_rank_and_changes_nothing(base_dir, refusing):
    """Two real ranks: the refusal (on every rank, or on rank 1 alone) reaches both ranks; no rank hangs."""
    outputs = run_world("dcp_scenarios", "overwrite_refused_on_every_rank", 2,
                        {"base": str(base_dir), "refusing": refusing}, timeout=120)
    for out in outputs:
        assert "REFUSED: CheckpointException" in out and "VersionExistsError" in out, out
        assert "overwrite=False" in out, out
        assert "FILES " in out and "FILES 0" not in out, out
    assert committed_steps(CheckpointLayout(base_dir)) == [4]


def failure_of_rank_0(save: Any) -> BaseException:
    with pytest.raises(CheckpointException) as info:
        dcp_without_process_group(save)
    return info.value.failures[0][0]


def test_overwrite_false_refuses_a_committed_step_with_file_system_writers_error(base_dir, tmp_path):
    fs_writer = FileSystemWriter(tmp_path / "fs", overwrite=False)
    dcp_without_process_group(lambda: dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "fs",
                                               storage_writer=fs_writer))
    theirs = failure_of_rank_0(lambda: dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "fs",
                                                storage_writer=fs_writer))
    writer = MemoryStorageWriter(base_dir, overwrite=False)
    (base_dir / "step-2").mkdir(parents=True)  # an uncommitted leftover is no checkpoint: written over
    for step in (1, 2):
        dcp_without_process_group(lambda: dcp.save({"w": torch.full((3,), float(step))},
                                                   checkpoint_id=base_dir / f"step-{step}", storage_writer=writer))
    ours = failure_of_rank_0(lambda: dcp.save({"w": torch.zeros(3)}, checkpoint_id=base_dir / "step-2",
                                              storage_writer=writer))
    assert type(theirs) is RuntimeError and isinstance(ours, RuntimeError), (theirs, ours)
    assert isinstance(ours, VersionExistsError) and "overwrite=False" in str(ours), ours
    writer.close()
    dest = {"w": torch.zeros(3)}  # nothing lost: step 2 as first saved
    dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-2",
                                               storage_reader=MemoryStorageReader(base_dir)))
    assert torch.equal(dest["w"], torch.full((3,), 2.0))
    replacing = MemoryStorageWriter(base_dir)  # the default replaces, as before
    dcp_without_process_group(lambda: dcp.save({"w": torch.full((3,), 9.0)}, checkpoint_id=base_dir / "step-2",
                                               storage_writer=replacing))
    replacing.close()
    dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-2",
                                               storage_reader=MemoryStorageReader(base_dir)))
    assert torch.equal(dest["w"], torch.full((3,), 9.0))




def single_process_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {
        "param": torch.nn.Parameter(torch.randn(6, 5, generator=gen)),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6, generator=gen).t(),  # a strided source and destination
        "extra": {"note": "python object, saved by DCP as bytes"},
    }


def dcp_without_process_group(action: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return action()


def test_whole_stored_tensors_are_read_in_place_and_verified(base_dir):
    """The direct path: each destination takes a whole stored tensor of its dtype, read into it (no copy)."""
    state = single_process_state()
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-1", storage_writer=writer))
    writer.close()
    dest: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dest["param"] = torch.nn.Parameter(torch.zeros(6, 5))  # requires grad: written in place all the same
    dest["extra"] = {"note": None}
    targets = {k: v.data_ptr() for k, v in dest.items() if isinstance(v, torch.Tensor)}
    with reader_paths() as seen:
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-1",
                                                   storage_reader=MemoryStorageReader(base_dir)))
    # DCP plans no read for a tensor without elements
    assert {key.split("@")[0] for key in seen["direct"]} == set(targets) - {"empty"}, seen
    assert seen["copied"] == {"extra.note"}, seen  # only the bytes record
    for key, ptr in targets.items():
        assert dest[key].data_ptr() == ptr, key
        assert torch.equal(dest[key].detach(), state[key].detach()), key
    assert dest["extra"]["note"] == state["extra"]["note"]
    assert verify_version(base_dir, 1).records == len(state)


def test_destination_of_another_dtype_is_read_through_a_copy(base_dir):
    """Not the direct path: the stored chunk is read and verified, then converted into the destination."""
    state = {"w": torch.randn(3, 4), "same": torch.arange(5)}
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-2", storage_writer=writer))
    writer.close()
    dest = {"w": torch.zeros(3, 4, dtype=torch.float64), "same": torch.zeros(5, dtype=torch.int64)}
    with reader_paths() as seen:
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-2",
                                                   storage_reader=MemoryStorageReader(base_dir)))
    assert seen == {"direct": {"same@0"}, "copied": {"w@0,0"}}, seen
    assert torch.equal(dest["w"], state["w"].double()) and torch.equal(dest["same"], state["same"])


class _ReadsWTwice(DefaultLoadPlanner):
    """A caller's planner that also loads the stored "w" into the state's "copy" (not in the checkpoint):
    one stored chunk asked for by two read items."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        (original,) = [item for item in plan.items if item.dest_index.fqn == "w"]
        twin = dataclasses.replace(original, dest_index=MetadataIndex("copy", original.dest_index.offset))
        return dataclasses.replace(plan, items=[*plan.items, twin])


def test_a_chunk_asked_for_twice_is_read_once_and_copied_to_both(base_dir):
    """Neither destination may take the stored chunk in place (the other would miss it): both go through the
    verified copy, and both end up equal to the saved tensor."""
    state = {"w": torch.randn(3, 4), "same": torch.arange(5)}
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-2", storage_writer=writer))
    writer.close()
    dest = {"w": torch.zeros(3, 4), "same": torch.zeros(5, dtype=torch.int64), "copy": torch.zeros(3, 4)}
    with reader_paths() as seen:
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-2",
                                                   storage_reader=MemoryStorageReader(base_dir),
                                                   planner=_ReadsWTwice(allow_partial_load=True)))
    assert seen == {"direct": {"same@0"}, "copied": {"w@0,0"}}, seen
    assert torch.equal(dest["w"], state["w"]) and torch.equal(dest["copy"], state["w"])
    assert torch.equal(dest["same"], state["same"])


def test_corrupted_record_fails_the_direct_path(base_dir):
    state = {"w": torch.randn(64)}
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-3", storage_writer=writer))
    writer.close()
    obj = base_dir / "step-3" / "rank-00000-0.fpo"
    data = bytearray(obj.read_bytes())
    data[200] ^= 0xFF  # inside the only record
    obj.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match="CRC32C"):  # DCP wraps the ChecksumError of the rank
        dcp_without_process_group(lambda: dcp.load({"w": torch.zeros(64)}, checkpoint_id=base_dir / "step-3",
                                                   storage_reader=MemoryStorageReader(base_dir)))


def test_state_keys_that_would_share_a_record_are_refused(base_dir):
    """"a" (a tensor chunk at offset 0) and "a@0" (a bytes item) would map to one record: refused, not dropped."""
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save({"x": torch.ones(3)}, checkpoint_id=base_dir / "step-1",
                                               storage_writer=writer))
    clash = {"a": torch.ones(4), "a@0": "a bytes item"}
    with pytest.raises((UnsupportedValueError, CheckpointException), match="record key 'a@0'"):
        dcp_without_process_group(lambda: dcp.save(clash, checkpoint_id=base_dir / "step-2", storage_writer=writer))
    writer.close()
    assert committed_steps(CheckpointLayout(base_dir)) == [1]


class StatefulWithoutState(Stateful):
    """An app object with nothing to save yet (DCP calls state_dict on save, load_state_dict on load)."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict)


EMPTY_STATES = {"nothing": dict, "stateful_returns_empty": lambda: {"app": StatefulWithoutState()},
                "empty_containers": lambda: {"optim": {}, "model": {"layers": {}}}}


@pytest.mark.parametrize("kind", sorted(EMPTY_STATES))
def test_empty_state_commits_and_loads_as_with_file_system_writer(base_dir, tmp_path, kind):
    """DCP saves an empty state as an empty .metadata; FileSystemReader loads it, so must ours."""
    saved: dict[str, list[Any]] = {}
    for name, writer, reader, checkpoint_id in (
            ("file_system", FileSystemWriter(tmp_path / "fs"), FileSystemReader(tmp_path / "fs"), tmp_path / "fs"),
            ("ours", MemoryStorageWriter(base_dir), MemoryStorageReader(base_dir), base_dir / "step-1")):
        state = EMPTY_STATES[kind]()
        metadata = dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=checkpoint_id,
                                                              storage_writer=writer))
        into = EMPTY_STATES[kind]()
        dcp_without_process_group(lambda: dcp.load(into, checkpoint_id=checkpoint_id, storage_reader=reader))
        saved[name] = [metadata.state_dict_metadata, reader.read_metadata().state_dict_metadata, into.keys(),
                       [v.loaded for v in into.values() if isinstance(v, StatefulWithoutState)]]
        if name == "ours":
            writer.close()
    assert saved["ours"] == saved["file_system"], saved
    assert committed_steps(CheckpointLayout(base_dir)) == [1]
    assert verify_version(base_dir, 1).objects == 0  # nothing to store: no object


def test_empty_state_and_a_rank_with_nothing_to_save_round_trip_on_two_ranks(base_dir):
    run("empty_states_round_trip", 2, base=base_dir)
    assert committed_steps(CheckpointLayout(base_dir)) == [1, 2, 3]
    assert [verify_version(base_dir, step).objects for step in (1, 2, 3)] == [0, 0, 1]


# --- what .metadata holds ----------------------------------------------------------------------


def save_single_process_version(base_dir: Path, step: int) -> dict[str, Any]:
    state = single_process_state()
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / f"step-{step}", storage_writer=writer))
    writer.close()
    return state


def test_dcp_metadata_unpickles_with_torch_alone(base_dir):
    """storage_data is plain (object name, record key) strings: a torch-only interpreter reads .metadata."""
    save_single_process_version(base_dir, 1)
    probe = (
        "import pickle, sys, torch.distributed.checkpoint\n"
        f"md = pickle.loads(open({str(base_dir / 'step-1' / '.metadata')!r}, 'rb').read())\n"
        "assert not [m for m in sys.modules if m.startswith('ml_flashpoint_nemo')]\n"
        "print(sorted((i.fqn, v) for i, v in md.storage_data.items()))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    listed = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert {fqn for fqn, _ in listed} == {"param", "bf16", "scalar", "empty", "transposed", "extra.note"}
    assert {name for _, (name, _) in listed} == {"rank-00000-0.fpo"}
    assert ("param", ("rank-00000-0.fpo", "param@0,0")) in listed


class StorageInfoOfAnOlderRelease:
    """Stands for the storage_data class earlier releases pickled into .metadata (gone from the package)."""

    def __init__(self, key: str) -> None:
        self.key = key


@pytest.mark.parametrize("kind", ["class_gone", "foreign_value", "not_metadata", "storage_data_emptied",
                                  "storage_data_none"])
def test_metadata_this_release_cannot_read_is_refused_and_nothing_is_loaded(base_dir, kind, monkeypatch):
    """A version whose .metadata another release wrote (checksums intact) is refused with a clear error."""
    state = save_single_process_version(base_dir, 1)
    layout = CheckpointLayout(base_dir)
    metadata_path = base_dir / "step-1" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    if kind == "class_gone":
        monkeypatch.setattr(storage_info, "StorageInfoOfAnOlderRelease", StorageInfoOfAnOlderRelease, raising=False)
        monkeypatch.setattr(StorageInfoOfAnOlderRelease, "__module__", storage_info.__name__)
    if kind in ("class_gone", "foreign_value"):
        metadata.storage_data = {i: StorageInfoOfAnOlderRelease(key) if kind == "class_gone" else {"key": key}
                                 for i, (_, key) in metadata.storage_data.items()}
    else:  # the items stay listed, where they are stored is gone
        metadata.storage_data = {} if kind == "storage_data_emptied" else None
    encoded = pickle.dumps({"not": "a DCP Metadata"} if kind == "not_metadata" else metadata)
    monkeypatch.undo()  # the class is gone again, as after an upgrade
    metadata_path.write_bytes(encoded)
    commit = read_commit(layout, 1)  # re-committed with the new file's checksum: only its content is foreign
    files = dict(commit.metadata[FILES_KEY], **{".metadata": describe_bytes(encoded)})
    write_commit(layout, 1, commit.objects, world_size=1, metadata={**commit.metadata, FILES_KEY: files})

    dest = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    expected = {"class_gone": "does not unpickle here", "foreign_value": "not written by this ml_flashpoint_nemo",
                "not_metadata": "DCP metadata of version 1 holds a dict",
                "storage_data_emptied": "lists 6 items but no storage data",
                "storage_data_none": "has storage_data of type NoneType, not a dict"}[kind]
    with pytest.raises((CorruptCheckpointError, CheckpointException), match=expected):
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-1",
                                                   storage_reader=MemoryStorageReader(base_dir)))
    assert all(not v.any() for v in dest.values())  # nothing half-loaded
    assert verify_version(base_dir, 1).records == len(state)  # the objects are intact


@pytest.mark.parametrize("plan_caching", [False, True])
def test_metadata_bytes_are_reused_only_while_the_structure_repeats(base_dir, plan_caching):
    """The coordinator reuses `.metadata`'s bytes for an equal Metadata; any change in structure re-encodes.

    With torch's plan caching DCP hands finish the same Metadata object again: the reuse must not rest on it.
    """
    writer = MemoryStorageWriter(base_dir, keep=4)
    gen = torch.Generator().manual_seed(11)
    shapes = [{"w": (4, 3), "b": (3,)}, {"w": (4, 3), "b": (3,)}, {"w": (4, 3), "b": (5,)},
              {"w": (4, 3), "b": (5,), "extra": (2,)}]
    saved = []
    for step, layout in enumerate(shapes, start=1):
        state = {"model": {k: torch.randn(shape, generator=gen) for k, shape in layout.items()}}
        planner = DefaultSavePlanner(enable_plan_caching=plan_caching)
        dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / f"step-{step}",
                                                   storage_writer=writer, planner=planner))
        saved.append(state)
    writer.close()
    files = [(base_dir / f"step-{step}" / ".metadata").read_bytes() for step in range(1, 5)]
    assert files[0] == files[1] and len({files[1], files[2], files[3]}) == 3
    for step, state in enumerate(saved, start=1):
        dest = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        reader = MemoryStorageReader(base_dir)
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / f"step-{step}",
                                                   storage_reader=reader))
        assert all(torch.equal(dest["model"][k], v) for k, v in state["model"].items()), step
        meta = reader.read_metadata().storage_meta  # not in the file: from the path and the commit record
        assert meta.checkpoint_id == str(base_dir / f"step-{step}") and meta.load_id == reader.load_id
        assert meta.save_id == read_commit(CheckpointLayout(base_dir), step).metadata["save_id"]


def test_storage_data_follows_each_save_even_when_record_keys_repeat(base_dir):
    """The coordinator reuses storage_data while the items and their objects repeat: the reuse compares DCP
    indices, not record keys (a tensor "x" at offset 0 and a value named "x@0" share the key "x@0"), and what
    the caller does to the Metadata dcp.save returned does not reach the next save's `.metadata`."""
    writer = MemoryStorageWriter(base_dir, keep=5)
    states = [{"x": torch.arange(3.0), "y": torch.ones(2)},
              {"x@0": "not a tensor", "y": torch.full((2,), 5.0)},
              {"x": torch.arange(3.0) + 1, "y": torch.ones(2)},
              {"x": torch.arange(3.0) + 2, "y": torch.ones(2)},
              {"x": torch.arange(3.0) + 3, "y": torch.ones(2)}]
    for step, state in enumerate(states, start=1):
        returned = dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / f"step-{step}",
                                                              storage_writer=writer))
        expected = {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in returned.storage_data}
        on_file = pickle.loads((base_dir / f"step-{step}" / ".metadata").read_bytes()).storage_data
        assert {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in on_file} == expected, step
        assert sorted(on_file.values()) == sorted(returned.storage_data.values()), step
        returned.storage_data.clear()  # the caller's copy: the writer's cache must not be it
    writer.close()
    for step, state in enumerate(states, start=1):
        dest: dict[str, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "" for k, v in state.items()}
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / f"step-{step}",
                                                   storage_reader=MemoryStorageReader(base_dir)))
        for key, value in state.items():
            assert torch.equal(dest[key], value) if isinstance(value, torch.Tensor) else dest[key] == value, (step, key)


def test_metadata_compared_before_the_copy_is_trusted_only_for_the_object_finish_gets(base_dir, monkeypatch):
    """write_data compares the planner's Metadata with the last save's before the copy; finish reuses the bytes
    on that answer only when DCP hands it that same object. A planner whose `metadata` is not the Metadata of
    this save (here: an equal copy of the last one, while this save's shapes changed) gets fresh bytes."""
    from ml_flashpoint_nemo.dcp import writer as writer_module

    answers: list[Any] = []
    real_compare_early = writer_module.compare_early
    monkeypatch.setattr(writer_module, "compare_early", lambda *a: answers.append(real_compare_early(*a)) or answers[-1])
    writer = MemoryStorageWriter(base_dir, keep=4)
    first = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    returned = dcp_without_process_group(lambda: dcp.save(first, checkpoint_id=base_dir / "step-1",
                                                          storage_writer=writer))
    dcp_without_process_group(lambda: dcp.save(first, checkpoint_id=base_dir / "step-2", storage_writer=writer))
    assert answers[0] is None and answers[1] is not None  # nothing to compare with yet; then equal
    assert (base_dir / "step-1" / ".metadata").read_bytes() == (base_dir / "step-2" / ".metadata").read_bytes()

    class StalePlanner(DefaultSavePlanner):
        def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
            plans, metadata = super().create_global_plan(all_plans)
            self.metadata = returned  # equal to what the last save wrote, not what DCP hands finish
            return plans, metadata

    changed = {"w": torch.randn(2, 6), "b": torch.randn(3)}
    dcp_without_process_group(lambda: dcp.save(changed, checkpoint_id=base_dir / "step-3", storage_writer=writer,
                                               planner=StalePlanner()))
    writer.close()
    assert answers[2] is not None  # the stale Metadata compared equal, and was not trusted
    assert pickle.loads((base_dir / "step-3" / ".metadata").read_bytes()).state_dict_metadata["w"].size == (2, 6)
    dest = {k: torch.zeros_like(v) for k, v in changed.items()}
    dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-3",
                                               storage_reader=MemoryStorageReader(base_dir)))
    assert all(torch.equal(dest[k], v) for k, v in changed.items())


def test_lookup_table_is_reused_only_for_the_same_metadata_bytes(base_dir, monkeypatch):
    """The reader keeps the checked lookup table of `.metadata` bytes it read: a second load of the same bytes
    skips the checks; changed bytes for the same step, a cached entry under the file's checksum but of other
    bytes, or a Metadata the caller changed after read_metadata are never served from it."""
    from collections import OrderedDict

    from ml_flashpoint_nemo.dcp import reader as reader_module

    monkeypatch.setattr(reader_module, "_TABLES", OrderedDict())
    checks = []
    real_checked_chunks = reader_module.checked_chunks
    monkeypatch.setattr(reader_module, "checked_chunks", lambda *a: checks.append(a[1]) or real_checked_chunks(*a))

    def save(state: dict[str, Any]) -> None:
        writer = MemoryStorageWriter(base_dir)
        dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-1", storage_writer=writer))
        writer.close()

    def load_and_check(state: dict[str, Any]) -> None:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-1",
                                                   storage_reader=MemoryStorageReader(base_dir)))
        assert all(torch.equal(dest[k], v) for k, v in state.items())

    first = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    save(first)
    load_and_check(first)
    load_and_check(first)
    assert checks == [1], "the second load of the same bytes skips the checks"

    # The same step saved again with another structure: other bytes, checked and loaded as they are now
    second = {"w": torch.randn(2, 6), "b": torch.randn(5), "c": torch.randn(1)}
    save(second)
    load_and_check(second)
    assert checks == [1, 1]

    # An entry under the file's (size, CRC32C) but of other bytes (a forged CRC) is not used
    described = read_commit(CheckpointLayout(base_dir), 1).metadata[FILES_KEY][".metadata"]
    key = (described["nbytes"], described["crc32c"])
    reader_module._TABLES[key] = reader_module._Decoded(b"\0" * described["nbytes"], {})
    load_and_check(second)
    assert checks == [1, 1, 1]
    load_and_check(second)
    assert checks == [1, 1, 1]

    # What a caller does to the Metadata read_metadata returned does not reach the cached table
    reader = MemoryStorageReader(base_dir)
    reader.reset(base_dir / "step-1")
    returned = reader.read_metadata()
    returned.storage_data = {index: ("rank-00099-0.fpo", "nothing") for index in returned.storage_data}
    load_and_check(second)
    assert checks == [1, 1, 1]


def test_repeated_loads_of_the_same_metadata_bytes_each_get_a_metadata_of_their_own(base_dir, monkeypatch):
    """From the third load of the same `.metadata` bytes the reader decodes a kept copy of the Metadata less its
    storage_data: each load still gets the saved Metadata, and what a caller (or a planner) changes in one never
    reaches the next."""
    from collections import OrderedDict

    from ml_flashpoint_nemo.dcp import reader as reader_module

    monkeypatch.setattr(reader_module, "_TABLES", OrderedDict())
    state = {"w": torch.randn(4, 3), "b": torch.randn(3), "blob": b"bytes"}
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-1", storage_writer=writer))
    writer.close()
    saved = pickle.loads((base_dir / "step-1" / ".metadata").read_bytes())

    def read() -> Any:
        reader = MemoryStorageReader(base_dir)
        reader.reset(base_dir / "step-1")
        return reader.read_metadata()

    returned = [read() for _ in range(4)]
    assert all(r.state_dict_metadata == saved.state_dict_metadata and r.storage_data == saved.storage_data
               for r in returned)
    assert len({r.storage_meta.load_id for r in returned}) == 4
    assert len({id(r) for r in returned}) == 4 and len({id(r.state_dict_metadata["w"]) for r in returned}) == 4
    kept = next(iter(reader_module._TABLES.values()))
    assert kept.rest is not None, "the second load keeps the decoded parts"

    # A caller changes everything it can reach in the third and fourth Metadata
    for r in returned[2:]:
        r.state_dict_metadata["w"].chunks[0].sizes = torch.Size([1, 1])
        r.state_dict_metadata["w"].size = torch.Size([1, 1])
        r.storage_data.clear()
        r.planner_data = {"changed": True}
    again = read()
    assert again.state_dict_metadata == saved.state_dict_metadata and again.storage_data == saved.storage_data
    assert again.planner_data == saved.planner_data
    dest = {"w": torch.zeros(4, 3), "b": torch.zeros(3), "blob": b""}
    dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-1",
                                               storage_reader=MemoryStorageReader(base_dir)))
    assert torch.equal(dest["w"], state["w"]) and torch.equal(dest["b"], state["b"]) and dest["blob"] == b"bytes"


def test_a_metadata_that_does_not_pickle_again_is_loaded_uncached(base_dir, monkeypatch):
    """Keeping the decoded parts needs the Metadata to pickle again; when it does not, every load decodes the
    file itself and succeeds (only the cache is lost)."""
    from collections import OrderedDict

    from ml_flashpoint_nemo.dcp import reader as reader_module

    monkeypatch.setattr(reader_module, "_TABLES", OrderedDict())

    def dumps(*args: Any, **kwargs: Any) -> bytes:
        raise TypeError("cannot pickle this Metadata here")

    monkeypatch.setattr(reader_module, "pickle", types.SimpleNamespace(
        dumps=dumps, loads=pickle.loads, HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL))
    state = {"w": torch.randn(4, 3)}
    writer = MemoryStorageWriter(base_dir)
    dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-1", storage_writer=writer))
    writer.close()
    for _ in range(3):
        dest = {"w": torch.zeros(4, 3)}
        dcp_without_process_group(lambda: dcp.load(dest, checkpoint_id=base_dir / "step-1",
                                                   storage_reader=MemoryStorageReader(base_dir)))
        assert torch.equal(dest["w"], state["w"])
    assert all(kept.rest is None for kept in reader_module._TABLES.values())


def test_metadata_file_writes_equal_sizes_once_and_decodes_to_the_saved_metadata(base_dir):
    """Equal sizes, offsets and tensor properties are one object each in `.metadata` (smaller, faster to
    unpickle); what it decodes to equals the Metadata DCP built, torch.Size stays torch.Size."""
    state = {f"layer{i}": {"w": torch.randn(4, 3), "b": torch.randn(3)} for i in range(6)}
    writer = MemoryStorageWriter(base_dir)
    returned = dcp_without_process_group(lambda: dcp.save(state, checkpoint_id=base_dir / "step-1",
                                                          storage_writer=writer))
    writer.close()
    decoded = pickle.loads((base_dir / "step-1" / ".metadata").read_bytes())
    assert decoded.storage_meta is None
    returned.storage_meta = None
    assert decoded == returned
    weights = [decoded.state_dict_metadata[f"layer{i}.w"] for i in range(6)]
    assert all(type(w.size) is torch.Size and type(w.chunks[0].offsets) is torch.Size for w in weights)
    assert len({id(w.size) for w in weights}) == 1 and len({id(w.properties) for w in weights}) == 1
    assert weights[0].size is weights[0].chunks[0].sizes


@pytest.mark.parametrize("offsets, sizes, message", [
    (torch.Size([0, 0]), torch.Size([4, 3]), None),
    (torch.Size([1, 0]), torch.Size([4, 3]), "outside the tensor's shape [4, 3]"),
    (torch.Size([0, 0]), torch.Size([2, 3]), "holding 6 elements, but the tensor [4, 3] has 12"),
    ((0.0, 0), torch.Size([4, 3]), "not non-negative integers"),
    (torch.Size([0, 0]), [4, 3], "not non-negative integers"),
    (torch.Size([0]), torch.Size([4, 3]), "outside the tensor's shape [4, 3]"),
])
def test_a_single_chunk_is_checked_as_strictly_as_several(offsets, sizes, message):
    """A tensor stored as one chunk takes a short path through the check; it accepts only the whole tensor."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ml_flashpoint_nemo.dcp.metadata_file import checked_chunks

    stored = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                                   [ChunkStorageMetadata(offsets, sizes)])
    metadata = Metadata({"w": stored}, storage_data={})
    if message is None:
        assert checked_chunks(metadata, 1) == {("w", (0, 0)): ((4, 3), "float32")}
    else:
        with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
            checked_chunks(metadata, 1)


def test_metadata_that_does_not_fit_fails_the_save_clearly_and_leaves_no_temporary(tmp_path):
    """.metadata goes through versions.write_file_atomically: ENOSPC (from a real full tmpfs) becomes
    OutOfSpaceError, the half-written temporary is removed, and the committed version before it still loads."""
    from tests.support.tmpfs import mounted_tmpfs

    # 3000 one-element tensors: an object of about 1.2 MB and a .metadata of about 0.35 MB. The tmpfs is sized
    # from a first save elsewhere so that the second save's object still fits and its .metadata does not.
    state = {f"t{i}": torch.full((1,), float(i)) for i in range(3000)}
    probe = MemoryStorageWriter(tmp_path / "probe")
    try:
        dcp.save(state, checkpoint_id=tmp_path / "probe" / "step-1", storage_writer=probe)
    finally:
        probe.close()
    object_nbytes = sum(p.stat().st_size for p in (tmp_path / "probe" / "step-1").glob("*.fpo"))
    metadata_nbytes = (tmp_path / "probe" / "step-1" / ".metadata").stat().st_size
    assert metadata_nbytes > 250_000, metadata_nbytes  # room for the margin below (page rounding)
    size_kib = (2 * object_nbytes + metadata_nbytes + metadata_nbytes // 2) // 1024  # half a .metadata short
    with mounted_tmpfs(tmp_path / "tmpfs", f"{size_kib}k") as mount_point:
        base = mount_point / "base"
        writer = MemoryStorageWriter(base)
        try:
            dcp.save(state, checkpoint_id=base / "step-1", storage_writer=writer)
            with pytest.raises((OutOfSpaceError, CheckpointException)) as info:
                dcp.save(state, checkpoint_id=base / "step-2", storage_writer=writer)
        finally:
            writer.close()
        assert "no space left for DCP's metadata of step 2" in str(info.value), info.value
        assert not [n for n in (base / "step-2").iterdir() if n.name.startswith(".") and ".tmp-" in n.name]
        assert committed_steps(CheckpointLayout(base)) == [1]
        loaded = {key: torch.zeros(1) for key in state}
        dcp.load(loaded, checkpoint_id=base / "step-1", storage_reader=MemoryStorageReader(base))
        assert all(torch.equal(loaded[key], value) for key, value in state.items())
