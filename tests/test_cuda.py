"""The CUDA staging paths on a real GPU: saves of device tensors, loads into device tensors.

Marked `cuda` and skipped without a CUDA device (every test here needs one; nothing is mocked).
scripts/gpu_check.sh runs them on a GPU machine; on CPU machines they report as skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ml_flashpoint_nemo.core import CheckpointSaver, load_version, loader
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.pinning import CudaHostRegistry
from ml_flashpoint_nemo.core.pool import BufferPool
from ml_flashpoint_nemo.dcp import MemoryStorageReader, MemoryStorageWriter
from ml_flashpoint_nemo.errors import ChecksumError
from tests.support.forge import object_path, read_parts, records_by_key
from tests.support.states import assert_state_equal

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh on one)"),
]


def gpu_state(seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    state = {
        "f32": torch.randn(1 << 20, device="cuda", generator=gen),
        "bf16": torch.randn(4096, 257, device="cuda", generator=gen).to(torch.bfloat16),
        "i64": torch.randint(-1000, 1000, (3, 1000), device="cuda", generator=gen, dtype=torch.int64),
        "fp8": torch.randn(999, device="cuda", generator=gen).to(torch.float8_e4m3fn),
        "transposed": torch.randn(300, 200, device="cuda", generator=gen).t(),  # not contiguous
        "host": torch.arange(100, dtype=torch.float32),  # CPU tensors mix with GPU ones
        "extra": b"common",
    }
    return state


def on_cpu(state: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_gpu_tensors_save_and_load_bit_exact_into_gpu_and_cpu_destinations(base_dir):
    state = gpu_state(1)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    into = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    loaded = load_version(base_dir, 1, into=into)
    for key, tensor in into.items():
        assert loaded[key] is tensor and tensor.device == state[key].device, key
    assert_state_equal(on_cpu(state), on_cpu(loaded))
    assert_state_equal(on_cpu(state), load_version(base_dir, 1))  # new CPU tensors


def test_a_save_returns_only_after_its_device_copies_landed(base_dir):
    # Training changes its tensors as soon as save() returns: the checkpoint must hold the old values.
    state = gpu_state(2)
    expected = on_cpu(state)
    with CheckpointSaver(base_dir) as saver:
        for step in range(3):
            saver.save(step, state, keep=3)
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_cuda and value.dtype in (torch.float32, torch.bfloat16):
                    value.mul_(3).add_(1)  # queued on the stream right behind the save's copies
            assert_state_equal(expected, load_version(base_dir, step))
            expected = on_cpu(state)


def test_pool_buffers_are_page_locked(base_dir):
    pool = BufferPool(CheckpointLayout(base_dir), 0, pinning=CudaHostRegistry())
    try:
        assert pool.pinning.enabled
        buffer = pool.acquire(8 << 20)
        assert torch.frombuffer(buffer, dtype=torch.uint8).is_pinned(), "a pool buffer is not page-locked"
        pool.release(buffer)
    finally:
        pool.close()


def test_dcp_save_and_load_of_gpu_state(base_dir):
    state = {k: v for k, v in gpu_state(3).items() if isinstance(v, torch.Tensor)}
    checkpoint = f"{base_dir}/step-1"
    dcp.save(state, checkpoint_id=checkpoint, storage_writer=MemoryStorageWriter(base_dir), no_dist=True)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(into, checkpoint_id=checkpoint, storage_reader=MemoryStorageReader(base_dir), no_dist=True)
    assert_state_equal(on_cpu(state), on_cpu(into))


def test_staging_and_uploads_in_many_small_batches_stay_bit_exact(base_dir, monkeypatch):
    # 1 MiB batches: the save checksums batch by batch behind the DMA, the load uploads behind the reads.
    monkeypatch.setattr(loader, "UPLOAD_BATCH_NBYTES", 1 << 20)
    state = gpu_state(4)
    with CheckpointSaver(base_dir) as saver:
        saver.staging_batch_nbytes = 1 << 20
        saver.save(1, state)
    into = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    load_version(base_dir, 1, into=into)
    assert_state_equal(on_cpu({k: state[k] for k in into}), on_cpu(into))
    assert_state_equal(on_cpu(state), load_version(base_dir, 1))  # the CRCs recorded batch by batch are right


def test_a_corrupt_record_fails_a_gpu_load_and_the_checkpoint_stays(base_dir, monkeypatch):
    monkeypatch.setattr(loader, "UPLOAD_BATCH_NBYTES", 1 << 20)
    state = gpu_state(5)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    path = object_path(base_dir, 1)
    _, index, _ = read_parts(path)
    offset = records_by_key(index)["bf16"]["offset"] + 5
    with open(path, "r+b") as f:
        f.seek(offset)
        good = f.read(1)
        f.seek(offset)
        f.write(bytes([good[0] ^ 0x10]))
    into = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ChecksumError, match="bf16"):
        load_version(base_dir, 1, into=into)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(good)
    load_version(base_dir, 1, into=into)  # the uploads of the failed load left nothing behind
    assert_state_equal(on_cpu({k: state[k] for k in into}), on_cpu(into))
