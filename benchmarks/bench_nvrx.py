"""How long a save blocks training behind NVRx's local-checkpoint interface: our manager against NVRx's own.

Two gloo ranks on this machine save Megatron-core's MCoreTensorAwareStateDict (each rank --mib MiB
of its own shards) through three managers, one save each in turn (A B C A B C ...) so that a noisy
machine cannot reorder them:

- flashpoint: FlashpointLocalCheckpointManager, each rank its own "node" (base directory), so
  the version is also replicated to the other rank's node, in the background;
- nvrx: NVRx's LocalCheckpointManager without replication;
- nvrx_clique: NVRx's LocalCheckpointManager with its CliqueReplicationStrategy (factor 2), which
  exchanges every shard between the two ranks inside the save.

"blocks" is what the training loop waits for: save(..., is_async=True) and handing the request to
NVRx's AsyncCallsQueue. "to commit" adds the queue's blocking finalize (the version is then
loadable). Our replication is waited for before the next save, so it does not slow the others.
Prints medians and ranges, and our blocking over each of NVRx's from the same rounds.

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

REPO = Path(__file__).resolve().parents[1]
MANAGERS = ("flashpoint", "nvrx", "nvrx_clique")
TENSORS_PER_RANK = 8


# --- one rank ------------------------------------------------------------------------------------


def sharded_state(rank: int, world: int, mib: float, seed: int) -> dict:
    """TENSORS_PER_RANK float32 tensors per rank, each rank's own shard of a global tensor."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    elements = max(1, int(mib * 2**20 / 4 / TENSORS_PER_RANK))
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.rand(elements, generator=generator), (0, rank, world))
            for i in range(TENSORS_PER_RANK)}


def make_manager(kind: str, root: Path, rank: int):
    if kind == "flashpoint":
        from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager

        return FlashpointLocalCheckpointManager(root / kind / f"node{rank}", session_id="bench")
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    strategy = None
    if kind == "nvrx_clique":
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        strategy = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
    return LocalCheckpointManager(root / kind, session_id="bench", repl_strategy=strategy)


def rank_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from ml_flashpoint_nemo.testing import cpu_shims

    cpu_shims.install_for_checkpointing()
    import datetime

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root)
    managers = {kind: make_manager(kind, root, rank) for kind in MANAGERS}
    queue = AsyncCallsQueue(persistent=False)
    times: dict[str, dict[str, list[float]]] = {k: {"blocks": [], "to_commit": []} for k in MANAGERS}
    for iteration in range(1, args.rounds + 2):  # the first round warms every manager up and is not counted
        for kind, manager in managers.items():
            state, _ = MCoreTensorAwareStateDict.from_state_dict(sharded_state(rank, world, args.mib, iteration),
                                                                 algo="atomic")
            dist.barrier()
            started = time.perf_counter()
            request = manager.save(state, iteration, is_async=True)
            queue.schedule_async_request(request)
            blocked = time.perf_counter() - started
            queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            committed = time.perf_counter() - started
            replication = getattr(manager, "_replication", None)
            if replication is not None:  # ours runs in the background: let it finish before the next save
                replication.wait(iteration, timeout=300)
            dist.barrier()
            if iteration > 1:
                times[kind]["blocks"].append(blocked)
                times[kind]["to_commit"].append(committed)
    queue.close()
    for manager in managers.values():
        close = getattr(manager, "close", None)
        if close is not None:
            close()
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------------


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=512, help="MiB of state per rank")
    parser.add_argument("--rounds", type=int, default=5, help="measured saves per manager (after one warm-up)")
    parser.add_argument("--root", default="/dev/shm", help="where the managers' directories go (a tmpfs)")
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
        argv = ["--rank-main", "--root", str(work), "--out", str(out), "--mib", str(args.mib),
                "--rounds", str(args.rounds)]
        code = launch_ranks(__file__, argv, nproc=2, timeout=args.timeout, log_dir=out)
        if code != 0:
            log = (out / "rank-0.log").read_text()[-4000:] if (out / "rank-0.log").exists() else ""
            sys.exit(f"bench_nvrx: the ranks exited with {code}\n{log}")
        ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    # The loop waits for the slower rank: per save, the max over ranks.
    per_save = {kind: {phase: [max(r[kind][phase][i] for r in ranks) for i in range(args.rounds)]
                       for phase in ("blocks", "to_commit")} for kind in MANAGERS}
    ratios = {f"flashpoint_over_{kind}": [f / o for f, o in zip(per_save["flashpoint"]["blocks"], per_save[kind]["blocks"])]
              for kind in ("nvrx", "nvrx_clique")}
    command = " ".join([Path(sys.executable).name, *sys.argv])
    result = {"command": command, "cpu": cpu_model(), "cpus": os.cpu_count(), "mib_per_rank": args.mib,
              "rounds": args.rounds, "seconds": per_save, "ratios": ratios,
              "target_flashpoint_over_nvrx_clique": 0.3}
    if args.json:
        print(json.dumps(result))
        return
    print(f"bench_nvrx: {command}\ncpu: {result['cpu']} ({result['cpus']} logical); 2 ranks, {args.mib:g} MiB each, "
          f"{args.rounds} saves per manager, interleaved; seconds, median (min-max) of the slower rank")
    print(f"{'manager':12}  {'blocks':24}  {'to commit':24}")
    for kind in MANAGERS:
        print(f"{kind:12}  {summary(per_save[kind]['blocks']):24}  {summary(per_save[kind]['to_commit']):24}")
    for name, values in ratios.items():
        print(f"{name}: {summary(values)} (same round; target for nvrx_clique: < 0.3)")


if __name__ == "__main__":
    main()
