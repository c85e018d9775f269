"""Quickstart: RAM checkpoints for a NeMo 2.0 trainer, a crash, and an exact recovery - on 2 CPU ranks.

    python examples/quickstart.py

1. reference: a tiny GPT (NeMo llm.GPTModel, MegatronStrategy, gloo) trains for --steps steps.
2. crash:     the same job with `wrap_trainer_with_flashpoint(trainer)` saves a RAM
              checkpoint every --every steps and is SIGKILLed after step --kill-at.
3. resume:    the job restarts; the trainer resumes from the newest RAM version complete on
              every rank and trains to --steps.
The losses after the resume and the final parameters and optimizer state must equal the
reference run's bit for bit; the script prints PASS or FAIL (exit code 1) with the save
blocking times, the checkpoint throughput and the recovery time.

The CPU stand-ins for CUDA-only calls live in ml_flashpoint_nemo/testing/cpu_shims.py (used by the examples
and tests only, never by the library). On GPUs see examples/pretrain_gpt_flashpoint.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3, help="RAM checkpoint interval in steps")
    parser.add_argument("--kill-at", type=int, default=8, help="SIGKILL every rank after this step")
    parser.add_argument("--out", default=None, help="where each run writes its results (default: a temp dir)")
    parser.add_argument("--base", default=None, help="RAM checkpoint directory (default: a fresh one in /dev/shm)")
    parser.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--phase", choices=("reference", "crash", "resume"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- one rank of one run ---------------------------------------------------------------------


def flat_tensors(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in a nested state dict, by path (to compare optimizer states bit for bit)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {prefix: value.detach().clone()}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    found: dict[str, Any] = {}
    for key, item in items:
        found.update(flat_tensors(item, f"{prefix}/{key}"))
    return found


def run_rank(args: argparse.Namespace) -> None:
    import signal

    import lightning.pytorch as pl
    import tiny_gpt  # installs the CPU shims first
    import torch
    from nemo import lightning as nl
    from nemo.collections import llm

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint

    class KillAfter(pl.Callback):
        """A crash: SIGKILL right after optimizer step `step`, whatever is in flight."""

        def on_train_batch_end(self, trainer: Any, *unused: Any) -> None:
            if trainer.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    out = Path(args.out) / args.phase
    recorder = tiny_gpt.LossRecorder()
    callbacks: list[Any] = [recorder] + ([KillAfter()] if args.phase == "crash" else [])
    trainer = tiny_gpt.make_trainer(args.steps, ckpt_async_save=args.async_save, callbacks=callbacks)
    flashpoint = None
    if args.phase != "reference":
        flashpoint = wrap_trainer_with_flashpoint(trainer, base_dir=args.base, every_n_steps=args.every)
    log = nl.NeMoLogger(name="quickstart", log_dir=str(out / "logs"), use_datetime_version=False)
    started = time.perf_counter()
    llm.train(tiny_gpt.make_model(), tiny_gpt.make_data(), trainer, log=log, resume=None)
    seconds = time.perf_counter() - started
    if trainer.global_rank != 0:
        return
    decision = getattr(trainer, "_flashpoint_resume", None)
    result = {
        "losses": recorder.losses,
        "train_seconds": seconds,
        "saves": flashpoint.saves if flashpoint else [],
        "resumed_from": decision.source if decision else None,
        "resumed_step": decision.ram_step if decision and decision.source == "ram" else None,
        "restore_seconds": getattr(trainer, "_flashpoint_restore_seconds", None),
    }
    (out / "result.json").write_text(json.dumps(result))
    state = {"model": tiny_gpt.model_state_dict(trainer),
             "optimizer": flat_tensors(trainer.strategy.optimizers[0].state_dict())}
    torch.save(state, out / "state.pt")


# --- the three runs and the verdict ----------------------------------------------------------


def compare(out: Path, resumed_from: str = "ram") -> list[str]:
    """What differs between out/reference and out/resume (empty: identical, resumed as expected)."""
    import torch

    reference = json.loads((out / "reference" / "result.json").read_text())
    resumed = json.loads((out / "resume" / "result.json").read_text())
    problems = []
    if resumed["resumed_from"] != resumed_from:
        problems.append(f"the restarted job resumed from {resumed['resumed_from']}, not from {resumed_from}")
    expected = {step: loss for step, loss in reference["losses"]}
    for step, loss in resumed["losses"]:
        if expected.get(step) != loss:
            problems.append(f"loss of step {step}: {loss!r} after the resume, {expected.get(step)!r} uninterrupted")
    ref_state = torch.load(out / "reference" / "state.pt", weights_only=True)
    new_state = torch.load(out / "resume" / "state.pt", weights_only=True)
    for part in ("model", "optimizer"):
        if ref_state[part].keys() != new_state[part].keys():
            problems.append(f"{part} state has different entries")
            continue
        problems += [f"{part} tensor {key} differs" for key, tensor in ref_state[part].items()
                     if not torch.equal(tensor, new_state[part][key])]
    return problems


def report(out: Path, args: argparse.Namespace, problems: list[str]) -> None:
    crash = json.loads((out / "crash" / "result.json").read_text()) if (out / "crash" / "result.json").exists() else None
    resumed = json.loads((out / "resume" / "result.json").read_text())
    saves = [s for s in resumed["saves"] if "error" not in s] + ([] if crash is None else crash["saves"])
    print(f"\nRAM checkpoints under {args.base}, every {args.every} steps; crash (SIGKILL) after step {args.kill_at}")
    for save in saves:
        print(f"  step {int(save['step']):3d}: training blocked {save['flashpoint/blocking_s'] * 1e3:7.1f} ms, "
              f"{save['flashpoint/bytes'] / 1e6:6.2f} MB, {save['flashpoint/gbps']:.2f} GB/s")
    stalls = sorted(save["flashpoint/blocking_s"] * 1e3 for save in saves)
    if stalls:
        print(f"  stall per save: median {statistics.median(stalls):.1f} ms over {len(stalls)} saves "
              f"(max {stalls[-1]:.1f} ms)")
    print(f"  recovery: resumed from RAM step {resumed['resumed_step']} in {resumed['restore_seconds']:.2f} s "
          "(choosing the version on every rank + reading it)")
    steps = [s for s, _ in resumed["losses"]]
    print(f"  resumed run trained steps {steps[0]}-{steps[-1]}" if steps else "  resumed run trained no step")
    print("PASS: training after the crash matches the uninterrupted run bit for bit "
          "(losses, parameters, optimizer state)" if not problems else "FAIL:\n  " + "\n  ".join(problems))


def main() -> int:
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")  # torch's import, not ours
    args = parse_args()
    if args.phase:
        run_rank(args)
        return 0
    from launch import launch_ranks

    args.out = args.out or tempfile.mkdtemp(prefix="flashpoint-quickstart-")
    args.base = args.base or f"/dev/shm/ml_flashpoint/quickstart-{uuid.uuid4().hex[:8]}"
    out = Path(args.out)
    common = ["--steps", str(args.steps), "--every", str(args.every), "--kill-at", str(args.kill_at),
              "--out", args.out, "--base", args.base, "--async-save" if args.async_save else "--no-async-save"]
    try:
        for phase, expected in (("reference", 0), ("crash", -9), ("resume", 0)):
            logs = out / phase
            print(f"== {phase} run: 2 ranks, output in {logs}/rank-*.log", flush=True)
            started = time.perf_counter()
            code = launch_ranks(__file__, [*common, "--phase", phase], log_dir=logs)
            print(f"   exited with {code} after {time.perf_counter() - started:.1f} s", flush=True)
            if code != expected:
                print(f"FAIL: the {phase} run exited with {code}, expected {expected}. End of rank 0's output:")
                print((logs / "rank-0.log").read_text()[-3000:])
                return 1
        problems = compare(out)
        report(out, args, problems)
        return 1 if problems else 0
    finally:
        shutil.rmtree(args.base, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
