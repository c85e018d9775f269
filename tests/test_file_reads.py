"""Loads from files whose pages may vanish or be huge.

- A file truncated while a read copies from it: the read raises ShortReadError (the loader's
  CorruptCheckpointError), never a SIGBUS that kills the process; every method, in a child
  process so that a SIGBUS on a broken build fails the test instead of killing pytest.
- The SIGBUS handler that makes this possible passes every other SIGBUS on: a fault outside a
  guarded copy, one sent with kill(), and Python's faulthandler installed after it.
- Huge pages where the tmpfs gives them (huge=within_size, huge=advise), 4 KiB pages where it
  does not (huge=never), and what read method `auto` picks for each. These mount their own tmpfs
  and need root; they are skipped without it.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo._core import ShmBuffer
from tests.support.smaps import mapping_kib
from tests.support.tmpfs import mounted_tmpfs

MiB = 1 << 20
HUGE_PAGE = 2 * MiB
THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")

# Child code: read one file while another thread truncates it as soon as the copy has begun.
# Both threads run on one CPU, so the scheduler switches between them during the copy; the
# truncation lands mid-read in (nearly) every attempt, and attempts repeat until one did.
READ_WHILE_TRUNCATED = r"""
import array, ctypes, json, os, threading
from ml_flashpoint_nemo import _core

