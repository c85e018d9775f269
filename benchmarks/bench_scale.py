"""How the save and recovery coordination grows with the number of ranks, measured on real processes.

For every N in --ranks and T in --tensors, N rank processes (torch.distributed, gloo on
127.0.0.1) form simulated nodes: --ranks-per-node consecutive ranks share a base directory,
each node its own, as the multi-process tests do. Each rank owns a Megatron sharded state dict
of T tiny tensors (4 float32 each): the even ones sharded over the ranks (ShardedTensor by rank
offsets), the odd ones replicated on every rank (only rank 0's copy is written: dedup), plus a
ShardedObject per rank and common state. Three worlds run one after the other, each a fresh
set of N processes:

  save      --saves async saves through dist_checkpointing.save with FlashpointSaveStrategy
            (replication factor --factor) and Megatron's AsyncCallsQueue (a forked worker per
            save); blocking = save() + schedule_async_request(), commit = the blocking
            finalize. Megatron's access-integrity check runs on the first save only, as the
            NeMo IO does. After each commit the rank waits for its replication pushes, so that
            every save starts from a replicated version. Then tmpfs per node (du of its base
            directory, pool/ included).
  intact    a restart with every node's RAM intact: choose_version(base).
  lost      the driver wipes node --lost-node's base directory (a node lost and replaced),
            then a restart: choose_version(base), then a load of the chosen version through
            FlashpointLoadStrategy, compared bit for bit with what was saved. (With a single
            node nothing survives a wipe: that world loads without wiping.)

Collectives are counted in every rank by wrapping torch.distributed's collective functions
(benchmarks/collective_meter.py says what "received" means per call); timings are net of the
meter's own sizing work. Bytes fetched per node at a restart are the growth of the files under
the node's base directory over that world (apparent sizes). A gloo calibration (after a
barrier: all_reduce of 4 bytes, all_gather of 64 KiB per rank) gives the alpha (seconds per
latency step) and beta (seconds per byte received) of the latency model used to extrapolate.

The per-(N, T) results of two nodes or more are fitted, per T, by least squares as value = a + b*N
and extrapolated to --target-ranks ranks on --target-nodes nodes, also along the line through the
two largest N alone (a step at small N, such as 2 nodes that hold every object already, bends the
fit over all); the collectives' time at the target comes from the latency model with the
calibrated constants and with assumed ones. The printout states the model and constants.

    python benchmarks/bench_scale.py --ranks 2,4,8,16 --ranks-per-node 2 --tensors 64,2000
    python benchmarks/bench_scale.py --ranks 2,4 --tensors 8 --json /tmp/scale.json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]

ELEMENTS = 4  # float32 values per tensor (per rank for the sharded ones)
CALIBRATION_ALLREDUCES = 20
CALIBRATION_ALLGATHERS = 5
CALIBRATION_ALLGATHER_BYTES = 64 * 1024
REPLICATION_WAIT_S = 120.0
PROCESS_GROUP_TIMEOUT_S = 300
POLL_S = 0.05
STOP_GRACE_S = 10.0  # for a rank's leftover processes (its resource tracker) to end by themselves
# The driver imports these before forking the ranks, so that N processes do not import them N times.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "megatron.core",
           "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.async_utils")
# An interconnect assumed for the second extrapolation (not measured here): alpha per latency step, beta per byte.
ASSUMED_ALPHA_S = 20e-6
ASSUMED_BETA_S_PER_BYTE = 1 / 10e9
PHASES = ("save", "intact", "lost")

Json = dict[str, Any]


# ================================================================ the state every rank saves


def tensor_values(step: int, index: int, owner: int) -> Any:
    """The values of tensor `index` at `step` held by `owner` (-1: the replicated copy); random bits, reproducible."""
    import torch

    seed = (step * 1_000_003 + index * 7_919 + owner + 1) & 0x7FFF_FFFF
    return torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(seed))


def is_sharded(index: int) -> bool:
    return index % 2 == 0


PAYLOAD_KEY = "payload"  # --mib-per-rank: one large tensor per rank, sharded by rank (its own bytes)


def payload_values(step: int, rank: int, mib: float) -> Any:
    """This rank's payload at step: mib MiB of float32, reproducible."""
    import torch

    count = int(mib * (1 << 20)) // 4
    return torch.randn(count, generator=torch.Generator().manual_seed(step * 7_919 + rank + 1))


