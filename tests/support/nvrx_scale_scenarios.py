"""FlashpointLocalCheckpointManager on more simulated nodes than replicas (tests/test_nvrx_scale.py).

A "node" is its own base directory and ranks_per_node consecutive ranks (as in
replication_scenarios). Each rank counts, with benchmarks/collective_meter.py, the collectives
of every save, of find_latest and of load, and prints one JSON line of what it saw.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

import torch.distributed as dist

from tests.support.multiproc import REPO, node_base, scenario_main

sys.path.insert(0, str(REPO / "benchmarks"))

from collective_meter import CollectiveMeter  # noqa: E402

METER = CollectiveMeter().install()  # before the manager's modules bind any collective

from ml_flashpoint_nemo.core.layout import object_name  # noqa: E402
from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager  # noqa: E402
from ml_flashpoint_nemo.replication import ReplicationConfig  # noqa: E402
from tests.support.nvrx_peer_states import PlainTensorState  # noqa: E402

SESSION = "job"
REPLICATED = "replicated"


def state_of(iteration: int, rank: int) -> PlainTensorState:
    """Different tensors per rank and iteration (a load of another rank's or iteration's object shows); from
    iteration 3 on, 4 times as many tensors, so that what a save's collectives carry can be compared across T."""
    return PlainTensorState(iteration * 1000 + rank, count=4 if iteration < 3 else 16)


def manager_of(p: dict[str, Any]) -> FlashpointLocalCheckpointManager:
    config = ReplicationConfig(
        factor=p["factor"], host="127.0.0.1", connect_timeout_s=2.0, io_timeout_s=5.0, retries=1, backoff_s=0.1
    )
    return FlashpointLocalCheckpointManager(node_base(p), SESSION, replication=config)


def received(window: Any) -> dict[str, Any]:
    counted = window.as_dict()
    return {
        "received": counted["received"],
        "collectives": counted["collectives"],
        "by_function": {name: s["received"] for name, s in counted["by_function"].items()},
    }


def lose_ram(p: dict[str, Any], manager: FlashpointLocalCheckpointManager, iteration: int) -> None:
    """Node p["lost_node"] loses its whole base directory; rank p["lost_object_rank"] its object of iteration."""
    rank, per_node = dist.get_rank(), p["ranks_per_node"]
    if rank == p["lost_node"] * per_node:
        shutil.rmtree(manager.base_dir)
    if rank == p.get("lost_object_rank"):
        manager.layout.object_path(iteration, object_name(rank)).unlink()


def save_lose_ram_and_load(p: dict[str, Any]) -> None:
    """Save p["saves"] iterations (each replicated before the next), lose RAM, then a new manager loads."""
    rank = dist.get_rank()
    manager = manager_of(p)
    saves = []
    for iteration in range(1, p["saves"] + 1):
        with METER.window(f"save-{iteration}") as window:
            manager.save(state_of(iteration, rank), iteration)
        assert manager._replication is not None
        state = manager._replication.wait(iteration, timeout=60).state
        saves.append({"iteration": iteration, "replication": state, **received(window)})
        dist.barrier()  # every rank's pushes of this iteration are in before the next save
    manager.close()
    dist.barrier()
    lose_ram(p, manager, p["saves"])
    dist.barrier()
    manager = manager_of(p)  # a restart: a new manager on what is left
    with METER.window("find_latest") as find:
        latest = manager.find_latest()
    result: dict[str, Any] = {"rank": rank, "saves": saves, "latest": latest, "find_latest": received(find)}
    if latest >= 0:
        with METER.window("load") as load:
            loaded, ckpt_id = manager.load()
        result.update(ckpt_id=list(ckpt_id), bit_exact=loaded == state_of(latest, rank), load=received(load))
    manager.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    scenario_main({"save_lose_ram_and_load": save_lose_ram_and_load})
