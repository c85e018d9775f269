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
    offset: tuple[int, ...] | None  # the DCP item's offset, which the shard must still have
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
        tensor's data as the view it resolved). Each tensor item is bound to the one shard of its
        key at the item's offset, as DCP finds it, and that shard's data must be the resolved view.
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
            offset = tuple(index.offset) if index.offset is not None else None
            at_offset = [i for i, shard in enumerate(shards) if isinstance(shard, ShardedTensor)
                         and _item_offset(shard) == offset]
            if len(at_offset) != 1 or not _same_view(shards[at_offset[0]].data, data):
                return None  # resolved to a copy, or no single shard is at that offset: only the long way knows it
            steps.append(_TensorItem(index.fqn, at_offset[0], offset, data.shape, data.numel()))
        recipe = cls(tuple(steps), items)
        try:
            replayed = recipe.replay(values)
        except Exception:  # noqa: BLE001 - no recipe: the long way serializes (and fails) the save itself
            return None
        if replayed is None or not _identical(replayed, resolved):
            return None
        return recipe

    def replay(self, values: ShardedValues) -> dict[str, Any] | None:
        """This save's items, by record key in plan order (as resolve_write_items gives them); None: go the long way.

        Every tensor item is checked before any object is serialized. May raise what torch.save
        raises for an object; the caller fails the save on every rank then.
        """
        tensors: dict[str, torch.Tensor] = {}
        for record_key, step in zip(self.items[0], self._steps):
            if isinstance(step, _TensorItem):
                tensor = _replayed_tensor(values, step)
                if tensor is None:
                    return None
                tensors[record_key] = tensor
        flat: dict[str, Any] = {}
        for record_key, step in zip(self.items[0], self._steps):
            if isinstance(step, _TensorItem):
                flat[record_key] = tensors[record_key]
                continue
            shards = values.get(step.key)
            if not shards:
                return None
            buffer = io.BytesIO()
            torch.save([getattr(shard, "data", None) for shard in shards], buffer)  # as Megatron's conversion does
            flat[record_key] = buffer.getbuffer()
        return flat


def _item_offset(shard: ShardedTensor) -> tuple[int, ...]:
    """The offset of the DCP write item Megatron makes of a shard (flattened shards: chunk offset + range start)."""
    if shard.flattened_range is None:
        return tuple(shard.global_offset)
    return (*shard.local_chunk_offset_in_global(), shard.flattened_range.start)


def _replayed_tensor(values: ShardedValues, step: _TensorItem) -> torch.Tensor | None:
    """The tensor item `step` takes from this save's values, the view the planner resolved; None if it no longer fits."""
    shards = values.get(step.key)
    shard = shards[step.position] if shards and step.position < len(shards) else None
    if not isinstance(shard, ShardedTensor) or shard.data is None or _item_offset(shard) != step.offset:
        return None
    tensor = shard.data.detach()  # as Megatron's conversion does: an alias outside autograd
    if not tensor.is_contiguous():
        return None  # the long way would make a contiguous copy (or stage a strided view): let it
    if tensor.shape != step.shape:
        if tensor.numel() != step.numel:
            return None
        tensor = tensor.view(step.shape)  # Megatron's prepended axes
    return tensor


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
        elif isinstance(ours, torch.Tensor) or memoryview(ours).cast("B") != memoryview(theirs).cast("B"):
            return False  # compared in place: an object's bytes are not copied again
    return True
