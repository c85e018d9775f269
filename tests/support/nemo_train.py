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
    parser.add_argument("--route", choices=("none", "wrap", "callback_config"), default="wrap")
    parser.add_argument("--async-save", action="store_true", help="the strategy's ckpt_async_save (durable and RAM)")
    parser.add_argument("--csv-logger", default=None, help="give the trainer a Lightning CSVLogger writing here")
    parser.add_argument("--save-worker-up", action="store_true",
                        help="train only once the persistent save worker is up, as a job whose first save comes "
                             "minutes after set-up has it (this tiny model saves within a second of starting)")
    parser.add_argument("--dump-resumed-state", action="store_true",
                        help="rank 0 writes the state it starts training from (after a resume) to resumed_state.pt")
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

    class DumpResumedState(pl.Callback):
        def on_train_start(self, trainer: Any, *unused: Any) -> None:
            if trainer.global_rank == 0:
                torch.save({"model": tiny_gpt.model_state_dict(trainer), "step": trainer.global_step,
                            "optimizer": quickstart.flat_tensors(trainer.strategy.optimizers[0].state_dict())},
                           Path(args.out) / "resumed_state.pt")

    recorder = tiny_gpt.LossRecorder()
    callbacks: list[Any] = [recorder] + ([KillAfter()] if args.kill_at else [])
    callbacks += [SaveWorkerUp()] if args.save_worker_up else []
    callbacks += [DumpResumedState()] if args.dump_resumed_state else []
    options = {"every_n_steps": args.every, "keep": args.keep}
    if args.route == "callback_config":  # what a recipe's trainer.callbacks entry becomes
        callbacks.append(build(run.Config(FlashpointCallback, base_dir=args.base, **options)))
    log = nl.NeMoLogger(name="e2e", log_dir=str(Path(args.out) / "logs"), use_datetime_version=False)
    resume = None
    if args.durable_every:
        log, checkpoint = tiny_gpt.make_checkpointing(args.durable_dir, args.durable_every)
        callbacks.append(checkpoint)
        resume = FlashpointAutoResume(durable=tiny_gpt.make_resume())
    logger = CSVLogger(args.csv_logger, name="metrics") if args.csv_logger else False
    trainer = tiny_gpt.make_trainer(args.steps, callbacks=callbacks, enable_checkpointing=bool(args.durable_every),
                                    ckpt_async_save=args.async_save, logger=logger)
    if args.route == "wrap":
        wrap_trainer_with_flashpoint(trainer, base_dir=args.base, **options)
    llm.train(tiny_gpt.make_model(), tiny_gpt.make_data(), trainer, log=log, resume=resume)
    if trainer.global_rank != 0:
        return
    decision = getattr(trainer, "_flashpoint_resume", None)
    flashpoint = getattr(trainer, "_flashpoint", None)
    result = {
        "losses": recorder.losses,
        "resumed_from": decision.source if decision else None,
        "resumed_path": str(decision.path) if decision and decision.path else None,
        "saves": flashpoint.callback.saves if flashpoint else [],
    }
    out = Path(args.out)
    (out / "result.json").write_text(json.dumps(result))
    torch.save({"model": tiny_gpt.model_state_dict(trainer),
                "optimizer": quickstart.flat_tensors(trainer.strategy.optimizers[0].state_dict())}, out / "state.pt")


if __name__ == "__main__":
    main()
