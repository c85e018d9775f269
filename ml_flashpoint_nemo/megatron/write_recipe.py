"""A reused save plan's items taken straight from Megatron's sharded values, without DCP's conversion.

Once every rank's structure is unchanged, a save reuses the last plan, yet Megatron's
mcore_to_pyt_state_dict still builds a torch ShardedTensor with global metadata per key, and
DCP's planner is set up again, only to look up, per planned item, a tensor this rank already
holds: on the quickstart model that was a quarter of the time a save blocks training. A recipe,
learnt from a save that went the long way, records for each item which sharded value it came
from and the view the planner resolved. It is kept only if replaying it on that same save gives
the very same tensors (storage, shape, strides, dtype) and the same bytes for every object, so
a replay stages exactly what the long way would. A value that no longer fits (missing data, a
non-contiguous tensor, another offset) makes the save go the long way again.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor

from ml_flashpoint_nemo.dcp.writer import PlannedItems

ShardedValues = Mapping[str, Sequence[ShardedBase]]  # Megatron's state dict after its keys became sharded keys


@dataclass(frozen=True)
class _TensorItem:
    key: str  # the sharded key (DCP's fqn)
    position: int  # which of that key's local shards
    offset: tuple[int, ...]  # the shard's global offset when the recipe was learnt
    shape: torch.Size  # the view DCP's planner resolved (with Megatron's prepended axes)
    numel: int


@dataclass(frozen=True)
class _ObjectsItem:
    key: str  # every ShardedObject of this key, serialized together as Megatron does for DCP


class WriteRecipe:
    """How each item of one cached plan is taken from the sharded values of a save with that structure."""

    def __init__(self, steps: tuple[_TensorItem | _ObjectsItem, ...], items: PlannedItems) -> None:
        self._steps = steps
        self.items = items

    @classmethod
    def learn(cls, values: ShardedValues, resolved: Mapping[str, Any], items: PlannedItems) -> WriteRecipe | None:
        """The recipe that reproduces `resolved` (what the planner gave for `items`) from `values`; None if none does.

        values are the sharded values the long way converted (Megatron's conversion left each
        tensor's data as the view it resolved), so each tensor item is found by its storage.
        """
        steps: list[_TensorItem | _ObjectsItem] = []
        for record_key, index in zip(*items):
            data = resolved.get(record_key)
            shards = values.get(index.fqn)
            if data is None or not shards:
                return None
            if not isinstance(data, torch.Tensor):
                steps.append(_ObjectsItem(index.fqn))
                continue
            position = next((i for i, shard in enumerate(shards) if isinstance(shard, ShardedTensor)
                             and _same_view(shard.data, data)), None)
            if position is None:
                return None  # resolved to a copy or to something else: only the long way knows it
            shard = shards[position]
            assert isinstance(shard, ShardedTensor), "found above"
            steps.append(_TensorItem(index.fqn, position, tuple(shard.global_offset), data.shape, data.numel()))
        recipe = cls(tuple(steps), items)
        replayed = recipe.replay(values)
        if replayed is None or not _identical(replayed, resolved):
            return None
        return recipe

    def replay(self, values: ShardedValues) -> dict[str, Any] | None:
        """This save's items, by record key in plan order (as resolve_write_items gives them); None: go the long way.

        May raise what torch.save raises for an object; the caller fails the save on every rank then.
        """
        flat: dict[str, Any] = {}
        for record_key, step in zip(self.items[0], self._steps):
            shards = values.get(step.key)
            if not shards:
                return None
            if isinstance(step, _ObjectsItem):
                buffer = io.BytesIO()
                torch.save([getattr(shard, "data", None) for shard in shards], buffer)
                flat[record_key] = buffer.getbuffer()
                continue
            shard = shards[step.position] if step.position < len(shards) else None
            if not isinstance(shard, ShardedTensor) or shard.data is None or tuple(shard.global_offset) != step.offset:
                return None
            tensor = shard.data
            if tensor.requires_grad or type(tensor) is not torch.Tensor:
                tensor = tensor.detach()  # as Megatron's conversion does: a plain tensor, outside autograd
            if tensor.shape != step.shape:
                if not tensor.is_contiguous() or tensor.numel() != step.numel:
                    return None
                tensor = tensor.view(step.shape)  # Megatron's prepended axes
            elif not tensor.is_contiguous():
                return None
            flat[record_key] = tensor
        return flat


def _same_view(candidate: Any, resolved: torch.Tensor) -> bool:
    return (isinstance(candidate, torch.Tensor) and candidate.data_ptr() == resolved.data_ptr()
            and candidate.shape == resolved.shape)


def _identical(replayed: Mapping[str, Any], resolved: Mapping[str, Any]) -> bool:
    """The same keys in the same order, the same tensors (storage, shape, strides, dtype) and the same bytes."""
    if list(replayed) != list(resolved):
        return False
    for key, ours in replayed.items():
        theirs = resolved[key]
        if isinstance(theirs, torch.Tensor):
            if not (isinstance(ours, torch.Tensor) and ours.data_ptr() == theirs.data_ptr()
                    and ours.shape == theirs.shape and ours.stride() == theirs.stride()
                    and ours.dtype == theirs.dtype and ours.device == theirs.device):
                return False
        elif isinstance(ours, torch.Tensor) or bytes(ours) != bytes(theirs):
            return False
    return True
