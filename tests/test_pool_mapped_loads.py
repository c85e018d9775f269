"""Loads in the process that saved copy from its pool buffers' mappings, and only when that is safe.

A load of an object this process saved, while its pool still holds the buffer, reads the buffer's
mapping (no per-page kernel work) instead of the file: the loader logs each such read at DEBUG,
which is what these tests observe. The mapping is used only when it maps the very file the load
opened; checksums, bounds and a pool closed during a load behave as for a file read.
"""

from __future__ import annotations

import array
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import CheckpointSaver, load_version, loader
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import open_object
from ml_flashpoint_nemo.core.pool import find_placed_buffer
from ml_flashpoint_nemo.core.tuning import read_method, reads_pool_mappings
from ml_flashpoint_nemo.core.versions import read_commit
from ml_flashpoint_nemo.errors import ChecksumError, CorruptCheckpointError
from tests.support.forge import forge_object, records_by_key
from tests.support.states import assert_state_equal, make_state

FROM_BUFFER = "from this process's pool buffer"


def object_file(base_dir: Path, step: int) -> Path:
    return next((base_dir / f"step-{step}").glob("rank-*.fpo"))


def record_offset(base_dir: Path, step: int, key: str) -> int:
    layout = CheckpointLayout(base_dir)
    (record,) = read_commit(layout, step).objects
    with open_object(str(layout.object_path(step, record.name)), record) as obj:
        return next(e.offset for e in obj.entries if e.key == key)


def buffer_reads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == loader.__name__ and FROM_BUFFER in r.getMessage()]


@pytest.fixture
def debug_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger=loader.__name__)
    return caplog


# --- (a) the mapping is used, bit-exact ----------------------------------------------------


def test_a_load_after_a_save_reads_the_pool_buffer_bit_exact(base_dir, debug_log):
    state = make_state(1, small_tensors=50)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
        path = object_file(base_dir, 1)
        buffer = find_placed_buffer(path)
        assert buffer is not None and saver.pool.placed_buffer(path) is buffer
        assert os.path.samestat(os.fstat(buffer.fd), os.stat(path))
        loaded = load_version(base_dir, 1)
        assert len(buffer_reads(debug_log)) == 1
    assert_state_equal(state, loaded)
    debug_log.clear()
    assert_state_equal(state, load_version(base_dir, 1))  # the pool is closed: the file
    assert buffer_reads(debug_log) == []
    assert find_placed_buffer(path) is None


def test_the_staged_path_reads_the_pool_buffer_batch_by_batch(base_dir, debug_log, monkeypatch):
    monkeypatch.setattr(loader, "UPLOAD_BATCH_NBYTES", 64 << 10)
    state = make_state(3, large_numel=1 << 16, small_tensors=20)
    into = {key: torch.zeros(value.numel() * 2, dtype=value.dtype)[::2].view(value.shape)
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dtype != torch.bool}  # torch's strided copy canonicalises bools
    assert len(into) > 3 and not any(t.is_contiguous() for t in into.values() if t.numel() > 1)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
        loaded = load_version(base_dir, 1, into=into)
        assert len(buffer_reads(debug_log)) > 3  # one per batch
    assert all(loaded[key] is tensor for key, tensor in into.items())
    assert_state_equal(state, loaded)


def test_read_method_other_than_auto_reads_the_file(base_dir, debug_log, monkeypatch):
    state = make_state(4, large_numel=1 << 12, small_tensors=5)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
        for method in ("file", "map", "pread"):
            monkeypatch.setenv("FLASHPOINT_READ_METHOD", method)
            assert not reads_pool_mappings() and read_method() == ("auto" if method == "file" else method)
            assert_state_equal(state, load_version(base_dir, 1))
        assert buffer_reads(debug_log) == []
        monkeypatch.setenv("FLASHPOINT_READ_METHOD", "bogus")  # warns, loads as auto
        assert reads_pool_mappings() and read_method() == "auto"
        assert_state_equal(state, load_version(base_dir, 1))
        assert len(buffer_reads(debug_log)) == 1


# --- (b) a corrupt byte is still caught ----------------------------------------------------


