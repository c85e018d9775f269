"""The `flashpoint` console script on real checkpoints, run as a real subprocess.

Checkpoints are made by core.CheckpointSaver, by single-process torch DCP through
MemoryStorageWriter, and by a 2-rank gloo DCP save (tests/support/dcp_scenarios.py),
then listed, verified, corrupted, exported to a torch FileSystemWriter directory and
cleaned by `flashpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from ml_flashpoint_nemo.core import CheckpointSaver
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import open_object
from ml_flashpoint_nemo.core.versions import read_commit, write_commit
from ml_flashpoint_nemo.dcp import MemoryStorageWriter
from tests.support.dcp_scenarios import global_weights
from tests.support.forge import forge_commit, forge_header
from tests.support.multiproc import REPO, run_world

SHM = Path("/dev/shm")
_SCRIPT = Path(sys.executable).parent / "flashpoint"
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ml_flashpoint_nemo.cli"]


def flashpoint(*args: Any, module: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ml_flashpoint_nemo.cli"] if module else COMMAND
    env = dict(os.environ, OMP_NUM_THREADS="1", FLASHPOINT_COPY_THREADS="1")
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def fresh_base() -> Path:
    return SHM / f"flashpoint-cli-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tmp_base() -> Iterator[Path]:
    path = fresh_base()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def quiet_dcp(action: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return action()


def bits(value: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so that equality is bit equality (NaN, -0.0, float8 included)."""
    flat = value.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def assert_bit_exact(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    for name, want in expected.items():
        got = actual[name]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(bits(got), bits(want)), name
        elif isinstance(want, dict):
            assert_bit_exact(want, got)
        else:
            assert got == want, (name, got, want)


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            out[name] = torch.zeros(value.shape, dtype=value.dtype)
        elif isinstance(value, dict):
            out[name] = {k: None for k in value}
        else:
            out[name] = None
    return out


def load_export(dest: Path, state: dict[str, Any]) -> dict[str, Any]:
    quiet_dcp(lambda: dcp.load(state, storage_reader=FileSystemReader(str(dest)), no_dist=True))
    return state


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def record_offset(base: Path, step: int, key: str) -> tuple[Path, int]:
    layout = CheckpointLayout(base)
    record = read_commit(layout, step).objects[0]
    path = layout.object_path(step, record.name)
    with open_object(str(path), record) as obj:
        entry = next(e for e in obj.entries if e.key == key)
    return path, entry.offset


def make_uncommitted(base: Path, source_step: int, step: int) -> Path:
    """A half-written version: an object of another version copied in, no COMMIT."""
    directory = base / f"step-{step}"
    directory.mkdir()
    for obj in (base / f"step-{source_step}").glob("*.fpo"):
        shutil.copy(obj, directory / obj.name)
    return directory


def core_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen).to(torch.bfloat16),
            "blob": b"opaque bytes %d" % seed}


def dcp_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {
        "param": torch.nn.Parameter(torch.randn(6, 5, generator=gen)),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "half": torch.tensor([float("nan"), -0.0, 1.5], dtype=torch.float16),
        "f8": torch.randn(9, generator=gen).to(torch.float8_e4m3fn),
        "complex": torch.randn(4, generator=gen, dtype=torch.complex64),
        "mask": torch.rand(5, generator=gen) > 0.5,
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6, generator=gen).t(),
        "extra": {"note": "python object, saved by DCP as bytes", "epoch": 7},
    }


# --- a base with one intact, several corrupt and one half-written version (built once) -----------


