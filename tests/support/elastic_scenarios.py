"""Megatron layouts saved by one world and loaded by another (tests/test_elastic.py).

A "layout" is tensor parallelism tp over world_size ranks (data parallelism world_size // tp):
rank r is TP rank r % tp and DP rank r // tp. Every layout describes the same global model,
built from a seed, so a loading world knows exactly what each of its shards must hold:

- w_col [8, 6], split by rows over TP (column parallel), replicated over DP;
- w_row [6, 8], split by columns over TP (row parallel), replicated over DP;
- bias [8], replicated on every rank;
- the distributed optimizer's state of w_col: each rank's TP shard, flattened and split over
  the DP ranks at uneven points (flattened ShardedTensors, as Megatron's distributed optimizer
  stores them);
- iteration, common state.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy  # noqa: E402

from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.replication.choice import choose_version  # noqa: E402
from ml_flashpoint_nemo.replication.service import ReplicationConfig  # noqa: E402
from tests.support.megatron_scenarios import load_strategy, version_dir  # noqa: E402
from tests.support.multiproc import expect_failure, scenario_main  # noqa: E402


def full(key: str, seed: int) -> torch.Tensor:
    shapes = {"w_col": (8, 6), "w_row": (6, 8), "bias": (8,), "exp_avg": (8, 6)}
    generator = torch.Generator().manual_seed(seed * 100 + sorted(shapes).index(key))
    return torch.randn(*shapes[key], generator=generator)


def flat_split(numel: int, dp: int, dp_rank: int) -> slice:
    """Uneven split points of a flattened shard over the DP ranks (bucket boundaries are never even)."""
    points = [0] + [numel * k // dp + (1 if 0 < k < dp else 0) for k in range(1, dp)] + [numel]
    return slice(points[dp_rank], points[dp_rank + 1])


def sharded_state(seed: int, tp: int, *, zeros: bool = False, flat: bool = True) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % tp == 0, (world, tp)
    dp, tp_rank, dp_rank = world // tp, rank % tp, rank // tp

    def data(key: str) -> torch.Tensor:
        tensor = full(key, seed)
        return torch.zeros_like(tensor) if zeros else tensor

    w_col = data("w_col").chunk(tp, 0)[tp_rank].clone()
    w_row = data("w_row").chunk(tp, 1)[tp_rank].clone()
    state: dict[str, Any] = {
        "w_col": ShardedTensor.from_rank_offsets("w_col", w_col, (0, tp_rank, tp), replica_id=dp_rank),
        "w_row": ShardedTensor.from_rank_offsets("w_row", w_row, (1, tp_rank, tp), replica_id=dp_rank),
        "bias": ShardedTensor.from_rank_offsets("bias", data("bias").clone(), replica_id=rank),
        "iteration": seed,
    }
    if flat:
        shard = data("exp_avg").chunk(tp, 0)[tp_rank]
        part = flat_split(shard.numel(), dp, dp_rank)
        state["optimizer"] = {"exp_avg": ShardedTensor.from_rank_offsets_flat(
            "optimizer.exp_avg.w_col", shard.flatten()[part].clone(), tuple(shard.shape), (0, tp_rank, tp),
            flattened_range=part)}
    return state


def check_loaded(loaded: dict[str, Any], seed: int, tp: int, *, flat: bool = True) -> None:
    expected = sharded_state(seed, tp, flat=flat)
    for key, value in (("w_col", loaded["w_col"]), ("w_row", loaded["w_row"]), ("bias", loaded["bias"])):
        assert torch.equal(value, expected[key].data), f"rank {dist.get_rank()}: {key} differs"
    if flat:
        got, want = loaded["optimizer"]["exp_avg"], expected["optimizer"]["exp_avg"].data
        assert torch.equal(got, want), f"rank {dist.get_rank()}: the flattened optimizer state differs"
    assert loaded["iteration"] == seed


def save_layout(p: dict[str, Any]) -> None:
    """Save step p["step"] (or each of p["steps"]) in layout tp=p["tp"]; with p["durable"], also through torch_dist."""
    strategy = FlashpointSaveStrategy()
    for step in p.get("steps") or [p["step"]]:
        dist_checkpointing.save(sharded_state(step, p["tp"]), version_dir(p["base"], step), sharded_strategy=strategy)
        if p.get("durable"):
            dist_checkpointing.save(sharded_state(step, p["tp"]), version_dir(p["durable"], step))
        print("SAVED", step, flush=True)
    strategy.close()


def load_layout(p: dict[str, Any]) -> None:
    """Choose the version as a restart would, then load it in layout tp=p["tp"] and check every shard. With
    p["domain_from_config"], the choice is given a config whose failure-domain callable must win over a malformed
    FLASHPOINT_FAILURE_DOMAIN (every node discovery of the choice must use the job's config)."""
    config = None
    if p.get("domain_from_config"):
        os.environ["FLASHPOINT_FAILURE_DOMAIN"] = "not a domain!"
        config = ReplicationConfig(failure_domain=lambda: "rack-a")
    try:
        chosen = choose_version(p["base"], config).step
    finally:
        os.environ.pop("FLASHPOINT_FAILURE_DOMAIN", None)
    assert chosen == p["step"], f"chose {chosen}, expected {p['step']}"
    loaded = dist_checkpointing.load(sharded_state(p["step"], p["tp"], zeros=True),
                                     os.path.join(p["base"], f"step-{p['step']}"), sharded_strategy=load_strategy(p))
    check_loaded(loaded, p["step"], p["tp"])
    print("LOADED", p["step"], "tp", p["tp"], "world", dist.get_world_size(), flush=True)


def unsatisfiable_load_is_refused(p: dict[str, Any]) -> None:
    """A request the saved version cannot satisfy fails clearly on every rank, through ours as through torch_dist."""
    kind = p["kind"]
    template = sharded_state(p["step"], p["tp"], zeros=True)
    if kind == "global_shape":  # a bigger model than the one saved
        template["w_col"] = ShardedTensor.from_rank_offsets("w_col", torch.zeros(10, 6), replica_id=dist.get_rank())
    elif kind == "missing_key":
        template["w_new"] = ShardedTensor.from_rank_offsets("w_new", torch.zeros(3), replica_id=dist.get_rank())
    elif kind == "flattened_shape":  # the optimizer state of another parameter shape
        template["optimizer"]["exp_avg"] = ShardedTensor.from_rank_offsets_flat(
            "optimizer.exp_avg.w_col", torch.zeros(12), (2, 6), (0, dist.get_rank(), 4 * dist.get_world_size()),
            flattened_range=slice(0, 12))
    before = {k: v.data.clone() for k, v in template.items() if isinstance(v, ShardedTensor)}
    for name, base in (("ours", p["base"]), ("torch_dist", p["durable"])):
        directory = os.path.join(base, f"step-{p['step']}")
        strategy = load_strategy(p) if name == "ours" else get_default_load_sharded_strategy(directory)
        expect_failure(lambda: dist_checkpointing.load(template, directory, sharded_strategy=strategy),
                       f"REFUSED {name}")
    for key, data in before.items():  # nothing was written into the caller's tensors
        assert torch.equal(template[key].data, data), key


def forge_metadata(base: str, step: int, kind: str) -> None:
    """Rewrite the version's .metadata as a buggy writer would, with the commit record's checksum made to match."""
    import pickle

    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.core.version_files import FILES_KEY, describe_bytes
    from ml_flashpoint_nemo.core.versions import read_commit, write_commit

    path = Path(base) / f"step-{step}" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    chunks = metadata.state_dict_metadata["w_col"].chunks  # saved by TP2: [4, 6] at [0, 0] and [4, 0]
    first = chunks[0]
    if kind == "record_shape":  # same volume, inside the tensor, but not the shape of the stored record
        chunks[0] = dataclasses.replace(first, sizes=torch.Size([6, 4]))
    elif kind == "outside":
        chunks[0] = dataclasses.replace(first, offsets=torch.Size([6, 0]))
    elif kind == "negative":
        chunks[0] = dataclasses.replace(first, offsets=torch.Size([-4, 0]))
    elif kind == "chunk_missing":  # rank 1's part of w_col is not listed
        del chunks[1]
    encoded = pickle.dumps(metadata)
    path.write_bytes(encoded)
    layout = CheckpointLayout(base)
    commit = read_commit(layout, step)
    files = dict(commit.metadata[FILES_KEY], **{".metadata": describe_bytes(encoded)})
    write_commit(layout, step, commit.objects, world_size=commit.world_size,
                 metadata={**commit.metadata, FILES_KEY: files})


def forged_chunk_is_refused(p: dict[str, Any]) -> None:
    """A .metadata whose chunk offsets or sizes lie (checksums recomputed) fails the load clearly."""
    if dist.get_rank() == 0:
        forge_metadata(p["base"], p["step"], p["kind"])
    dist.barrier()
    template = sharded_state(p["step"], p["tp"], zeros=True)
    expect_failure(lambda: dist_checkpointing.load(template, os.path.join(p["base"], f"step-{p['step']}"),
                                                   sharded_strategy=load_strategy(p)), "REFUSED")
    untouched = all(not v.data.any() for v in template.values() if isinstance(v, ShardedTensor))
    print("UNTOUCHED", untouched, flush=True)


if __name__ == "__main__":
    scenario_main({f.__name__: f for f in (save_layout, load_layout, unsatisfiable_load_is_refused,
                                           forged_chunk_is_refused)})
