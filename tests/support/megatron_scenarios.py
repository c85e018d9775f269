"""megatron.core.dist_checkpointing scenarios run on several gloo ranks by tests/test_megatron.py."""

from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from ml_flashpoint_nemo.core import committed_steps  # noqa: E402
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name  # noqa: E402
from ml_flashpoint_nemo.core.sync_manager import start_manager_warmup  # noqa: E402
from ml_flashpoint_nemo.core.version_files import MEGATRON_CONFIG_BYTES, MEGATRON_CONFIG_NAME  # noqa: E402
from ml_flashpoint_nemo.megatron import FlashpointLoadStrategy, FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.replication.choice import choose_version  # noqa: E402
from tests.support import manager_hooks  # noqa: E402
from tests.support.multiproc import expect_failure, node_base, scenario_main  # noqa: E402
from tests.support.orphans import wait_gone  # noqa: E402

ROWS_PER_RANK = 4


def full_weight(seed: int) -> torch.Tensor:
    return torch.randn(ROWS_PER_RANK * dist.get_world_size(), 8, generator=torch.Generator().manual_seed(seed))


def sharded_state(seed: int, *, zeros: bool = False) -> dict[str, Any]:
    """TP-style: a weight split by rows over ranks, a replicated bias, a per-rank ShardedObject, common state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    weight = full_weight(seed)[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK].clone()
    bias = torch.arange(8, dtype=torch.bfloat16) * seed
    if zeros:
        weight, bias = torch.zeros_like(weight), torch.zeros_like(bias)
    return {
        "layer.weight": ShardedTensor.from_rank_offsets("layer.weight", weight, (0, rank, world)),
        "layer.bias": ShardedTensor.from_rank_offsets("layer.bias", bias, replica_id=rank),
        "rng": ShardedObject("rng", None if zeros else {"seed": seed, "rank": rank}, (world,), (rank,),
                             replica_id=0),
        "iteration": seed,  # common state
    }


def check_loaded(loaded: dict[str, Any], seed: int) -> None:
    rank = dist.get_rank()
    expected = full_weight(seed)[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    assert torch.equal(loaded["layer.weight"], expected), "weight shard differs"
    assert torch.equal(loaded["layer.bias"], torch.arange(8, dtype=torch.bfloat16) * seed), "bias differs"
    assert loaded["rng"] == {"seed": seed, "rank": rank}, loaded["rng"]
    assert loaded["iteration"] == seed


def version_dir(base: str, step: int) -> str:
    path = os.path.join(base, f"step-{step}")
    if dist.get_rank() == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return path


def save_strategy(p: dict[str, Any]):
    manager_future = None
    if p.get("manager") and dist.get_rank() == 1:  # only rank 1's Manager misbehaves
        manager_future = start_manager_warmup(timeout=p.get("manager_timeout"),
                                              _server_hook=getattr(manager_hooks, p["manager"]))
    strategy = FlashpointSaveStrategy(manager_future=manager_future)
    if p.get("fully_parallel"):
        strategy = FullyParallelSaveStrategyWrapper(strategy, dist.group.WORLD, do_cache_distribution=True)
    return strategy


def load_strategy(p: dict[str, Any]):
    strategy = FlashpointLoadStrategy()
    if p.get("fully_parallel"):
        strategy = FullyParallelLoadStrategyWrapper(strategy, dist.group.WORLD, exchange_algo="gather_object")
    return strategy


def save(p: dict[str, Any], step: int, queue: AsyncCallsQueue | None, strategy: Any = None) -> None:
    request = dist_checkpointing.save(sharded_state(step), version_dir(p["base"], step),
                                      sharded_strategy=strategy or save_strategy(p),
                                      async_sharded_save=queue is not None)
    if queue is not None:
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)


def load(p: dict[str, Any], step: int) -> dict[str, Any]:
    return dist_checkpointing.load(sharded_state(step, zeros=True), os.path.join(p["base"], f"step-{step}"),
                                   sharded_strategy=load_strategy(p))


def roundtrip(p: dict[str, Any]) -> None:
    queue = None if p["mode"] == "sync" else AsyncCallsQueue(persistent=p["mode"] == "persistent")
    strategy = save_strategy(p)  # one per job, as a trainer holds it: its plan is reused from the 2nd save
    for step in (1, 2, 3):
        save(p, step, queue, strategy)
    for step in (2, 3):  # keep=1: the newest and the one before the last save survive
        check_loaded(load(p, step), step)
    base = strategy.base_strategy if hasattr(strategy, "base_strategy") else strategy
    assert base.recipe_saves == 2, base.recipe_saves  # saves 2 and 3 replayed the recipe learnt on save 1
    if queue is not None:
        queue.close()
    (strategy.base_strategy if hasattr(strategy, "base_strategy") else strategy).close()


def save_then_corrupt_is_refused(p: dict[str, Any]) -> None:
    save(p, 1, None)
    if dist.get_rank() == 0:
        obj = Path(p["base"]) / "step-1" / p["file"]
        data = bytearray(obj.read_bytes())
        offset = p["offset"] if isinstance(p["offset"], int) else data.index(p["offset"].encode())
        data[offset] ^= 0x01
        obj.write_bytes(bytes(data))
    dist.barrier()
    expect_failure(lambda: load(p, 1), "REFUSED")


def interrupted_config_rewrite_is_repaired(p: dict[str, Any]) -> None:
    """Megatron rewrites metadata.json in place after our commit; a kill there leaves it truncated.

    Recovery still chooses the version and it loads: the file is restored from its only possible
    content, which matches the commit record.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    from ml_flashpoint_nemo.megatron.strategies import BACKEND, VERSION

    save(p, 1, None)
    config = Path(p["base"]) / "step-1" / MEGATRON_CONFIG_NAME
    written = config.read_bytes()
    assert written == MEGATRON_CONFIG_BYTES, written  # the content flashpoint knows without importing Megatron
    dist.barrier()  # every rank read it before rank 0 truncates it
    if dist.get_rank() == 0:
        config.write_bytes(b"")  # the truncation before Megatron's write
    dist.barrier()
    assert choose_version(p["base"]).step == 1  # recovery checks the version's files (and repairs this one)
    assert config.read_bytes() == written, config.read_bytes()
    check_loaded(load(p, 1), 1)
    print("REPAIRED", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        save_config(CheckpointingConfig(BACKEND, VERSION + 1), str(config.parent))  # well-formed, but not ours
    dist.barrier()
    assert choose_version(p["base"]).step == 1 and config.read_bytes() == written  # any damage: one content
    print("RESTORED", flush=True)


def plan_reused_only_while_structure_is_unchanged(p: dict[str, Any]) -> None:
    """Saves 1-5 share a structure (the plan is reused); save 6 adds a tensor on rank 1 only.

    Under the reused plan a save replays the write recipe learnt on the last save that went the
    long way (Megatron's conversion and DCP's planner), unless a value no longer fits it: at save 3
    rank 1's weight is a non-contiguous tensor, so rank 1 alone goes the long way (and learns no
    recipe from it: a replay could not give that view). At save 4 both ranks hold an object torch
    cannot save, rank 0 in its replay, rank 1 on the long way (still without a recipe): that save
    fails on every rank (no rank raises alone), rank 0 keeps its recipe and rank 1 relearns at save
    5. Every committed version loads exactly.
    """
    strategy = save_strategy(p)
    recipe_saves = []
    for step in (1, 2, 3, 4, 5, 6):
        state = sharded_state(step)
        if step == 3 and dist.get_rank() == 1:
            weight = state["layer.weight"]
            weight.data = weight.data.t().contiguous().t()  # the same values, column-major
            assert not weight.data.is_contiguous()
        if step == 4:  # rank 0 replays its recipe, rank 1 goes the long way: both must fail alike
            state["rng"].data = {"seed": lambda: step}  # torch.save cannot pickle a lambda
        if step == 6 and dist.get_rank() == 1:
            state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.full((5,), 7.0), replica_id=0)
        directory = version_dir(p["base"], step)
        if step == 4:
            expect_failure(lambda: dist_checkpointing.save(state, directory, sharded_strategy=strategy),
                           "SAVE 4 FAILED")
        else:
            dist_checkpointing.save(state, directory, sharded_strategy=strategy)
        recipe_saves.append(strategy.recipe_saves)
        if step not in (4, 6):
            check_loaded(load(p, step), step)
    expected = [0, 1, 2, 2, 3, 3] if dist.get_rank() == 0 else [0, 1, 1, 1, 1, 1]
    assert recipe_saves == expected, (dist.get_rank(), recipe_saves)
    template = sharded_state(6, zeros=True)
    template["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(5), replica_id=dist.get_rank())
    loaded = dist_checkpointing.load(template, os.path.join(p["base"], "step-6"), sharded_strategy=load_strategy(p))
    check_loaded(loaded, 6)
    assert torch.equal(loaded["extra"], torch.full((5,), 7.0)), loaded["extra"]


def recipes_that_keep_failing_are_not_relearnt(p: dict[str, Any]) -> None:
    """A value on Megatron's prepend-axis path is non-contiguous at every save: its conversion copies it, so each
    recipe is learnt from that copy and fails at the next save's replay. After two such recipes the plan stops
    learning (each would cost a replay and a comparison for nothing); every version still loads exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = save_strategy(p)
    seen = []
    for step in (1, 2, 3, 4):
        data = (torch.arange(8.0).view(4, 2) * step).t()  # (2, 4), column-major
        state = {"stack": ShardedTensor.from_rank_offsets("stack", data, (0, rank, world), prepend_axis_num=1)}
        dist_checkpointing.save(state, version_dir(p["base"], step), sharded_strategy=strategy)
        seen.append((strategy._recipe is not None, strategy._recipes_dropped, strategy.recipe_saves))
        template = {"stack": ShardedTensor.from_rank_offsets("stack", torch.zeros(2, 4), (0, rank, world),
                                                             prepend_axis_num=1)}
        loaded = dist_checkpointing.load(template, os.path.join(p["base"], f"step-{step}"),
                                         sharded_strategy=load_strategy(p))
        assert torch.equal(loaded["stack"], data), (step, loaded["stack"], data)
    # learnt at 1, dropped and relearnt at 2, dropped at 3 and not learnt again
    assert seen == [(True, 0, 0), (True, 1, 0), (False, 2, 0), (False, 2, 0)], seen


def second_save_reuses_a_buffer_warmed_after_the_first(p: dict[str, Any]) -> None:
    """The first save leaves a warm pool buffer behind: the second save (the first version still committed)
    stages into that file, not into a new one whose pages it would fault in while training waits."""
    strategy = save_strategy(p)
    save(p, 1, None, strategy)
    layout, rank = CheckpointLayout(p["base"]), dist.get_rank()
    object_nbytes = (layout.version_dir(1) / object_name(rank)).stat().st_size
    deadline = time.monotonic() + 60
    while True:
        warm = [b.stat() for b in layout.pool_dir(rank).glob("buf-*") if b.stat().st_size >= object_nbytes]
        if warm:
            break
        assert time.monotonic() < deadline, f"no pool buffer of >= {object_nbytes} bytes 60 s after the first save"
        time.sleep(0.05)
    save(p, 2, None, strategy)
    placed = (layout.version_dir(2) / object_name(rank)).stat()
    assert (placed.st_dev, placed.st_ino) == (warm[0].st_dev, warm[0].st_ino), "the second save made a new buffer"
    assert committed_steps(layout) == [1, 2]
    check_loaded(load(p, 2), 2)
    print("WARM BUFFER REUSED", flush=True)
    strategy.close()


def failed_background_write_fails_every_rank(p: dict[str, Any]) -> None:
    """Rank 1's staged buffer disappears before its worker seals it: a real I/O failure in the worker."""
    save(p, 1, None)
    queue = AsyncCallsQueue(persistent=False)
    request = dist_checkpointing.save(sharded_state(2), version_dir(p["base"], 2), sharded_strategy=save_strategy(p),
                                      async_sharded_save=True)
    if dist.get_rank() == 1:
        os.unlink(request.async_fn_args[0].path)
    queue.schedule_async_request(request)
    expect_failure(lambda: queue.maybe_finalize_async_calls(blocking=True), "SAVE FAILED")
    check_loaded(load(p, 1), 1)
    queue.close()


def overlapping_saves_each_get_their_report(p: dict[str, Any]) -> None:
    """Three async saves in flight, all workers done before the first finalize: each finalize finds its report.

    The first finalize reads the later saves' reports from the shared queue too; they must be
    kept for their own finalize (dropping them failed those saves as "ended without reporting").
    """
    queue = AsyncCallsQueue(persistent=p["mode"] == "persistent")
    strategy = save_strategy(p)
    for step in (1, 2, 3):
        request = dist_checkpointing.save(sharded_state(step), version_dir(p["base"], step),
                                          sharded_strategy=strategy, async_sharded_save=True)
        queue.schedule_async_request(request)
    deadline = time.monotonic() + 60
    while strategy._reports.queue.qsize() < 3:  # every worker has sealed and reported
        assert time.monotonic() < deadline, "the background writes did not report within 60 s"
        time.sleep(0.05)
    dist.barrier()
    queue.maybe_finalize_async_calls(blocking=True)  # raises if any of the three saves failed
    assert committed_steps(CheckpointLayout(p["base"]))[-1] == 3
    check_loaded(load(p, 3), 3)
    # saves 2 and 3 were scheduled before save 1 finalized, and reused its plan all the same
    assert strategy._coordinator_items.plan == 1, strategy._coordinator_items.plan
    queue.close()
    strategy.close()


def overlapping_saves_report_compactly_after_a_full_one(p: dict[str, Any]) -> None:
    """NeMo's async queue under frequent saves: each save is scheduled before the previous one finalized.

    Save 1 makes the plan and fails on rank 1 (its staged buffer disappears before it is sealed);
    save 2, scheduled before that failure was known, reuses the plan. Rank 0 never got the plan's
    items, so save 2 reports in full and commits; saves 3-5 report their object records alone.
    Prints, on rank 0, how each save that reached the commit reported, and the number of plans made.
    """
    strategy = save_strategy(p)
    items = strategy._coordinator_items
    reported: list[str] = []
    plain_full_results = items.full_results

    def recording(gathered: list[Any], *, compact: bool, plan: int) -> Any:
        reported.append("compact" if compact else "full")
        return plain_full_results(gathered, compact=compact, plan=plan)

    items.full_results = recording  # type: ignore[method-assign]

    def scheduled(step: int) -> Any:
        request = dist_checkpointing.save(sharded_state(step), version_dir(p["base"], step),
                                          sharded_strategy=strategy, async_sharded_save=True)
        if step == 1 and dist.get_rank() == 1:
            os.unlink(request.async_fn_args[0].path)  # a real I/O failure in rank 1's background write
        request.async_fn(*request.async_fn_args)  # the background write, here in the trainer
        return request

    def finalized(request: Any) -> None:
        for fn in request.finalize_fns:
            fn()

    pending = scheduled(1)
    for step in (2, 3, 4, 5):
        following = scheduled(step)  # before `pending` finalized
        if step == 2:
            expect_failure(lambda: finalized(pending), "SAVE 1 FAILED")
        else:
            finalized(pending)
        pending = following
    finalized(pending)
    committed = committed_steps(CheckpointLayout(p["base"]))
    assert committed[-1] == 5 and 1 not in committed, committed
    check_loaded(load(p, 5), 5)
    if dist.get_rank() == 0:
        print("REPORTS", " ".join(reported), flush=True)
    print("PLANS", items.plan, flush=True)
    strategy.close()


def nemo_io(p: dict[str, Any], **options: Any) -> Any:
    """The NeMo checkpoint IO flashpoint wraps a trainer's with, RAM saves async, on p["base"]."""
    from nemo.lightning.io.pl import MegatronCheckpointIO

    from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO
    from ml_flashpoint_nemo.nemo.settings import FlashpointSettings

    settings = FlashpointSettings.create(p["base"], async_save=True, parallel_save=False, **options)
    return FlashpointCheckpointIO(MegatronCheckpointIO(), settings)


def save_through(io: Any, p: dict[str, Any], step: int) -> None:
    from ml_flashpoint_nemo.nemo.checkpoint_io import FLASHPOINT_SAVE

    io.save_checkpoint(sharded_state(step), version_dir(p["base"], step), storage_options={FLASHPOINT_SAVE: True})


def print_outcomes(io: Any, p: dict[str, Any]) -> None:
    print("OUTCOMES", " ".join(f"{o.step}:{'failed' if o.error else 'ok'}" for o in io.outcomes), flush=True)
    print("COMMITTED", committed_steps(CheckpointLayout(p["base"])), flush=True)


def close_and_report(io: Any, p: dict[str, Any], *, loaded_step: int) -> None:
    """Close the IO (finalizing), print every save's outcome and the errors, check loaded_step loads."""
    io.close(finalize=True)
    print_outcomes(io, p)
    if dist.get_rank() == 0:
        print("ERRORS", [o.error for o in io.outcomes if o.error], flush=True)
    check_loaded(load(p, loaded_step), loaded_step)


def close_commits_the_saves_after_a_failed_one(p: dict[str, Any]) -> None:
    """Two RAM saves in flight through the NeMo checkpoint IO; rank 1's write of the first fails.

    Megatron stops finalizing at the failed save; closing with finalize must still commit the
    second (it used to kill its worker), and report both outcomes.
    """
    io = nemo_io(p)
    strategy = io.flashpoint_strategy
    plain_async_save = strategy.async_save

    def async_save_losing_step_1(sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        request = plain_async_save(sharded_state_dict, checkpoint_dir)
        if dist.get_rank() == 1 and str(checkpoint_dir).endswith("step-1"):
            os.unlink(request.async_fn_args[0].path)  # a real I/O failure in rank 1's forked worker
        return request

    strategy.async_save = async_save_losing_step_1  # type: ignore[method-assign]
    for step in (1, 2):
        save_through(io, p, step)
    io.close(finalize=True)
    print_outcomes(io, p)
    check_loaded(load(p, 2), 2)


def staging_fails_on_one_rank_before_its_persistent_worker(p: dict[str, Any]) -> None:
    """Rank 1's staging of step 1 fails (its worker gets a call with nothing to run) and step 2 follows at once:
    both finalize in order without waiting out worker_timeout_s; step 1 failed everywhere, step 2 committed."""
    from ml_flashpoint_nemo.megatron import strategies

    io = nemo_io(p, worker_timeout_s=60)
    io.begin_fit()
    assert io.flashpoint_queue.worker_ready(timeout=120), "the persistent worker did not come up"
    dist.barrier()
    stage = strategies._StagingWriter._stage

    def stage_failing_step_1(self: Any, resolve: Any) -> None:
        if dist.get_rank() == 1 and self.step == 1:
            raise OSError("injected: no room to stage step 1")
        stage(self, resolve)

    strategies._StagingWriter._stage = stage_failing_step_1  # type: ignore[method-assign]
    for step in (1, 2):
        save_through(io, p, step)
    io.close(finalize=True)
    print_outcomes(io, p)
    check_loaded(load(p, 2), 2)


def hung_worker_fails_its_save_within_the_timeout(p: dict[str, Any]) -> None:
    """Rank 1's forked worker of step 2 hangs forever: the blocking finalize must end within worker_timeout_s
    with the save failed on every rank, the worker stopped, and the next save committed."""
    from ml_flashpoint_nemo.core import save_worker

    io = nemo_io(p, persistent_worker=False, worker_timeout_s=5)
    save_through(io, p, 1)
    io.finalize_flashpoint(blocking=True)
    sealing = save_worker.seal_object
    if dist.get_rank() == 1:
        save_worker.seal_object = lambda job, threads: time.sleep(3600)  # inherited by the forked worker
    save_through(io, p, 2)
    save_worker.seal_object = sealing
    worker_pid = io.flashpoint_queue.async_calls[0].async_caller.process.pid
    started = time.monotonic()
    io.finalize_flashpoint(blocking=True)
    print(f"FINALIZED in {time.monotonic() - started:.1f}s worker_gone={not os.path.exists(f'/proc/{worker_pid}')}",
          flush=True)
    save_through(io, p, 3)
    close_and_report(io, p, loaded_step=3)


def a_due_save_waits_while_one_is_sealing(p: dict[str, Any]) -> None:
    """Rank 1's forked worker of step 2 seals only once released: the callback takes no save while it is in
    flight (steps 4 and 5, every 2 steps, max_saves_in_flight=1), then takes the owed one at step 5."""
    from types import SimpleNamespace

    from ml_flashpoint_nemo.core import save_worker
    from ml_flashpoint_nemo.nemo.callback import FlashpointCallback

    io = nemo_io(p, persistent_worker=False, every_n_steps=2)
    callback = FlashpointCallback()
    callback.attach(io.settings, io)
    trainer = SimpleNamespace(callbacks=[])  # should_save reads only the trainer's callbacks (no ModelCheckpoint)
    released = Path(p["base"]) / "release-seal"
    sealing = save_worker.seal_object

    def seal_once_released(job: Any, threads: int) -> Any:
        deadline = time.monotonic() + 120
        while not released.exists():
            assert time.monotonic() < deadline, "the test never released the seal"
            time.sleep(0.01)
        return sealing(job, threads)

    if dist.get_rank() == 1:
        save_worker.seal_object = seal_once_released  # inherited by the forked worker
    decisions = []
    for step in (2, 3, 4, 5):
        decisions.append(f"{step}:{callback.should_save(trainer, step)}")
        if decisions[-1].endswith("True"):
            save_through(io, p, step)
        io.finalize_flashpoint(blocking=False)
    save_worker.seal_object = sealing
    if dist.get_rank() == 1:
        released.touch()
    io.finalize_flashpoint(blocking=True)
    decisions.append(f"5:{callback.should_save(trainer, 5)}")
    print("DECISIONS", " ".join(decisions), "DEFERRED", callback.deferred_saves, flush=True)
    io.close(finalize=True)
    print_outcomes(io, p)


def overlapped_capture_holds_the_optimizer_step(p: dict[str, Any]) -> None:
    """Overlapped capture on live parameters: each save returns with its copy still held back (it waits for
    `release`, set by a timer only once the save returned); the optimizer step right after it must wait for the
    copy, which a step pre-hook registered after ours sees as no copy in flight, and each committed version holds
    the values of before its step, bit for bit. Rank 1's copy of step 2 fails: that save fails on every rank,
    step 3 commits. At step 4 rank 1 cannot make the channel to its worker (its Manager failed): it waits for its
    copy in the save instead, and step 4 commits on every rank. At step 5 the save's worker is forked while the copy
    is held, then a load of step 4 into the live parameter (a restore) runs: it must wait for the copy, the worker's
    seal must wait for the copy's outcome, and version 5 holds the values from before the load."""
    import threading

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from ml_flashpoint_nemo.core import capture
    from ml_flashpoint_nemo.core import saver as saver_module

    rank, world = dist.get_rank(), dist.get_world_size()
    weight = torch.nn.Parameter(full_weight(1)[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK].clone())
    optimizer = torch.optim.SGD([weight], lr=0.5)
    strategy = FlashpointSaveStrategy(overlap_capture=True)
    queue = AsyncCallsQueue(persistent=False)
    copy = saver_module.background_copy
    release = threading.Event()
    failing = [False]
    at_step: list[int] = []  # copies in flight when an optimizer step begins, after our guard's hook

    def held_copy(*args: Any) -> None:
        assert release.wait(120), "the test never released the copy"
        if dist.get_rank() == 1 and failing[0]:
            raise OSError("injected: the background copy failed")
        copy(*args)

    def no_channel(copying: Any) -> Any:
        raise ConnectionResetError("injected: the Manager is gone")

    saver_module.background_copy = held_copy
    for step in (1, 2, 3, 4):
        failing[0] = step == 2
        release.clear()
        if step == 4 and rank == 1:
            strategy._copy_outcome_channel = no_channel  # type: ignore[method-assign]
            release.set()  # this save waits for its copy itself
        state = {"w": ShardedTensor.from_rank_offsets("w", weight.detach(), (0, rank, world))}
        request = dist_checkpointing.save(state, version_dir(p["base"], step), sharded_strategy=strategy,
                                          async_sharded_save=True)
        after_save = capture.copies_in_flight()
        if step == 1:  # after the first overlapped save installed ours, so it runs second
            register_optimizer_step_pre_hook(lambda *unused: at_step.append(capture.copies_in_flight()))
        saved = weight.detach().clone()
        threading.Timer(0.3, release.set).start()  # a step not held by our guard begins long before this
        weight.grad = torch.ones_like(weight)
        optimizer.step()  # writes the captured tensor in place: must wait for the copy
        print(f"STEP {step} in flight after the save {after_save}, at the optimizer step {at_step[-1]}", flush=True)
        queue.schedule_async_request(request)
        if step == 2:
            expect_failure(lambda: queue.maybe_finalize_async_calls(blocking=True), "SAVE 2 FAILED")
            continue
        queue.maybe_finalize_async_calls(blocking=True)
        loaded = dist_checkpointing.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(weight), (0, rank, world))},
            os.path.join(p["base"], f"step-{step}"), sharded_strategy=FlashpointLoadStrategy())
        print(f"STEP {step} EXACT", torch.equal(loaded["w"], saved), "CHANGED", not torch.equal(saved, weight.detach()),
              flush=True)
    # Step 5: a restore into the live parameter while the save's copy is held: the load must wait for the copy.
    if rank == 1:
        del strategy._copy_outcome_channel  # its channel to the worker works again
    release.clear()
    request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight.detach(), (0, rank, world))},
                                      version_dir(p["base"], 5), sharded_strategy=strategy, async_sharded_save=True)
    saved = weight.detach().clone()
    queue.schedule_async_request(request)  # forks this save's worker while the capture thread holds its copy
    threading.Timer(0.3, release.set).start()
    dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", weight.detach(), (0, rank, world))},
                            os.path.join(p["base"], "step-4"), sharded_strategy=FlashpointLoadStrategy())
    after_load = capture.copies_in_flight()
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = dist_checkpointing.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(weight), (0, rank, world))},
        os.path.join(p["base"], "step-5"), sharded_strategy=FlashpointLoadStrategy())
    print(f"LOAD in flight after it {after_load}, STEP 5 EXACT", torch.equal(loaded["w"], saved),
          "CHANGED", not torch.equal(saved, weight.detach()), flush=True)
    saver_module.background_copy = copy
    print("COMMITTED", committed_steps(CheckpointLayout(p["base"])), flush=True)
    queue.close()
    strategy.close()


