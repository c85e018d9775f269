"""Every bad input and damaged file gets a specific error, and nothing already committed is lost."""

from __future__ import annotations

import logging
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from ml_flashpoint_nemo import (
    BaseDirError,
    ChecksumError,
    CorruptCheckpointError,
    FormatVersionError,
    LoadMismatchError,
    MissingKeyError,
    OutOfSpaceError,
    PoolBusyError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
)
from ml_flashpoint_nemo.core import (
    CheckpointSaver,
    committed_steps,
    load_newest_valid,
    load_version,
    loader,
    verify_version,
)
from ml_flashpoint_nemo.core.format import HEADER_NBYTES
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import open_object
from ml_flashpoint_nemo.core.versions import read_commit
from tests.support.forge import forge_commit, forge_header
from tests.support.states import assert_state_equal, make_state


def object_file(base_dir: Path, step: int) -> Path:
    return next((base_dir / f"step-{step}").glob("rank-*.fpo"))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def two_versions(base_dir):
    """Steps 1 and 2 committed (keep=2), each a distinct deterministic state."""
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, make_state(1, small_tensors=10), keep=2)
        saver.save(2, make_state(2, small_tensors=10), keep=2)
    return base_dir


# --- base directory -------------------------------------------------------------------------


def test_base_dir_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(BaseDirError, match="cannot create checkpoint base directory"):
        CheckpointSaver(blocker / "base")


def test_base_dir_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(BaseDirError, match="not a directory"):
        CheckpointSaver(blocker)


def test_read_only_base_dir_is_refused(small_tmpfs):
    (small_tmpfs / "base").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(BaseDirError, match="not writable"):
        CheckpointSaver(small_tmpfs / "base")


def test_a_new_base_dir_is_made_private(tmp_path):
    with CheckpointSaver(tmp_path / "new" / "base"):
        pass
    assert (tmp_path / "new" / "base").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_base_dir_writable_by_group_or_others_is_refused_and_kept(tmp_path, mode):
    """The ssh rule: whoever else may write the base directory can plant a version a restart loads."""
    base = tmp_path / "base"
    with CheckpointSaver(base) as saver:
        saver.save(1, {"x": torch.ones(3)})
    base.chmod(mode)
    with pytest.raises(BaseDirError, match=rf"writable by group or others \(mode 0{mode:o}\).*Run: chmod 700 {re.escape(str(base))}$"):
        CheckpointSaver(base)
    with pytest.raises(BaseDirError, match="writable by group or others"):  # a load would read what they planted
        load_version(base, 1)
    base.chmod(0o755)  # not writable by others: fine, and what was there is intact
    assert torch.equal(load_version(base, 1)["x"], torch.ones(3))
    CheckpointSaver(base).close()


def test_a_base_dir_owned_by_another_user_is_refused(tmp_path):
    """We run the tests as root here, so the directory is given to another uid with chown."""
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    os.chown(base, 4242, -1)
    with pytest.raises(BaseDirError, match=rf"owned by uid 4242, not by this job's user \(uid 0\).*chown -R 0 {re.escape(str(base))} && chmod 700"):
        CheckpointSaver(base)
    assert sorted(os.listdir(base)) == []


def _saved_under(parent: Path) -> Path:
    base = parent / "base"
    with CheckpointSaver(base) as saver:
        saver.save(1, {"x": torch.ones(3)})
    return base


def test_a_directory_above_the_base_that_others_may_write_refuses_saves_and_loads(tmp_path):
    """Whoever may write a directory above the base (no sticky bit) can swap the base for one of their own."""
    base = _saved_under(tmp_path / "shared")
    (tmp_path / "shared").chmod(0o777)
    unsafe = rf"{re.escape(str(tmp_path / 'shared'))}, a directory above .* without the sticky bit \(mode 0777\)"
    for attempt in (lambda: CheckpointSaver(base), lambda: load_version(base, 1), lambda: load_newest_valid(base)):
        with pytest.raises(BaseDirError, match=unsafe):
            attempt()
    (tmp_path / "shared").chmod(0o1777)  # sticky, as /dev/shm: others may not rename what is ours
    assert torch.equal(load_version(base, 1)["x"], torch.ones(3))
    assert load_newest_valid(base)[0] == 1
    CheckpointSaver(base).close()