def sharded_state(step: int, tensors: int, *, zeros: bool = False, mib: float = 0.0) -> Json:
    """This rank's Megatron sharded state dict at step (zeros: the template a load fills)."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    state: Json = {}
    for index in range(tensors):
        key = f"t.{index:05d}"
        values = tensor_values(step, index, rank if is_sharded(index) else -1)
        if zeros:
            values = torch.zeros_like(values)
        if is_sharded(index):
            state[key] = ShardedTensor.from_rank_offsets(key, values, (0, rank, world))
        else:
            state[key] = ShardedTensor.from_rank_offsets(key, values, replica_id=rank)
    if mib > 0:
        payload = payload_values(step, rank, mib)
        state[PAYLOAD_KEY] = ShardedTensor.from_rank_offsets(
            PAYLOAD_KEY, torch.zeros_like(payload) if zeros else payload, (0, rank, world))
    state["rank_state"] = ShardedObject("rank_state", None if zeros else {"step": step, "rank": rank},
                                        (world,), (rank,), replica_id=0)
    state["iteration"] = step  # common state
    return state


def mismatches(loaded: Json, step: int, tensors: int, mib: float = 0.0) -> list[str]:
    """Keys whose loaded value differs, bit for bit, from what this rank saved at step."""
    import torch
    import torch.distributed as dist

    rank, wrong = dist.get_rank(), []
    for index in range(tensors):
        key = f"t.{index:05d}"
        expected = tensor_values(step, index, rank if is_sharded(index) else -1)
        got = loaded.get(key)
        if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype \
                or not torch.equal(got.view(torch.int32), expected.view(torch.int32)):
            wrong.append(key)
    if mib > 0 and not torch.equal(loaded.get(PAYLOAD_KEY), payload_values(step, rank, mib)):
        wrong.append(PAYLOAD_KEY)
    if loaded.get("rank_state") != {"step": step, "rank": rank}:
        wrong.append("rank_state")
    if loaded.get("iteration") != step:
        wrong.append("iteration")
    return wrong


# ================================================================ in a rank process


@dataclass(frozen=True)
class RankSpec:
    """What one rank process does; the same for every rank of a world but its rank."""

    phase: str
    rank: int
    world: int
    ranks_per_node: int
    tensors: int
    saves: int
    factor: int
    root: str
    result: str
    mib: float = 0.0  # --mib-per-rank

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def base(self) -> str:
        return node_base(self.root, self.node)

    @property
    def is_node_leader(self) -> bool:
        return self.rank % self.ranks_per_node == 0


def node_base(root: str | Path, node: int) -> str:
    return os.path.join(root, f"node-{node}")


def is_rank_file(base: str | Path, path: str | Path) -> bool:
    """A file that exists per rank (an object, own or a replica, or a pool buffer), not one per version."""
    relative = Path(path).relative_to(base)
    return relative.parts[0] == "pool" or relative.name.startswith("rank-")


def tree_bytes(path: str | Path) -> Json:
    """Bytes allocated (as du counts them, each inode once) under path: all, of per-rank files, of pool/;
    and the apparent size of all."""
    seen: set[tuple[int, int]] = set()
    out = {"allocated": 0, "rank_files": 0, "pool": 0, "apparent": 0}
    for directory, _, files in os.walk(path):
        for name in files:
            full = os.path.join(directory, name)
            try:
                info = os.lstat(full)
            except FileNotFoundError:
                continue
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            out["allocated"] += info.st_blocks * 512
            out["apparent"] += info.st_size
            if is_rank_file(path, full):
                out["rank_files"] += info.st_blocks * 512
            if Path(full).relative_to(path).parts[0] == "pool":
                out["pool"] += info.st_blocks * 512
    return out


def calibrate(world: int) -> Json:
    """Median seconds of a 4-byte all_reduce and of a 64 KiB-per-rank all_gather, after a barrier (not metered)."""
    import torch
    import torch.distributed as dist

    def timed(action: Callable[[], None], runs: int) -> float:
        dist.barrier()
        samples = []
        for _ in range(runs):
            started = time.perf_counter()
            action()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    small = torch.zeros(1, dtype=torch.float32)
    mine = torch.zeros(CALIBRATION_ALLGATHER_BYTES // 4, dtype=torch.float32)
    parts = [torch.empty_like(mine) for _ in range(world)]
    return {"all_reduce_seconds": timed(lambda: dist.all_reduce(small), CALIBRATION_ALLREDUCES),
            "all_gather_seconds": timed(lambda: dist.all_gather(parts, mine), CALIBRATION_ALLGATHERS),
            "all_gather_received": (world - 1) * CALIBRATION_ALLGATHER_BYTES}


def net_seconds(started: float, window: Any) -> float:
    """Wall seconds since started, less what the meter spent sizing payloads inside the window."""
    return max(0.0, time.perf_counter() - started - window.overhead_seconds)


def run_saves(spec: RankSpec, meter: Any) -> Json:
    """The save world: --saves async saves, each committed and replicated, then tmpfs per node."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy
    from ml_flashpoint_nemo.replication import ReplicationConfig

    out: Json = {"calibration": calibrate(spec.world), "saves": []}
    strategy = FlashpointSaveStrategy(replication=ReplicationConfig(factor=spec.factor, host="127.0.0.1"))
    queue = AsyncCallsQueue(persistent=False)
    try:
        for index in range(spec.saves):
            step = index + 1
            state = sharded_state(step, spec.tensors, mib=spec.mib)
            directory = os.path.join(spec.base, f"step-{step}")
            if spec.rank == 0:  # Megatron checks that the directory exists, on rank 0
                os.makedirs(directory, exist_ok=True)
            dist.barrier()
            with meter.window(f"save-{step}-blocking") as blocking:
                started = time.perf_counter()
                request = dist_checkpointing.save(state, directory, sharded_strategy=strategy,
                                                  async_sharded_save=True, validate_access_integrity=index == 0)
                queue.schedule_async_request(request)
                blocking_s = net_seconds(started, blocking)
            with meter.window(f"save-{step}-commit") as commit:
                started = time.perf_counter()
                queue.maybe_finalize_async_calls(blocking=True)
                commit_s = net_seconds(started, commit)
            with meter.window(f"save-{step}-replication") as replication:
                started = time.perf_counter()
                status = strategy.replication.wait(step, timeout=REPLICATION_WAIT_S) if strategy.replication else None
                replication_s = net_seconds(started, replication)
            out["saves"].append({"step": step, "blocking_s": blocking_s, "commit_s": commit_s,
                                 "replication_s": replication_s,
                                 "replication": None if status is None else status.state,
                                 "blocking": blocking.as_dict(), "commit": commit.as_dict(),
                                 "replication_window": replication.as_dict()})
            dist.barrier()  # every rank's pushes are done before the next save, or before du
        if spec.is_node_leader:
            out["tmpfs"] = tree_bytes(spec.base)
        dist.barrier()
    finally:
        queue.close()
        strategy.close()
    return out


