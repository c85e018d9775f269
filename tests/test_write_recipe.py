"""WriteRecipe: kept only when replaying it gives exactly what DCP's planner resolved, and replayed only on values
that still fit it (the multi-rank saves that use it are in tests/test_megatron.py, the cached-plan scenario)."""

from __future__ import annotations

import io

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint.metadata import MetadataIndex

from ml_flashpoint_nemo.megatron.write_recipe import WriteRecipe


def _values_and_resolved(weight: torch.Tensor) -> tuple[dict, dict, tuple]:
    """A rank's sharded values after Megatron's conversion, what the planner resolved, and the plan's items."""
    tensor = ShardedTensor.from_rank_offsets("w", weight, (0, 1, 2))
    objects = [ShardedObject("rng", {"seed": 3}, (2,), (1,), replica_id=0)]
    serialized = io.BytesIO()
    torch.save([o.data for o in objects], serialized)
    values = {"w": [tensor], "rng": objects}
    resolved = {"w@a": tensor.data, "rng@b": serialized.getbuffer()}
    items = (("w@a", "rng@b"), (MetadataIndex("w", (4, 0)), MetadataIndex("rng")))
    return values, resolved, items


def test_a_recipe_replays_the_same_tensors_and_bytes_on_later_values():
    values, resolved, items = _values_and_resolved(torch.arange(8.0).view(4, 2))
    recipe = WriteRecipe.learn(values, resolved, items)
    assert recipe is not None and recipe.items == items
    later, _, _ = _values_and_resolved(torch.full((4, 2), 5.0))
    flat = recipe.replay(later)
    assert flat is not None and list(flat) == ["w@a", "rng@b"]
    assert flat["w@a"].data_ptr() == later["w"][0].data.data_ptr() and torch.equal(flat["w@a"], later["w"][0].data)
    assert bytes(flat["rng@b"]) == bytes(resolved["rng@b"])


def test_no_recipe_when_the_planner_resolved_a_copy_or_other_bytes():
    values, resolved, items = _values_and_resolved(torch.arange(8.0).view(4, 2))
    assert WriteRecipe.learn(values, {**resolved, "w@a": resolved["w@a"].clone()}, items) is None
    assert WriteRecipe.learn(values, {**resolved, "rng@b": memoryview(b"other")}, items) is None
    assert WriteRecipe.learn(values, {"w@a": resolved["w@a"]}, items) is None  # an item the planner did not give
    assert WriteRecipe.learn({"w": values["w"]}, resolved, items) is None  # a key the values lack


def test_values_that_no_longer_fit_go_the_long_way():
    values, resolved, items = _values_and_resolved(torch.arange(8.0).view(4, 2))
    recipe = WriteRecipe.learn(values, resolved, items)
    assert recipe is not None
    strided, _, _ = _values_and_resolved(torch.arange(8.0).view(2, 4).t())  # same shape, not contiguous
    assert recipe.replay(strided) is None
    moved, _, _ = _values_and_resolved(torch.arange(8.0).view(4, 2))
    moved["w"][0].global_offset = (0, 0)  # another shard of the tensor
    assert recipe.replay(moved) is None
    no_data, _, _ = _values_and_resolved(torch.arange(8.0).view(4, 2))
    no_data["w"][0].data = None
    assert recipe.replay(no_data) is None
    assert recipe.replay({"rng": values["rng"]}) is None


def test_each_item_is_bound_to_the_shard_at_its_offset_even_when_shards_alias_at_learning():
    """Two local shards of one key whose data are one tensor when the recipe is learnt: each item must still take
    the shard at its own offset afterwards, not the first shard with that storage (which would save the other
    shard's values under this one's offset, silently)."""

    def values(first: torch.Tensor, second: torch.Tensor) -> dict:
        return {"m": [ShardedTensor("m", first, torch.float32, (4,), (8,), (0,), None),
                      ShardedTensor("m", second, torch.float32, (4,), (8,), (4,), None)]}

    shared = torch.full((4,), 1.0)
    learnt_from = values(shared, shared)
    items = (("m@0", "m@4"), (MetadataIndex("m", (0,)), MetadataIndex("m", (4,))))
    recipe = WriteRecipe.learn(learnt_from, {"m@0": shared, "m@4": shared}, items)
    assert recipe is not None
    later = values(torch.full((4,), 2.0), torch.full((4,), -2.0))
    flat = recipe.replay(later)
    assert flat is not None
    assert torch.equal(flat["m@0"], later["m"][0].data) and torch.equal(flat["m@4"], later["m"][1].data)