def saves_fork_until_the_persistent_worker_is_up(p: dict[str, Any]) -> None:
    """The IO starts its persistent worker at set-up; a save made while it boots forks a worker of its own,
    the saves after it is up run on it; all finalize in order, the newest loads bit-exactly, close stops it."""
    from tests.support.exit_hooks import boot_once_path_exists

    io = nemo_io(p)
    queue = io.flashpoint_queue
    booted = Path(tempfile.mkdtemp(prefix="boot-worker-")) / "go"
    queue._boot_hook = functools.partial(boot_once_path_exists, str(booted))  # held until step 1 was scheduled
    io.begin_fit()  # what it costs the trainer: benchmarks/bench_adapters.py, worker_start_seconds
    callers = []
    for step in (1, 2, 3):
        save_through(io, p, step)  # step 1: the worker is still booting
        callers.append(type(queue.async_calls[-1].async_caller).__name__)
        if step == 1:
            booted.touch()
            assert queue.worker_ready(timeout=120), "the persistent worker did not come up"
            dist.barrier()
    print("CALLERS", " ".join(callers), flush=True)
    worker = queue.persistent_caller.process.pid
    io.finalize_flashpoint(blocking=True)
    maps = Path(f"/proc/{worker}/maps").read_text()  # after two saves ran on it
    print("WORKER LOADED TORCH", "libtorch" in maps, "EXTENSION", "_core.cpython" in maps, flush=True)
    process, exit_codes = queue.persistent_caller.process, []
    close_process = process.close

    def close_recording_the_exit() -> None:  # the stop joins it, then closes it: its status is gone after that
        exit_codes.append(process.exitcode)
        close_process()

    process.close = close_recording_the_exit  # type: ignore[method-assign]
    close_and_report(io, p, loaded_step=3)
    print("WORKER GONE", wait_gone(worker, 10), "EXIT", exit_codes, flush=True)


