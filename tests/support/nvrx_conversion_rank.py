"""One rank of a job that converts and saves 10 local checkpoints, counting Megatron's sharding-check collectives.

tests/test_nvrx_conversion.py. Each save converts megatron_scenarios' sharded state with
--via "conversion" (TensorAwareConversion, as Megatron-LM-style code would call it) or "io"
(FlashpointHierarchicalCheckpointIO.save_checkpoint with NVRx's local options, what NeMo's
LocalCheckpointCallback calls), then saves it through FlashpointLocalCheckpointManager. The
sharding, save by save (PLAN): unchanged; one more ShardedObject on rank 1 only; rank 1's weight
shard claiming rank 0's rows (Megatron's check fails on rank 0); the original again; a factory that
raises on rank 1 (the conversion fails there before any collective); a ShardedObject on rank 1 whose
replica id cannot be pickled (it converts, but Megatron's check could not all-gather it). Written per
save: the all_gather_object and broadcast_object_list calls while converting (Megatron's check
makes both), the conversion's check count, and the error if the save failed. Then the newest
version is loaded back and checked bit for bit. First, sharding_of is checked on small state dicts:
values are not part of the sharding, offsets, replica ids and added shards are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import torch.distributed as dist  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory  # noqa: E402

from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager, InvalidShardingError  # noqa: E402
from ml_flashpoint_nemo.nvrx.conversion import TensorAwareConversion, sharding_of  # noqa: E402
from tests.support.megatron_scenarios import check_loaded, sharded_state  # noqa: E402

PLAN = ("same", "same", "same", "extra_on_rank_1", "extra_on_rank_1", "broken_on_rank_1", "same", "same",
        "unconvertible_on_rank_1", "unpicklable_on_rank_1")
COUNTED = ("all_gather_object", "broadcast_object_list")
calls = {name: 0 for name in COUNTED}


def count_calls() -> None:
    """Count the object collectives through torch.distributed's module attributes (Megatron looks them up per call)."""
    for name in COUNTED:
        original = getattr(dist, name)

        def counted(*args: Any, _original: Callable[..., Any] = original, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def state_of(kind: str, seed: int) -> dict[str, Any]:
    state = sharded_state(seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "extra_on_rank_1" and rank == 1:
        state["extra"] = ShardedObject("extra", {"rank": rank}, (1,), (0,), replica_id=0)
    if kind == "broken_on_rank_1" and rank == 1:
        weight = state["layer.weight"]
        state["layer.weight"] = ShardedTensor.from_rank_offsets("layer.weight", weight.data, (0, 0, world))
    if kind == "unpicklable_on_rank_1" and rank == 1:  # converts, but its metadata cannot be all-gathered
        state["odd"] = ShardedObject("odd", {"rank": rank}, (1,), (0,), replica_id=(0, threading.Lock()))
    if kind == "unconvertible_on_rank_1" and rank == 1:
        state["factory"] = ShardedTensorFactory("factory", state["layer.bias"].data, _fails, _fails)
    return state


def _fails(*args: Any) -> Any:
    raise ValueError("this factory fails on purpose")


def check_sharding_of() -> bool:
    import torch

    def state(offset: int, replica: int = 0, data: float = 0.0) -> dict[str, Any]:
        weight = torch.full((2, 3), data)
        return {"w": ShardedTensor.from_rank_offsets("w", weight, (0, offset, 2), replica_id=replica),
                "o": [ShardedObject("o", {"any": data}, (2,), (offset,), replica_id=0)]}

    assert sharding_of(state(0)) == sharding_of(state(0, data=1.0))  # the values are not the sharding
    assert sharding_of(state(0)) != sharding_of(state(1))  # offsets
    assert sharding_of(state(0)) != sharding_of(state(0, replica=1))  # which replica is the main one
    assert sharding_of(state(0)) != sharding_of({**state(0), "b": ShardedObject("b", None, (1,), (0,))})
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--via", choices=["conversion", "io"], required=True)
    parser.add_argument("--algo", choices=["atomic", "fully_parallel"], default="atomic")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    manager = FlashpointLocalCheckpointManager(args.base, session_id="job")
    conversion: TensorAwareConversion
    if args.via == "io":
        from nvidia_resiliency_ext.ptl_resiliency.local_checkpoint_callback import LOCAL_CKPT_OPTS_KEY

        from ml_flashpoint_nemo.nvrx import FlashpointHierarchicalCheckpointIO

        io = FlashpointHierarchicalCheckpointIO(None, manager, lambda path: -1, local_ckpt_algo=args.algo)
        conversion = io.conversion

        def save(state: dict[str, Any], iteration: int) -> None:
            options = {LOCAL_CKPT_OPTS_KEY: {"iteration": iteration, "is_async": False}}
            assert io.save_checkpoint(state, None, options) is None
    else:
        conversion = TensorAwareConversion(args.algo)

        def save(state: dict[str, Any], iteration: int) -> None:
            assert manager.save(conversion(state), iteration) is None

    checked = check_sharding_of()
    count_calls()
    saves = []
    for iteration, kind in enumerate(PLAN, start=1):
        state = state_of(kind, iteration)
        before, checks = dict(calls), conversion.checks
        result: dict[str, Any] = {"iteration": iteration, "kind": kind}
        try:
            save(state, iteration)
        except InvalidShardingError as exc:
            result["error"] = str(exc)
        # The manager's own save gathers nothing with all_gather_object unless a rank failed.
        result.update({name: calls[name] - before[name] for name in COUNTED}, checks=conversion.checks - checks)
        saves.append(result)
    latest = manager.find_latest()
    state, _ = manager.load()
    loaded = state.to_state_dict(sharded_state(0, zeros=True), algo=args.algo, exchange_algo="gather_object")
    check_loaded(loaded, latest)  # bit for bit
    Path(args.out, f"rank-{dist.get_rank()}.json").write_text(json.dumps({"saves": saves, "latest": latest, "sharding_of_checked": checked}))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