def run_recovery(spec: RankSpec, meter: Any) -> Json:
    """A restart: choose_version on this node's base; in the last world, a load of the chosen version."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from ml_flashpoint_nemo.megatron import FlashpointLoadStrategy
    from ml_flashpoint_nemo.replication.choice import choose_version

    Path(spec.base).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with meter.window("choose") as choose:
        started = time.perf_counter()
        chosen = choose_version(spec.base).step
        choose_s = net_seconds(started, choose)
    out: Json = {"chosen": chosen, "choose_s": choose_s, "choose": choose.as_dict()}
    if chosen is None:
        return out
    dist.barrier()  # both restarts load: the objects a load reads from other nodes count as fetched
    with meter.window("load") as load:
        started = time.perf_counter()
        loaded = dist_checkpointing.load(sharded_state(chosen, spec.tensors, zeros=True, mib=spec.mib),
                                         os.path.join(spec.base, f"step-{chosen}"),
                                         sharded_strategy=FlashpointLoadStrategy())
        load_s = net_seconds(started, load)
    wrong = mismatches(loaded, chosen, spec.tensors, spec.mib)
    out.update(load_s=load_s, load=load.as_dict(), bit_exact=not wrong, mismatched_keys=wrong[:10])
    return out


def rank_main(spec: RankSpec) -> Json:
    """In a forked rank: shims, meter, process group, the phase's work; returns what it measured."""
    from ml_flashpoint_nemo.testing import cpu_shims

    cpu_shims.install_for_checkpointing()
    from collective_meter import CollectiveMeter

    # before ml_flashpoint_nemo's modules are imported; nodes as the harness makes them (consecutive ranks)
    meter = CollectiveMeter(node_of=lambda rank: rank // spec.ranks_per_node).install()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    try:
        work = run_saves if spec.phase == "save" else run_recovery
        out = work(spec, meter)
        out.update(rank=spec.rank, node=spec.node)
        return out
    finally:
        dist.destroy_process_group()


def rank_process(spec: RankSpec, env: dict[str, str], log_path: str) -> None:
    """The body of a forked rank: never returns (os._exit), so the driver's code never runs twice."""
    code = 1
    try:
        os.setsid()  # its own process group: the driver kills it and whatever it forked at once
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        atexit._clear()  # the driver's exit hooks are not this process's
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.update(env)
        result = rank_main(spec)
        Path(spec.result).write_text(json.dumps(result))
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the rank's log, the driver shows it
        traceback.print_exc()
    finally:
        try:  # what a normal exit runs, then leave without finalizing (gloo's threads race it: tests/support)
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# ================================================================ the driver


class WorldFailed(RuntimeError):
    """A rank of a world failed or the world ran out of time; the message has the ranks' log tails."""


def free_port() -> int:
    from ml_flashpoint_nemo.testing.ports import free_port as port

    return port()


class World:
    """N forked rank processes of one phase; run() waits for all of them within a deadline."""

    live: set[int] = set()  # rank pids not yet reaped, of every world: killed on an interrupt

    def __init__(self, phase: str, world: int, args: argparse.Namespace, root: Path, logs: Path,
                 secret: str) -> None:
        self.phase, self.world, self.args, self.root, self.logs, self.secret = phase, world, args, root, logs, secret
        self.tag = f"n{world}-{root.name}-{phase}"

    def spec(self, rank: int, tensors: int) -> RankSpec:
        return RankSpec(self.phase, rank, self.world, self.args.ranks_per_node, tensors, self.args.saves,
                        self.args.factor, str(self.root), str(self.logs / f"{self.tag}-rank{rank}.json"),
                        self.args.mib_per_rank)

    def env(self, rank: int, port: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank % self.args.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(self.args.ranks_per_node), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "FLASHPOINT_COPY_THREADS": "1",
                "FLASHPOINT_REPLICATION_SECRET": self.secret, "FLASHPOINT_REPLICATION_HOST": "127.0.0.1"}

    def run(self, tensors: int, deadline: float) -> list[Json]:
        port = free_port()
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(self.world):
            spec = self.spec(rank, tensors)
            pid = os.fork()
            if pid == 0:
                rank_process(spec, self.env(rank, port), str(self.logs / f"{self.tag}-rank{rank}.log"))
            pids.append(pid)
            World.live.add(pid)
        try:
            codes = self._wait(pids, deadline)
        finally:
            stop_groups(pids)
        if any(code != 0 for code in codes):
            raise WorldFailed(self._failure(codes))
        return [json.loads(Path(self.spec(rank, tensors).result).read_text()) for rank in range(self.world)]

    def _wait(self, pids: list[int], deadline: float) -> list[int | None]:
        """Exit codes (None: still running when the deadline passed or another rank failed)."""
        codes: list[int | None] = [None] * len(pids)
        while any(code is None for code in codes):
            for rank, pid in enumerate(pids):
                if codes[rank] is None:
                    codes[rank] = _reap(pid, block=False)
            if any(code not in (None, 0) for code in codes) or time.monotonic() > deadline:
                return codes  # the others would wait in a collective for the failed one
            time.sleep(POLL_S)
        return codes

    def _failure(self, codes: list[int | None]) -> str:
        """Which ranks failed (or, if none did, that the world ran out of time), with the failed ranks' log tails."""
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        stopped = [rank for rank, code in enumerate(codes) if code is None]
        if failed:
            lines = [f"world {self.tag}: ranks {failed} failed (exit codes {[codes[r] for r in failed]}); "
                     f"ranks {stopped} were stopped"]
        else:
            lines = [f"world {self.tag}: ranks {stopped} still ran at the deadline (--timeout {self.args.timeout} s)"]
        for rank in (failed or stopped)[:3]:
            log = self.logs / f"{self.tag}-rank{rank}.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            lines.append(f"--- rank {rank} log tail ---\n{tail}")
        return "\n".join(lines)


def _reap(pid: int, *, block: bool) -> int | None:
    """The exit code of a rank (negative: killed by that signal), or None while it runs."""
    try:
        done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        World.live.discard(pid)
        return -1
    if done == 0:
        return None
    World.live.discard(pid)
    return os.waitstatus_to_exitcode(status)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_groups(pids: list[int]) -> None:
    """End the ranks' process groups (a rank's group: it and the workers, Manager and resource tracker it started).

    Everything but multiprocessing's resource trackers is killed and the ranks reaped; a tracker exits by
    itself once the processes it served are gone, after unlinking the semaphores they left in /dev/shm
    (killed with them, it would leak those). Whatever is left after STOP_GRACE_S is killed.
    """
    import psutil  # type: ignore[import-untyped]

    groups = set(pids)
    for proc in psutil.process_iter(["cmdline"]):
        try:
            in_group = os.getpgid(proc.pid) in groups
        except (ProcessLookupError, PermissionError):
            continue
        if in_group and "resource_tracker" not in " ".join(proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for pid in pids:
        if pid in World.live:  # also a rank killed before its setsid()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _reap(pid, block=True)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(_group_alive(pgid) for pgid in groups) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def file_sizes(path: str) -> dict[str, int]:
    sizes = {}
    for directory, _, files in os.walk(path):
        for name in files:
            full = os.path.join(directory, name)
            try:
                sizes[full] = os.lstat(full).st_size
            except FileNotFoundError:
                continue
    return sizes


def grown_bytes(base: str, before: dict[str, int], after: dict[str, int]) -> Json:
    """Bytes that appeared under base (new files' sizes plus the growth of files that were there): all, and
    those of per-rank files (objects) and of version files (metadata, common state, commit record)."""
    grown = {path: max(0, size - before.get(path, 0)) for path, size in after.items()}
    objects = sum(size for path, size in grown.items() if is_rank_file(base, path))
    total = sum(grown.values())
    return {"all": total, "objects": objects, "version_files": total - objects}


def measure_point(world: int, tensors: int, args: argparse.Namespace, root: Path, logs: Path) -> Json:
    """The three worlds for one (N, T); per-rank results and the driver's per-node measurements."""
    nodes = math.ceil(world / args.ranks_per_node)
    deadline = time.monotonic() + args.timeout
    secret = secrets.token_hex(32)
    bases = [node_base(root, n) for n in range(nodes)]
    point: Json = {"ranks": world, "nodes": nodes, "tensors": tensors, "ranks_per_node": args.ranks_per_node}
    started = time.monotonic()
    point["save"] = World("save", world, args, root, logs, secret).run(tensors, deadline)
    for phase in ("intact", "lost"):
        lost = phase == "lost" and nodes > 1
        if lost:
            shutil.rmtree(bases[args.lost_node % nodes])
        before = [file_sizes(b) for b in bases]
        point[phase] = World(phase, world, args, root, logs, secret).run(tensors, deadline)
        fetched = [grown_bytes(base, b, file_sizes(base)) for b, base in zip(before, bases)]
        point[f"{phase}_fetched_per_node"] = [f["all"] for f in fetched]
        point[f"{phase}_fetched_objects_per_node"] = [f["objects"] for f in fetched]
        point[f"{phase}_fetched_version_files_per_node"] = [f["version_files"] for f in fetched]
        point[f"{phase}_node_lost"] = (args.lost_node % nodes) if lost else None
        point[f"{phase}_tmpfs_per_node"] = [tree_bytes(base)["allocated"] for base in bases]
    point["wall_seconds"] = round(time.monotonic() - started, 2)
    return point


# ================================================================ summaries


def spread(values: Iterable[float]) -> Json:
    values = list(values)
    return {"max": max(values), "mean": statistics.fmean(values)} if values else {"max": None, "mean": None}


def kind_counts(window: Json) -> dict[str, float]:
    counts = {"linear": 0.0, "tree": 0.0}
    for stats in window["by_function"].values():
        counts[stats["kind"]] += stats["calls"]
    return counts


def scope_counts(windows: list[Json]) -> dict[str, float]:
    """Calls per "kind:scope" (collective_meter), max over the windows (ranks): a leader gathers where others do not."""
    keys = sorted({key for w in windows for key in w.get("by_scope", {})})
    return {key: max(float(w.get("by_scope", {}).get(key, 0)) for w in windows) for key in keys}


def merged(windows: list[Json]) -> Json:
    """One window's totals from several (e.g. a save's blocking part and its commit)."""
    total: Json = {"collectives": 0, "received": 0, "padded": 0, "seconds": 0.0, "by_function": {}, "by_scope": {}}
    for w in windows:
        for key in ("collectives", "received", "padded", "seconds"):
            total[key] += w[key]
        for key, calls in w.get("by_scope", {}).items():
            total["by_scope"][key] = total["by_scope"].get(key, 0) + calls
        for name, stats in w["by_function"].items():
            into = total["by_function"].setdefault(name, {"calls": 0, "received": 0, "padded": 0, "seconds": 0.0,
                                                          "kind": stats["kind"]})
            for key in ("calls", "received", "padded", "seconds"):
                into[key] += stats[key]
    return total


def mean_window(windows: list[Json]) -> Json:
    """The per-save mean of several saves' windows."""
    total = merged(windows)
    n = max(1, len(windows))
    out = {key: total[key] / n for key in ("collectives", "received", "padded", "seconds")}
    out["by_function"] = {name: {k: (v / n if k != "kind" else v) for k, v in stats.items()}
                          for name, stats in total["by_function"].items()}
    out["by_scope"] = {key: calls / n for key, calls in total["by_scope"].items()}
    return out


def save_summary(ranks: list[Json], which: slice) -> Json:
    """Per-rank totals (blocking + commit) of the saves in `which`, as max and mean over ranks."""
    per_rank = [mean_window([merged([s["blocking"], s["commit"]]) for s in r["saves"][which]]) for r in ranks]
    blocking_part = [mean_window([s["blocking"] for s in r["saves"][which]]) for r in ranks]
    commit_part = [mean_window([s["commit"] for s in r["saves"][which]]) for r in ranks]
    blocking = [statistics.fmean(s["blocking_s"] for s in r["saves"][which]) for r in ranks]
    commit = [statistics.fmean(s["commit_s"] for s in r["saves"][which]) for r in ranks]
    return {
        "saves": len(ranks[0]["saves"][which]),
        "collectives": spread(w["collectives"] for w in per_rank),
        "received": spread(w["received"] for w in per_rank),
        "padded": spread(w["padded"] for w in per_rank),
        "collective_seconds": spread(w["seconds"] for w in per_rank),
        "blocking_part": {"collectives": spread(w["collectives"] for w in blocking_part),
                          "received": spread(w["received"] for w in blocking_part)},
        "commit_part": {"collectives": spread(w["collectives"] for w in commit_part),
                        "received": spread(w["received"] for w in commit_part)},
        "linear_collectives": max(kind_counts(w)["linear"] for w in per_rank),
        "tree_collectives": max(kind_counts(w)["tree"] for w in per_rank),
        "collectives_by_scope": scope_counts(per_rank),
        "blocking_s": spread(blocking), "commit_s": spread(commit),
        "replication_s": spread(statistics.fmean(s["replication_s"] for s in r["saves"][which]) for r in ranks),
        "replication_states": sorted({str(s["replication"]) for r in ranks for s in r["saves"][which]}),
        "collectives_outside_saves": sum(s["replication_window"]["collectives"] for r in ranks
                                         for s in r["saves"][which]),
        "rank0_by_function": per_rank[0]["by_function"],
    }


def window_summary(ranks: list[Json], key: str, seconds_key: str) -> Json:
    windows = [r[key] for r in ranks if key in r]
    if not windows:
        return {}
    return {"collectives": spread(w["collectives"] for w in windows), "received": spread(w["received"] for w in windows),
            "padded": spread(w["padded"] for w in windows),
            "linear_collectives": max(kind_counts(w)["linear"] for w in windows),
            "tree_collectives": max(kind_counts(w)["tree"] for w in windows),
            "collectives_by_scope": scope_counts(windows),
            "seconds": spread(r[seconds_key] for r in ranks if seconds_key in r),
            "rank0_by_function": windows[0]["by_function"]}


def calibration_constants(ranks: list[Json], world: int) -> Json:
    """alpha: all_reduce seconds / ceil(log2 N); beta: the all_gather's seconds beyond alpha*(N-1), per byte."""
    from collective_meter import LINEAR, TREE, latency_steps

    if world < 2:
        return {}
    reduce_s = statistics.median(r["calibration"]["all_reduce_seconds"] for r in ranks)
    gather_s = statistics.median(r["calibration"]["all_gather_seconds"] for r in ranks)
    alpha = reduce_s / latency_steps(TREE, world)
    received = ranks[0]["calibration"]["all_gather_received"]
    beta = max(0.0, gather_s - alpha * latency_steps(LINEAR, world)) / received
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "all_reduce_s": reduce_s, "all_gather_s": gather_s,
            "all_gather_received": received}


def summarize(point: Json) -> Json:
    save, intact, lost = point["save"], point["intact"], point["lost"]
    leaders = [r["tmpfs"] for r in save if "tmpfs" in r]
    row: Json = {key: point[key] for key in ("ranks", "nodes", "tensors", "ranks_per_node", "wall_seconds")}
    row["save_first"] = save_summary(save, slice(0, 1))
    row["save_steady"] = save_summary(save, slice(1, None)) if len(save[0]["saves"]) > 1 else row["save_first"]
    row["tmpfs_per_node"] = spread(t["allocated"] for t in leaders)
    row["tmpfs_rank_files_per_node"] = spread(t["rank_files"] for t in leaders)
    row["tmpfs_version_files_per_node"] = spread(t["allocated"] - t["rank_files"] for t in leaders)
    row["pool_per_node"] = spread(t["pool"] for t in leaders)
    row["calibration"] = calibration_constants(save, point["ranks"])
    for phase, ranks in (("intact", intact), ("lost", lost)):
        recovery = window_summary(ranks, "choose", "choose_s")
        recovery["chosen"] = sorted({str(r["chosen"]) for r in ranks})
        fetched = point[f"{phase}_fetched_per_node"]
        recovery["fetched_per_node"] = spread(fetched)
        recovery["fetched_objects_per_node"] = spread(point[f"{phase}_fetched_objects_per_node"])
        recovery["fetched_version_files_per_node"] = spread(point[f"{phase}_fetched_version_files_per_node"])
        recovery["fetched_total"] = sum(fetched)
        recovery["node_lost"] = point[f"{phase}_node_lost"]
        recovery["tmpfs_per_node"] = spread(point[f"{phase}_tmpfs_per_node"])
        recovery["bit_exact"] = all(r.get("bit_exact") is True for r in ranks)
        row[f"recovery_{phase}"] = recovery
    row["load"] = window_summary(lost, "load", "load_s")
    row["load"]["bit_exact"] = all(r.get("bit_exact") is True for r in lost)
    row["load"]["mismatched_keys"] = sorted({k for r in lost for k in r.get("mismatched_keys", [])})[:10]
    return row


# ================================================================ fits and extrapolation

# (label, path in a row, per node?) of what is fitted against N. "Per node" values grow with the node's own
# ranks (its objects, its replicas), so they are fitted per rank of the node and scaled to the target's ranks
# per node; the others, per-node ones that grow with the whole job included, are fitted as they are.
FIT_METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("save collectives/rank", ("save_steady", "collectives", "max"), False),
    ("save bytes recv/rank max", ("save_steady", "received", "max"), False),
    ("save bytes recv/rank mean", ("save_steady", "received", "mean"), False),
    ("save blocking s max", ("save_steady", "blocking_s", "max"), False),
    ("save commit s max", ("save_steady", "commit_s", "max"), False),
    ("first save bytes recv/rank max", ("save_first", "received", "max"), False),
    ("recovery(intact) collectives/rank", ("recovery_intact", "collectives", "max"), False),
    ("recovery(intact) bytes recv/rank max", ("recovery_intact", "received", "max"), False),
    ("recovery(intact) s max", ("recovery_intact", "seconds", "max"), False),
    ("recovery(lost) collectives/rank", ("recovery_lost", "collectives", "max"), False),
    ("recovery(lost) bytes recv/rank max", ("recovery_lost", "received", "max"), False),
    ("recovery(lost) s max", ("recovery_lost", "seconds", "max"), False),
    ("load bytes recv/rank max", ("load", "received", "max"), False),
    ("recovery(intact) fetched bytes/node max", ("recovery_intact", "fetched_per_node", "max"), False),
    ("recovery(lost) fetched object bytes/node max", ("recovery_lost", "fetched_objects_per_node", "max"), True),
    ("recovery(lost) fetched version-file bytes/node max",
     ("recovery_lost", "fetched_version_files_per_node", "max"), False),
    ("tmpfs per-rank-file bytes/node max", ("tmpfs_rank_files_per_node", "max"), True),
    ("tmpfs version-file bytes/node max", ("tmpfs_version_files_per_node", "max"), False),
)
# The windows whose collective time is extrapolated with the latency model.
MODELLED = (("save (steady)", "save_steady"), ("recovery (intact)", "recovery_intact"),
            ("recovery (lost)", "recovery_lost"), ("load", "load"))


