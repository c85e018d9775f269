"""Staging for async saves: one copy of the state into reusable host buffers.

Training may change its tensors as soon as staging returns, so staging must copy.
The copies go into host buffers kept from the previous save (pinned when CUDA is
present, so device-to-host copies run at full speed and asynchronously); a save of
the same structure allocates nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor

    _HAS_DTENSOR = True
except ImportError:  # pragma: no cover - torch without DTensor
    _HAS_DTENSOR = False


class StagingBuffers:
    """Host copies of a state dict's tensors, reused while shapes and dtypes stay the same."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    def stage(self, state: Any) -> Any:
        """A structural copy of state whose tensors are host copies of the originals."""
        used: set[tuple] = set()
        staged = self._stage(state, (), used)
        for stale in set(self._buffers) - used:
            del self._buffers[stale]
        if self._pin:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land before we return
        return staged

    def _stage(self, value: Any, path: tuple, used: set[tuple]) -> Any:
        if _HAS_DTENSOR and isinstance(value, DTensor):
            local = self._copy_tensor(value.to_local(), path, used)
            return DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path, used)
        if isinstance(value, dict):
            return type(value)((k, self._stage(v, path + (k,), used)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._stage(v, path + (i,), used) for i, v in enumerate(value))
        return copy.deepcopy(value)  # small non-tensor leaves: ints, strings, BytesIO, ...

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple, used: set[tuple]) -> torch.Tensor:
        key = path + (tuple(tensor.shape), tensor.dtype)
        used.add(key)
        buffer = self._buffers.get(key)
        if buffer is None:
            pin = self._pin and tensor.is_cuda
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        with torch.no_grad():
            buffer.copy_(tensor.detach().resolve_conj().resolve_neg(), non_blocking=tensor.is_cuda)
        return buffer

    def clear(self) -> None:
        self._buffers.clear()
