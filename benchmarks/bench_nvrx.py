"""How long a save blocks training: our NVRx-interface manager against our NeMo path and NVRx's own manager.

Two gloo ranks on this machine save the same Megatron-core sharded state (each rank --mib MiB of
its own shards) in five configurations, one save each in turn (A B C D E A B C D E ...) so that a
noisy machine cannot reorder them:

- flashpoint: FlashpointLocalCheckpointManager, each rank its own "node" (base directory), so
  the version is also replicated to the other rank's node, in the background; scheduled on
  NVRx's AsyncCallsQueue, which forks a writer per save (as NVRx's own managers here);
- flashpoint_persistent: the same manager on our PersistentWorkerQueue (the NeMo path's queue:
  one save worker, up before the timed saves), which isolates the manager from the queue;
- nemo_path: our NeMo path's save (what FlashpointCheckpointIO does for wrap_trainer_with_flashpoint):
  dist_checkpointing.save(async_sharded_save=True) with FlashpointSaveStrategy into the same kind of
  per-rank base directories, replicated in the background, on a PersistentWorkerQueue; Megatron's
  sharding-integrity check on the first (warm-up) save only, as the IO does;
- nvrx: NVRx's LocalCheckpointManager without replication (fork per save);
- nvrx_clique: NVRx's LocalCheckpointManager with its CliqueReplicationStrategy (factor 2), which
  exchanges every shard between the two ranks inside the save.

"blocks" is what the training loop waits for: for the managers, the conversion to a tensor-aware
state dict ("convert" alone) plus save(..., is_async=True) and the queue's schedule_async_request; for
the NeMo path, dist_checkpointing.save plus schedule_async_request. The conversion is what each
manager's NeMo wiring calls before the save: for ours, FlashpointHierarchicalCheckpointIO's
TensorAwareConversion (Megatron's sharding check on the first save and after a sharding change, one
16-byte all-reduce on a steady save); for NVRx's, NeMo's MCoreHierarchicalCheckpointIO's
MCoreTensorAwareStateDict.from_state_dict without cached metadata (the check on every save). --algo
is the conversion's algorithm for all of them (NeMo's default is fully_parallel); --ours-convert megatron
converts for our managers as NeMo's IO does too (what FlashpointHierarchicalCheckpointIO did before it
had its own conversion). Each rank builds its state before the barrier that starts a save, so that
one rank's slower state building is not timed as the other's wait in a collective. "to commit" adds
the queue's blocking finalize (the version is then loadable). Our replication is waited for before
the next save, so it does not slow the others. Prints medians and ranges, and each configuration's
blocking over the NeMo path's and over NVRx's from the same rounds.

    .venv/bin/python benchmarks/bench_nvrx.py --mib 512 --rounds 5
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
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("flashpoint", "flashpoint_persistent", "nemo_path", "nvrx", "nvrx_clique")
OURS = ("flashpoint", "flashpoint_persistent")
REFERENCES = ("nemo_path", "nvrx", "nvrx_clique")  # the ratios divide our managers' blocking by these
PHASES = ("convert", "blocks", "to_commit")
TENSORS_PER_RANK = 8
WORKER_BOOT_TIMEOUT_S = 240
REPLICATION_TIMEOUT_S = 300


# --- one rank ------------------------------------------------------------------------------------


def sharded_state(rank: int, world: int, mib: float, seed: int) -> dict:
    """TENSORS_PER_RANK float32 tensors per rank, each rank's own shard of a global tensor."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    elements = max(1, int(mib * 2**20 / 4 / TENSORS_PER_RANK))
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.rand(elements, generator=generator), (0, rank, world))
        for i in range(TENSORS_PER_RANK)
    }


def make_manager(kind: str, root: Path, rank: int):
    if kind in OURS:
        from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager

        return FlashpointLocalCheckpointManager(root / kind / f"node{rank}", session_id="bench")
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    strategy = None
    if kind == "nvrx_clique":
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        strategy = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
    return LocalCheckpointManager(root / kind, session_id="bench", repl_strategy=strategy)


def persistent_queue() -> Any:
    """Our PersistentWorkerQueue with its worker up, as the NeMo IO starts it at trainer set-up."""
    from ml_flashpoint_nemo.megatron.async_workers import PersistentWorkerQueue

    queue = PersistentWorkerQueue()
    queue.start_worker()
    if not queue.worker_ready(timeout=WORKER_BOOT_TIMEOUT_S):
        raise RuntimeError(f"the persistent save worker was not up within {WORKER_BOOT_TIMEOUT_S} s")
    return queue