def kill_persistent_worker(io: Any, *, close_process: bool = False) -> None:
    """SIGKILL this rank's persistent worker and reap it (an OOM kill); with close_process, also close its
    process object, so that from then on is_alive() and exitcode raise ValueError."""
    worker = io.flashpoint_queue.persistent_caller.process
    worker.kill()
    worker.join(10)
    if close_process:
        worker.close()


def saves_around_a_lost_worker(p: dict[str, Any], *, close_process: bool) -> None:
    """Steps 1 to 3 through persistent workers; rank 1's worker is killed (kill_persistent_worker) after step 1
    is finalized, so step 2 is queued for a worker that is gone; reports what step 3 left."""
    io = nemo_io(p, persistent_worker=True)
    io.begin_fit()
    assert io.flashpoint_queue.worker_ready(timeout=120), "the persistent worker did not come up"
    dist.barrier()
    save_through(io, p, 1)
    io.finalize_flashpoint(blocking=True)
    if dist.get_rank() == 1:
        kill_persistent_worker(io, close_process=close_process)
    dist.barrier()
    save_through(io, p, 2)
    io.finalize_flashpoint(blocking=True)
    save_through(io, p, 3)
    close_and_report(io, p, loaded_step=3)


def worker_dead_while_booting_leaves_saves_to_forks(p: dict[str, Any]) -> None:
    """Rank 1's persistent worker dies before it is up (killed at boot): rank 1's saves fork a worker each
    from then on, rank 0's run on its worker, and none fails (no save was ever given to the dead worker)."""
    logging.getLogger("ml_flashpoint_nemo").addHandler(logging.StreamHandler(sys.stdout))  # the warning, to assert
    from tests.support.exit_hooks import hang_ignoring_sigterm

    io = nemo_io(p)
    if dist.get_rank() == 1:  # its boot never ends: the kill below comes while it boots, however slow this rank is
        io.flashpoint_queue._boot_hook = hang_ignoring_sigterm
    io.begin_fit()
    if dist.get_rank() == 1:
        kill_persistent_worker(io)
    else:
        assert io.flashpoint_queue.worker_ready(timeout=120)
    dist.barrier()
    callers = []
    for step in (1, 2):
        save_through(io, p, step)
        callers.append(type(io.flashpoint_queue.async_calls[-1].async_caller).__name__)
        io.finalize_flashpoint(blocking=True)
    print("CALLERS", " ".join(callers), flush=True)
    close_and_report(io, p, loaded_step=2)