def walk(row: Json, path: Sequence[str]) -> Any:
    """row[path[0]][path[1]]..., or None where a key is missing."""
    value: Any = row
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def lookup(row: Json, path: Sequence[str]) -> float | None:
    value = walk(row, path)
    return float(value) if isinstance(value, (int, float)) else None


def least_squares(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(a, b) of y = a + b*x minimising the squared error; None with fewer than two distinct x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def growth_exponent(points: list[tuple[float, float]]) -> float | None:
    """The slope of log y against log N: 1 is linear growth, 0 flat, 2 quadratic."""
    logs = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    fit = least_squares(logs)
    return None if fit is None else fit[1]


def fitted_rows(rows: list[Json], tensors: int) -> list[Json]:
    """The rows of T that the fits use: those of two nodes or more (one node neither replicates nor loses one)."""
    return sorted((r for r in rows if r["tensors"] == tensors and r["nodes"] > 1), key=lambda r: r["ranks"])


def fits(rows: list[Json], args: argparse.Namespace) -> list[Json]:
    """Per T and metric: the linear fit in N, its value at the target and the log-log growth exponent.

    Per-node metrics are fitted per rank of the node (value / ranks per node) and multiplied by the
    target's ranks per node, so that the measured 2 ranks per node do not stand for the target's 8."""
    target_rpn = args.target_ranks / args.target_nodes
    out = []
    for tensors in sorted({r["tensors"] for r in rows}):
        mine = fitted_rows(rows, tensors)
        for label, path, per_node in FIT_METRICS:
            points = [(float(r["ranks"]), v / (r["ranks_per_node"] if per_node else 1))
                      for r in mine if (v := lookup(r, path)) is not None]
            fit, local = least_squares(points), least_squares(points[-2:])
            scale = target_rpn if per_node else 1
            at_target = None if fit is None else (fit[0] + fit[1] * args.target_ranks) * scale
            local_at_target = None if local is None else (local[0] + local[1] * args.target_ranks) * scale
            out.append({"tensors": tensors, "metric": label, "per_node": per_node, "points": points,
                        "largest_measured": None if not points else points[-1][1] * (
                            mine[-1]["ranks_per_node"] if per_node else 1),
                        "intercept": None if fit is None else fit[0], "slope": None if fit is None else fit[1],
                        "at_target": at_target, "at_target_from_two_largest": local_at_target,
                        "growth_exponent": growth_exponent(points)})
    return out


def model_constants(rows: list[Json]) -> Json:
    """The gloo alpha and beta measured here: the median over the worlds of >= 4 ranks (else over all)."""
    measured = [r for r in rows if r["calibration"]]
    wide = [r for r in measured if r["ranks"] >= 4] or measured
    if not wide:
        return {}
    return {"alpha_s": statistics.median(r["calibration"]["alpha_s"] for r in wide),
            "beta_s_per_byte": statistics.median(r["calibration"]["beta_s_per_byte"] for r in wide),
            "from_worlds": sorted({r["ranks"] for r in wide})}


def modelled_seconds(rows: list[Json], args: argparse.Namespace, alpha: float, beta: float) -> list[Json]:
    """Collective seconds per rank at the target: counts and bytes on the line through the two largest N, in the
    latency model (the smaller worlds may sit on the other side of a step, e.g. 2 nodes that fetch nothing).

    Each count is per kind and scope of its group (collective_meter): a gather among one node's ranks is
    charged g-1 steps, one among the node leaders nodes-1, one over the world N-1 (tree ones ceil(log2))."""
    from collective_meter import latency_steps, scope_size

    out = []
    for tensors in sorted({r["tensors"] for r in rows}):
        mine = fitted_rows(rows, tensors)
        for label, key in MODELLED:
            keys = sorted({k for r in mine for k in (lookup_dict(r, (key, "collectives_by_scope")) or {})})
            fitted: dict[str, float] = {}
            paths = [(what, (key, "collectives_by_scope", what)) for what in keys]
            for what, path in [*paths, ("linear", (key, "linear_collectives")), ("tree", (key, "tree_collectives")),
                               ("bytes", (key, "received", "max"))]:
                points = [(float(r["ranks"]), lookup(r, path) or 0.0) for r in mine if lookup_dict(r, (key,))]
                fit = least_squares(points[-2:])
                if fit is not None:
                    fitted[what] = max(0.0, fit[0] + fit[1] * args.target_ranks)
            if "bytes" not in fitted:
                continue
            steps = 0.0
            for what in keys:  # "kind:scope"
                kind, scope = what.split(":", 1)
                steps += fitted[what] * latency_steps(kind, scope_size(scope, args.target_ranks, args.target_nodes))
            out.append({"tensors": tensors, "window": label, "linear_collectives": fitted["linear"],
                        "tree_collectives": fitted["tree"], "by_scope": {k: fitted[k] for k in keys},
                        "latency_steps": steps, "bytes_received": fitted["bytes"],
                        "seconds": alpha * steps + beta * fitted["bytes"]})
    return out


def lookup_dict(row: Json, path: Sequence[str]) -> Json | None:
    value = walk(row, path)
    return value if isinstance(value, dict) and value else None


# ================================================================ output


def human_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}B"