def test_a_byte_flipped_through_the_file_fails_the_mapped_read_naming_the_key(base_dir, debug_log):
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, make_state(1, small_tensors=10))
        path = object_file(base_dir, 1)
        offset = record_offset(base_dir, 1, "large.2") + 100
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset)
        finally:
            os.close(fd)
        with memoryview(saver.pool.placed_buffer(path)) as view:  # the shared mapping shows the write
            assert view[offset] == byte[0] ^ 0x40
        with pytest.raises(ChecksumError, match="large.2") as info:
            load_version(base_dir, 1)
        assert info.value.key == "large.2" and info.value.path == str(path)
        assert len(buffer_reads(debug_log)) == 1


# --- (c) only the very file ----------------------------------------------------------------


def test_an_object_file_replaced_at_its_path_is_read_from_the_new_file(base_dir, debug_log):
    state = make_state(5, small_tensors=10)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
        path = object_file(base_dir, 1)
        copy = path.with_name("copy.tmp")
        shutil.copyfile(path, copy)
        os.replace(copy, path)  # same bytes, another inode
        buffer = saver.pool.placed_buffer(path)
        offset = record_offset(base_dir, 1, "large.0")
        with memoryview(buffer) as view:  # the stale mapping now differs: reading it would fail the CRC
            view[offset] ^= 0xFF
        assert_state_equal(state, load_version(base_dir, 1))
        assert buffer_reads(debug_log) == []


# --- (d) bounds before pointers -------------------------------------------------------------


@pytest.fixture
def buffer(shm_dir):
    created = _core.ShmBuffer.create(str(shm_dir / "buffer"), 1 << 20)
    with memoryview(created) as view:
        view[:] = bytes(range(256)) * (created.size // 256)
    yield created
    created.close()


@pytest.mark.parametrize("offset, nbytes", [
    (0, (1 << 20) + 1),  # one byte past the end
    ((1 << 20) - 10, 11),
    (1 << 20, 1),
    (2**64 - 1, 2),  # offset + nbytes wraps around
    (1, 2**64 - 1),
])
def test_a_row_outside_the_buffer_is_refused_before_any_byte_moves(buffer, offset, nbytes):
    first = torch.full((4096,), 7, dtype=torch.uint8)
    second = torch.full((4096,), 7, dtype=torch.uint8)
    ops = array.array("Q", [0, first.data_ptr(), 4096, 4096,  # a good row first: it must not be copied either
                            offset, second.data_ptr(), nbytes, 2**64 - 1])
    with pytest.raises(IndexError, match="overruns buffer"):
        _core.read_buffer_into(buffer, ops, True, 2)
    assert bool((first == 7).all()) and bool((second == 7).all())


def test_a_row_larger_than_its_destination_is_refused(buffer):
    dst = torch.full((100,), 7, dtype=torch.uint8)
    with pytest.raises(IndexError, match="overruns its destination"):
        _core.read_buffer_into(buffer, array.array("Q", [0, dst.data_ptr(), 101, 100]))
    assert bool((dst == 7).all())


def test_read_buffer_into_copies_and_checksums(buffer):
    dst = torch.zeros(300_000, dtype=torch.uint8)
    ops = array.array("Q", [5, dst.data_ptr(), 200_000, 300_000, 0, dst.data_ptr() + 200_000, 100_000, 100_000])
    crcs = _core.read_buffer_into(buffer, ops, True, 2)
    with memoryview(buffer) as view:
        expected = [bytes(view[5:200_005]), bytes(view[:100_000])]
    assert bytes(dst[:200_000].numpy()) == expected[0] and bytes(dst[200_000:].numpy()) == expected[1]
    assert crcs == [_core.crc32c(e) for e in expected]
    assert _core.read_buffer_into(buffer, ops, False, 1) == [0, 0]


def test_read_buffer_into_refuses_a_closed_buffer_and_a_truncated_file(shm_dir):
    dst = torch.zeros(8192, dtype=torch.uint8)
    ops = array.array("Q", [(1 << 20) - 8192, dst.data_ptr(), 8192, 8192])
    truncated = _core.ShmBuffer.create(str(shm_dir / "truncated"), 1 << 20)
    os.truncate(truncated.path, 1 << 19)  # the mapping outlasts the file's end
    with pytest.raises(EOFError, match="file ends at offset"):
        _core.read_buffer_into(truncated, ops)
    truncated.close()
    assert truncated.fd == -1
    with pytest.raises(RuntimeError, match="closed"):
        _core.read_buffer_into(truncated, ops)


def test_a_forged_index_is_refused_while_the_pool_holds_the_buffer(base_dir):
    state = {"a": torch.randn(16), "b": torch.randn(16), "big": torch.randn(300_000)}
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
        path = object_file(base_dir, 1)
        raw = path.read_bytes()

        def overrun_a_into_b(payload):
            records = records_by_key(payload)
            a, b = records["a"], records["b"]
            a["nbytes"] = b["offset"] + b["nbytes"] - a["offset"]
            a["crc32c"] = "%08x" % _core.crc32c(raw[a["offset"] : a["offset"] + a["nbytes"]])

        forge_object(path, index=overrun_a_into_b)  # rewritten in place: the buffer still maps it
        assert saver.pool.placed_buffer(path) is not None
        into = {key: torch.full_like(value, 7.0) for key, value in state.items()}
        with pytest.raises(CorruptCheckpointError, match="'a'"):
            load_version(base_dir, 1, into=into)
        assert all(bool((t == 7.0).all()) for t in into.values())


# --- (e) a pool closed during loads ---------------------------------------------------------


def test_closing_the_pool_while_loads_run_never_crashes(base_dir, debug_log):
    state = make_state(6, large_numel=1 << 19, small_tensors=20)
    used_buffer = 0
    for attempt in range(8):
        saver = CheckpointSaver(base_dir)
        saver.save(attempt + 1, state, keep=1)
        errors: list[BaseException] = []
        loads = [0]
        stop = threading.Event()

        def load_repeatedly(step: int = attempt + 1) -> None:
            while not stop.is_set():
                try:
                    assert_state_equal(state, load_version(base_dir, step, threads=2))
                    loads[0] += 1
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=load_repeatedly) for _ in range(2)]
        for thread in threads:
            thread.start()
        while loads[0] < 1 + attempt % 3 and not errors:
            stop.wait(0.001)
        saver.close()  # waits for a read that holds a buffer's mapping; later ones read the file
        before = loads[0]
        while loads[0] < before + 2 and not errors:
            stop.wait(0.001)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        used_buffer += len(buffer_reads(debug_log))
        debug_log.clear()
    assert used_buffer > 0  # loads before each close read the buffer, those after it the file
    assert_state_equal(state, load_version(base_dir, 8))