def dead_persistent_worker_drops_its_saves_everywhere(p: dict[str, Any]) -> None:
    """Rank 1's persistent worker is SIGKILLed between saves (an OOM kill): the next blocking finalize
    must not wait for it forever; its save fails on every rank and the save after it gets a new worker."""
    saves_around_a_lost_worker(p, close_process=False)


def writer_fails_on_one_rank(p: dict[str, Any]) -> None:
    """Rank 1 names step 2 "step-02", which no writer accepts: async_save must fail on both ranks (issue 13 §3)."""
    strategy = save_strategy(p)
    queue = AsyncCallsQueue(persistent=False)
    save(p, 1, queue, strategy)
    bad = os.path.join(p["base"], "step-02" if dist.get_rank() == 1 else "step-2")
    Path(bad).mkdir(parents=True, exist_ok=True)
    expect_failure(lambda: dist_checkpointing.save(sharded_state(2), bad, sharded_strategy=strategy,
                                                   async_sharded_save=True), "SAVE FAILED")
    dist.barrier()
    check_loaded(load(p, 1), 1)  # nothing lost
    save(p, 3, queue, strategy)  # and the next save plans afresh and commits
    check_loaded(load(p, 3), 3)
    print("COMMITTED", committed_steps(CheckpointLayout(p["base"])), flush=True)
    queue.close()
    strategy.close()