def number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def table(title: str, header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    text = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths)),
            "  ".join("-" * w for w in widths)]
    text += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(text)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measured_tree() -> str:
    """The commit measured, and how many files under ml_flashpoint_nemo/ differ from it (a shared tree)."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [line for line in git("status", "--porcelain", "--", "ml_flashpoint_nemo", "csrc").splitlines() if line]
    return f"{git('rev-parse', '--short', 'HEAD') or 'unknown'} + {len(changed)} uncommitted files in ml_flashpoint_nemo/ csrc/"


def code_digest() -> str:
    """A digest of the package's Python sources: another developer's edit during a run changes it."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO / "ml_flashpoint_nemo").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode())
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"unreadable")
    return digest.hexdigest()[:12]


def header_lines(args: argparse.Namespace, argv: Sequence[str]) -> list[str]:
    import megatron.core
    import torch

    return [
        "bench_scale: flashpoint save and recovery coordination vs number of ranks (gloo on 127.0.0.1)",
        f"command: {shlex.join([sys.executable, *argv])}",
        f"cpu: {cpu_model()} ({os.cpu_count()} logical cpus); python {platform.python_version()}, "
        f"torch {torch.__version__}, megatron-core {megatron.core.__version__}",
        f"tree: {measured_tree()}; sources digest {code_digest()}",
        f"started: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; "
        f"ranks per node {args.ranks_per_node}, replication factor {args.factor}, {args.saves} saves per world "
        f"(save 1 = first, saves 2.. = steady), node lost: {args.lost_node}",
        f"state per rank: T tensors of {ELEMENTS} float32, even ones sharded over ranks, odd ones replicated "
        "(written once), one ShardedObject, common state" + (f", and {args.mib_per_rank:g} MiB of its own per rank"
                                                            if args.mib_per_rank else ""),
    ]