@pytest.mark.parametrize("gap", [0, 32, 64, 128, 192, 255, 256, 257, 320, 2048])
@pytest.mark.parametrize("nbytes", [200_013, 65_536 + 3 * 64 + 7, 16_384 + 2 * 64 + 33])
def test_the_fused_copy_is_exact_where_stores_would_alias_loads(buffer, gap, nbytes):
    # (dst - src) mod 4096 in 1..256 takes another loop (AVX-512: loads 256 bytes ahead of the stores; SSE4.2:
    # a bounce; csrc/crc32c.cpp): both ways, random bytes, 1-3 64-byte blocks after the last 256, destinations
    # aligned or not, and the bytes on both sides of each destination left alone.
    guard = 4096
    random_bytes = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(gap))
    dst = torch.zeros(guard + nbytes + guard, dtype=torch.uint8)
    at = dst.data_ptr() + guard + gap % 64  # gaps that are not a multiple of 64 leave dst unaligned
    offset = (at - buffer.address - gap) % 4096  # buffer.address + offset == at - gap (mod 4096)
    with memoryview(buffer) as view:
        view[offset : offset + nbytes] = random_bytes.numpy().tobytes()
    crcs = _core.read_buffer_into(buffer, array.array("Q", [offset, at, nbytes, nbytes]), True, 1)
    start = at - dst.data_ptr()
    assert bytes(dst[start : start + nbytes].numpy()) == random_bytes.numpy().tobytes()
    assert crcs == [_core.crc32c(random_bytes.numpy())]
    assert not dst[:start].any() and not dst[start + nbytes :].any()  # nothing written outside the destination

    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    to = (source.data_ptr() + gap - buffer.address) % 4096 + guard
    with memoryview(buffer) as view:
        view[to - guard : to + nbytes + guard] = bytes(nbytes + 2 * guard)
    crcs = _core.copy_into_buffer(buffer, array.array("Q", [source.data_ptr(), to, nbytes]), True, 1)
    with memoryview(buffer) as view:
        assert bytes(view[to : to + nbytes]) == bytes(source.numpy())
        assert not any(view[to - guard : to]) and not any(view[to + nbytes : to + nbytes + guard])
    assert crcs == [_core.crc32c(source.numpy())]
