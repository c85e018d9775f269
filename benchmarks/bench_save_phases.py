"""Where a steady RAM save's fixed cost goes, by phase, with and without the write recipe.

Two measurements, each comparing two configurations interleaved (A B A B ...):

- quickstart: the quickstart's NeMo GPT on 2 CPU ranks saving every step; per save, the wall
  time of each phase (NeMo's and Megatron's state dicts, Megatron's conversion, our collectives,
  staging). `long` is the save as it was before the recipe (Megatron's conversion and DCP's planner
  every save, and Lightning's closing barrier); `recipe` is today's.
- tensors: megatron.core.dist_checkpointing.save with our strategy on 2 gloo ranks, a state of
  --tensors small tensors, the saves after the second timed; `long` and `recipe` as above (without
  NeMo, so no barrier), one strategy each in the same processes, their saves alternating.

    .venv/bin/python benchmarks/bench_save_phases.py                  # both, 2 repeats
    .venv/bin/python benchmarks/bench_save_phases.py --parts tensors --tensors 2000 --saves 20
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
CONFIGS = ("long", "recipe")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="quickstart,tensors")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, interleaved")
    parser.add_argument("--steps", type=int, default=24, help="quickstart: training steps (a save each)")
    parser.add_argument("--tensors", type=int, default=2000, help="tensors: tensors per rank")
    parser.add_argument("--saves", type=int, default=12, help="tensors: saves per run")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="quickstart: which configurations to run (e.g. `recipe` alone, for a before/after)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--rank-part", choices=("quickstart", "tensors"), help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=(*CONFIGS, "both"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- in a rank ------------------------------------------------------------------------------------


class PhaseTimer:
    """Sums the wall time of wrapped functions while a save runs; one dict of sums per save."""

    def __init__(self) -> None:
        self.active = False
        self.sums: dict[str, float] = collections.defaultdict(float)
        self.saves: list[dict[str, float]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        function = getattr(owner, name)

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.sums[label] += time.perf_counter() - started

        setattr(owner, name, timed)

    def time_save(self, save: Callable[[], Any], keep: bool) -> None:
        self.sums.clear()
        self.active = keep
        started = time.perf_counter()
        save()
        if keep:
            self.saves.append({"total": time.perf_counter() - started, **self.sums})
        self.active = False


def _as_before_the_recipe() -> None:
    """Every save goes Megatron's conversion and DCP's planner, and ends in Lightning's barrier, as before."""
    from ml_flashpoint_nemo.megatron import strategies
    from ml_flashpoint_nemo.nemo import callback

    strategies.FlashpointSaveStrategy._staged_by_recipe = lambda self, *unused: False  # type: ignore[method-assign]
    callback.save_without_barrier = lambda trainer, path, options: trainer.save_checkpoint(
        path, storage_options=options)


def _wrap_strategy_phases(timer: PhaseTimer) -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    from ml_flashpoint_nemo.megatron import strategies

    timer.wrap(serialization, "save_preprocess", "megatron: save_preprocess")
    timer.wrap(common.TorchCommonSaveStrategy, "save_common", "megatron: common.pt (rank 0)")
    timer.wrap(strategies.FlashpointSaveStrategy, "_start_agreed",
               "ours: start all-reduce (room, structure, replication)")
    timer.wrap(strategies, "mcore_to_pyt_state_dict", "megatron: mcore_to_pyt_state_dict")
    timer.wrap(strategies.FlashpointSaveStrategy, "_plan_and_stage", "long way: conversion+planner+staging")
    timer.wrap(strategies.FlashpointSaveStrategy, "_staged_by_recipe", "recipe: replay+staging")
    timer.wrap(strategies._StagingWriter, "_stage", "ours: staging copy")


