"""What `flashpoint` says about bad command-line input, in-process (test_cli.py runs the real console script).

Each case asserts the exit code and a message that tells the user what to pass, and that the
base directory is left as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.cli import main
from ml_flashpoint_nemo.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    PoolLocks,
    compact_ranks,
    format_time,
    human_bytes,
    iso_time,
    scan_pool,
    scan_replica_spares,
    valid_time,
)
from ml_flashpoint_nemo.core import CheckpointSaver, committed_steps, loader
from ml_flashpoint_nemo.core.format import CommitRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.versions import read_commit, write_commit
from tests.support.forge import forge_commit


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.is_dir() else []


@pytest.mark.parametrize("command", ["ls", "verify", "clean"])
def test_a_base_that_is_a_file_is_a_usage_error(tmp_path, capsys, command):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    assert main([command, str(not_a_dir)]) == EXIT_USAGE
    assert f"{not_a_dir} is not a directory; BASE is a flashpoint base directory" in capsys.readouterr().err
    assert not_a_dir.read_bytes() == b"x"


@pytest.mark.parametrize("command", ["ls", "clean"])
def test_a_foreign_directory_is_refused_and_left_alone(tmp_path, capsys, command):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "sub").mkdir()
    before = listing(tmp_path)
    assert main([command, str(tmp_path)]) == EXIT_USAGE
    assert "is not a flashpoint base directory: it holds neither pool/ nor step-<N>/" in capsys.readouterr().err
    assert listing(tmp_path) == before


@pytest.mark.parametrize("step", ["seven", "-1", "step-x", "1.5"])
def test_a_step_that_is_not_a_non_negative_integer_is_a_usage_error(shm_dir, capsys, step):
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(1, {"w": torch.ones(3)})
    assert main(["verify", str(base), step]) == EXIT_USAGE
    assert f"STEP must be a non-negative integer (or step-<N>), got {step!r}" in capsys.readouterr().err
    assert committed_steps(CheckpointLayout(base)) == [1]


def test_an_empty_directory_is_an_empty_base(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == EXIT_OK
    assert "Traceback" not in capsys.readouterr().err
    assert listing(tmp_path) == []


def test_pool_scan_counts_buffers_and_ignores_what_is_not_one(shm_dir):
    """A saver's spare buffer is counted with the memory it holds; stray names in the pool are not."""
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(1, {"w": torch.ones(1024)})
        saver.save(2, {"w": torch.ones(1024)})  # retires step 1: its object becomes a free buffer
    layout = CheckpointLayout(base)
    rank_dir = layout.pool_root / "rank-00000"
    (rank_dir / "notes.txt").write_text("not a buffer")
    (layout.pool_root / "not-a-rank").mkdir()
    (pool,) = scan_pool(layout)
    assert pool.rank == 0 and pool.buffers >= 1 and pool.nbytes >= 4096
    assert pool.to_json()["locked"] is False  # the saver is closed: nobody holds the lock
    spares = scan_replica_spares(layout)
    assert spares.files == 0 and spares.nbytes == 0  # no replication ran: no spare directory


def test_pool_locks_report_a_live_holder_and_release_what_they_took(shm_dir):
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver, CheckpointSaver(base, rank=1) as other:
        saver.save(1, {"w": torch.ones(4)})
        other.close()  # rank 1's lock is free, rank 0's is held by this process's saver
        with PoolLocks(CheckpointLayout(base)) as locks:
            assert [rank for rank, _ in locks.busy] == [0]
            assert [holder for _, holder in locks.busy] in ([os.getpid()], [None])
            assert len(locks.fds) == 1
        assert locks.fds == []
        saver.save(2, {"w": torch.ones(4)})  # still its pool: nothing was taken from it
    assert committed_steps(CheckpointLayout(base)) == [2]


@pytest.mark.parametrize("ranks, text", [([], "-"), ([3], "3"), ([0, 1, 2, 5], "0-2,5"), ([7, 1, 2, 2, 8], "1-2,7-8")])
def test_rank_lists_are_compact(ranks, text):
    assert compact_ranks(ranks) == text


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 << 30, "3.0 GiB"),
                                     (5 << 50, "5120.0 TiB")])
def test_byte_counts_are_human(n, text):
    assert human_bytes(n) == text


def test_missing_times_print_as_a_dash_or_null():
    assert format_time(None) == "-" and iso_time(None) is None
    assert format_time(0.0).count(":") == 2 and iso_time(0.0).startswith(("1970", "1969"))


@pytest.mark.parametrize("unix", [float("nan"), float("inf"), -float("inf"), 1e300, -1e300])
def test_no_time_prints_as_invalid_or_null(unix):
    assert format_time(unix) == "invalid" and iso_time(unix) is None and valid_time(unix) is None


# --- a commit record's creation time that is no time (finding 6a) -----------------------------


