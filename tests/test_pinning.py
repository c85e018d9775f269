"""CUDA page-locking of pool buffers. No GPU here: a stand-in for torch.cuda.cudart() records the
calls (the only mock in these tests, because the CUDA runtime cannot run on this machine)."""

from __future__ import annotations

import logging

import torch

from ml_flashpoint_nemo.core import CheckpointSaver, load_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.pinning import CudaHostRegistry
from ml_flashpoint_nemo.core.pool import BufferPool


class RecordingCudart:
    """Stands in for the CUDA runtime: tracks which host ranges are registered."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", address))
        if self.status == 0:
            assert address not in self.live, "registered twice"
            self.live[address] = size
        return self.status

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("unregister", address))
        assert address in self.live, "unregistering memory that is not registered"
        del self.live[address]
        return 0


def test_buffers_are_registered_once_and_unregistered_before_grow_and_close(base_dir):
    cudart = RecordingCudart()
    pool = BufferPool(CheckpointLayout(base_dir), 0, pinning=CudaHostRegistry(cudart))
    buffer = pool.acquire(1 << 20)
    assert cudart.live == {buffer.address: buffer.size}
    pool.release(buffer)
    again = pool.acquire(1 << 20)  # same buffer: no second registration
    assert again is buffer and [c for c, _ in cudart.calls] == ["register"]
    pool.release(again)
    old_address = buffer.address
    grown = pool.acquire(64 << 20)  # the free buffer grows: its old registration goes first
    assert grown is buffer
    assert ("unregister", old_address) in cudart.calls
    assert cudart.live == {grown.address: grown.size}
    pool.release(grown)
    pool.close()
    assert cudart.live == {}, "a closed buffer is still registered with CUDA"


def test_failed_registration_warns_once_and_saves_still_work(base_dir, caplog):
    cudart = RecordingCudart(status=2)  # cudaErrorMemoryAllocation
    pool = BufferPool(CheckpointLayout(base_dir), 0, pinning=CudaHostRegistry(cudart))
    state = {"w": torch.randn(1000)}
    with caplog.at_level(logging.WARNING), CheckpointSaver(base_dir, pool=pool) as saver:
        for step in range(3):
            saver.save(step, state)
    assert caplog.text.count("Could not page-lock") == 1
    assert torch.equal(load_version(base_dir)["w"], state["w"])


def test_registry_is_enabled_exactly_when_cuda_is_usable(monkeypatch):
    assert CudaHostRegistry().enabled == torch.cuda.is_available()
    monkeypatch.setenv("FLASHPOINT_PIN_BUFFERS", "0")
    assert not CudaHostRegistry().enabled