def quickstart_rank(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import lightning.pytorch.strategies.ddp as ddp
    import nemo.lightning.megatron_parallel as megatron_parallel
    import nemo.lightning.pytorch.strategies.megatron_strategy as megatron_strategy
    import quickstart
    from megatron.core.dist_checkpointing import serialization

    from ml_flashpoint_nemo.megatron import strategies
    from ml_flashpoint_nemo.nemo import callback

    timer = PhaseTimer()
    timer.wrap(ddp.DDPStrategy, "barrier", "lightning: barrier")
    timer.wrap(megatron_strategy.MegatronStrategy, "optimizer_sharded_state_dict", "nemo: optimizer sharded state dict")
    timer.wrap(megatron_parallel.MegatronParallel, "sharded_state_dict", "nemo: model sharded state dict")
    timer.wrap(strategies, "check_room_on_every_rank", "ours: room check's own all-reduce (first save)")
    timer.wrap(strategies, "start_problem", "ours: room check (local)")
    timer.wrap(serialization, "save", "megatron: dist_checkpointing.save")
    _wrap_strategy_phases(timer)
    if args.config == "long":
        _as_before_the_recipe()  # after the wrapping: the stand-in is not timed
    save = callback.FlashpointCallback.save
    callback.FlashpointCallback.save = lambda self, trainer, step: timer.time_save(  # type: ignore[method-assign]
        lambda: save(self, trainer, step), keep=step >= 3)
    base = f"/dev/shm/ml_flashpoint/bench-phases-{uuid.uuid4().hex[:8]}"
    quickstart.run_rank(quickstart.parse_args(
        ["--steps", str(args.steps), "--every", "1", "--kill-at", str(args.steps + 1), "--base", base,
         "--out", args.out, "--phase", "resume"]))
    Path(args.out, f"phases-{os.environ['RANK']}.json").write_text(json.dumps(timer.saves))


def tensors_rank(args: argparse.Namespace) -> None:
    from ml_flashpoint_nemo.testing import cpu_shims

    cpu_shims.install_for_checkpointing()
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    timer = PhaseTimer()
    timer.wrap(dist_checkpointing, "save", "megatron: dist_checkpointing.save")
    _wrap_strategy_phases(timer)
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((64,), float(i)), (0, rank, world))
             for i in range(args.tensors)}
    strategies = {config: FlashpointSaveStrategy() for config in CONFIGS}
    # Both configurations in the same processes, save by save (long, recipe, long, ...), each into its own base.
    strategies["long"]._staged_by_recipe = lambda *unused: False  # type: ignore[method-assign]
    saves: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
    for step in range(1, args.saves + 1):
        for config, strategy in strategies.items():
            directory = Path(args.out) / config / f"step-{step}"
            directory.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            timer.saves = saves[config]
            save = functools.partial(dist_checkpointing.save, dict(state), str(directory), sharded_strategy=strategy,
                                     validate_access_integrity=step == 1)  # as our NeMo IO: the first save only
            timer.time_save(save, keep=step >= 3)
    for strategy in strategies.values():
        strategy.close()
    Path(args.out, f"phases-{rank}.json").write_text(json.dumps(saves))
    dist.destroy_process_group()


# --- the driver ------------------------------------------------------------------------------------


def run_part(part: str, config: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """One 2-rank run of a part: the steady saves of both ranks, by configuration (tensors: both at once)."""
    sys.path.insert(0, str(EXAMPLES))
    from launch import launch_ranks

    with tempfile.TemporaryDirectory(prefix="bench-phases-") as out:
        argv = ["--rank-part", part, "--config", config, "--out", out, "--steps", str(args.steps),
                "--tensors", str(args.tensors), "--saves", str(args.saves)]
        code = launch_ranks(__file__, argv, log_dir=Path(out) / "logs")
        if code != 0:
            raise SystemExit(f"{part}/{config}: a rank exited with {code}; its log:\n"
                             + (Path(out) / "logs" / "rank-0.log").read_text()[-3000:])
        found: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        for rank in (0, 1):
            saves = json.loads(Path(out, f"phases-{rank}.json").read_text())
            for name, of_config in (saves.items() if isinstance(saves, dict) else [(config, saves)]):
                found[name] += of_config
        return found


def medians_ms(saves: list[dict[str, float]]) -> dict[str, float]:
    if not saves:
        return {}
    labels = sorted({label for save in saves for label in save})
    return {label: round(statistics.median(save.get(label, 0.0) for save in saves) * 1e3, 2) for label in labels}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_part == "quickstart":
        quickstart_rank(args)
        return 0
    if args.rank_part == "tensors":
        tensors_rank(args)
        return 0
    parts = [part for part in args.parts.split(",") if part]
    result: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}
    for part in parts:
        saves: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
        for _ in range(args.repeats):  # interleaved: long, recipe, long, recipe, ...
            for config in ([c for c in CONFIGS if c in args.configs.split(",")] if part == "quickstart" else ("both",)):
                for name, of_config in run_part(part, config, args).items():
                    saves[name] += of_config
        table = {config: medians_ms(saves[config]) for config in CONFIGS}
        long_total = table["long"].get("total") if saves["long"] else None
        ratio = table["recipe"]["total"] / long_total if long_total and saves["recipe"] else float("nan")
        result[part] = {"saves_per_config": {c: len(saves[c]) for c in CONFIGS}, "median_ms": table,
                        "recipe_over_long": round(ratio, 3)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"# {result['command']}")
    for part in parts:
        table = result[part]["median_ms"]
        print(f"\n{part}: median ms per steady save over both ranks "
              f"({result[part]['saves_per_config']['long']} saves per configuration)")
        labels = sorted(set(table["long"]) | set(table["recipe"]), key=lambda label: -max(table["long"].get(label, 0.0), table["recipe"].get(label, 0.0)))
        print(f"  {'phase':45s} {'long':>8s} {'recipe':>8s}")
        for label in labels:
            print(f"  {label:45s} {table['long'].get(label, 0.0):8.2f} {table['recipe'].get(label, 0.0):8.2f}")
        print(f"  recipe / long (total): {result[part]['recipe_over_long']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