def result_tables(rows: list[Json]) -> list[str]:
    save_lines, recovery_lines, load_lines = [], [], []
    for r in rows:
        steady, first = r["save_steady"], r["save_first"]
        save_lines.append([
            str(r["ranks"]), str(r["nodes"]), str(r["tensors"]), count(steady["collectives"]["max"]),
            f'{count(steady["blocking_part"]["collectives"]["max"])}+{count(steady["commit_part"]["collectives"]["max"])}',
            human_bytes(steady["received"]["max"]), human_bytes(steady["received"]["mean"]),
            f'{human_bytes(steady["blocking_part"]["received"]["max"])}+'
            f'{human_bytes(steady["commit_part"]["received"]["max"])}',
            number(steady["collective_seconds"]["max"]),
            count(first["collectives"]["max"]), human_bytes(first["received"]["max"]),
            number(steady["blocking_s"]["max"]), number(steady["blocking_s"]["mean"]),
            number(steady["commit_s"]["max"]), number(steady["commit_s"]["mean"]),
            number(first["blocking_s"]["max"]), ",".join(steady["replication_states"])])
        for phase in ("intact", "lost"):
            rec = r[f"recovery_{phase}"]
            case = "no node lost" if phase == "intact" else (
                f"node {rec['node_lost']} lost" if rec["node_lost"] is not None else "(1 node: not wiped)")
            recovery_lines.append([
                str(r["ranks"]), str(r["nodes"]), str(r["tensors"]), case, count(rec["collectives"]["max"]),
                human_bytes(rec["received"]["max"]), human_bytes(rec["received"]["mean"]),
                number(rec["seconds"]["max"]), number(rec["seconds"]["mean"]),
                human_bytes(rec["fetched_per_node"]["max"]),
                f'{human_bytes(rec["fetched_objects_per_node"]["max"])}+'
                f'{human_bytes(rec["fetched_version_files_per_node"]["max"])}',
                human_bytes(rec["fetched_total"]), human_bytes(rec["tmpfs_per_node"]["max"]),
                ",".join(rec["chosen"]), "yes" if rec["bit_exact"] else "NO"])
        load = r["load"]
        load_lines.append([
            str(r["ranks"]), str(r["nodes"]), str(r["tensors"]), count(load.get("collectives", {}).get("max")),
            human_bytes(load.get("received", {}).get("max")), number(load.get("seconds", {}).get("max")),
            "yes" if load["bit_exact"] else "NO", human_bytes(r["tmpfs_per_node"]["max"]),
            human_bytes(r["tmpfs_per_node"]["mean"]), human_bytes(r["tmpfs_version_files_per_node"]["max"]),
            human_bytes(r["pool_per_node"]["max"]),
            number(r["wall_seconds"], 1)])
    return [
        table("SAVE (per rank: max / mean over ranks; steady = mean of saves 2..; coll = collectives per save, "
              "blk+cmt = in the blocking part + in the commit; recv = bytes received by collectives; coll s = "
              "seconds inside collectives; blocking and commit in seconds, net of the meter)",
              ["N", "nodes", "T", "coll", "blk+cmt", "recv max", "recv mean", "recv max blk+cmt", "coll s max",
               "1st coll", "1st recv max", "block max",
               "block mean", "commit max", "commit mean", "1st block max", "replication"], save_lines),
        table("RECOVERY (choose_version, then a load, on every rank; coll/recv/s: the choice; fetched = bytes that "
              "appeared under node base dirs during the choice and the load; tmpfs/node after = du after the load)",
              ["N", "nodes", "T", "case", "coll", "recv max", "recv mean", "s max", "s mean", "fetched/node max",
               "objects+version files", "fetched total", "tmpfs/node after", "chosen", "bit-exact"], recovery_lines),
        table("LOAD after the last recovery (FlashpointLoadStrategy) and TMPFS per node after the saves (du)",
              ["N", "nodes", "T", "load coll", "load recv max", "load s max", "bit-exact", "tmpfs/node max",
               "tmpfs/node mean", "version files/node max", "pool/node max", "wall s"], load_lines),
    ]


