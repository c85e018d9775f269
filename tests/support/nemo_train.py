"""One rank of a tiny NeMo GPT training run with flashpoint, configured by flags (tests/test_nemo_e2e.py).

Started as 2 ranks by examples/launch.py. Rank 0 writes result.json (losses, how it resumed,
the saves) and state.pt (parameters and optimizer state) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--base", required=True, help="'{rank}' in it gives each rank its own base: a node each")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--durable-every", type=int, default=0, help="NeMo ModelCheckpoint interval; 0: none")
    parser.add_argument("--durable-dir", default=None, help="NeMoLogger dir of the durable checkpoints")
    parser.add_argument("--nvrx-resume-without-global", type=int, choices=(0, 1), default=1)
    parser.add_argument("--route", choices=("none", "wrap", "callback_config", "nvrx"), default="wrap",
                        help="nvrx: NeMo's LocalCheckpointCallback + hierarchical IO with our NVRx manager")
    parser.add_argument("--async-save", action="store_true", help="the strategy's ckpt_async_save (durable and RAM)")
    parser.add_argument("--csv-logger", default=None, help="give the trainer a Lightning CSVLogger writing here")
    parser.add_argument("--save-worker-up", action="store_true",
                        help="train only once the persistent save worker is up, as a job whose first save comes "
                             "minutes after set-up has it (this tiny model saves within a second of starting)")
    parser.add_argument("--overlap-capture", action="store_true", help="the flashpoint option overlap_capture")
    parser.add_argument("--sealed-before-optimizer", action="store_true",
                        help="each optimizer step first waits (bounded) until this rank's pending RAM saves are sealed, "
                             "so that when a save commits depends on the callbacks' hooks, not on the machine's speed")
    parser.add_argument("--dump-resumed-state", action="store_true",
                        help="rank 0 writes the state it starts training from (after a resume) to resumed_state.pt")
    parser.add_argument("--drain-every", type=int, default=0, help="durable_every_n_steps (drained from RAM); 0: off")
    parser.add_argument("--drain-log", default=None, help="NeMoLogger dir of drained checkpoints: <it>/tiny/checkpoints")
    parser.add_argument("--drain-rate", type=float, default=None, help="durable_bytes_per_s")
    parser.add_argument("--drain-modelcheckpoint", action="store_true",
                        help="give the drain run a NeMo ModelCheckpoint (no periodic saves) that names its checkpoints")
    parser.add_argument("--plain-resume", default=None,
                        help="plain NeMo, no flashpoint: AutoResume from the NeMoLogger dir given here")
    parser.add_argument("--sigterm-at", type=int, default=0, help="send this process SIGTERM after this step")
    parser.add_argument("--kill-mid-drain-of", type=int, default=0,
                        help="SIGKILL once the drain of this RAM step has written part of its data")
    parser.add_argument("--unblock-at", type=int, default=0,
                        help="after this step, once the drain is idle, rank 0 removes --filler")
    parser.add_argument("--filler", default=None)
    parser.add_argument("--delay-pushes-of-rank", type=int, default=None,
                        help="this rank starts each replication push 3 s late (a slow peer at the end of training)")
    parser.add_argument("--slow-copy-s", type=float, default=0.0,
                        help="each overlapped save's background copy starts this late (a slow copy, injected)")
    parser.add_argument("--check-versions", action="store_true",
                        help="each rank records what each save captured (cloned as the save began) and, after "
                             "training, compares every committed version's object with it bit for bit")
    parser.add_argument("--last-pushes-wait-s", type=float, default=None,
                        help="the job-wide bound on waiting for the last pushes at the end of training")
    args = parser.parse_args()
    args.base = args.base.replace("{rank}", os.environ.get("RANK", "0"))
    sys.path.insert(0, str(EXAMPLES))

    import lightning.pytorch as pl
    import nemo_run as run
    import quickstart
    import tiny_gpt
    import torch
    from fiddle import build
    from lightning.pytorch.loggers import CSVLogger
    from nemo import lightning as nl
    from nemo.collections import llm

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint
    from ml_flashpoint_nemo.nemo import FlashpointAutoResume, FlashpointCallback

    class KillAfter(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *unused: Any) -> None:
            if trainer.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class SaveWorkerUp(pl.Callback):
        def on_train_start(self, trainer: Any, *unused: Any) -> None:
            queue = trainer._flashpoint.io.flashpoint_queue
            assert queue.worker_ready(timeout=120), "the persistent save worker did not come up in 120 s"

    class SealedBeforeOptimizer(pl.Callback):
        """Placed before FlashpointCallback, whose own on_before_optimizer_step then finds the writes done."""

        def on_before_optimizer_step(self, trainer: Any, *unused: Any) -> None:
            queue = trainer._flashpoint.io.flashpoint_queue
            deadline = time.monotonic() + 120
            while queue.async_calls:
                caller = queue.async_calls[0].async_caller  # the persistent worker's, shared by every call
                # completions it reported, looked at without taking them (Megatron's collective check takes them)
                if (caller.cur_item is not None) + caller.comp_q.qsize() >= len(queue.async_calls):
                    return
                assert time.monotonic() < deadline, "this rank's pending RAM saves were not sealed in 120 s"
                time.sleep(0.01)

    class DumpResumedState(pl.Callback):
        def on_train_start(self, trainer: Any, *unused: Any) -> None:
            if trainer.global_rank == 0:
                torch.save({"model": tiny_gpt.model_state_dict(trainer), "step": trainer.global_step,
                            "optimizer": quickstart.flat_tensors(trainer.strategy.optimizers[0].state_dict())},
                           Path(args.out) / "resumed_state.pt")

    def drain_idle(trainer: Any) -> None:
        drain = trainer._flashpoint.callback.drain
        deadline = time.monotonic() + 120
        while drain.busy_with():
            assert time.monotonic() < deadline, "the drain did not become idle in 120 s"
            time.sleep(0.02)

    class DrainEvents(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *unused: Any) -> None:
            step = trainer.global_step
            if step == args.unblock_at:  # a version's drain is asked for at the next step's end: all up to step - 2
                drain_idle(trainer)
                if args.filler and trainer.global_rank == 0:
                    os.unlink(args.filler)
            if step == args.sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_train_batch_start(self, trainer: Any, *unused: Any) -> None:
            # the drain of step S is asked for at the end of step S + 1
            if args.kill_mid_drain_of and trainer.global_step == args.kill_mid_drain_of:
                drain_idle(trainer)  # every earlier drain published (a busy drain would skip a waiting one)
            if args.kill_mid_drain_of and trainer.global_step == args.kill_mid_drain_of + 1:
                drain = trainer._flashpoint.callback.drain
                deadline = time.monotonic() + 120
                temporary = drain.temporary_dir(args.kill_mid_drain_of)
                while not list(temporary.glob(f"weights/__{trainer.global_rank}_*.distcp")):  # this rank's own
                    assert time.monotonic() < deadline, f"no drain data in {temporary} after 120 s"
                    time.sleep(0.005)
                os.kill(os.getpid(), signal.SIGKILL)

    # How many loads went through Megatron's fully parallel load (each rank reads a part and the ranks
    # exchange the rest): a spy around the real method, which still runs.
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    parallel_loads = []
    fully_parallel_load = FullyParallelLoadStrategyWrapper.load

    def counted_load(self: Any, *load_args: Any, **load_kwargs: Any) -> Any:
        parallel_loads.append(1)
        return fully_parallel_load(self, *load_args, **load_kwargs)

    FullyParallelLoadStrategyWrapper.load = counted_load

    if args.delay_pushes_of_rank == int(os.environ.get("RANK", "0")):
        from ml_flashpoint_nemo.replication.service import ReplicationService

        push_version = ReplicationService._push_version

        def late_push(self: Any, step: int) -> Any:
            time.sleep(3.0)  # the fault injected, not a synchronisation: the other rank ends its run meanwhile
            return push_version(self, step)

        ReplicationService._push_version = late_push  # type: ignore[method-assign]
    if args.last_pushes_wait_s is not None:
        import ml_flashpoint_nemo.nemo.callback as flashpoint_callback

        flashpoint_callback.LAST_PUSHES_WAIT_S = args.last_pushes_wait_s

    captured: dict[int, dict[str, Any]] = {}
    overlapped: list[int] = []  # steps whose save's copy was still running when the next step began
    if args.slow_copy_s:
        from ml_flashpoint_nemo.core import saver as saver_module

        copy = saver_module.background_copy

        def slow_copy(*copy_args: Any) -> None:
            time.sleep(args.slow_copy_s)  # the fault injected (a slow copy), not a synchronisation
            copy(*copy_args)

        saver_module.background_copy = slow_copy
    if args.check_versions:
        from ml_flashpoint_nemo.core.saver import CheckpointSaver

        stage_object = CheckpointSaver.stage_object

        def recorded(self: Any, step: int, state: Any, **kwargs: Any) -> Any:
            captured[step] = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            return stage_object(self, step, state, **kwargs)

        CheckpointSaver.stage_object = recorded  # type: ignore[method-assign]

    class CopyInFlight(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *unused: Any) -> None:
            from ml_flashpoint_nemo.core import capture

            if capture.copies_in_flight():
                overlapped.append(trainer.global_step)

    recorder = tiny_gpt.LossRecorder()
    callbacks: list[Any] = [recorder] + ([CopyInFlight()] if args.check_versions else [])
    callbacks += [KillAfter()] if args.kill_at else []
    if args.drain_every:
        callbacks.append(DrainEvents())
    callbacks += [SaveWorkerUp()] if args.save_worker_up else []
    callbacks += [DumpResumedState()] if args.dump_resumed_state else []
    callbacks += [SealedBeforeOptimizer()] if args.sealed_before_optimizer else []
    options: dict[str, Any] = {"every_n_steps": args.every, "keep": args.keep, "overlap_capture": args.overlap_capture}
    if args.drain_every:
        options.update(durable_every_n_steps=args.drain_every, durable_bytes_per_s=args.drain_rate,
                       durable_dir=str(Path(args.drain_log) / "tiny" / "checkpoints"))
    if args.route == "callback_config":  # what a recipe's trainer.callbacks entry becomes
        callbacks.append(build(run.Config(FlashpointCallback, base_dir=args.base, **options)))
    log = nl.NeMoLogger(name="e2e", log_dir=str(Path(args.out) / "logs"), use_datetime_version=False)
    resume = None
    if args.durable_every:
        log, checkpoint = tiny_gpt.make_checkpointing(args.durable_dir, args.durable_every)
        callbacks.append(checkpoint)
        resume = tiny_gpt.make_resume() if args.route == "nvrx" else FlashpointAutoResume(durable=tiny_gpt.make_resume())
    if args.drain_modelcheckpoint or args.plain_resume:  # never saves by itself before max_steps
        log, checkpoint = tiny_gpt.make_checkpointing(args.plain_resume or args.drain_log, 10**6)
        callbacks.append(checkpoint)
    if args.plain_resume:
        args.route = "none"
        resume = tiny_gpt.make_resume()
    logger = CSVLogger(args.csv_logger, name="metrics") if args.csv_logger else False
    checkpointing = bool(args.durable_every or args.drain_modelcheckpoint or args.plain_resume)
    trainer = tiny_gpt.make_trainer(args.steps, callbacks=callbacks, enable_checkpointing=checkpointing,
                                    ckpt_async_save=args.async_save, logger=logger)
    if args.route == "wrap":
        wrap_trainer_with_flashpoint(trainer, base_dir=args.base, **options)
    local_io = None
    if args.route == "nvrx":
        from ml_flashpoint_nemo.nvrx import use_flashpoint_local_checkpoints

        local_io = use_flashpoint_local_checkpoints(trainer, args.base, every_n_train_steps=args.every,
                                                    keep=args.keep, session_id="tiny-gpt",
                                                    resume_without_global=args.nvrx_resume_without_global == 1)
    llm.train(tiny_gpt.make_model(), tiny_gpt.make_data(), trainer, log=log, resume=resume)
    if args.check_versions:
        from ml_flashpoint_nemo.core import committed_steps, load_version
        from ml_flashpoint_nemo.core.layout import CheckpointLayout

        versions = {}
        for step in committed_steps(CheckpointLayout(args.base)):
            saved = load_version(args.base, step, rank=trainer.global_rank, keys=list(captured[step]))
            versions[step] = sorted(k for k, v in captured[step].items()
                                    if not (isinstance(saved[k], torch.Tensor) and saved[k].dtype == v.dtype
                                            and torch.equal(saved[k].view(v.shape), v)))
        (Path(args.out) / f"versions-{trainer.global_rank}.json").write_text(
            json.dumps({"differing": versions, "overlapped": overlapped}))
    if trainer.global_rank != 0:
        return
    decision = getattr(trainer, "_flashpoint_resume", None)
    if local_io is not None:  # what NeMo's hierarchical IO loaded: a local (RAM) version, the global one, or none
        local = local_io.loaded_local_iteration
        source = "ram" if local is not None else ("durable" if trainer.ckpt_path else "none")
        path = str(local_io.local_ckpt_manager.layout.version_dir(local)) if local is not None else trainer.ckpt_path
        decision = argparse.Namespace(source=source, path=path)
    flashpoint = getattr(trainer, "_flashpoint", None)
    result = {
        "losses": recorder.losses,
        "resumed_from": decision.source if decision else None,
        "resumed_path": str(decision.path) if decision and decision.path else None,
        "saves": flashpoint.callback.saves if flashpoint else [],
        "ckpt_path": str(trainer.ckpt_path) if trainer.ckpt_path else None,
        "parallel_loads": len(parallel_loads),
    }
    out = Path(args.out)
    (out / "result.json").write_text(json.dumps(result))
    torch.save({"model": tiny_gpt.model_state_dict(trainer),
                "optimizer": quickstart.flat_tensors(trainer.strategy.optimizers[0].state_dict())}, out / "state.pt")


if __name__ == "__main__":
    main()