def test_a_directory_above_the_base_owned_by_another_user_refuses_loads(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    base = _saved_under(tmp_path / "theirs")
    os.chown(tmp_path / "theirs", 4242, -1)
    with pytest.raises(BaseDirError, match=r"theirs, a directory above .* owned by uid 4242, not by root or this job"):
        load_version(base, 1)
    os.chown(tmp_path / "theirs", 0, -1)
    assert torch.equal(load_version(base, 1)["x"], torch.ones(3))


def test_a_symlinked_base_is_checked_where_it_resolves(tmp_path):
    """The path as given may be fine while the directory it leads to sits under one that others may write."""
    real = _saved_under(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").chmod(0o777)
    (tmp_path / "private").mkdir(mode=0o700)
    (tmp_path / "private" / "link").symlink_to(real)
    with pytest.raises(BaseDirError, match=r"elsewhere, a directory above"):
        load_version(tmp_path / "private" / "link", 1)


def test_base_dir_off_tmpfs_warns_and_works(tmp_path, caplog):
    assert tmp_path.resolve().parts[1] != "dev"
    with caplog.at_level(logging.WARNING, logger="ml_flashpoint_nemo.core.layout"):
        with CheckpointSaver(tmp_path / "base") as saver:
            saver.save(1, {"x": torch.ones(3)})
    assert "not on a tmpfs" in caplog.text
    assert torch.equal(load_version(tmp_path / "base", 1)["x"], torch.ones(3))


def test_second_process_on_same_rank_is_refused(base_dir):
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, {"x": torch.ones(2)})
        with pytest.raises(PoolBusyError, match="held by another live process"):
            CheckpointSaver(base_dir)
    with CheckpointSaver(base_dir) as again:  # the lock went away with the first saver
        again.save(2, {"x": torch.ones(2)})


# --- values that cannot be stored -----------------------------------------------------------


@pytest.mark.parametrize(
    "state, message",
    [
        ({1: torch.ones(1)}, "keys must be str"),
        ({"s": torch.ones(3).to_sparse()}, "layout"),
        ({"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}, "quantized"),
        ({"m": torch.empty(3, device="meta")}, "meta device"),
        ({"i": 3}, "only torch.Tensor and bytes"),
        ({"n": [torch.ones(1)]}, "only torch.Tensor and bytes"),
    ],
)
def test_unsupported_values_are_refused_and_nothing_is_written(two_versions, state, message):
    with CheckpointSaver(two_versions) as saver:
        with pytest.raises(UnsupportedValueError, match=message):
            saver.save(3, {"ok": torch.ones(2), **state})
    assert committed_steps(CheckpointLayout(two_versions)) == [1, 2]
    assert not (two_versions / "step-3").exists()
    assert_state_equal(make_state(2, small_tensors=10), load_version(two_versions, 2))


def test_state_must_be_a_mapping(base_dir):
    with CheckpointSaver(base_dir) as saver, pytest.raises(UnsupportedValueError, match="mapping"):
        saver.save(1, [torch.ones(1)])


def test_saving_a_committed_step_needs_overwrite(two_versions):
    with CheckpointSaver(two_versions) as saver:
        with pytest.raises(VersionExistsError, match="overwrite=True"):
            saver.save(2, {"x": torch.zeros(1)})
        assert_state_equal(make_state(2, small_tensors=10), load_version(two_versions, 2))
        saver.save(2, {"x": torch.zeros(1)}, overwrite=True, keep=None)
    assert_state_equal({"x": torch.zeros(1)}, load_version(two_versions, 2))
    assert_state_equal(make_state(1, small_tensors=10), load_version(two_versions, 1))


# --- out of space ---------------------------------------------------------------------------


def test_enospc_mid_save_keeps_the_previous_version(small_tmpfs):
    base = small_tmpfs / "base"
    small = {"w": torch.randn(1 << 20)}  # 4 MiB of data (8 MiB buffer) in a 16 MiB tmpfs
    with CheckpointSaver(base) as saver:
        saver.save(1, small)
        with pytest.raises(OutOfSpaceError, match="tmpfs is full"):
            saver.save(2, {"w": torch.randn(5 << 20)})  # 20 MiB: cannot fit
        assert committed_steps(CheckpointLayout(base)) == [1]
        assert_state_equal(small, load_version(base, 1))
        # the failure left the pool usable: a save that fits still works
        saver.save(3, {"w": torch.randn(1 << 18)})
    assert committed_steps(CheckpointLayout(base)) == [3]


def test_enospc_when_growing_a_pool_buffer(small_tmpfs):
    base = small_tmpfs / "base"
    first = {"w": torch.randn(1 << 18)}  # 1 MiB of data in a 5 MiB buffer (slack included)
    with CheckpointSaver(base) as saver:
        saver.save(1, first, keep=None)
        saver.save(2, first, keep=None)
        saver.save(3, first, keep=1)  # steps 1 and 2 retired: their buffers are free in the pool
        with pytest.raises(OutOfSpaceError):
            saver.save(4, {"w": torch.randn(3 << 20)})  # 12 MiB: the free buffer cannot grow that far
        assert_state_equal(first, load_version(base, 3))


# --- damaged files --------------------------------------------------------------------------


def record_offset(base_dir: Path, step: int, key: str) -> int:
    layout = CheckpointLayout(base_dir)
    record = read_commit(layout, step).objects[0]
    with open_object(str(layout.object_path(step, record.name)), record) as obj:
        return next(e.offset for e in obj.entries if e.key == key)


def test_flipped_data_byte_names_object_and_key(two_versions):
    path = object_file(two_versions, 2)
    flip_byte(path, record_offset(two_versions, 2, "large.0") + 100)
    with pytest.raises(ChecksumError, match="large.0") as info:
        load_version(two_versions, 2)
    assert info.value.key == "large.0" and info.value.path == str(path)
    with pytest.raises(ChecksumError):
        verify_version(two_versions, 2)
    assert_state_equal(make_state(1, small_tensors=10), load_version(two_versions, 1))


def test_flipped_data_byte_fails_a_batched_load_into_strided_tensors(two_versions, monkeypatch):
    monkeypatch.setattr(loader, "UPLOAD_BATCH_NBYTES", 64 << 10)  # the error comes after earlier batches landed
    path = object_file(two_versions, 2)
    flip_byte(path, record_offset(two_versions, 2, "large.1") + 100)
    expected = make_state(2, small_tensors=10)
    into = {key: torch.zeros(expected[key].numel() * 2)[::2] for key in ("large.0", "large.1")}
    with pytest.raises(ChecksumError, match="large.1"):
        load_version(two_versions, 2, into=into)
    assert_state_equal(make_state(1, small_tensors=10), load_version(two_versions, 1))


def test_flipped_byte_in_every_region_is_detected(base_dir):
    state = make_state(9, small_tensors=4, large_numel=1024)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    path = object_file(base_dir, 1)
    pristine = path.read_bytes()
    size = CheckpointLayout(base_dir).commit_path(1).parent.joinpath(path.name).stat().st_size
    object_nbytes = struct.unpack_from("<Q", pristine, 16)[0]
    for offset in [0, 9, 20, 40, 63, HEADER_NBYTES + 5, object_nbytes // 2, object_nbytes - 3]:
        path.write_bytes(pristine)
        flip_byte(path, offset)
        with pytest.raises(CorruptCheckpointError):
            load_version(base_dir, 1)
    path.write_bytes(pristine)
    assert size >= object_nbytes
    assert_state_equal(state, load_version(base_dir, 1))


def test_flipped_byte_in_commit_record(two_versions, caplog):
    commit = two_versions / "step-2" / "COMMIT"
    flip_byte(commit, 30)
    with pytest.raises(CorruptCheckpointError, match="commit record"):
        load_version(two_versions, 2)
    with caplog.at_level(logging.WARNING):
        step, state = load_newest_valid(two_versions)
    assert step == 1
    assert "Skipping RAM checkpoint step 2" in caplog.text
    assert_state_equal(make_state(1, small_tensors=10), state)


def test_truncated_object(two_versions):
    path = object_file(two_versions, 2)
    os.truncate(path, 4096)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_version(two_versions, 2)
    step, _ = load_newest_valid(two_versions)
    assert step == 1


def test_missing_object(two_versions):
    object_file(two_versions, 2).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load_version(two_versions, 2)


def test_unknown_object_format_version(two_versions):
    path = object_file(two_versions, 2)
    forge_header(path, lambda header: header.update(format_version=2))
    with pytest.raises(FormatVersionError, match="format v2"):
        load_version(two_versions, 2)


def test_unknown_commit_format_version(two_versions):
    forge_commit(two_versions / "step-2" / "COMMIT", lambda commit: commit.update(format_version=7))
    with pytest.raises(FormatVersionError, match="format v7"):
        load_version(two_versions, 2)


def test_a_newer_format_is_not_reported_as_corrupt_and_an_older_version_is_loaded(two_versions, caplog):
    """A newer release's valid checkpoint is not "corrupt"; load_newest_valid skips it and keeps its files."""
    assert not issubclass(FormatVersionError, CorruptCheckpointError)
    path = object_file(two_versions, 2)
    forge_header(path, lambda header: header.update(format_version=2))
    newer = path.read_bytes()
    with pytest.raises(FormatVersionError) as raised:
        load_version(two_versions, 2)
    assert not isinstance(raised.value, CorruptCheckpointError) and "release that wrote it" in str(raised.value)
    with caplog.at_level(logging.WARNING):
        step, state = load_newest_valid(two_versions)
    assert step == 1
    assert_state_equal(state, make_state(1, small_tensors=10))
    assert "Skipping RAM checkpoint step 2" in caplog.text and "format v2" in caplog.text
    assert committed_steps(CheckpointLayout(two_versions)) == [1, 2] and path.read_bytes() == newer


def test_uncommitted_version_does_not_exist(two_versions):
    (two_versions / "step-2" / "COMMIT").unlink()
    with pytest.raises(VersionNotFoundError, match="no committed version of step 2"):
        load_version(two_versions, 2)
    assert load_newest_valid(two_versions)[0] == 1


# --- loading into the wrong places ----------------------------------------------------------


def test_missing_key_on_load(two_versions):
    with pytest.raises(MissingKeyError, match="not_there"):
        load_version(two_versions, 2, keys=["not_there"])
    with pytest.raises(MissingKeyError, match="absent"):
        load_version(two_versions, 2, into={"absent": torch.zeros(1)})


@pytest.mark.parametrize(
    "destination, message",
    [(torch.zeros(7), r"stored float32\[1048576\]"), (torch.zeros(1 << 20, dtype=torch.float64), "float64")],
)
def test_shape_or_dtype_mismatch_leaves_destinations_untouched(two_versions, destination, message):
    untouched = torch.full((1 << 20,), 5.0)
    with pytest.raises(LoadMismatchError, match=message):
        load_version(two_versions, 2, into={"large.0": untouched, "large.1": destination})
    assert torch.all(untouched == 5.0)


def test_bytes_and_tensor_records_need_matching_destinations(two_versions):
    with pytest.raises(LoadMismatchError, match="holds bytes"):
        load_version(two_versions, 2, into={"extra": torch.zeros(6, dtype=torch.uint8)})
    with pytest.raises(LoadMismatchError, match="must be a torch.Tensor"):
        load_version(two_versions, 2, into={"large.0": b"placeholder"})
    assert load_version(two_versions, 2, into={"extra": b""})["extra"] == b"seed=2"


def test_wrong_rank_and_empty_base(two_versions):
    with pytest.raises(VersionNotFoundError, match="no object of rank 3"):
        load_version(two_versions, 2, rank=3)
    empty = two_versions / "empty"
    with pytest.raises(VersionNotFoundError, match="no committed version"):
        load_version(empty)
    with pytest.raises(VersionNotFoundError, match="none committed"):
        load_newest_valid(empty)


def test_every_error_type_is_exported_at_the_top_level():
    """A user catches any of them as ml_flashpoint_nemo.<Name>, ManagerStartError included."""
    import inspect

    import ml_flashpoint_nemo
    from ml_flashpoint_nemo import errors

    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, errors.FlashpointError)}
    assert "ManagerStartError" in defined
    missing = sorted(n for n in defined if n not in ml_flashpoint_nemo.__all__ or not hasattr(ml_flashpoint_nemo, n))
    assert not missing, f"not exported by ml_flashpoint_nemo: {missing}"
