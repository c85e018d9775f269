"""The C++ extension ``ml_flashpoint_nemo._core`` on its own: CRC32C, ShmBuffer and the copy engine.

Every test runs against the real kernel: buffers are real tmpfs files under /dev/shm, the
out-of-space tests mount a real 8 MiB tmpfs, and copies read from real torch tensor memory.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import random
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo._core import ShmBuffer
from tests.support.smaps import mapping_kib
from tests.support.tmpfs import mounted_tmpfs

PAGE = _core.page_size()
MiB = 1 << 20
LANE_BLOCK = 3 * 4096  # the hardware paths checksum three interleaved 4 KiB lanes at a time
PIECE = 4 * MiB  # the copy engine splits operations into pieces this big


# --- helpers and fixtures ---------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs, so that ENOSPC is the kernel's own answer. Mounting needs root."""
    with mounted_tmpfs(tmp_path / "tiny-tmpfs", "8m") as mount_point:
        yield mount_point


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC32C straight from the definition: independent of the C++ tables."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def ops_array(rows) -> array.array:
    flat = array.array("Q")
    for row in rows:
        flat.extend(row)
    return flat


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def random_tensor(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def memory_at(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes) if nbytes else b""


def buffer_bytes(buffer: ShmBuffer, offset: int = 0, nbytes: int | None = None) -> bytes:
    end = buffer.size if nbytes is None else offset + nbytes
    with memoryview(buffer) as view:
        return bytes(view[offset:end])


def read_only_buffer(path: Path, size: int) -> ShmBuffer:
    """A new buffer of `size` zero bytes at path, its writer closed, opened again read-only."""
    ShmBuffer.create(str(path), size).close()
    return ShmBuffer.open(str(path))


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bfree * stats.f_frsize


# --- CRC32C -----------------------------------------------------------------------------------


def test_crc32c_known_vectors():
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c_software(b"123456789") == 0xE3069283
    assert _core.crc32c(b"") == 0
    # RFC 3720 (iSCSI), appendix B.4.
    assert _core.crc32c(bytes(32)) == 0x8A9136AA
    assert _core.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert _core.crc32c(bytes(range(32))) == 0x46DD794E
    assert _core.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert _core.crc32c_backend() in {"avx512-vpclmul", "sse4.2", "armv8-crc", "software"}
    assert _core.crc32c_backend() == _core.crc32c_backends()[0]  # the fastest this CPU runs


FOLD_BLOCK = 256  # the carry-less folding path takes 256 bytes per iteration, 64 at the end


def fold_edge_lengths() -> list[int]:
    """Lengths at the edges of every path: lanes, fold blocks and cache lines, and the fold's minimum."""
    lengths = set(range(0, 80)) | {255, 256, 257, 447, 448, 449, 511, 512, 513, 575, 576, 577, 1023, 1024, 1025}
    for base in (LANE_BLOCK, 2 * FOLD_BLOCK, 4096, 256 * 1024, MiB):
        for k in (1, 2, 3):
            for delta in (-65, -64, -63, -1, 0, 1, 63, 64, 65):
                lengths.add(k * base + delta)
    return sorted(n for n in lengths if n >= 0)


def test_every_crc32c_backend_equals_the_software_one():
    """Each implementation this CPU can run, not only the one picked: known vectors, then every edge."""
    backends = _core.crc32c_backends()
    assert backends[-1] == "software"
    data = random_bytes(3 * MiB + 256, seed=11)
    view = memoryview(data)
    rng = random.Random(12)
    for backend in backends:
        assert _core.crc32c_using(backend, b"123456789") == 0xE3069283, backend
        assert _core.crc32c_using(backend, bytes(32)) == 0x8A9136AA, backend
        for n in fold_edge_lengths():
            start = rng.randrange(0, 130)
            crc = rng.randrange(0, 2**32)
            chunk = view[start : start + n]
            assert _core.crc32c_using(backend, chunk, crc) == _core.crc32c_software(chunk, crc), (backend, start, n)
    with pytest.raises(ValueError, match="not available on this CPU"):
        _core.crc32c_using("no-such-backend", b"abc")


def test_crc32c_matches_the_bitwise_definition_on_short_inputs():
    data = random_bytes(600, seed=1)
    for n in list(range(0, 70)) + [127, 128, 255, 256, 511, 600]:
        expected = crc32c_bitwise(data[:n])
        assert _core.crc32c(data[:n]) == expected, n
        assert _core.crc32c_software(data[:n]) == expected, n


def test_crc32c_hardware_equals_software_across_lengths_and_alignments():
    data = random_bytes(100_000 + 16, seed=2)
    lengths = set(range(0, 40)) | {100_000}
    for blocks in range(1, 6):
        for delta in (-9, -8, -7, -1, 0, 1, 7, 8, 9):
            lengths.add(blocks * LANE_BLOCK + delta)
    rng = random.Random(3)
    lengths |= {rng.randrange(0, 100_001) for _ in range(60)}
    view = memoryview(data)
    for start in range(8):
        for n in sorted(lengths):
            chunk = view[start : start + n]
            assert _core.crc32c(chunk) == _core.crc32c_software(chunk), (start, n)


def test_crc32c_accepts_any_contiguous_bytes_like_object():
    data = random_bytes(4096, seed=4)
    expected = _core.crc32c(data)
    assert _core.crc32c(bytearray(data)) == expected
    assert _core.crc32c(memoryview(data)) == expected
    assert _core.crc32c(array.array("I", data)) == expected
    assert _core.crc32c(memoryview(data).cast("B", (64, 64))) == expected  # 2-d, C-contiguous
    assert _core.crc32c(memoryview(data)[0:0]) == 0


@pytest.mark.parametrize("step", [2, -1, -3])
def test_crc32c_refuses_non_contiguous_views(step):
    """A strided view must never be checksummed as if its bytes were adjacent."""
    view = memoryview(random_bytes(1000, seed=5))[::step]
    with pytest.raises(ValueError):
        _core.crc32c(view)
    with pytest.raises(ValueError):
        _core.crc32c_software(view)


def test_crc32c_refuses_non_contiguous_2d_arrays():
    numpy = pytest.importorskip("numpy")
    matrix = numpy.arange(64 * 64, dtype=numpy.uint8).reshape(64, 64)
    assert _core.crc32c(matrix) == _core.crc32c(matrix.tobytes())
    with pytest.raises(ValueError):
        _core.crc32c(matrix.T)
    with pytest.raises(ValueError):
        _core.crc32c(matrix[:, ::2])


def test_crc32c_continuation_and_combine_at_lane_boundaries():
    data = random_bytes(10 * LANE_BLOCK + 123, seed=6)
    whole = _core.crc32c(data)
    for split in (0, 1, 7, 4096, LANE_BLOCK - 1, LANE_BLOCK, LANE_BLOCK + 1, 5 * LANE_BLOCK + 3, len(data)):
        a, b = data[:split], data[split:]
        assert _core.crc32c(b, _core.crc32c(a)) == whole, split
        assert _core.crc32c_software(b, _core.crc32c_software(a)) == whole, split
        assert _core.crc32c_combine(_core.crc32c(a), _core.crc32c(b), len(b)) == whole, split


def test_crc32c_combine_with_long_runs_of_zeros():
    head = random_bytes(1000, seed=7)
    for n in (1, 4095, 4096, 65536, 3 * MiB + 5):
        zeros = bytes(n)
        combined = _core.crc32c_combine(_core.crc32c(head), _core.crc32c(zeros), n)
        assert combined == _core.crc32c(head + zeros), n


@settings(max_examples=300, deadline=None)
@given(a=st.binary(max_size=3 * LANE_BLOCK + 64), b=st.binary(max_size=3 * LANE_BLOCK + 64))
def test_crc32c_continuation_property(a, b):
    assert _core.crc32c(b, _core.crc32c(a)) == _core.crc32c(a + b)
    assert _core.crc32c(a + b) == _core.crc32c_software(a + b)


@settings(max_examples=300, deadline=None)
@given(a=st.binary(max_size=2 * LANE_BLOCK), b=st.binary(max_size=4 * LANE_BLOCK))
def test_crc32c_combine_property(a, b):
    assert _core.crc32c_combine(_core.crc32c(a), _core.crc32c(b), len(b)) == _core.crc32c(a + b)


@settings(max_examples=300, deadline=None)
@given(
    crc_a=st.integers(0, 2**32 - 1),
    crc_b=st.integers(0, 2**32 - 1),
    crc_c=st.integers(0, 2**32 - 1),
    # Any 64-bit total length: the table of x^(2^k) covers every bit of a byte count.
    len_b=st.integers(0, 2**63 - 1),
    len_c=st.integers(0, 2**63 - 1),
)
def test_crc32c_combine_is_associative_for_huge_lengths(crc_a, crc_b, crc_c, len_b, len_c):
    """(A||B)||C == A||(B||C): checks the x^(8n) powers for lengths far too long to checksum."""
    # The CRC of an empty part is 0 (combine returns crc_a unchanged for len_b == 0).
    crc_b = crc_b if len_b else 0
    crc_c = crc_c if len_c else 0
    left = _core.crc32c_combine(_core.crc32c_combine(crc_a, crc_b, len_b), crc_c, len_c)
    right = _core.crc32c_combine(crc_a, _core.crc32c_combine(crc_b, crc_c, len_c), len_b + len_c)
    assert left == right


# --- ShmBuffer --------------------------------------------------------------------------------


@pytest.mark.parametrize("requested, expected", [(0, PAGE), (1, PAGE), (PAGE, PAGE), (PAGE + 1, 2 * PAGE)])
def test_create_rounds_up_to_pages_and_allocates(shm_dir, requested, expected):
    path = shm_dir / "buf"
    buffer = ShmBuffer.create(str(path), requested)
    try:
        assert buffer.size == expected
        assert buffer.path == str(path)
        assert buffer.writable and not buffer.closed
        assert buffer.address != 0 and buffer.address % PAGE == 0
        stat = path.stat()
        assert stat.st_size == expected
        assert stat.st_blocks * 512 >= expected  # reserved up front, not a sparse file
        assert stat.st_mode & 0o777 == 0o600
        assert buffer_bytes(buffer) == bytes(expected)
        assert str(path) in repr(buffer)
    finally:
        buffer.close()


def test_create_allocates_large_buffers_up_front(shm_dir):
    path = shm_dir / "big"
    buffer = ShmBuffer.create(str(path), 32 * MiB + 1)
    try:
        assert buffer.size == 32 * MiB + PAGE
        assert path.stat().st_blocks * 512 >= buffer.size
        assert mapping_kib(buffer.address, "Rss") == 0  # reserved, but not yet mapped in
    finally:
        buffer.close()


def test_create_refuses_an_existing_path_and_leaves_it_alone(shm_dir):
    path = shm_dir / "buf"
    first = ShmBuffer.create(str(path), PAGE)
    try:
        with memoryview(first) as view:
            view[:5] = b"first"
        with pytest.raises(FileExistsError) as info:
            ShmBuffer.create(str(path), 2 * PAGE)
        assert info.value.errno == errno.EEXIST
        assert info.value.filename == str(path)
        assert path.stat().st_size == PAGE
        assert path.read_bytes()[:5] == b"first"
        assert buffer_bytes(first, 0, 5) == b"first"
    finally:
        first.close()


def test_create_and_open_report_missing_paths(shm_dir):
    with pytest.raises(FileNotFoundError) as info:
        ShmBuffer.create(str(shm_dir / "no-such-dir" / "buf"), PAGE)
    assert info.value.errno == errno.ENOENT
    with pytest.raises(FileNotFoundError):
        ShmBuffer.open(str(shm_dir / "missing"))
    with pytest.raises(FileNotFoundError):
        ShmBuffer.open(str(shm_dir / "missing"), writable=True)


def test_memoryview_writes_reach_the_file_and_other_mappings(shm_dir):
    path = shm_dir / "buf"
    payload = random_bytes(3 * PAGE, seed=10)
    writer = ShmBuffer.create(str(path), len(payload))
    reader = ShmBuffer.open(str(path))
    try:
        with memoryview(writer) as view:
            assert not view.readonly
            assert view.nbytes == writer.size
            view[:] = payload
            view[PAGE + 3 : PAGE + 8] = b"hello"
        expected = payload[: PAGE + 3] + b"hello" + payload[PAGE + 8 :]
        assert buffer_bytes(writer) == expected
        assert buffer_bytes(reader) == expected  # MAP_SHARED: one page cache
        with open(path, "rb") as handle:
            assert handle.read() == expected
    finally:
        reader.close()
        writer.close()


def test_open_read_only_maps_existing_content(shm_dir):
    path = shm_dir / "buf"
    payload = random_bytes(2 * PAGE, seed=11)
    writer = ShmBuffer.create(str(path), len(payload))
    with memoryview(writer) as view:
        view[:] = payload
    writer.close()

    reader = ShmBuffer.open(str(path))
    try:
        assert not reader.writable and reader.size == 2 * PAGE and reader.path == str(path)
        with memoryview(reader) as view:
            assert view.readonly
            assert bytes(view) == payload
            with pytest.raises(TypeError):
                view[0] = 1
    finally:
        reader.close()


def test_read_only_buffer_refuses_writable_views(shm_dir):
    path = shm_dir / "buf"
    ShmBuffer.create(str(path), PAGE).close()
    reader = ShmBuffer.open(str(path), writable=False)
    try:
        # Ask for a writable view through the raw buffer protocol (PyBUF_WRITABLE == 1).
        get_buffer = ctypes.pythonapi.PyObject_GetBuffer
        get_buffer.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
        get_buffer.restype = ctypes.c_int
        raw_view = ctypes.create_string_buffer(256)  # larger than a Py_buffer
        with pytest.raises(BufferError, match="read-only"):
            get_buffer(reader, ctypes.addressof(raw_view), 1)
        with pytest.raises(TypeError):
            (ctypes.c_char * PAGE).from_buffer(reader)
    finally:
        # None of the refused requests may leave an export behind.
        reader.close()
        assert reader.closed


def test_open_read_only_refuses_files_that_are_not_buffers(shm_dir):
    empty = shm_dir / "empty"
    empty.write_bytes(b"")
    odd = shm_dir / "odd"
    odd.write_bytes(b"x" * (PAGE + 1))
    for path in (empty, odd):
        with pytest.raises(ValueError):
            ShmBuffer.open(str(path))


def test_open_writable_rounds_up_and_allocates(shm_dir):
    path = shm_dir / "odd"
    path.write_bytes(b"abc")
    buffer = ShmBuffer.open(str(path), writable=True)
    try:
        assert buffer.writable and buffer.size == PAGE
        assert buffer_bytes(buffer, 0, 4) == b"abc\0"
        assert path.stat().st_size == PAGE
        assert path.stat().st_blocks * 512 >= PAGE
    finally:
        buffer.close()


def test_grow_keeps_content_and_extends(shm_dir):
    path = shm_dir / "buf"
    payload = random_bytes(2 * PAGE, seed=12)
    buffer = ShmBuffer.create(str(path), len(payload))
    try:
        with memoryview(buffer) as view:
            view[:] = payload
        buffer.grow(5 * PAGE + 1)
        assert buffer.size == 6 * PAGE
        assert path.stat().st_size == 6 * PAGE
        assert path.stat().st_blocks * 512 >= 6 * PAGE
        assert buffer_bytes(buffer) == payload + bytes(4 * PAGE)
        with memoryview(buffer) as view:
            view[-4:] = b"tail"
        assert path.read_bytes()[-4:] == b"tail"

        buffer.grow(PAGE)  # never shrinks
        assert buffer.size == 6 * PAGE
        buffer.grow(40 * MiB)  # large enough that mremap has to move the mapping
        assert buffer.size == 40 * MiB
        assert buffer_bytes(buffer, 0, len(payload)) == payload
        assert buffer_bytes(buffer, 6 * PAGE - 4, 4) == b"tail"
    finally:
        buffer.close()


def test_grow_is_refused_while_views_exist(shm_dir):
    buffer = ShmBuffer.create(str(shm_dir / "buf"), PAGE)
    try:
        view = memoryview(buffer)
        with pytest.raises(BufferError):
            buffer.grow(2 * PAGE)
        with pytest.raises(_core.BufferBusyError):
            buffer.grow(2 * PAGE)
        assert buffer.size == PAGE
        view[0] = 7  # the mapping did not move under the view
        view.release()
        buffer.grow(2 * PAGE)
        assert buffer.size == 2 * PAGE
        assert buffer_bytes(buffer, 0, 1) == b"\x07"
    finally:
        buffer.close()


def test_grow_of_a_read_only_buffer_is_refused(shm_dir):
    reader = read_only_buffer(shm_dir / "buf", PAGE)
    try:
        with pytest.raises(ValueError):
            reader.grow(2 * PAGE)
        assert reader.size == PAGE
    finally:
        reader.close()


def test_prefault_maps_the_pages_in_without_changing_them(shm_dir):
    size = 4 * MiB
    buffer = ShmBuffer.create(str(shm_dir / "buf"), size)
    try:
        assert mapping_kib(buffer.address, "Rss") == 0
        buffer.prefault(0, 256 * 1024)
        assert mapping_kib(buffer.address, "Rss") >= 256
        assert mapping_kib(buffer.address, "Rss") < size // 1024
        buffer.prefault(3 * MiB + 5)  # to the end, from an unaligned offset
        buffer.prefault()
        assert mapping_kib(buffer.address, "Rss") == size // 1024
        assert buffer_bytes(buffer) == bytes(size)  # the write-faults did not change a byte

        with memoryview(buffer) as view:
            view[: 3 * PAGE] = random_bytes(3 * PAGE, seed=13)
        before = buffer_bytes(buffer)
        buffer.prefault()
        buffer.prefault(size, 10)  # past the end: nothing to do
        buffer.prefault(size + 12345)
        buffer.prefault(5, 0)
        assert buffer_bytes(buffer) == before
    finally:
        buffer.close()


def test_prefault_on_a_read_only_buffer(shm_dir):
    reader = read_only_buffer(shm_dir / "buf", 2 * MiB)
    try:
        reader.prefault()
        assert mapping_kib(reader.address, "Rss") == 2 * MiB // 1024
    finally:
        reader.close()


def test_rename_keeps_the_mapping_valid(shm_dir):
    old = shm_dir / "old"
    new = shm_dir / "sub" / "new"
    new.parent.mkdir()
    buffer = ShmBuffer.create(str(old), PAGE)
    try:
        with memoryview(buffer) as view:
            view[:6] = b"before"
        buffer.rename_to(str(new))
        assert buffer.path == str(new)
        assert not old.exists() and new.exists()
        with memoryview(buffer) as view:
            assert bytes(view[:6]) == b"before"
            view[6:11] = b"after"
        assert new.read_bytes()[:11] == b"beforeafter"

        with pytest.raises(FileNotFoundError):
            buffer.rename_to(str(shm_dir / "missing-dir" / "x"))
        assert buffer.path == str(new) and new.exists()
        # A rename works while views exist: the mapping does not move.
        with memoryview(buffer) as view:
            buffer.rename_to(str(old))
            view[0] = ord("B")
        assert old.read_bytes()[:6] == b"Before"
    finally:
        buffer.close()


def test_close_waits_for_views_to_be_released(shm_dir):
    path = shm_dir / "buf"
    buffer = ShmBuffer.create(str(path), PAGE)
    first = memoryview(buffer)
    second = memoryview(buffer)
    with pytest.raises(BufferError):
        buffer.close()
    first.release()
    with pytest.raises(_core.BufferBusyError):
        buffer.close()
    assert not buffer.closed
    second[0] = 42  # still mapped after the refused closes
    second.release()
    buffer.close()
    assert buffer.closed
    assert "closed" in repr(buffer)
    buffer.close()  # a second close is harmless
    assert buffer.closed
    assert path.read_bytes()[0] == 42  # closing unmaps; the file stays


def test_a_view_of_a_view_keeps_the_buffer_busy(shm_dir):
    buffer = ShmBuffer.create(str(shm_dir / "buf"), PAGE)
    outer = memoryview(buffer)
    inner = outer[10:20].cast("B")
    outer.release()  # inner still holds the one export
    with pytest.raises(BufferError):
        buffer.close()
    inner.release()
    buffer.close()
    assert buffer.closed


def test_operations_on_a_closed_buffer_raise(shm_dir):
    path = shm_dir / "buf"
    buffer = ShmBuffer.create(str(path), PAGE)
    source = torch.zeros(16, dtype=torch.uint8)
    buffer.close()
    assert buffer.size == PAGE and buffer.path == str(path)
    with pytest.raises(ValueError):
        memoryview(buffer)
    with pytest.raises(RuntimeError):
        buffer.grow(2 * PAGE)
    with pytest.raises(RuntimeError):
        buffer.prefault()
    with pytest.raises(RuntimeError):
        buffer.rename_to(str(shm_dir / "elsewhere"))
    assert path.exists() and not (shm_dir / "elsewhere").exists()
    with pytest.raises(RuntimeError):
        _core.copy_into_buffer(buffer, ops_array([(source.data_ptr(), 0, 16)]))
    with pytest.raises(RuntimeError):
        _core.checksum_buffer_ranges(buffer, ops_array([(0, 16)]))
    buffer.close()


# --- out of space -----------------------------------------------------------------------------


def test_create_on_a_full_tmpfs_raises_enospc_and_leaves_nothing(tiny_tmpfs):
    free_before = free_bytes(tiny_tmpfs)
    with pytest.raises(OSError) as info:
        ShmBuffer.create(str(tiny_tmpfs / "huge"), 64 * MiB)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(tiny_tmpfs / "huge")
    assert os.listdir(tiny_tmpfs) == []

    # Fails part-way through the allocation: the pages it got are given back too.
    filler = ShmBuffer.create(str(tiny_tmpfs / "filler"), 6 * MiB)
    try:
        free_with_filler = free_bytes(tiny_tmpfs)
        with pytest.raises(OSError) as info:
            ShmBuffer.create(str(tiny_tmpfs / "second"), 4 * MiB)
        assert info.value.errno == errno.ENOSPC
        assert os.listdir(tiny_tmpfs) == ["filler"]
        assert free_bytes(tiny_tmpfs) == free_with_filler
    finally:
        filler.close()
    os.unlink(tiny_tmpfs / "filler")
    assert free_bytes(tiny_tmpfs) == free_before


def test_open_writable_reserves_space_for_sparse_files(tiny_tmpfs):
    sparse = tiny_tmpfs / "sparse"
    with open(sparse, "wb") as handle:
        handle.truncate(32 * MiB)
    with pytest.raises(OSError) as info:
        ShmBuffer.open(str(sparse), writable=True)
    assert info.value.errno == errno.ENOSPC
    assert sparse.exists()  # not ours to delete


def test_grow_beyond_the_space_raises_enospc_and_keeps_the_buffer(tiny_tmpfs):
    other = ShmBuffer.create(str(tiny_tmpfs / "other"), 4 * MiB)
    buffer = ShmBuffer.create(str(tiny_tmpfs / "buf"), 2 * MiB)
    payload = random_bytes(2 * MiB, seed=20)
    try:
        with memoryview(buffer) as view:
            view[:] = payload
        free_before = free_bytes(tiny_tmpfs)
        # 64 MiB can never fit; 5 MiB fails part-way (3 MiB more wanted, under 2 MiB free).
        for new_size in (64 * MiB, 5 * MiB):
            with pytest.raises(OSError) as info:
                buffer.grow(new_size)
            assert info.value.errno == errno.ENOSPC, new_size
            assert buffer.size == 2 * MiB
            assert (tiny_tmpfs / "buf").stat().st_size == 2 * MiB
            assert buffer_bytes(buffer) == payload
            assert free_bytes(tiny_tmpfs) == free_before

        # Writing every page of both buffers is safe: no page was left unbacked (no SIGBUS).
        with memoryview(buffer) as view:
            view[:] = bytes(reversed(payload))
        with memoryview(other) as view:
            view[:] = b"\x5a" * other.size
        assert buffer_bytes(buffer) == bytes(reversed(payload))
        assert buffer_bytes(other, 0, 16) == b"\x5a" * 16

        # Once there is room, the same grow succeeds and keeps the content.
        other.close()
        os.unlink(tiny_tmpfs / "other")
        buffer.grow(5 * MiB)
        assert buffer.size == 5 * MiB
        assert buffer_bytes(buffer, 0, 2 * MiB) == bytes(reversed(payload))
        with memoryview(buffer) as view:
            view[-1] = 1
    finally:
        other.close()
        buffer.close()


# --- copy_into_buffer -------------------------------------------------------------------------


def build_copy_case(seed: int):
    """Random ops: thousands of tiny ones, empty ones, and ones bigger than a piece."""
    rng = random.Random(seed)
    sizes = [0, 1, 7, 8, 65535, 65536, 65537, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 13, 3 * LANE_BLOCK + 5]
    sizes += [rng.randint(1, 64) for _ in range(3000)]
    sizes += [rng.randint(0, 300_000) for _ in range(20)]
    sizes += [0] * 10
    rng.shuffle(sizes)
    pool = random_tensor(max(sizes) + 64, seed)
    sources: list[tuple[int, int]] = []  # (address, nbytes)
    for n in sizes:
        start = rng.randint(0, 63)  # unaligned sources
        sources.append((pool.data_ptr() + start, n))
    # Tensors of other dtypes, copied whole.
    extras = [
        torch.randn(1000, generator=torch.Generator().manual_seed(seed)),
        torch.arange(777, dtype=torch.int64),
        torch.randn(333, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16),
    ]
    for tensor in extras:
        sources.append((tensor.data_ptr(), tensor.nbytes))
    ops, offset = [], 0
    for address, n in sources:
        offset += rng.randint(0, 15)  # unaligned destinations, with untouched gaps
        ops.append((address, offset, n))
        offset += n
    return ops, offset, (pool, extras)


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_into_buffer_copies_and_checksums(shm_dir, threads):
    ops, end, keep_alive = build_copy_case(seed=30 + threads)
    assert end > 8 * MiB  # above the single-thread cut-off, so threads really run
    buffer = ShmBuffer.create(str(shm_dir / "buf"), end)
    try:
        crcs = _core.copy_into_buffer(buffer, ops_array(ops), True, threads)
        assert len(crcs) == len(ops)
        expected = bytearray(buffer.size)
        for (address, offset, n), crc in zip(ops, crcs):
            source = memory_at(address, n)
            expected[offset : offset + n] = source
            assert crc == _core.crc32c(source), (offset, n)
        assert buffer_bytes(buffer) == bytes(expected)
        # Spot-check the per-op CRCs of the split ops against the software reference.
        for (address, _, n), crc in zip(ops, crcs):
            if n > PIECE:
                assert crc == _core.crc32c_software(memory_at(address, n))
    finally:
        buffer.close()
    del keep_alive


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_into_buffer_without_checksums_returns_zeros(shm_dir, threads):
    ops, end, keep_alive = build_copy_case(seed=40 + threads)
    buffer = ShmBuffer.create(str(shm_dir / "buf"), end)
    try:
        crcs = _core.copy_into_buffer(buffer, ops_array(ops), checksum=False, threads=threads)
        assert crcs == [0] * len(ops)
        with memoryview(buffer) as view:
            for address, offset, n in ops:
                assert view[offset : offset + n] == memory_at(address, n)
    finally:
        buffer.close()
    del keep_alive


def test_copy_into_buffer_edge_cases(shm_dir):
    buffer = ShmBuffer.create(str(shm_dir / "buf"), PAGE)
    source = random_tensor(PAGE, seed=50)
    try:
        assert _core.copy_into_buffer(buffer, array.array("Q")) == []
        # Empty ops need no valid address and may sit at the very end.
        assert _core.copy_into_buffer(buffer, ops_array([(0, PAGE, 0), (0, 0, 0)])) == [0, 0]
        # The whole buffer, exactly; threads < 1 means one thread.
        for threads in (0, -3, 64):
            crcs = _core.copy_into_buffer(buffer, ops_array([(source.data_ptr(), 0, PAGE)]), True, threads)
            assert crcs == [_core.crc32c(memory_at(source.data_ptr(), PAGE))]
        assert buffer_bytes(buffer) == memory_at(source.data_ptr(), PAGE)
    finally:
        buffer.close()


def test_copy_into_buffer_refuses_out_of_bounds_ops_before_copying(shm_dir):
    buffer = ShmBuffer.create(str(shm_dir / "buf"), PAGE)
    source = random_tensor(2 * PAGE, seed=51)
    address = source.data_ptr()
    try:
        bad_ops = [
            (address, PAGE - 10, 11),
            (address, 0, PAGE + 1),
            (address, PAGE + 1, 0),
            (address, 2**64 - 1, 2),  # offset + nbytes wraps around
            (address, 1, 2**64 - 1),
        ]
        for bad in bad_ops:
            # A valid op first: nothing may be copied when any op is out of bounds.
            with pytest.raises(IndexError):
                _core.copy_into_buffer(buffer, ops_array([(address, 0, 100), bad]), True, 2)
            assert buffer_bytes(buffer) == bytes(PAGE), bad
    finally:
        buffer.close()


def test_copy_into_buffer_refuses_malformed_op_lists(shm_dir):
    buffer = ShmBuffer.create(str(shm_dir / "buf"), PAGE)
    source = torch.zeros(8, dtype=torch.uint8)
    try:
        with pytest.raises(ValueError):
            _core.copy_into_buffer(buffer, array.array("Q", [source.data_ptr(), 0]))  # not a multiple of 3
        with pytest.raises(ValueError):
            _core.copy_into_buffer(buffer, array.array("I", [0, 0, 0]))  # 32-bit items
        with pytest.raises(ValueError):
            _core.copy_into_buffer(buffer, array.array("d", [0.0, 0.0, 0.0]))  # 8-byte floats, not uint64
        with pytest.raises(ValueError):
            _core.copy_into_buffer(buffer, memoryview(array.array("Q", [0] * 6))[::2])  # strided
        with pytest.raises(TypeError):
            _core.copy_into_buffer(buffer, [source.data_ptr(), 0, 8])  # not a buffer
    finally:
        buffer.close()


def test_copy_into_a_read_only_buffer_is_refused(shm_dir):
    reader = read_only_buffer(shm_dir / "buf", PAGE)
    source = torch.ones(16, dtype=torch.uint8)
    try:
        with pytest.raises(ValueError, match="read-only"):
            _core.copy_into_buffer(reader, ops_array([(source.data_ptr(), 0, 16)]))
        assert buffer_bytes(reader, 0, 16) == bytes(16)
    finally:
        reader.close()


# --- reading files, checksumming ranges -------------------------------------------------------


def build_read_ops(file_size: int, seed: int):
    """(file_offset, nbytes) ranges: empty, tiny, > one read chunk and > one piece, unaligned."""
    rng = random.Random(seed)
    ranges = [(0, 0), (file_size, 0), (0, 1), (file_size - 1, 1), (3, PIECE + 257 * 1024 + 1), (5, 256 * 1024)]
    ranges += [(rng.randrange(0, file_size - 64), rng.randint(0, 64)) for _ in range(500)]
    ranges += [(o, rng.randint(0, file_size - o)) for o in (rng.randrange(0, file_size) for _ in range(4))]
    return ranges


READ_METHODS = ["auto", "map", "pread"]


@pytest.mark.parametrize("method", READ_METHODS)
@pytest.mark.parametrize("threads", [1, 2])
def test_read_file_into_tensors(shm_dir, threads, method):
    file_size = 9 * MiB + 123
    data = random_bytes(file_size, seed=60)
    path = shm_dir / "file"
    path.write_bytes(data)
    ranges = build_read_ops(file_size, seed=61 + threads)
    destinations = [torch.empty(n, dtype=torch.uint8) for _, n in ranges]
    ops = [(offset, dest.data_ptr(), n, n) for (offset, n), dest in zip(ranges, destinations)]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = _core.read_file_into(fd, ops_array(ops), True, threads, method)
        assert len(crcs) == len(ops)
        for (offset, n), dest, crc in zip(ranges, destinations, crcs):
            expected = data[offset : offset + n]
            assert memory_at(dest.data_ptr(), n) == expected, (offset, n)
            assert crc == _core.crc32c(expected), (offset, n)

        for dest in destinations:
            dest.zero_()
        assert _core.read_file_into(fd, ops_array(ops), checksum=False, threads=threads, method=method) == [0] * len(ops)
        for (offset, n), dest in zip(ranges, destinations):
            assert memory_at(dest.data_ptr(), n) == data[offset : offset + n]

        # Straight into a float tensor's memory.
        floats = torch.randn(1000)
        path2 = shm_dir / "floats"
        path2.write_bytes(memory_at(floats.data_ptr(), floats.nbytes))
        target = torch.empty_like(floats)
        fd2 = os.open(path2, os.O_RDONLY)
        try:
            _core.read_file_into(fd2, ops_array([(0, target.data_ptr(), target.nbytes, target.nbytes)]), True, threads,
                                 method)
        finally:
            os.close(fd2)
        assert torch.equal(target, floats)
    finally:
        os.close(fd)


@pytest.mark.parametrize("method", READ_METHODS)
@pytest.mark.parametrize("threads", [1, 2])
def test_reading_past_the_end_raises_short_read(shm_dir, threads, method):
    path = shm_dir / "file"
    path.write_bytes(random_bytes(10 * MiB, seed=62))
    destination = torch.empty(11 * MiB, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert issubclass(_core.ShortReadError, EOFError)
        for offset, n in [(10 * MiB - 10, 20), (10 * MiB, 1), (0, 10 * MiB + 1), (20 * MiB, 5)]:
            destination.fill_(0x77)
            fine = (0, destination.data_ptr(), MiB, destination.nbytes)  # refused with the bad one
            with pytest.raises(EOFError) as info:
                _core.read_file_into(fd, ops_array([fine, (offset, destination.data_ptr(), n, destination.nbytes)]),
                                     True, threads, method)
            assert isinstance(info.value, _core.ShortReadError)
            assert bool((destination == 0x77).all()), "a refused read must not have written any byte"
            with pytest.raises(_core.ShortReadError):
                _core.checksum_file_ranges(fd, ops_array([(offset, n)]), threads, method)
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_read_longer_than_its_destination_is_refused_before_any_byte_moves(shm_dir, threads):
    path = shm_dir / "file"
    path.write_bytes(random_bytes(2 * MiB, seed=63))
    arena = torch.full((3 * MiB,), 0xAB, dtype=torch.uint8)  # destination, then memory that must stay untouched
    destination = arena[: MiB]
    fd = os.open(path, os.O_RDONLY)
    try:
        fine = ops_array([(0, destination.data_ptr(), MiB, MiB)])
        over = ops_array([(0, destination.data_ptr(), 64, 64), (MiB, destination.data_ptr(), MiB + 1, MiB)])
        with pytest.raises(IndexError, match="overruns its destination of 1048576 bytes"):
            _core.read_file_into(fd, over, True, threads)
        assert bool((arena == 0xAB).all()), "no op of a refused call may run"
        _core.read_file_into(fd, fine, True, threads)
        assert bool((arena[MiB:] == 0xAB).all())
        with pytest.raises(ValueError, match="multiple of 4"):
            _core.read_file_into(fd, ops_array([(0, destination.data_ptr(), 16)]), True, threads)
    finally:
        os.close(fd)


def test_read_file_into_reports_a_bad_fd():
    destination = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(OSError) as info:
        _core.read_file_into(-1, ops_array([(0, destination.data_ptr(), 16, 16)]))
    assert info.value.errno == errno.EBADF
    with pytest.raises(OSError) as info:
        _core.checksum_file_ranges(-1, ops_array([(0, 16)]))
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("method", READ_METHODS)
@pytest.mark.parametrize("threads", [1, 2])
def test_checksum_file_ranges(shm_dir, threads, method):
    file_size = 9 * MiB + 77
    data = random_bytes(file_size, seed=63)
    path = shm_dir / "file"
    path.write_bytes(data)
    ranges = build_read_ops(file_size, seed=64 + threads) + [(0, file_size)]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = _core.checksum_file_ranges(fd, ops_array(ranges), threads, method)
    finally:
        os.close(fd)
    assert crcs == [_core.crc32c(data[offset : offset + n]) for offset, n in ranges]


@pytest.mark.parametrize("threads", [1, 2])
def test_checksum_buffer_ranges(shm_dir, threads):
    size = 9 * MiB
    data = random_bytes(size, seed=65)
    path = shm_dir / "buf"
    buffer = ShmBuffer.create(str(path), size)
    try:
        with memoryview(buffer) as view:
            view[:] = data
        ranges = build_read_ops(size, seed=66 + threads) + [(0, size)]
        expected = [_core.crc32c(data[offset : offset + n]) for offset, n in ranges]
        assert _core.checksum_buffer_ranges(buffer, ops_array(ranges), threads) == expected
        with pytest.raises(IndexError):
            _core.checksum_buffer_ranges(buffer, ops_array([(0, 1), (size - 1, 2)]), threads)
        with pytest.raises(IndexError):
            _core.checksum_buffer_ranges(buffer, ops_array([(2**64 - 1, 2)]), threads)
    finally:
        buffer.close()
    reader = ShmBuffer.open(str(path))  # read-only buffers can be checksummed too
    try:
        assert _core.checksum_buffer_ranges(reader, ops_array([(0, size)]), threads) == [_core.crc32c(data)]
    finally:
        reader.close()


# --- the GIL ----------------------------------------------------------------------------------


def test_copy_into_buffer_releases_the_gil(shm_dir):
    """While one thread copies 256 MiB, the main thread keeps running Python code.

    A functional check, not a timing one: the worker reads the main thread's loop counter
    right before and right after the call. If the call held the GIL, the main thread could
    not run in between. The switch interval is made tiny so that few iterations sneak in at
    the edges of the call: a call that holds the GIL as long (crc32c_software of 256 MiB)
    lets through a few hundred, while a released copy lets through hundreds of thousands.
    """
    nbytes = 256 * MiB
    source = torch.full((nbytes,), 0x3C, dtype=torch.uint8)
    buffer = ShmBuffer.create(str(shm_dir / "buf"), nbytes)
    ops = ops_array([(source.data_ptr(), 0, nbytes)])
    counter = [0]
    seen: dict[str, object] = {}
    done = threading.Event()

    def worker() -> None:
        try:
            seen["before"] = counter[0]
            seen["crcs"] = _core.copy_into_buffer(buffer, ops, True, 1)
            seen["after"] = counter[0]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            seen["error"] = exc
        finally:
            done.set()

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        while not done.is_set():
            counter[0] += 1
        thread.join(timeout=60)
    finally:
        sys.setswitchinterval(old_interval)
    try:
        assert "error" not in seen, seen.get("error")
        iterations = seen["after"] - seen["before"]
        assert iterations > 10_000, f"main thread ran only {iterations} iterations during the copy"
        crc_of_source = _core.crc32c(memory_at(source.data_ptr(), 1 << 20))
        with memoryview(buffer) as view:
            assert view[:16] == b"\x3c" * 16 and view[-16:] == b"\x3c" * 16
            assert _core.crc32c(view[: 1 << 20]) == crc_of_source
    finally:
        buffer.close()


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize(
    "dst_offset, src_offset, nbytes",
    [(1, 3, (1 << 20) + 17), (33, 0, 3 * 4096 * 5 + 5), (64, 7, 256 << 10), (4096, 1, (8 << 20) + 1), (0, 0, 255 << 10),
     (5, 2, 16 << 10), (0, 9, (16 << 10) - 1), (63, 0, (16 << 10) + 1), (7, 7, 20000)],
)
def test_large_copies_stream_correctly_at_any_alignment(shm_dir, checksum, dst_offset, src_offset, nbytes):
    """Copies of 16 KiB and more take the one-pass streaming path: check its edges byte for byte."""
    buffer = ShmBuffer.create(str(shm_dir / "buf"), 16 << 20)
    source = torch.randint(0, 256, (nbytes + src_offset,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    try:
        crcs = _core.copy_into_buffer(buffer, ops_array([(source.data_ptr() + src_offset, dst_offset, nbytes)]),
                                      checksum, 2)
        expected = source[src_offset:].numpy().tobytes()
        assert buffer_bytes(buffer, dst_offset, nbytes) == expected
        assert buffer_bytes(buffer, 0, dst_offset) == bytes(dst_offset)  # nothing written before the op
        assert crcs == [_core.crc32c(expected) if checksum else 0]
    finally:
        buffer.close()


def test_fused_copy_and_checksum_at_random_sizes_alignments_and_offsets(shm_dir):
    """One call, many ops at random source and destination alignments, sizes around the streaming
    threshold and not multiples of any block: every byte lands, nothing between ops is touched,
    and each CRC equals the reference."""
    rng = random.Random(70)
    source = torch.randint(0, 256, (24 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(71))
    src_bytes = source.numpy().tobytes()
    sizes = [rng.choice([16 * 1024 + rng.randrange(-300, 300), rng.randrange(256 * 1024, 3 * MiB),
                         rng.randrange(0, 70_000), 4 * MiB + rng.randrange(1, 200)]) for _ in range(24)]
    rows, dst = [], 0
    for n in sizes:
        dst += rng.randrange(1, 200)  # a gap that must stay untouched
        src = rng.randrange(0, len(src_bytes) - n)
        rows.append((src, dst, n))
        dst += n
    buffer = ShmBuffer.create(str(shm_dir / "buf"), dst + 4096)
    try:
        with memoryview(buffer) as view:
            view[:] = b"\x5a" * len(view)
        crcs = _core.copy_into_buffer(buffer, ops_array([(source.data_ptr() + s, d, n) for s, d, n in rows]), True, 2)
        image = buffer_bytes(buffer)
        end = 0
        for (src, dst, n), crc in zip(rows, crcs):
            assert image[end:dst] == b"\x5a" * (dst - end), "a gap between ops was written"
            assert image[dst : dst + n] == src_bytes[src : src + n], (src, dst, n)
            assert crc == _core.crc32c_software(src_bytes[src : src + n]), (src, dst, n)
            end = dst + n
        assert image[end:] == b"\x5a" * (len(image) - end)
    finally:
        buffer.close()


@pytest.mark.parametrize("method", READ_METHODS)
@pytest.mark.parametrize("threads", [1, 2])
def test_read_file_into_at_random_sizes_alignments_and_offsets(shm_dir, threads, method):
    """Loads copy and checksum straight from the file's pages: unaligned file offsets, destinations
    and lengths, large and small, in one call."""
    rng = random.Random(80 + threads)
    data = random_bytes(12 * MiB + 777, seed=81)
    path = shm_dir / "file"
    path.write_bytes(data)
    rows = []
    for _ in range(20):
        n = rng.choice([rng.randrange(256 * 1024, 5 * MiB), rng.randrange(0, 5000), 256 * 1024 + rng.randrange(-70, 70),
                        16 * 1024 + rng.randrange(-70, 70), rng.randrange(5000, 70_000)])
        rows.append((rng.randrange(0, len(data) - n), n, rng.randrange(0, 64)))
    arenas = [torch.full((n + shift + 64,), 0xC3, dtype=torch.uint8) for _, n, shift in rows]
    ops = [(offset, arena.data_ptr() + shift, n, n) for (offset, n, shift), arena in zip(rows, arenas)]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = _core.read_file_into(fd, ops_array(ops), True, threads, method)
    finally:
        os.close(fd)
    for (offset, n, shift), arena, crc in zip(rows, arenas, crcs):
        got = arena.numpy().tobytes()
        assert got[shift : shift + n] == data[offset : offset + n], (offset, n, shift)
        assert got[:shift] == b"\xc3" * shift and got[shift + n :] == b"\xc3" * 64, "wrote outside its destination"
        assert crc == _core.crc32c_software(data[offset : offset + n]), (offset, n, shift)