def forge_created_unix(base: Path, step: int, token: str) -> None:
    """Write `token` as the JSON text of step's created_unix, every CRC made consistent again."""
    path = base / f"step-{step}" / "COMMIT"
    forge_commit(path, lambda payload: payload.update(created_unix="@@"))
    body = path.read_bytes().rpartition(b"\ncrc32c=")[0].replace(b'"@@"', token.encode())
    path.write_bytes(body + f"\ncrc32c={_core.crc32c(body):08x}\n".encode())


def strict_json(text: str) -> Any:
    """Parse as a strict JSON parser would: NaN and Infinity are not JSON."""
    def refuse(token: str) -> Any:
        raise AssertionError(f"{token} in --json output")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e309", '"nan"', "1e300", "1" + "0" * 400])
def test_ls_lists_a_version_whose_creation_time_is_no_time(shm_dir, capsys, token):
    """NaN, an infinity, a number beyond any date: the version is listed, its time shown as invalid."""
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(1, {"w": torch.ones(3)}, keep=None)
        saver.save(2, {"w": torch.ones(3)}, keep=None)
    forge_created_unix(base, 2, token)
    assert main(["ls", str(base)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    (row,) = [line for line in out.splitlines() if line.split()[:1] == ["2"]]
    assert main(["ls", "--json", str(base)]) == EXIT_OK
    versions = {v["step"]: v for v in strict_json(capsys.readouterr().out)["versions"]}
    assert versions[1]["created_valid"] and isinstance(versions[1]["created_unix"], float)
    forged = versions[2]
    if forged["state"] == "unreadable":  # a decoder may refuse the record as corrupt: listed, with why
        assert "unreadable" in row and "step 2: commit record unreadable" in out, out
        return
    assert forged["state"] == "committed" and "invalid" in row.split(), out
    assert forged["created_unix"] is None and forged["created"] is None and not forged["created_valid"]


@pytest.mark.parametrize("token", ["NaN", "Infinity", "1e309", '"nan"', "true", "1" + "0" * 400])
def test_a_commit_record_whose_creation_time_is_no_time_is_corrupt_and_the_older_version_is_chosen(shm_dir, token):
    """The decoder refuses such a record as CorruptCheckpointError (it was a raw OverflowError for a huge
    integer, and NaN passed), so every reader skips the version the same way and falls back to the older one."""
    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.core.loader import load_newest_valid
    from ml_flashpoint_nemo.core.versions import read_commit
    from ml_flashpoint_nemo.errors import CorruptCheckpointError

    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(1, {"w": torch.ones(3)}, keep=None)
        saver.save(2, {"w": torch.full((3,), 2.0)}, keep=None)
    forge_created_unix(base, 2, token)
    with pytest.raises(CorruptCheckpointError, match="created_unix .* is not a finite number|malformed"):
        read_commit(CheckpointLayout(base), 2)
    step, state = load_newest_valid(base, rank=0)
    assert step == 1 and torch.equal(state["w"], torch.ones(3))


# --- verify's work grows with the objects, not objects times ranks (finding 6b) -------------------


def many_rank_version(base: Path, step: int, world_size: int) -> None:
    """One committed version with one tiny object per rank, written by each rank's own saver.

    Each object file is cut to its object's size: the pool buffer it lives in is larger (MiBs each).
    """
    layout = CheckpointLayout(base)
    written = []
    for rank in range(world_size):
        with CheckpointSaver(base, rank=rank, threads=1) as saver:
            record = saver.write_object(step, {"w": torch.full((4,), float(rank))}).record
        os.truncate(layout.object_path(step, record.name), record.nbytes)
        written.append(record)
    write_commit(layout, step, written, world_size=world_size)


@pytest.mark.parametrize("world_size", [3, 24])
def test_verify_reads_the_commit_record_once_and_each_object_once(shm_dir, capsys, monkeypatch, world_size):
    """Counted, not timed: one commit record decode and one object open per object, whatever the rank count.

    It was one whole verification of the version per rank (the record decoded and scanned again
    each time), quadratic in the objects: 2,000 one-object ranks took minutes.
    """
    base = shm_dir / "base"
    many_rank_version(base, 1, world_size)
    decodes: list[str] = []
    opens: list[str] = []
    real_decode, real_open = CommitRecord.decode.__func__, loader.open_object  # type: ignore[attr-defined]

    def counted_decode(cls: type[CommitRecord], raw: bytes, path: str) -> CommitRecord:
        decodes.append(path)
        return real_decode(cls, raw, path)

    def counted_open(path: str, record: Any) -> Any:
        opens.append(os.path.basename(path))
        return real_open(path, record)

    monkeypatch.setattr(CommitRecord, "decode", classmethod(counted_decode))
    monkeypatch.setattr(loader, "open_object", counted_open)
    assert main(["verify", "--json", str(base)]) == EXIT_OK
    (version,) = strict_json(capsys.readouterr().out)["versions"]
    assert version["ok"] and version["objects"] == world_size
    assert len(decodes) == 1, decodes
    assert sorted(opens) == sorted(o.name for o in read_commit(CheckpointLayout(base), 1).objects)