def uninspectable_worker_fails_its_save_everywhere(p: dict[str, Any]) -> None:
    """Rank 1's persistent worker is killed and its process object closed, so that asking it anything
    raises on rank 1 alone: the save in flight must fail on every rank, and the next one commit."""
    saves_around_a_lost_worker(p, close_process=True)


def common_state_on_every_node(p: dict[str, Any]) -> None:
    """Each node has its own base dir; after async saves every node can read the common state by itself."""
    queue = AsyncCallsQueue(persistent=False)
    strategy = save_strategy(p)
    for step in (1, 2):
        save(dict(p, base=node_base(p)), step, queue, strategy)
    assert dist_checkpointing.load_common_state_dict(os.path.join(node_base(p), "step-2")) == {"iteration": 2}
    listed = FlashpointLoadStrategy().load_sharded_metadata(os.path.join(node_base(p), "step-2"))
    world = dist.get_world_size()
    expected = {"layer.weight", "layer.bias"} | {f"rng/shard_{r}_{world}" for r in range(world)}
    assert set(listed) == expected, sorted(listed)
    assert isinstance(listed["rng/shard_0_" + str(world)], ShardedObject)
    queue.close()
    strategy.close()


def failed_node_copy_fails_every_rank(p: dict[str, Any]) -> None:
    """Node 1 cannot take the version's common state (a directory is in the way): every rank is told."""
    strategy = save_strategy(p)
    save(dict(p, base=node_base(p)), 1, None, strategy)
    if dist.get_rank() == p["ranks_per_node"]:
        (Path(node_base(p)) / "step-2" / "common.pt").mkdir(parents=True)
    dist.barrier()
    expect_failure(lambda: save(dict(p, base=node_base(p)), 2, None, strategy), "SAVE FAILED")
    strategy.close()