def extrapolation_text(fitted: list[Json], modelled: dict[str, list[Json]], constants: Json,
                       args: argparse.Namespace) -> list[str]:
    lines = [
        f"EXTRAPOLATION to N = {args.target_ranks} ranks on {args.target_nodes} nodes "
        f"({args.target_ranks // args.target_nodes} ranks per node)",
        "  fit: least squares value = a + b*N over the measured N of 2 nodes or more, per T; per-rank files per "
        "node (objects, replicas, pool buffers: the lost node's object fetch and tmpfs) are fitted per rank of the "
        "node and scaled to the target's ranks per node; version files (metadata, common state, commit record) and "
        "the intact restart's fetch are not (they grow with the job, not with the node's ranks); exponent = slope of log(value) vs log(N) "
        "(1 = linear, 2 = quadratic: then the linear fit underestimates); 'same, 2 largest N' = the line through "
        "the two largest N only (a step at small N, e.g. 2 nodes needing no peer transfer, distorts the fit over all)",
    ]
    def shown(f: Json, value: float | None) -> str:
        return human_bytes(value) if "bytes" in f["metric"] else number(value, 2)

    fit_lines = [[str(f["tensors"]), f["metric"], number(f["intercept"], 4) if f["intercept"] is not None else "-",
                  number(f["slope"], 4) if f["slope"] is not None else "-", shown(f, f["largest_measured"]),
                  shown(f, f["at_target"]), shown(f, f["at_target_from_two_largest"]), number(f["growth_exponent"], 2)]
                 for f in fitted]
    lines.append(table("", ["T", "metric", "a", "b (per rank)", "at largest N", f"at N={args.target_ranks}",
                            "same, 2 largest N", "exponent"], fit_lines))
    lines.append(
        "  latency model per collective call: alpha*steps + beta*bytes received; steps = n-1 for linear "
        "collectives (all_gather*, gather*, scatter*, all_to_all*, reduce_scatter*: ring or root), "
        "ceil(log2 n) for tree ones (all_reduce, broadcast*, reduce, barrier, new_group), n the ranks of the "
        "call's group at the target: N for the world, g = N/nodes for one node's ranks, nodes for the node "
        "leaders (one rank per node); counts per kind and group (max over ranks, summed: a rank 0 that is in "
        "every group pays every step) and bytes (max over ranks) are lines through the two largest N, at the "
        "target N")
    if constants:
        lines.append(f"  gloo constants measured here (median over worlds {constants['from_worlds']}): "
                     f"alpha = {constants['alpha_s'] * 1e6:.1f} us/step (4-byte all_reduce / ceil(log2 N)), "
                     f"beta = {constants['beta_s_per_byte'] * 1e9:.3f} ns/byte (64 KiB/rank all_gather beyond "
                     "alpha*(N-1)); N processes share this machine's cores, so both are pessimistic")
    lines.append(f"  assumed interconnect (not measured): alpha = {ASSUMED_ALPHA_S * 1e6:.0f} us/step, "
                 f"beta = {ASSUMED_BETA_S_PER_BYTE * 1e9:.2f} ns/byte (10 GB/s)")
    model_lines = []
    for name, entries in modelled.items():
        for e in entries:
            model_lines.append([name, str(e["tensors"]), e["window"], count(round(e["linear_collectives"], 1)),
                                count(round(e["tree_collectives"], 1)), count(round(e["latency_steps"], 1)),
                                human_bytes(e["bytes_received"]), number(e["seconds"], 3)])
    lines.append(table("", ["constants", "T", "window", "linear coll", "tree coll", "latency steps",
                            "bytes recv/rank", "collective s/rank"], model_lines))
    scoped = sorted({(e["tensors"], e["window"], ", ".join(f"{k} {count(round(v, 1))}" for k, v in e["by_scope"].items()))
                     for entries in modelled.values() for e in entries})
    lines += [f"  calls per kind:group at the target, T={t} {window}: {text}" for t, window, text in scoped]
    return lines