@pytest.fixture(scope="module")
def damaged_base() -> Iterator[Path]:
    """Core versions: 1 intact, 2 flipped data byte, 3 truncated object, 4 flipped COMMIT, 5 intact; 6 uncommitted."""
    base = fresh_base()
    with CheckpointSaver(base) as saver:
        for step in range(1, 6):
            saver.save(step, core_state(step), keep=None)
    path, offset = record_offset(base, 2, "b")
    flip_byte(path, offset + 3)
    record = read_commit(CheckpointLayout(base), 3).objects[0]
    os.truncate(base / "step-3" / record.name, record.nbytes - 100)  # the file may be longer (a pool buffer)
    flip_byte(base / "step-4" / "COMMIT", 20)
    make_uncommitted(base, 5, 6)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_help_documents_the_exit_codes():
    result = flashpoint("--help")
    assert result.returncode == 0 and "exit codes" in result.stdout and "3  refused" in result.stdout
    module = flashpoint("clean", "--help", module=True)  # python -m ml_flashpoint_nemo.cli works too
    assert module.returncode == 0 and "--dry-run" in module.stdout and "exit codes" in module.stdout
    assert flashpoint("frobnicate").returncode == 2


def test_ls_of_missing_empty_and_foreign_directories(tmp_path):
    missing = flashpoint("ls", tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    listed = flashpoint("ls", empty)
    assert listed.returncode == 0 and "no versions" in listed.stdout
    doc = json.loads(flashpoint("ls", empty, "--json").stdout)
    assert doc["versions"] == [] and doc["pool"] == [] and doc["newest_committed"] is None
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    refused = flashpoint("ls", foreign)
    assert refused.returncode == 2 and "not a flashpoint base directory" in refused.stderr
    file_base = flashpoint("verify", foreign / "notes.txt")
    assert file_base.returncode == 2 and "not a directory" in file_base.stderr
    nothing = flashpoint("verify", empty)
    assert nothing.returncode == 2 and "nothing to verify" in nothing.stderr


def test_ls_lists_committed_unreadable_and_uncommitted_versions(damaged_base):
    doc = json.loads(flashpoint("ls", damaged_base, "--json").stdout)
    versions = {v["step"]: v for v in doc["versions"]}
    assert sorted(versions) == [1, 2, 3, 4, 5, 6]
    one = versions[1]
    assert one["state"] == "committed" and one["kind"] == "core" and one["world_size"] == 1
    assert one["ranks"] == [0] and one["objects"] == 1 and one["nbytes"] > 32 * 16 * 4
    assert one["created"] and one["replication"] is None and one["error"] is None
    four = versions[4]
    assert four["state"] == "unreadable" and four["committed"] and four["commit_readable"] is False
    assert "checksum" in four["error"]
    six = versions[6]
    assert six["state"] == "uncommitted" and not six["committed"] and six["objects"] == 1
    assert six["leftover"] is False  # newer than the newest committed version: maybe a save in progress
    assert doc["newest_committed"] == 5
    assert doc["pool"] == [{"rank": 0, "path": str(damaged_base / "pool" / "rank-00000"), "free_buffers": 0,
                            "nbytes": 0, "locked": False, "holder_pid": None}]
    text = flashpoint("ls", damaged_base)
    assert text.returncode == 0
    assert "uncommitted" in text.stdout and "unknown" in text.stdout and "commit record unreadable" in text.stdout


def test_verify_reports_each_corruption(damaged_base):
    result = flashpoint("verify", damaged_base, "--json", "--threads", "1")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["skipped_uncommitted"] == [6]
    versions = {v["step"]: v for v in doc["versions"]}
    assert sorted(versions) == [1, 2, 3, 4, 5]  # the uncommitted one is not verified as committed
    assert versions[1]["ok"] and versions[5]["ok"] and versions[1]["records"] == 3
    flipped = versions[2]["problems"]
    assert [(p["rank"], p["type"], p["key"]) for p in flipped] == [(0, "ChecksumError", "b")]
    assert "rank-00000-0.fpo" in flipped[0]["path"]
    assert "truncated" in versions[3]["problems"][0]["error"]
    assert versions[4]["problems"][0]["rank"] is None and "COMMIT" in versions[4]["problems"][0]["error"]

    intact = flashpoint("verify", damaged_base, 1)
    assert intact.returncode == 0 and "warning:" not in intact.stderr  # a private base: nothing to warn about
    named = flashpoint("verify", damaged_base, "step-2")
    assert named.returncode == 1 and "CORRUPT" in named.stdout and "'b'" in named.stdout
    commit = flashpoint("verify", damaged_base, 4)
    assert commit.returncode == 1 and "COMMIT fails its checksum" in commit.stdout
    uncommitted = flashpoint("verify", damaged_base, 6)
    assert uncommitted.returncode == 2 and "not committed" in uncommitted.stderr
    unknown = flashpoint("verify", damaged_base, 99)
    assert unknown.returncode == 2 and "no version of step 99" in unknown.stderr


def test_export_of_a_corrupt_version_fails_and_leaves_no_dest(damaged_base, tmp_path):
    dest = tmp_path / "export"
    result = flashpoint("export", damaged_base, 2, dest)
    assert result.returncode == 1 and "'b'" in result.stderr and "CRC32C" in result.stderr
    assert list(tmp_path.iterdir()) == []  # neither DEST nor its temporary directory
    assert flashpoint("export", damaged_base, 6, dest).returncode == 2  # uncommitted
    unreadable = flashpoint("export", damaged_base, 4, dest)  # its commit record fails its checksum
    assert unreadable.returncode == 1 and "COMMIT" in unreadable.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def newer_format_base() -> Iterator[Path]:
    """Core versions: 1 intact, 2 with a commit record of format v7, 3 with an object header of format v2."""
    base = fresh_base()
    with CheckpointSaver(base) as saver:
        for step in range(1, 4):
            saver.save(step, core_state(step), keep=None)
    forge_commit(base / "step-2" / "COMMIT", lambda commit: commit.update(format_version=7))
    forge_header(next((base / "step-3").glob("*.fpo")), lambda header: header.update(format_version=2))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_newer_format_is_reported_as_unsupported_not_corrupt(newer_format_base, tmp_path):
    before = {p: p.read_bytes() for p in newer_format_base.rglob("*") if p.is_file()}
    result = flashpoint("verify", newer_format_base, "--json", "--threads", "1")
    assert result.returncode == 5, result.stderr
    versions = {v["step"]: v for v in json.loads(result.stdout)["versions"]}
    assert versions[1]["ok"]
    commit_problems = versions[2]["problems"]
    assert [(p["rank"], p["kind"], p["type"]) for p in commit_problems] == [(None, "format", "FormatVersionError")]
    assert [(p["rank"], p["kind"]) for p in versions[3]["problems"]] == [(0, "format")]
    assert "format v2" in versions[3]["problems"][0]["error"]
    text = flashpoint("verify", newer_format_base, 2)
    assert text.returncode == 5 and "UNSUPPORTED FORMAT (not corrupt)" in text.stdout and "CORRUPT" not in text.stdout
    assert "format v7" in text.stdout and "release that wrote it" in text.stdout
    dest = tmp_path / "export"
    exported = flashpoint("export", newer_format_base, 3, dest)
    assert exported.returncode == 5 and "unsupported checkpoint format (not corrupt)" in exported.stderr
    assert "corrupt checkpoint" not in exported.stderr and list(tmp_path.iterdir()) == []
    listed = json.loads(flashpoint("ls", newer_format_base, "--json").stdout)
    two = next(v for v in listed["versions"] if v["step"] == 2)
    assert two["state"] == "unreadable" and "format v7" in two["error"]
    assert {p: p.read_bytes() for p in newer_format_base.rglob("*") if p.is_file()} == before  # nothing touched
    assert "5  unsupported format" in flashpoint("--help").stdout


# --- export round trips ------------------------------------------------------------------------------


def test_export_single_rank_dcp_version_round_trips_bit_exact(tmp_base, tmp_path):
    state = dcp_state()
    writer = MemoryStorageWriter(tmp_base)
    quiet_dcp(lambda: dcp.save(state, checkpoint_id=tmp_base / "step-3", storage_writer=writer))
    writer.close()
    dest = tmp_path / "dcp-export"
    dest.mkdir()
    (dest / "old.txt").write_text("something already here")
    refused = flashpoint("export", tmp_base, 3, dest)
    assert refused.returncode == 2 and "--force" in refused.stderr and (dest / "old.txt").exists()
    result = flashpoint("export", tmp_base, 3, dest, "--force", "--progress")
    assert result.returncode == 0, result.stderr
    assert "export step 3" in result.stderr and "100.0%" in result.stderr  # the progress bar
    assert not (dest / "old.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["dcp-export"]
    loaded = load_export(dest, zeros_like_state(state))
    expected = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    assert_bit_exact(expected, loaded)


def test_export_refuses_and_verify_warns_when_another_user_could_have_written_the_base(tmp_base, tmp_path):
    with CheckpointSaver(tmp_base) as saver:
        saver.save(2, {"x": torch.arange(4)})
    tmp_base.chmod(0o777)
    try:
        refused = flashpoint("export", tmp_base, 2, tmp_path / "out")
        assert refused.returncode == 2 and "not exported" in refused.stderr and "chmod 700" in refused.stderr
        assert not (tmp_path / "out").exists()
        verified = flashpoint("verify", tmp_base)
        assert verified.returncode == 0, verified.stderr
        assert "warning:" in verified.stderr and "writable by group or others" in verified.stderr
    finally:
        tmp_base.chmod(0o700)


def test_export_two_rank_sharded_dcp_version_round_trips_bit_exact(tmp_base, tmp_path):
    run_world("dcp_scenarios", "save_only", 2, {"base": str(tmp_base), "step": 4})
    listed = json.loads(flashpoint("ls", tmp_base, "--json").stdout)
    (version,) = listed["versions"]
    assert version["kind"] == "dcp" and version["world_size"] == 2 and version["ranks"] == [0, 1]
    assert [p["rank"] for p in listed["pool"]] == [0, 1]
    dest = tmp_path / "sharded"
    result = flashpoint("export", tmp_base, 4, dest)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a TTY
    metadata = FileSystemReader(str(dest)).read_metadata()
    chunks = metadata.state_dict_metadata["tp.weight"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (8, 0)]  # the sharding is kept
    full = global_weights(4)
    state: dict[str, Any] = {name: torch.zeros_like(t) for name, t in full.items()}
    state["extra"] = {"seed": None, "note": None}
    state["rank_local.0"] = torch.zeros(3)
    state["rank_local.1"] = torch.zeros(3)
    load_export(dest, state)
    assert_bit_exact(full, state)
    assert state["extra"] == {"seed": 4, "note": "python object, saved by DCP as bytes"}
    assert torch.equal(state["rank_local.0"], torch.full((3,), 40.0))
    assert torch.equal(state["rank_local.1"], torch.full((3,), 41.0))


def test_export_multi_rank_core_version_prefixes_rank_keys(tmp_base, tmp_path):
    states = {rank: core_state(20 + rank) for rank in (0, 1)}
    records = []
    for rank, state in states.items():
        with CheckpointSaver(tmp_base, rank) as saver:
            records.append(saver.write_object(7, state).record)
    write_commit(CheckpointLayout(tmp_base), 7, records, world_size=2)
    dest = tmp_path / "core"
    result = flashpoint("export", tmp_base, 7, dest)
    assert result.returncode == 0, result.stderr
    loaded = load_export(dest, {f"rank{r}/{k}": (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                                for r, s in states.items() for k, v in s.items()})
    for rank, state in states.items():
        for key, value in state.items():
            got = loaded[f"rank{rank}/{key}"]
            assert torch.equal(bits(got), bits(value)) if isinstance(value, torch.Tensor) else got == value


# --- clean -------------------------------------------------------------------------------------------


def tree(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.rglob("*"))


@pytest.fixture
def cluttered_base(tmp_base) -> Path:
    """Committed 1, 3, 4; uncommitted leftover 2; uncommitted 9 (newer); a stray commit temp file in 4."""
    with CheckpointSaver(tmp_base) as saver:
        for step in (1, 3, 4):
            saver.save(step, core_state(step), keep=None)
    make_uncommitted(tmp_base, 1, 2)
    make_uncommitted(tmp_base, 4, 9)
    (tmp_base / "step-4" / ".COMMIT.tmp-12345-abcdef01").write_bytes(b"{half a record")
    return tmp_base


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_clean_removes_exactly_what_a_saver_retires(cluttered_base, keep):
    """One retention policy: `flashpoint clean --keep K` and a saver's retire_superseded(keep=K) agree."""
    from ml_flashpoint_nemo.core.versions import retire_superseded

    dry = flashpoint("clean", cluttered_base, "--keep", keep, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    by_clean = sorted(a["step"] for a in json.loads(dry.stdout)["would_remove"] if a["what"] == "version")
    copy = fresh_base()
    try:
        shutil.copytree(cluttered_base, copy)
        assert retire_superseded(copy, keep=keep) == by_clean
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    assert by_clean == {1: [1, 2, 3], 2: [1, 2], 3: [2]}[keep]


def test_clean_dry_run_then_keep_two_then_keep_one(cluttered_base):
    base = cluttered_base
    before = tree(base)
    dry = flashpoint("clean", base, "--keep", "2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove step-1" in dry.stdout and "would remove step-2" in dry.stdout
    assert ".COMMIT.tmp-12345-abcdef01" in dry.stdout and "kept step-9" in dry.stdout
    assert tree(base) == before  # nothing changed

    result = flashpoint("clean", base, "--keep", "2", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert sorted({a["step"] for a in doc["removed"]}) == [1, 2, 4]  # 4: only its temp file
    assert [k["step"] for k in doc["kept_uncommitted"]] == [9]
    assert sorted(p.name for p in base.iterdir()) == ["pool", "step-3", "step-4", "step-9"]
    assert not (base / "step-4" / ".COMMIT.tmp-12345-abcdef01").exists()
    assert (base / "step-4" / "COMMIT").exists()

    again = flashpoint("clean", base)
    assert again.returncode == 0 and "removed step-3" in again.stdout
    assert sorted(p.name for p in base.iterdir()) == ["pool", "step-4", "step-9"]  # the newest stays
    assert flashpoint("verify", base, 4).returncode == 0
    assert "nothing to remove" in flashpoint("clean", base).stdout
    assert flashpoint("clean", base, "--keep", "0").returncode == 2


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["clean", "--dry-run"], ["clean", "--keep", "2"]])
def test_ls_and_clean_run_without_importing_torch(cluttered_base, command):
    """ls and clean read commit records and names only: they must not pay torch's 1-2 s import (an operator
    runs them by hand on a node), yet act exactly as the console script does."""
    code = ("import sys; from ml_flashpoint_nemo.cli import main; status = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code, command[0], str(cluttered_base), *command[1:]],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("no torch"), result.stdout
    if command[0] == "clean" and "--dry-run" not in command:
        assert sorted(p.name for p in cluttered_base.iterdir()) == ["pool", "step-3", "step-4", "step-9"]


def test_clean_refuses_while_a_live_process_holds_a_pool_lock(cluttered_base):
    base = cluttered_base
    holder = subprocess.Popen([sys.executable, "-m", "tests.support.cli_pool_holder", str(base), "1"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "READY"
        before = tree(base)
        for extra in ((), ("--dry-run",)):
            refused = flashpoint("clean", base, *extra)
            assert refused.returncode == 3, refused.stdout + refused.stderr
            assert "rank 1" in refused.stderr and "--force" in refused.stderr
        assert tree(base) == before
        pools = {p["rank"]: p for p in json.loads(flashpoint("ls", base, "--json").stdout)["pool"]}
        assert pools[1]["locked"] is True and pools[1]["holder_pid"] in (None, holder.pid)
        assert pools[0]["locked"] is False
        forced = flashpoint("clean", base, "--force")
        assert forced.returncode == 0, forced.stderr
        assert sorted(p.name for p in base.iterdir()) == ["pool", "step-4", "step-9"]
        assert (base / "step-4" / ".COMMIT.tmp-12345-abcdef01").exists()  # left alone while a rank is live
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert flashpoint("clean", base).returncode == 0  # the lock is free again
    assert not (base / "step-4" / ".COMMIT.tmp-12345-abcdef01").exists()
