"""A complete TensorAwareStateDict of plain CPU tensors, for the peer check of NVRx's manager tests.

NVRx's own test double implements only the copy to CPU and back (its manager torch.saves the whole
object); ours implements every method of NVRx's abstract interface, which our manager uses.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict


class PlainTensorState(TensorAwareStateDict):
    """`count` random tensors seeded by `iteration`, and the iteration itself as non-tensor state."""

    def __init__(self, iteration: int, count: int = 8) -> None:
        generator = torch.Generator().manual_seed(iteration)
        self._tensors: list[torch.Tensor] | None = [torch.rand((64, 32), generator=generator) for _ in range(count)]
        self.iteration = iteration

    def pop_tensors(self) -> Sequence[torch.Tensor]:
        tensors, self._tensors = self._tensors, None
        assert tensors is not None, "already hollow"
        return tensors

    @property
    def tensors(self) -> Iterable[torch.Tensor]:
        assert self._tensors is not None, "hollow"
        return iter(self._tensors)

    @property
    def is_hollow(self) -> bool:
        return self._tensors is None

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        assert self._tensors is None, "not hollow"
        self._tensors = list(tensor_data)

    def init_tensors(self) -> None:
        raise NotImplementedError  # our manager never asks for empty tensors

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        pass  # CPU already

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        pass

    def to_state_dict(self) -> dict:
        return {"iteration": self.iteration, "tensors": list(self.tensors)}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlainTensorState) or self.is_hollow or other.is_hollow:
            return False
        mine, theirs = list(self.tensors), list(other.tensors)
        return (
            self.iteration == other.iteration
            and len(mine) == len(theirs)
            and all(torch.equal(a, b) for a, b in zip(mine, theirs))
        )

    __hash__ = None  # type: ignore[assignment]