def version_files_sent_once(p: dict[str, Any]) -> None:
    """Three saves on 2+ nodes: what each node leader received as bytes and what it reused from its last copy.

    damage: before the third save, node 1's copy of step 2's `.metadata` is "deleted" or "flipped",
    so that node 1 must get it sent again in the second broadcast.
    """
    from ml_flashpoint_nemo.core import node_copies

    received: list[tuple[int, list[str], list[str]]] = []
    write_copy = node_copies.NodeCopies._write_copy

    def recording(self: Any, layout: Any, step: int, files: dict[str, Any]) -> Any:
        received.append((step, sorted(n for n, c in files.items() if isinstance(c, bytes)),
                         sorted(n for n, c in files.items() if isinstance(c, tuple))))
        return write_copy(self, layout, step, files)

    node_copies.NodeCopies._write_copy = recording
    strategy = save_strategy(p)
    base = node_base(p)
    for step in (1, 2, 3):
        if step == 3 and p.get("damage") and dist.get_rank() == p["ranks_per_node"]:
            metadata = Path(base) / "step-2" / ".metadata"
            if p["damage"] == "deleted":
                metadata.unlink()
            else:
                data = bytearray(metadata.read_bytes())
                data[len(data) // 2] ^= 0x01
                metadata.write_bytes(bytes(data))
        dist.barrier()
        save(dict(p, base=base), step, None, strategy)
    check_loaded(load(dict(p, base=base), 3), 3)
    for step, sent, reused in received:
        print(f"COPY {step} SENT {','.join(sent)} REUSED {','.join(reused)}", flush=True)
    strategy.close()


def choose(p: dict[str, Any]) -> None:
    """Print the version every rank agreed to resume from."""
    print("CHOSEN", choose_version(node_base(p)).step, flush=True)


def choose_after_verifying_ahead(p: dict[str, Any]) -> None:
    """Each rank checks its objects of the newest version ahead; rank 1's object of step 2 may be flipped
    (p["flip"]: "before" that check or "after" it). Prints the choice and how many objects it read itself."""
    from ml_flashpoint_nemo.replication import choice, preverify

    base, rank = node_base(p), dist.get_rank()
    step_2 = Path(base) / "step-2"

    def flip() -> None:
        dist.barrier()
        if rank == 1:
            target = step_2 / object_name(1)
            data = bytearray(target.read_bytes())
            data[80] ^= 0x10  # inside the first record
            target.write_bytes(bytes(data))
        dist.barrier()

    if p["flip"] == "before":
        flip()
    preverify.verify_ahead(base, rank)
    record = next(o for o in choice.read_commit(CheckpointLayout(base), 2).objects if o.rank == rank)
    passed = preverify.verified_ahead(base, rank, step_2 / record.name, record)  # waits for the check
    print("PASSED AHEAD", passed, flush=True)
    if p["flip"] == "after":
        flip()
    reads = []
    verify = choice.verify_object_file

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[0])
        return verify(*args, **kwargs)

    from ml_flashpoint_nemo.replication import own_objects

    choice.verify_object_file = own_objects.verify_object_file = counted  # the elastic path's and the saved layout's
    print("CHOSEN", choice.choose_version(base).step, "READ", len(reads), flush=True)