def read_while_truncated(path, method, nbytes, attempts):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    pattern = bytes(range(1, 256)) * 4112  # no zero byte: a destination byte != 0 has been copied
    expected = (pattern * (nbytes // len(pattern) + 1))[:nbytes]
    for attempt in range(attempts):
        with open(path, "wb") as f:
            f.write(expected)
        fd = os.open(path, os.O_RDONLY)
        dst = bytearray(nbytes)
        address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(dst))
        def truncate_once_copying():
            while dst[0] == 0:
                pass
            os.truncate(path, 4096)
        truncator = threading.Thread(target=truncate_once_copying)
        truncator.start()
        ops = array.array("Q", [0, address, nbytes, nbytes])
        try:
            if method == "default":
                _core.read_file_into(fd, ops, True, 1)
            else:
                _core.read_file_into(fd, ops, True, 1, method)
            outcome = {"outcome": "complete", "exact": bytes(dst) == expected}
        except EOFError as exc:
            outcome = {"outcome": "error", "type": type(exc).__name__, "message": str(exc)}
        truncator.join()
        os.close(fd)
        print(json.dumps(outcome), flush=True)
        if outcome["outcome"] == "error":
            return outcome
    return None
"""

TRUNCATE_DURING_READ = READ_WHILE_TRUNCATED + r"""
import sys
read_while_truncated(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
"""


def run_child(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.parametrize("method", ["default", "auto", "map", "pread"])
def test_a_file_truncated_during_a_read_raises_instead_of_killing_the_process(shm_dir, method):
    result = run_child(TRUNCATE_DURING_READ, shm_dir / "object", method, 96 * MiB, 6)
    assert result.returncode == 0, f"the reader died (signal {-result.returncode}): {result.stderr[-2000:]}"
    outcomes = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(o["exact"] for o in outcomes if o["outcome"] == "complete"), outcomes
    errors = [o for o in outcomes if o["outcome"] == "error"]
    assert errors, f"no attempt was truncated mid-read: {outcomes}"
    assert errors[0]["type"] == "ShortReadError"
    assert "shrank while it was read" in errors[0]["message"] or "file ends at offset" in errors[0]["message"]


# A child that takes the guarded path once (installing the handler), then meets a SIGBUS of its
# own making outside any guarded copy, or one sent with kill().
FOREIGN_SIGBUS = READ_WHILE_TRUNCATED + r"""
import faulthandler, mmap, signal, sys, time

directory, how = sys.argv[1], sys.argv[2]
path = os.path.join(directory, "guarded")
with open(path, "wb") as f:
    f.write(b"\x01" * (8 << 20))
fd = os.open(path, os.O_RDONLY)
dst = bytearray(8 << 20)
address = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
_core.read_file_into(fd, array.array("Q", [0, address, len(dst), len(dst)]), True, 1, "map")
print("guarded read done", flush=True)
if how == "faulthandler":
    faulthandler.enable()  # replaces our handler; the next guarded read puts ours back in front of it
    error = read_while_truncated(os.path.join(directory, "truncated"), "map", 64 << 20, 6)
    print("second read:", error and error["message"], flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGBUS)
    time.sleep(30)  # not reached: the default action ends the process
else:
    victim = os.path.join(directory, "victim")
    with open(victim, "wb") as f:
        f.write(b"\x02" * (1 << 20))
    with open(victim, "r+b") as f:
        view = mmap.mmap(f.fileno(), 1 << 20)
        os.truncate(victim, 0)
        print("touching a page the file lost", flush=True)
        print(view[8192])  # SIGBUS outside any guarded copy: not ours
print("still alive", flush=True)
"""


@pytest.mark.parametrize("how", ["fault", "kill", "faulthandler"])
def test_other_sigbus_keep_their_default_or_earlier_handler(shm_dir, how):
    result = run_child(FOREIGN_SIGBUS, shm_dir, how, timeout=120)
    assert "guarded read done" in result.stdout, result.stderr[-2000:]
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "still alive" not in result.stdout
    if how == "faulthandler":
        assert "second read: the file shrank while it was read" in result.stdout, result.stdout
        assert "Bus error" in result.stderr, result.stderr[-2000:]  # faulthandler still saw the foreign fault


def test_an_unknown_read_method_is_refused(shm_dir):
    path = shm_dir / "file"
    path.write_bytes(b"\x01" * 4096)
    destination = bytearray(4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = ctypes.addressof((ctypes.c_char * 4096).from_buffer(destination))
        ops = array.array("Q", [0, address, 4096, 4096])
        with pytest.raises(ValueError, match="read method 'mmap' is unknown; use 'auto', 'map' or 'pread'"):
            _core.read_file_into(fd, ops, True, 1, "mmap")
        with pytest.raises(ValueError, match="unknown"):
            _core.checksum_file_ranges(fd, array.array("Q", [0, 4096]), 1, "")
        assert destination == bytearray(4096)
    finally:
        os.close(fd)


# --- huge pages ---------------------------------------------------------------------------------


def shmem_huge_pages_possible() -> bool:
    try:
        setting = THP_SHMEM.read_text()
    except OSError:
        return False
    return "[deny]" not in setting


@pytest.fixture(params=["within_size", "advise"])
def huge_tmpfs(request, tmp_path: Path) -> Iterator[Path]:
    """A tmpfs that gives huge pages: to every file (within_size) or to mappings that ask (advise)."""
    if not shmem_huge_pages_possible():
        pytest.skip(f"this kernel gives tmpfs no huge pages ({THP_SHMEM} missing or deny)")
    with mounted_tmpfs(tmp_path / "huge-tmpfs", "64m", f"huge={request.param}") as mount_point:
        yield mount_point


@pytest.fixture
def small_page_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "small-page-tmpfs", "64m", "huge=never") as mount_point:
        yield mount_point


def write_pattern(path: Path, nbytes: int) -> bytes:
    data = bytes((i * 7 + 3) & 0xFF for i in range(4096)) * (nbytes // 4096)
    path.write_bytes(data)
    return data


def read_all(path: Path, method: str, threads: int = 2) -> tuple[str, bytes, int]:
    nbytes = path.stat().st_size
    destination = bytearray(nbytes)
    address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(destination))
    fd = os.open(path, os.O_RDONLY)
    try:
        picked = _core.read_method_for(fd, 0, nbytes)
        crcs = _core.read_file_into(fd, array.array("Q", [0, address, nbytes, nbytes]), True, threads, method)
        assert _core.checksum_file_ranges(fd, array.array("Q", [0, nbytes]), threads, method) == crcs
    finally:
        os.close(fd)
    return picked, bytes(destination), crcs[0]


def assert_every_method_reads(path: Path, data: bytes, *, auto_picks: str) -> None:
    """Every read method reads path's data bit-exact with its CRC32C, and `auto` picks auto_picks for it."""
    for method in ("auto", "map", "pread"):
        picked, got, crc = read_all(path, method)
        assert picked == auto_picks
        assert got == data, method
        assert crc == _core.crc32c(data), method


def test_buffers_get_huge_pages_where_the_tmpfs_gives_them(huge_tmpfs):
    buffer = ShmBuffer.create(str(huge_tmpfs / "buf"), 16 * MiB)
    try:
        assert buffer.address % HUGE_PAGE == 0, "a mapping not on a 2 MiB boundary cannot use huge pages"
        buffer.prefault()
        assert mapping_kib(buffer.address, "ShmemPmdMapped") == 16 * 1024, "every page of the buffer is huge and mapped as such"
        with memoryview(buffer) as view:
            view[:] = b"\x11" * buffer.size
        buffer.grow(20 * MiB)
        assert buffer.address % HUGE_PAGE == 0, "a grown mapping stays on a 2 MiB boundary"
        with memoryview(buffer) as view:
            assert bytes(view[: 16 * MiB]) == b"\x11" * (16 * MiB)
    finally:
        buffer.close()


def write_as_a_save_does(path: Path, nbytes: int) -> bytes:
    """A pool buffer filled through its mapping: what an object file is."""
    data = bytes((i * 13 + 5) & 0xFF for i in range(4096)) * (nbytes // 4096)
    buffer = ShmBuffer.create(str(path), nbytes)
    try:
        with memoryview(buffer) as view:
            view[:] = data
    finally:
        buffer.close()
    return data


def test_auto_maps_files_of_huge_pages_and_reads_them_bit_exact(huge_tmpfs):
    data = write_as_a_save_does(huge_tmpfs / "object", 24 * MiB)
    assert_every_method_reads(huge_tmpfs / "object", data, auto_picks="map")


def test_small_pages_are_read_with_pread_and_buffers_work_without_huge_pages(small_page_tmpfs):
    buffer = ShmBuffer.create(str(small_page_tmpfs / "buf"), 16 * MiB)
    try:
        assert mapping_kib(buffer.address, "Rss") == 0, "without huge pages a new buffer is reserved, not mapped in"
        buffer.prefault()
        assert mapping_kib(buffer.address, "ShmemPmdMapped") == 0
        with memoryview(buffer) as view:
            view[:] = b"\x22" * buffer.size
    finally:
        buffer.close()
    assert (small_page_tmpfs / "buf").read_bytes() == b"\x22" * (16 * MiB)
    data = write_pattern(small_page_tmpfs / "object", 24 * MiB)
    assert_every_method_reads(small_page_tmpfs / "object", data, auto_picks="pread")


def test_auto_preads_reads_too_small_to_hold_a_huge_page(huge_tmpfs):
    data = write_as_a_save_does(huge_tmpfs / "small", 3 * MiB)
    fd = os.open(huge_tmpfs / "small", os.O_RDONLY)
    try:
        assert _core.read_method_for(fd, 0, len(data)) == "map"  # holds the aligned 2 MiB at 0
        assert _core.read_method_for(fd, 1, 2 * MiB) == "pread"  # no aligned 2 MiB inside
        assert _core.read_method_for(fd, 0, MiB) == "pread"
    finally:
        os.close(fd)