class Config:
    """One configuration: its blocking save (timed), its queue, and what waits for its replication."""

    def __init__(self, kind: str, root: Path, rank: int, world: int, algo: str, ours_convert: str) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        from ml_flashpoint_nemo.nvrx.conversion import TensorAwareConversion

        self.kind, self.rank, self.world, self.algo = kind, rank, world, algo
        self.conversion = TensorAwareConversion(algo) if kind in OURS and ours_convert == "flashpoint" else None
        self.base = root / kind / f"node{rank}"
        self.strategy: Any = None
        self.manager: Any = None
        if kind == "nemo_path":
            from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy

            self.strategy = FlashpointSaveStrategy()
        else:
            self.manager = make_manager(kind, root, rank)
        self.queue = (
            persistent_queue() if kind in ("nemo_path", "flashpoint_persistent") else AsyncCallsQueue(persistent=False)
        )

    def save(self, state: dict, iteration: int) -> tuple[float, float]:
        """One save's blocking part: (seconds converting to a tensor-aware state dict, seconds in all)."""
        if self.strategy is not None:
            return 0.0, self._nemo_path_save(state, iteration)
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        started = time.perf_counter()
        if self.conversion is not None:  # what FlashpointHierarchicalCheckpointIO converts with
            tensor_aware = self.conversion(state)
        else:  # what NeMo's MCoreHierarchicalCheckpointIO converts with
            tensor_aware, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo=self.algo)
        converted = time.perf_counter()
        self.queue.schedule_async_request(self.manager.save(tensor_aware, iteration, is_async=True))
        return converted - started, time.perf_counter() - started

    def _nemo_path_save(self, state: dict, iteration: int) -> float:
        from megatron.core import dist_checkpointing

        directory = self.base / f"step-{iteration}"
        directory.mkdir(parents=True, exist_ok=True)  # Megatron checks that it exists
        started = time.perf_counter()
        request = dist_checkpointing.save(
            state,
            str(directory),
            sharded_strategy=self.strategy,
            async_sharded_save=True,
            validate_access_integrity=iteration == 1,
        )
        self.queue.schedule_async_request(request)
        return time.perf_counter() - started

    def finalize(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)

    def wait_for_replication(self, iteration: int) -> None:
        """Ours replicate in the background: let it finish before the next save."""
        if self.strategy is not None:
            replication = self.strategy.replication
        else:
            replication = getattr(self.manager, "_replication", None)  # NVRx's managers have none
        if replication is not None:
            replication.wait(iteration, timeout=REPLICATION_TIMEOUT_S)

    def close(self) -> None:
        self.queue.close()
        close: Callable[[], None] | None = getattr(self.strategy or self.manager, "close", None)
        if close is not None:
            close()


def rank_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from ml_flashpoint_nemo.testing import cpu_shims

    cpu_shims.install_for_checkpointing()
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = {kind: Config(kind, Path(args.root), rank, world, args.algo, args.ours_convert) for kind in CONFIGS}
    times: dict[str, dict[str, list[float]]] = {k: {phase: [] for phase in PHASES} for k in CONFIGS}
    for iteration in range(1, args.rounds + 2):  # the first round warms every configuration up and is not counted
        for kind, config in configs.items():
            state = sharded_state(rank, world, args.mib, iteration)
            dist.barrier()
            started = time.perf_counter()
            converted, blocked = config.save(state, iteration)
            config.finalize()
            committed = time.perf_counter() - started
            config.wait_for_replication(iteration)
            del state
            dist.barrier()
            if iteration > 1:
                for phase, seconds in zip(PHASES, (converted, blocked, committed)):
                    times[kind][phase].append(seconds)
    for config in configs.values():
        config.close()
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------------


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=512, help="MiB of state per rank")
    parser.add_argument("--rounds", type=int, default=5, help="measured saves per configuration (after one warm-up)")
    parser.add_argument("--root", default="/dev/shm", help="where the configurations' directories go (a tmpfs)")
    parser.add_argument("--algo", choices=["atomic", "fully_parallel"], default="atomic",
                        help="the managers' conversion algorithm (NeMo's default: fully_parallel)")
    parser.add_argument("--ours-convert", choices=["flashpoint", "megatron"], default="flashpoint",
                        help="our managers' conversion: our IO's (checked when the sharding changed) or NeMo's IO's")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    sys.path.insert(0, str(REPO / "examples"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_scale import cpu_model
    from launch import launch_ranks

    work = Path(tempfile.mkdtemp(prefix="bench-nvrx-", dir=args.root))
    out = Path(tempfile.mkdtemp(prefix="bench-nvrx-out-"))
    try:
        argv = [
            "--rank-main",
            "--root",
            str(work),
            "--out",
            str(out),
            "--mib",
            str(args.mib),
            "--rounds",
            str(args.rounds),
            "--algo",
            args.algo,
            "--ours-convert",
            args.ours_convert,
        ]
        code = launch_ranks(__file__, argv, nproc=2, timeout=args.timeout, log_dir=out)
        if code != 0:
            log = (out / "rank-0.log").read_text()[-4000:] if (out / "rank-0.log").exists() else ""
            sys.exit(f"bench_nvrx: the ranks exited with {code}\n{log}")
        ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    # The loop waits for the slower rank: per save, the max over ranks.
    per_save = {
        kind: {phase: [max(r[kind][phase][i] for r in ranks) for i in range(args.rounds)] for phase in PHASES}
        for kind in CONFIGS
    }
    ratios = {
        f"{ours}_over_{reference}": [o / r for o, r in zip(per_save[ours]["blocks"], per_save[reference]["blocks"])]
        for ours in OURS
        for reference in REFERENCES
    }
    command = " ".join([Path(sys.executable).name, *sys.argv])
    result = {
        "command": command,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "mib_per_rank": args.mib,
        "rounds": args.rounds,
        "algo": args.algo,
        "ours_convert": args.ours_convert,
        "seconds": per_save,
        "ratios": ratios,
        "targets": {"over_nemo_path": 1.0, "over_nvrx_clique": 0.3},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"bench_nvrx: {command}\ncpu: {result['cpu']} ({result['cpus']} logical); 2 ranks, {args.mib:g} MiB each, "
        f"{args.rounds} saves per configuration, interleaved, {args.algo}, ours converted by {args.ours_convert}; "
        f"seconds, median (min-max) of the slower rank"
    )
    print(f"{'configuration':22}  {'convert':24}  {'blocks':24}  {'to commit':24}")
    for kind in CONFIGS:
        print(f"{kind:22}  " + "  ".join(f"{summary(per_save[kind][phase]):24}" for phase in PHASES))
    for name, values in ratios.items():
        print(f"{name}: {summary(values)} (same round; targets: over nemo_path <= 1, over nvrx_clique < 0.3)")


if __name__ == "__main__":
    main()