def manager_failure_fails_first_save_everywhere(p: dict[str, Any]) -> None:
    expect_failure(lambda: save(p, 1, AsyncCallsQueue(persistent=False)), "SAVE FAILED")


def only_common_state_round_trips_as_with_torch_dist(p: dict[str, Any]) -> None:
    """A checkpoint with no sharded tensor (Megatron's test_empty_load, content metadata only) saves and loads.

    The same save and load through torch_dist, in p["durable"], gives what ours must give.
    """
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
        load_content_metadata,
    )

    content = {"kind": "only common state", "iteration": 7}
    common = {"iteration": 7, "args": {"lr": 0.5}}
    queue = AsyncCallsQueue(persistent=False) if p["mode"] == "async" else None
    strategy = FlashpointSaveStrategy()
    results = {}
    for name, base in (("ours", p["base"]), ("torch_dist", p["durable"])):
        directory = version_dir(base, 1)
        save_with = strategy if name == "ours" else get_default_save_sharded_strategy("torch_dist")
        request = dist_checkpointing.save(dict(common), directory, sharded_strategy=save_with,
                                          async_sharded_save=queue is not None and name == "ours",
                                          content_metadata=content)
        if request is not None:
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
        load_with = FlashpointLoadStrategy() if name == "ours" else get_default_load_sharded_strategy(directory)
        loaded = dist_checkpointing.load({}, directory, sharded_strategy=load_with)
        results[name] = (loaded, load_content_metadata(preloaded_state_dict=loaded), load_content_metadata(directory))
    assert results["ours"] == results["torch_dist"], results
    assert results["ours"][1] == content and results["ours"][0]["args"] == common["args"], results
    if queue is not None:
        queue.close()
    strategy.close()
    print("EMPTY LOADED", committed_steps(CheckpointLayout(p["base"])))


