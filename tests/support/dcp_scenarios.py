"""DCP scenarios run on several gloo ranks by tests/test_dcp.py (one process per rank)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ml_flashpoint_nemo.dcp import MemoryStorageReader, MemoryStorageWriter
from ml_flashpoint_nemo.dcp import reader as dcp_reader
from tests.support.multiproc import expect_failure, scenario_main

ROWS = 16


def global_weights(seed: int) -> dict[str, torch.Tensor]:
    """Full tensors; every rank builds the same ones, then keeps its shard."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "tp.weight": torch.randn(ROWS, 24, generator=gen),
        "tp.bias_bf16": torch.randn(ROWS, generator=gen).to(torch.bfloat16),
        "replicated.norm": torch.randn(24, generator=gen),
        "replicated.step": torch.tensor(seed, dtype=torch.int64),
    }


def make_state(seed: int) -> dict[str, Any]:
    """TP-style: tp.* sharded by rows over all ranks (DTensor), replicated.* on every rank, plus objects."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = global_weights(seed)
    state: dict[str, Any] = {}
    for name, tensor in full.items():
        state[name] = distribute_tensor(tensor, mesh, [Shard(0)]) if name.startswith("tp.") else tensor.clone()
    state["extra"] = {"seed": seed, "note": "python object, saved by DCP as bytes"}
    state[f"rank_local.{dist.get_rank()}"] = torch.full((3,), float(dist.get_rank() + 10 * seed))
    return state


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            out[name] = distribute_tensor(torch.zeros(value.shape, dtype=value.dtype), value.device_mesh,
                                          value.placements)
        elif isinstance(value, torch.Tensor):
            out[name] = torch.zeros_like(value)
        elif isinstance(value, dict):
            out[name] = {k: None for k in value}  # DCP flattens dicts; each leaf is loaded from its bytes
        else:
            out[name] = None
    return out


def assert_same(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    for name, want in expected.items():
        got = actual[name]
        if isinstance(want, DTensor):
            want, got = want.to_local(), got.to_local()
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dim() else got,
                                                           want.view(torch.uint8) if want.dim() else want), name
        else:
            assert got == want, (name, got, want)


def checkpoint_id(base: str, step: int) -> str:
    return os.path.join(base, f"step-{step}")


def sync_roundtrip(p: dict[str, Any]) -> None:
    writer = MemoryStorageWriter(p["base"])
    for step in (1, 2, 3):
        dcp.save(make_state(step), checkpoint_id=checkpoint_id(p["base"], step), storage_writer=writer)
    # keep=1: a save retires what is older than the newest committed version, so 2 and 3 remain
    assert sorted(os.listdir(p["base"])) == ["pool", "step-2", "step-3"], os.listdir(p["base"])
    loaded = empty_like_state(make_state(3))
    dcp.load(loaded, checkpoint_id=checkpoint_id(p["base"], 3), storage_reader=MemoryStorageReader(p["base"]))
    assert_same(make_state(3), loaded)
    writer.close()


def async_roundtrip(p: dict[str, Any]) -> None:
    kind = AsyncCheckpointerType.PROCESS if p["executor"] == "process" else AsyncCheckpointerType.THREAD
    writer = MemoryStorageWriter(p["base"])
    for step in (1, 2):
        state = make_state(step)
        future = dcp.async_save(state, checkpoint_id=checkpoint_id(p["base"], step), storage_writer=writer,
                                async_checkpointer_type=kind)
        state["replicated.norm"].add_(100.0)  # training goes on: staging must have copied already
        state["tp.weight"].to_local().mul_(-1)
        future.result(timeout=120)
    loaded = empty_like_state(make_state(2))
    dcp.load(loaded, checkpoint_id=checkpoint_id(p["base"], 2), storage_reader=MemoryStorageReader(p["base"]))
    assert_same(make_state(2), loaded)
    writer.close()


def save_only(p: dict[str, Any]) -> None:
    writer = MemoryStorageWriter(p["base"])
    dcp.save(make_state(p["step"]), checkpoint_id=checkpoint_id(p["base"], p["step"]), storage_writer=writer)
    writer.close()


@contextlib.contextmanager
def reader_paths() -> Iterator[dict[str, set[str]]]:
    """Which records the reader read in place into their destinations ("direct") and which through a copy."""
    seen: dict[str, set[str]] = {"direct": set(), "copied": set()}
    original = dcp_reader.read_object

    def spy(obj: Any, *, into: Any = None, keys: Any = None, threads: Any = None) -> Any:
        seen["direct"].update(into or {})
        seen["copied"].update(keys or ())
        return original(obj, into=into, keys=keys, threads=threads)

    dcp_reader.read_object = spy
    try:
        yield seen
    finally:
        dcp_reader.read_object = original


def load_resharded(p: dict[str, Any]) -> None:
    """Load tp.* (saved on another world size) into this world's shards; replicated values as saved.

    p["tp_path"] says how the tp.* records must be read: "direct" when every destination chunk is
    a whole stored chunk (more ranks saved than load), "copied" when destinations take parts of
    stored chunks (fewer ranks saved than load: read once, verified, the parts copied out).
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = global_weights(p["step"])
    state = {name: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for name, t in full.items()
             if name.startswith("tp.")}
    state["replicated.norm"] = torch.zeros(24)
    with reader_paths() as seen:
        dcp.load(state, checkpoint_id=checkpoint_id(p["base"], p["step"]),
                 storage_reader=MemoryStorageReader(p["base"]))
    tp_records = {key for path in seen.values() for key in path if key.startswith("tp.")}
    assert tp_records and tp_records <= seen[p["tp_path"]], (p["tp_path"], seen)
    assert "replicated.norm@0" in seen["direct"], seen
    for name in ("tp.weight", "tp.bias_bf16"):
        expected = distribute_tensor(full[name], mesh, [Shard(0)]).to_local()
        assert torch.equal(state[name].to_local(), expected), name
    assert torch.equal(state["replicated.norm"], full["replicated.norm"])


