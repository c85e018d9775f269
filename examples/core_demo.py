"""Save, crash, recover: the core of ml_flashpoint_nemo on a small training loop, on CPU.

1. A trainer process trains a small MLP with Adam, saving a RAM checkpoint (model,
   optimizer state, RNG state, step) every few steps, then SIGKILLs itself mid-run.
2. A restarted trainer recovers the newest intact checkpoint from RAM and trains on.
3. An uninterrupted run of the same job checks that the recovered run ends with
   bit-identical parameters and optimizer state.

It prints save times, throughput and recovery time, and exits non-zero if the
recovered run differs in any bit. Run: python examples/core_demo.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ml_flashpoint_nemo.core import CheckpointSaver, load_newest_valid

HIDDEN = 1024
LAYERS = 6
BATCH = 64


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    gen = torch.Generator().manual_seed(10_000 + step)  # the data of a step never depends on restarts
    x = torch.randn(BATCH, HIDDEN, generator=gen)
    y = x[:, :1].sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """Everything needed to resume, as a flat mapping of tensors and bytes."""
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for index, per_param in opt["state"].items():
        for name, value in per_param.items():
            state[f"optim/{index}/{name}"] = value
    state["optim/param_groups"] = json.dumps(opt["param_groups"]).encode()
    state["rng/torch"] = torch.get_rng_state()
    state["step"] = torch.tensor(step)
    return state


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> int:
    model.load_state_dict({k.removeprefix("model/"): v for k, v in loaded.items() if k.startswith("model/")})
    per_param: dict[int, dict] = {}
    for key, value in loaded.items():
        if key.startswith("optim/") and key != "optim/param_groups":
            _, index, name = key.split("/")
            per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": json.loads(loaded["optim/param_groups"])})
    torch.set_rng_state(loaded["rng/torch"])
    return int(loaded["step"])


def run_trainer(base_dir: Path, steps: int, save_every: int, crash_at: int | None, report: Path) -> None:
    """One trainer process: recover if a RAM checkpoint exists, train, save; maybe die at crash_at."""
    torch.set_num_threads(1)
    model, optimizer = build()
    train_step(model, optimizer, -1)  # creates Adam's state so the saved layout is complete from the start
    first_step, recovery_seconds = 0, None
    saver = CheckpointSaver(base_dir)
    if any(base_dir.glob("step-*/COMMIT")):
        start = time.perf_counter()
        step, loaded = load_newest_valid(base_dir, into=training_state(model, optimizer, 0))
        first_step = restore(model, optimizer, loaded) + 1
        recovery_seconds = time.perf_counter() - start
    else:
        # model + two Adam moments: about 3x the parameters; prefaulted while the job starts
        saver.warm_up(sum(v.numel() * v.element_size() for v in model.state_dict().values()) * 3)
    saves = []
    for step in range(first_step, steps):
        train_step(model, optimizer, step)
        if step % save_every == 0:
            result = saver.save(step, training_state(model, optimizer, step))
            saves.append({"step": step, "seconds": result.seconds, "gbps": result.gbps, "nbytes": result.nbytes})
            report.write_text(json.dumps({"saves": saves, "recovery_seconds": recovery_seconds}))
        if crash_at is not None and step == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no flush, nothing
    final = training_state(model, optimizer, steps - 1)
    torch.save({k: v for k, v in final.items() if isinstance(v, torch.Tensor)}, report.with_suffix(".final.pt"))
    report.write_text(json.dumps({"saves": saves, "recovery_seconds": recovery_seconds, "resumed_at": first_step}))
    saver.close()


def launch(base_dir: Path, steps: int, save_every: int, crash_at: int | None, report: Path) -> int:
    args = [sys.executable, __file__, "--trainer", str(base_dir), "--steps", str(steps),
            "--save-every", str(save_every), "--report", str(report)]
    if crash_at is not None:
        args += ["--crash-at", str(crash_at)]
    return subprocess.run(args).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--trainer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--crash-at", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        run_trainer(args.trainer, args.steps, args.save_every, args.crash_at, args.report)
        return 0

    crash_at = args.steps // 2 + args.save_every // 2 + 1  # between two saves
    base_dir = Path(tempfile.mkdtemp(prefix="flashpoint-demo-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="flashpoint-demo-"))
    try:
        print(f"1) training {args.steps} steps, RAM checkpoint every {args.save_every}, crash at step {crash_at}")
        code = launch(base_dir, args.steps, args.save_every, crash_at, work / "crashed.json")
        print(f"   trainer died with signal {-code}" if code < 0 else f"   trainer exited with {code}")
        crashed = json.loads((work / "crashed.json").read_text())
        for save in crashed["saves"]:
            print(f"   saved step {save['step']:3d}: {save['nbytes'] / 1e6:7.1f} MB in "
                  f"{save['seconds'] * 1e3:6.1f} ms ({save['gbps']:.2f} GB/s)")
        print("2) restarting: recover from RAM and train on")
        if launch(base_dir, args.steps, args.save_every, None, work / "resumed.json") != 0:
            print("FAIL: the restarted trainer failed")
            return 1
        resumed = json.loads((work / "resumed.json").read_text())
        print(f"   recovered step {resumed['resumed_at'] - 1} in {resumed['recovery_seconds'] * 1e3:.1f} ms, "
              f"trained to step {args.steps - 1}")
        print("3) reference run without a crash")
        launch(Path(tempfile.mkdtemp(prefix="flashpoint-demo-ref-", dir="/dev/shm")), args.steps, args.save_every,
               None, work / "reference.json")
        got = torch.load(work / "resumed.final.pt")
        want = torch.load(work / "reference.final.pt")
        differing = [k for k in want if not torch.equal(got[k], want[k])]
        if differing or set(got) != set(want):
            print(f"FAIL: recovered run differs from the uninterrupted run in {differing[:5]}")
            return 1
        print(f"PASS: parameters and optimizer state after recovery are bit-identical "
              f"to the uninterrupted run ({len(want)} tensors)")
        return 0
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
        for ref in Path("/dev/shm").glob("flashpoint-demo-ref-*"):
            shutil.rmtree(ref, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