if __name__ == "__main__":
    scenario_main({f.__name__: f for f in (roundtrip, recipes_that_keep_failing_are_not_relearnt, save_then_corrupt_is_refused, interrupted_config_rewrite_is_repaired,
                                           failed_background_write_fails_every_rank,
                                           second_save_reuses_a_buffer_warmed_after_the_first,
                                           manager_failure_fails_first_save_everywhere,
                                           plan_reused_only_while_structure_is_unchanged,
                                           overlapping_saves_each_get_their_report,
                                           overlapping_saves_report_compactly_after_a_full_one,
                                           common_state_on_every_node, failed_node_copy_fails_every_rank, choose,
                                           version_files_sent_once,
                                           choose_after_verifying_ahead,
                                           close_commits_the_saves_after_a_failed_one,
                                           staging_fails_on_one_rank_before_its_persistent_worker,
                                           dead_persistent_worker_drops_its_saves_everywhere,
                                           saves_fork_until_the_persistent_worker_is_up,
                                           worker_dead_while_booting_leaves_saves_to_forks,
                                           hung_worker_fails_its_save_within_the_timeout,
                                           a_due_save_waits_while_one_is_sealing,
                                           overlapped_capture_holds_the_optimizer_step,
                                           only_common_state_round_trips_as_with_torch_dist,
                                           writer_fails_on_one_rank,
                                           uninspectable_worker_fails_its_save_everywhere)})