# ================================================================ main


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=parse_ints, default=[2, 4, 8, 16], help="world sizes N (default 2,4,8,16)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="consecutive ranks sharing a base directory")
    parser.add_argument("--tensors", type=parse_ints, default=[64, 2000], help="tensors per rank T (default 64,2000)")
    parser.add_argument("--saves", type=int, default=3, help="saves per world (>= 2: the first and steady ones)")
    parser.add_argument("--factor", type=int, default=2, help="replication factor k")
    parser.add_argument("--mib-per-rank", type=float, default=0.0,
                        help="add one tensor of this many MiB per rank (its own shard): tmpfs sizes that mean something")
    parser.add_argument("--lost-node", type=int, default=0, help="the node wiped before the last restart")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the three worlds of one (N, T)")
    parser.add_argument("--target-ranks", type=int, default=4096)
    parser.add_argument("--target-nodes", type=int, default=512)
    parser.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the temporary directory goes (default /dev/shm)")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement, summary and fit as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, bases)")
    args = parser.parse_args(argv)
    if args.ranks_per_node < 1 or args.saves < 1 or args.factor < 1:
        parser.error("--ranks-per-node, --saves and --factor must be positive")
    bad = [n for n in args.ranks if n % args.ranks_per_node]
    if bad:
        parser.error(f"every N must be a multiple of --ranks-per-node ({args.ranks_per_node}): {bad}")
    return args


def preload() -> None:
    """Import what every rank needs before forking them; warn if that left a Python thread running (fork copies none)."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() > 1:  # (torch's own native helper thread is not one: the test fork server has it too)
        print(f"warning: the driver runs {threading.active_count()} Python threads before forking the ranks",
              file=sys.stderr)


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    preload()
    started = time.monotonic()
    digest_at_start = code_digest()
    print("\n".join(header_lines(args, argv)), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="flashpoint-bench-scale-", dir=args.root))
    logs = workdir / "logs"
    logs.mkdir()
    rows, points, failures = [], [], []
    try:
        for tensors in args.tensors:
            for world in args.ranks:
                root = workdir / f"n{world}-t{tensors}"
                print(f"... N={world} T={tensors}", file=sys.stderr, flush=True)
                try:
                    point = measure_point(world, tensors, args, root, logs)
                except WorldFailed as exc:
                    failures.append(str(exc))
                    print(f"FAILED N={world} T={tensors}: {exc}", file=sys.stderr, flush=True)
                    continue
                finally:
                    if not args.keep:
                        shutil.rmtree(root, ignore_errors=True)
                points.append(point)
                rows.append(summarize(point))
        rows.sort(key=lambda r: (r["tensors"], r["ranks"]))
        constants = model_constants(rows)
        fitted = fits(rows, args)
        modelled = {"assumed": modelled_seconds(rows, args, ASSUMED_ALPHA_S, ASSUMED_BETA_S_PER_BYTE)}
        if constants:
            modelled = {"gloo here": modelled_seconds(rows, args, constants["alpha_s"], constants["beta_s_per_byte"]),
                        **modelled}
        print()
        print("\n\n".join(result_tables(rows)))
        print()
        print("\n".join(extrapolation_text(fitted, modelled, constants, args)))
        digest_now = code_digest()
        changed = digest_now != digest_at_start
        print(f"\nrun time: {time.monotonic() - started:.1f} s" + (f"; {len(failures)} points FAILED" if failures else "")
              + (f"; WARNING: ml_flashpoint_nemo's sources changed during the run (digest now {digest_now})"
                 if changed else "; sources unchanged during the run"), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "command": shlex.join([sys.executable, *argv]), "header": header_lines(args, argv), "rows": rows,
                "fits": fitted, "latency_constants": constants, "modelled": modelled, "failures": failures,
                "sources_changed_during_run": changed,
                "raw": points, "run_seconds": time.monotonic() - started}, indent=1))
        return 1 if failures else 0
    finally:
        stop_groups(list(World.live))
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    return run(args, [str(Path(__file__).resolve().relative_to(Path.cwd()) if Path.cwd() in Path(__file__).resolve().parents
                          else Path(__file__).resolve()), *argv])


if __name__ == "__main__":
    sys.exit(main())