def load_into(p: dict[str, Any], state: dict[str, Any]) -> None:
    dcp.load(state, checkpoint_id=checkpoint_id(p["base"], p["step"]), storage_reader=MemoryStorageReader(p["base"]))


def load_wrong_shape(p: dict[str, Any]) -> None:
    expect_failure(lambda: load_into(p, {"replicated.norm": torch.zeros(25)}), "REFUSED")


def load_expect_failure(p: dict[str, Any]) -> None:
    expect_failure(lambda: load_into(p, empty_like_state(make_state(p["step"]))), "REFUSED")


def save_fails_then_previous_loads(p: dict[str, Any]) -> None:
    """Step 1 fits the small tmpfs; step 2's extra payload does not: every rank must see the error."""
    writer = MemoryStorageWriter(p["base"])
    dcp.save(make_state(1), checkpoint_id=checkpoint_id(p["base"], 1), storage_writer=writer)
    too_big = make_state(2)
    too_big["payload"] = torch.zeros(p["payload_numel"])
    expect_failure(lambda: dcp.save(too_big, checkpoint_id=checkpoint_id(p["base"], 2), storage_writer=writer),
                   "SAVE FAILED")
    loaded = empty_like_state(make_state(1))
    dcp.load(loaded, checkpoint_id=checkpoint_id(p["base"], 1), storage_reader=MemoryStorageReader(p["base"]))
    assert_same(make_state(1), loaded)
    writer.close()


def empty_states_round_trip(p: dict[str, Any]) -> None:
    """Step 1: nothing to save (sync); 2: nothing (async); 3: only rank 0 has a tensor."""
    writer = MemoryStorageWriter(p["base"], keep=3)
    dcp.save({}, checkpoint_id=checkpoint_id(p["base"], 1), storage_writer=writer)
    dcp.async_save({}, checkpoint_id=checkpoint_id(p["base"], 2), storage_writer=writer,
                   async_checkpointer_type=AsyncCheckpointerType.THREAD).result(timeout=120)
    only_rank0 = {"rank_local.0": torch.arange(4.0)} if dist.get_rank() == 0 else {}
    dcp.save(only_rank0, checkpoint_id=checkpoint_id(p["base"], 3), storage_writer=writer)
    for step in (1, 2):
        nothing: dict[str, Any] = {}
        dcp.load(nothing, checkpoint_id=checkpoint_id(p["base"], step), storage_reader=MemoryStorageReader(p["base"]))
        assert nothing == {}, nothing
    into = {"rank_local.0": torch.zeros(4)} if dist.get_rank() == 0 else {}
    dcp.load(into, checkpoint_id=checkpoint_id(p["base"], 3), storage_reader=MemoryStorageReader(p["base"]))
    assert dist.get_rank() != 0 or torch.equal(into["rank_local.0"], torch.arange(4.0)), into
    writer.close()


def version_bytes(base: str, step: int) -> dict[str, bytes]:
    """Every file of a version and its bytes: what "nothing changed" compares."""
    root = os.path.join(base, f"step-{step}")
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def overwrite_refused_on_every_rank(p: dict[str, Any]) -> None:
    """Step 4 is committed; a second save to it with overwrite=False on p["refusing"] ranks must fail on all."""
    writer = MemoryStorageWriter(p["base"], overwrite=False)
    dcp.save(make_state(4), checkpoint_id=checkpoint_id(p["base"], 4), storage_writer=writer)
    dist.barrier()
    before = version_bytes(p["base"], 4)
    refusing = dist.get_rank() in p["refusing"]
    again = writer if refusing else MemoryStorageWriter(p["base"], overwrite=True)
    expect_failure(lambda: dcp.save(make_state(5), checkpoint_id=checkpoint_id(p["base"], 4), storage_writer=again),
                   "REFUSED")
    dist.barrier()  # no rank is left behind in a collective of the refused save
    assert version_bytes(p["base"], 4) == before, "the refused save changed the committed version"
    loaded = empty_like_state(make_state(4))
    dcp.load(loaded, checkpoint_id=checkpoint_id(p["base"], 4), storage_reader=MemoryStorageReader(p["base"]))
    assert_same(make_state(4), loaded)
    print(f"FILES {len(before)}", flush=True)
    for w in {id(writer): writer, id(again): again}.values():
        w.close()


if __name__ == "__main__":
    scenario_main({f.__name__: f for f in (sync_roundtrip, async_roundtrip, save_only, load_resharded,
                                           load_wrong_shape, load_expect_failure, save_fails_then_previous_loads,
                                           empty_states_round_trip, overwrite_refused_on_every_rank)})
