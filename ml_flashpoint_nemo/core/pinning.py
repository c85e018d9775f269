"""Page-locking pool buffers for CUDA, so staging a GPU tensor is one fast device-to-host copy.

A copy from the GPU into pageable memory goes through a driver bounce buffer at a
fraction of the bus speed. Registered (page-locked) host memory is written by DMA
directly, and the copy can be asynchronous. Pool buffers live for the whole job, so
they are registered once, after they are pre-faulted, and unregistered before they
are remapped (grow) or unmapped (close): CUDA must never hold a stale registration.

Set FLASHPOINT_PIN_BUFFERS=0 to turn this off (e.g. when the memory lock limit is low).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_CUDA_SUCCESS = 0
_REGISTER_PORTABLE = 1  # visible to every CUDA context of the process


class _Registrable(Protocol):
    """What registration reads of a buffer (read-only, as on _core.ShmBuffer)."""

    @property
    def address(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def path(self) -> str: ...


class CudaHostRegistry:
    """Registers buffers with CUDA when a GPU is present; does nothing otherwise."""

    def __init__(self, cudart: Any | None = None) -> None:
        self._lock = threading.Lock()
        self._registered: dict[int, tuple[int, int]] = {}  # id(buffer) -> (address, size)
        self._cudart = cudart if cudart is not None else _cuda_runtime()
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._cudart is not None

    def register(self, buffer: _Registrable) -> bool:
        """Page-lock the buffer's mapping; False (and one warning) if CUDA refuses."""
        if self._cudart is None:
            return False
        with self._lock:
            if id(buffer) in self._registered:
                return True
            address, size = buffer.address, buffer.size
            status = self._cudart.cudaHostRegister(address, size, _REGISTER_PORTABLE)
            if int(status) != _CUDA_SUCCESS:
                if not self._warned:
                    logger.warning(
                        "Could not page-lock %s for CUDA (error %s); GPU staging copies will be slower. "
                        "Raise the memlock limit (ulimit -l) or set FLASHPOINT_PIN_BUFFERS=0 to silence this.",
                        buffer.path, status,
                    )
                    self._warned = True
                return False
            self._registered[id(buffer)] = (address, size)
            return True

    def unregister(self, buffer: _Registrable) -> None:
        """Release the registration before the mapping moves or goes away."""
        if self._cudart is None:
            return
        with self._lock:
            entry = self._registered.pop(id(buffer), None)
        if entry is not None:
            self._cudart.cudaHostUnregister(entry[0])


def _cuda_runtime() -> Any | None:
    if os.environ.get("FLASHPOINT_PIN_BUFFERS", "1") == "0":
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.cudart()
    except Exception:  # noqa: BLE001 - no usable CUDA runtime: pinning is an optimisation only
        return None
