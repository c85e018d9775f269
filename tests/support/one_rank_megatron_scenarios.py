"""One-rank failures at the collective sites of megatron/ and nemo/ (issue 13, section 3).

Run by tests/test_one_rank_sites.py on 2 gloo ranks, each rank its own "node" (base directory)
unless a case says otherwise. Each case injects a local failure on one rank; see
tests/support/one_rank_sites.py.
"""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from ml_flashpoint_nemo.testing import cpu_shims

cpu_shims.install_for_checkpointing()  # before Megatron is imported

import torch.distributed as dist  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402

from ml_flashpoint_nemo.core.layout import DCP_METADATA_NAME, CheckpointLayout  # noqa: E402
from ml_flashpoint_nemo.core.sync_manager import TIMEOUT_ENV  # noqa: E402
from ml_flashpoint_nemo.core.versions import committed_steps  # noqa: E402
from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.nemo import checkpoint_io  # noqa: E402 - NeMo's import, before the timed cases
from ml_flashpoint_nemo.nemo.resume import install_resume_choice  # noqa: E402
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings  # noqa: E402
from ml_flashpoint_nemo.replication.secret import SECRET_ENV  # noqa: E402
from tests.support import megatron_scenarios as ms  # noqa: E402
from tests.support.one_rank_sites import (  # noqa: E402
    Case,
    cases_main,
    committed_on_two_nodes,
    environment,
    failing_on,
    node_base,
)

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)

SECRET = "1b4bc043290ae7e2145ab0cbc35d27e3213050fd81531f58ff0672dc2db5408b"


def attempt(label: str, action: Callable[[], Any]) -> str:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - printed for the test
        return f"{label} FAILED {type(exc).__name__}: {exc}"
    return f"{label} DONE"


def manager_start_when_one_rank_has_a_bad_timeout(root: Path) -> str:
    """One node. Rank 1's FLASHPOINT_MANAGER_TIMEOUT_S is not a number, so starting its Manager at the first save
    fails there alone: the save fails on every rank, and the next one (the variable fixed) commits."""
    p = {"base": str(root / "shared")}
    strategy = FlashpointSaveStrategy()  # without a Manager future: it starts its own at the first save
    queue = AsyncCallsQueue(persistent=False)
    try:
        with environment(**{TIMEOUT_ENV: "soon" if dist.get_rank() == 1 else None}):
            first = attempt("SAVE", lambda: ms.save(p, 1, queue, strategy))
        ms.save(p, 2, queue, strategy)
        ms.check_loaded(ms.load(p, 2), 2)
        return f"{first} THEN COMMITTED {committed_steps(CheckpointLayout(p['base']))}"
    finally:
        queue.close()
        strategy.close()


def load_when_one_nodes_copy_is_damaged(root: Path) -> str:
    """Rank 1's node holds a copy of step 2's DCP metadata with a flipped byte: the load fails on every rank
    before DCP's collectives; with the byte flipped back, it loads."""
    p = {"base": str(node_base(root))}
    strategy = FlashpointSaveStrategy()
    try:
        with environment(**{SECRET_ENV: SECRET}):
            for step in (1, 2):
                ms.save(p, step, None, strategy)
        # Rank 1 reads rank 0's object (the replicated tensors) from its own node: wait until it was pushed there.
        assert strategy.replication is not None and strategy.replication.wait(2, timeout=60).replicated
        dist.barrier()
        metadata = Path(p["base"]) / "step-2" / DCP_METADATA_NAME
        if dist.get_rank() == 1:
            flip(metadata)
        dist.barrier()
        failed = attempt("LOAD", lambda: ms.load(p, 2))
        if dist.get_rank() == 1:
            flip(metadata)
        dist.barrier()
        ms.check_loaded(ms.load(p, 2), 2)
        return f"{failed} THEN LOADED 2"
    finally:
        strategy.close()


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def nemo_save_when_one_version_dir_cannot_be_made(root: Path) -> str:
    """A file sits where rank 1's node puts step 2: the NeMo IO skips that save on every rank (the outcome says
    why), the next save commits and loads, and the file is left alone."""
    p = {"base": str(node_base(root))}
    with environment(**{SECRET_ENV: SECRET}):
        io = ms.nemo_io(p)
        try:
            ms.save_through(io, p, 1)
            io.finalize_flashpoint(blocking=True)
            in_the_way = Path(p["base"]) / "step-2"
            if dist.get_rank() == 1:
                in_the_way.write_bytes(b"not a directory")
            dist.barrier()
            for step in (2, 3):
                ms.save_through(io, p, step)
            io.close(finalize=True)
        finally:
            io.close(finalize=False)
    ms.check_loaded(ms.load(p, 3), 3)
    if dist.get_rank() == 1:
        assert in_the_way.read_bytes() == b"not a directory"
    return f"{outcomes_of(io)} {[o.error for o in io.outcomes if o.error]} LOADED 3"


def nemo_steady_saves_when_one_rank_cannot_start(root: Path) -> str:
    """Steady saves fold the room check into the strategy's first all-reduce. Step 2: rank 0 cannot check its
    room; it joins that all-reduce without calling Megatron's save, so no common.pt, and every rank skips the
    save. Step 3: rank 0's common.pt write fails (before the strategy runs): every rank raises. Step 5, after a
    re-planning step 4: one collective in all the blocking part of the save."""
    import os

    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from collective_meter import CollectiveMeter

    p = {"base": str(node_base(root))}
    meter = CollectiveMeter().install()  # counts inside its window only
    with environment(**{SECRET_ENV: SECRET}):
        io = ms.nemo_io(p)
        try:
            ms.save_through(io, p, 1)
            io.finalize_flashpoint(blocking=True)
            with failing_on(0, os, "statvfs", OSError(errno.EIO, "Input/output error")):
                ms.save_through(io, p, 2)
            common_2 = (Path(p["base"]) / "step-2" / "common.pt").exists()
            with failing_on(0, TorchCommonSaveStrategy, "save_common", OSError(errno.ENOSPC, "No space left")):
                third = attempt("SAVE 3", lambda: ms.save_through(io, p, 3))
            ms.save_through(io, p, 4)
            path, state = ms.version_dir(p["base"], 5), ms.sharded_state(5)  # the helpers' own collectives
            with meter.window("steady save") as window:
                io.save_checkpoint(state, path, storage_options={checkpoint_io.FLASHPOINT_SAVE: True})
            collectives = [name for name, stats in window.by_function.items() for _ in range(stats.calls)]
            io.close(finalize=True)
        finally:
            io.close(finalize=False)
    ms.check_loaded(ms.load(p, 5), 5)
    return (f"{outcomes_of(io)} {[o.error for o in io.outcomes if o.error]} COMMON.PT OF 2 {common_2} {third} "
            f"COLLECTIVES {collectives} LOADED 5")


def outcomes_of(io: Any) -> str:
    return "OUTCOMES " + " ".join(f"{o.step}:{'failed' if o.error else 'ok'}" for o in io.outcomes)


def nemo_finalize_when_one_rank_cannot_count_the_bytes(root: Path) -> str:
    """Rank 1 cannot read step 1's commit record when the IO reports the committed save (out of file
    descriptors, say): the save is reported committed on every rank, only its byte count is unknown there."""
    p = {"base": str(node_base(root))}
    with environment(**{SECRET_ENV: SECRET}):
        io = ms.nemo_io(p)
        try:
            with failing_on(1, checkpoint_io, "read_commit", OSError(errno.EMFILE, "Too many open files")):
                ms.save_through(io, p, 1)
                io.finalize_flashpoint(blocking=True)
            ms.save_through(io, p, 2)
            io.close(finalize=True)
        finally:
            io.close(finalize=False)
    ms.check_loaded(ms.load(p, 2), 2)
    return f"{outcomes_of(io)} COUNTED {[o.nbytes > 0 for o in io.outcomes]} LOADED 2"


def resumed(root: Path, path: Any, *, ram: bool, durable_error: BaseException | None = None) -> str:
    """Call a trainer's checkpoint restore, wired for flashpoint resumes, with path; what it restored from."""
    if ram:
        committed_on_two_nodes(root)
    restored: list[Any] = []
    connector = SimpleNamespace(resume_start=lambda checkpoint_path=None: restored.append(checkpoint_path))
    trainer = SimpleNamespace(_checkpoint_connector=connector, state=SimpleNamespace(fn=TrainerFn.FITTING))
    if durable_error is not None:
        trainer._flashpoint_durable_error = durable_error  # type: ignore[attr-defined]
    install_resume_choice(trainer, FlashpointSettings.create(node_base(root)), enabled=True)
    with environment(**{SECRET_ENV: SECRET}):
        trainer._checkpoint_connector.resume_start(path)
    decision = trainer._flashpoint_resume  # type: ignore[attr-defined]
    assert restored == [decision.path], (restored, decision)
    return f"RESUMED FROM {decision.source} {decision.ram_step}"


def durable_checkpoint(root: Path, step: int) -> Path:
    """A durable (torch_dist) checkpoint of global step `step`, made by every rank."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    directory = ms.version_dir(str(root / "durable"), step)
    dist_checkpointing.save({"global_step": step}, directory,
                            sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    return Path(directory)


def resume_when_one_rank_cannot_read_the_durable_checkpoint(root: Path) -> str:
    """RAM step 1 on every node, durable step 7 that rank 1 cannot read: every rank resumes from RAM."""
    durable = durable_checkpoint(root, 7)
    with failing_on(1, dist_checkpointing, "load_common_state_dict", OSError(errno.EIO, "Input/output error")):
        return resumed(root, durable, ram=True)


def resume_when_the_ranks_see_different_durable_checkpoints(root: Path) -> str:
    """No RAM version; rank 0's AutoResume found durable step 7, rank 1's found none: every rank raises."""
    durable = durable_checkpoint(root, 7)
    return resumed(root, durable if dist.get_rank() == 0 else None, ram=False)


def resume_when_autoresume_failed_on_one_rank(root: Path) -> str:
    """No RAM version, no durable checkpoint, and rank 1's AutoResume failed: every rank raises."""
    error = ValueError("injected: the newest durable checkpoint is unfinished") if dist.get_rank() == 1 else None
    return resumed(root, None, ram=False, durable_error=error)


CASES: dict[str, Case] = {f.__name__: f for f in (
    manager_start_when_one_rank_has_a_bad_timeout,
    load_when_one_nodes_copy_is_damaged,
    nemo_save_when_one_version_dir_cannot_be_made,
    nemo_steady_saves_when_one_rank_cannot_start,
    nemo_finalize_when_one_rank_cannot_count_the_bytes,
    resume_when_one_rank_cannot_read_the_durable_checkpoint,
    resume_when_the_ranks_see_different_durable_checkpoints,
    resume_when_autoresume_failed_on_one_rank,
)}


if __name__ == "__main__":
    cases_main(CASES)
