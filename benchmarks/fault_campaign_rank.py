"""One rank of benchmarks/fault_campaign.py: deterministic training with flashpoint saves and one injected fault.

Training is real and distributed: a row-parallel linear layer (each rank holds ROWS rows of the
weight) with a replicated input bias whose gradient is all-reduced, SGD with momentum, data drawn
from a generator seeded by the step, so every run computes bit-identical states. Every step is
saved to RAM through megatron.core.dist_checkpointing with FlashpointSaveStrategy (async, finalized
at the next step; on the NeMo IO's default PersistentWorkerQueue, whose worker is up before training
starts, or with "worker": "fork" a Megatron AsyncCallsQueue forking a worker per save), each rank
being its own "node" with its
own base directory and replication factor 2; every DURABLE_EVERY steps a durable copy goes to
disk with torch.save. Before a step's state is saved its SHA-256 is appended to this rank's
ledger, so the driver can check any later load against what was saved.

A run starts by recovering (replication.choice.choose_version on the RAM versions, else the newest durable
copy, else step 0), writes what it loaded and its digest to result-rank<r>-inc<i>.json, trains to
--steps and writes the final digest. Faults (incarnation 0 only) are injected by wrapping the
product's own functions in this process: a SIGKILL before or after staging, the background
write (for the spawned persistent worker, the request carries the fault: campaign_worker_faults),
the commit, the node copy or a replication push; a SIGKILL of the receiving peer; a
SIGKILL at a random time; a full tmpfs (a ballast file); a Manager whose process cannot start.
"""

from __future__ import annotations

import faulthandler
import hashlib
import inspect
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # launch.py (a site package shadows `examples`)
from launch import init_process_group_reporting_start  # noqa: E402 - examples/launch.py

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from campaign_worker_faults import KillRankAroundWrite  # noqa: E402 - benchmarks/ is the script's directory
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402

from ml_flashpoint_nemo.core.space import check_room_on_every_rank  # noqa: E402
from ml_flashpoint_nemo.errors import FlashpointError  # noqa: E402
from ml_flashpoint_nemo.megatron import FlashpointLoadStrategy, FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.megatron.async_workers import PersistentWorkerQueue  # noqa: E402
from ml_flashpoint_nemo.replication import ReplicationConfig  # noqa: E402
from ml_flashpoint_nemo.replication.choice import choose_version  # noqa: E402

ROWS, COLS, BATCH = 1024, 2048, 32  # 8 MiB of weight + 8 MiB of momentum per rank
DURABLE_EVERY = 4
LR, MOMENTUM = 0.01, 0.9
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
WORKER_BOOT_TIMEOUT_S = 60.0
log = logging.getLogger("fault_campaign_rank")


class Model:
    """This rank's rows of the weight, the replicated bias and their SGD momentum."""

    def __init__(self, rank: int) -> None:
        gen = torch.Generator().manual_seed(1000 + rank)
        self.weight = (torch.randn(ROWS, COLS, generator=gen) * 0.02).requires_grad_()
        self.bias = torch.zeros(COLS, requires_grad=True)
        self.optimizer = torch.optim.SGD([self.weight, self.bias], lr=LR, momentum=MOMENTUM)

    def train_step(self, step: int) -> None:
        rank = dist.get_rank()
        data = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, COLS, generator=data)
        targets = torch.randn(BATCH, ROWS * dist.get_world_size(), generator=data)
        mine = targets[:, rank * ROWS:(rank + 1) * ROWS]
        self.optimizer.zero_grad()
        loss = ((x + self.bias) @ self.weight.T - mine).pow(2).mean()
        loss.backward()
        dist.all_reduce(self.bias.grad)  # the bias is replicated: every rank applies the same update
        self.optimizer.step()

    def momenta(self) -> tuple[torch.Tensor, torch.Tensor]:
        def buffer(p: torch.Tensor) -> torch.Tensor:
            return self.optimizer.state.get(p, {}).get("momentum_buffer", torch.zeros_like(p))
        return buffer(self.weight), buffer(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight.detach(), self.bias.detach(), *self.momenta()]

    def digest(self, step: int) -> str:
        h = hashlib.sha256(str(step).encode())
        for t in self.tensors():
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def sharded_state(self, step: int) -> dict[str, Any]:
        rank, world = dist.get_rank(), dist.get_world_size()
        w_mom, b_mom = self.momenta()
        return {
            "weight": ShardedTensor.from_rank_offsets("weight", self.weight.detach(), (0, rank, world)),
            "bias": ShardedTensor.from_rank_offsets("bias", self.bias.detach(), replica_id=rank),
            "weight_momentum": ShardedTensor.from_rank_offsets("weight_momentum", w_mom, (0, rank, world)),
            "bias_momentum": ShardedTensor.from_rank_offsets("bias_momentum", b_mom, replica_id=rank),
            "data_position": ShardedObject("data_position", {"rank": rank, "step": step}, (world,), (rank,),
                                           replica_id=0),
            "step": step,
        }

    def restore(self, weight: torch.Tensor, bias: torch.Tensor, w_mom: torch.Tensor, b_mom: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(weight)
            self.bias.copy_(bias)
        self.optimizer.state[self.weight]["momentum_buffer"] = w_mom.clone()
        self.optimizer.state[self.bias]["momentum_buffer"] = b_mom.clone()


# --- recovery -----------------------------------------------------------------------------------

def recover(model: Model, p: dict[str, Any]) -> tuple[int, str]:
    """Resume like a trainer: the agreed RAM version, else the newest complete durable copy, else step 0."""
    choice = choose_version(p["base"])
    if choice.step is not None:
        template = model.sharded_state(choice.step)
        for key in ("weight", "bias", "weight_momentum", "bias_momentum"):
            template[key].data = torch.zeros_like(template[key].data)
        loaded = dist_checkpointing.load(template, choice.path(p["base"]), sharded_strategy=FlashpointLoadStrategy())
        position = loaded["data_position"]
        if loaded["step"] != choice.step or position != {"rank": dist.get_rank(), "step": choice.step}:
            raise AssertionError(f"step {choice.step} loaded a foreign step/position: {loaded['step']}, {position}")
        model.restore(loaded["weight"], loaded["bias"], loaded["weight_momentum"], loaded["bias_momentum"])
        return choice.step, "ram"
    durable = newest_durable(Path(p["durable"]))
    if durable is not None:
        saved = torch.load(Path(p["durable"]) / f"step-{durable}" / f"rank-{dist.get_rank()}.pt")
        model.restore(*saved)
        return durable, "durable"
    return 0, "scratch"


def newest_durable(root: Path) -> int | None:
    steps = [int(d.name[5:]) for d in root.glob("step-*") if (d / "COMPLETE").exists()] if root.is_dir() else []
    return max(steps, default=None)


def save_durable(model: Model, step: int, root: Path) -> None:
    directory = root / f"step-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save([t.clone() for t in model.tensors()], directory / f"rank-{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (directory / "COMPLETE").write_text("")


# --- faults -------------------------------------------------------------------------------------

CURRENT_STEP = 0  # the step being saved; a forked async worker inherits it
RANK_PID = os.getpid()


def die(where: str) -> None:
    print(f"FAULT: SIGKILL {where} (step {CURRENT_STEP})", flush=True)
    os.kill(RANK_PID, signal.SIGKILL)
    time.sleep(60)  # a forked worker killed its rank; it must not report as if nothing happened


def wrap(owner: Any, name: str, fault: dict[str, Any], action: Callable[[], None] | None = None,
         step_of: Callable[..., int] = lambda *args: CURRENT_STEP) -> None:
    """Make owner.name run the fault (default: die) before or after its first call at or past the fault's step.

    step_of(*args) says which step a call works on: by default the step being saved; a
    replication push runs later, in its own thread, and names its step in its arguments.
    "At or past": replication pushes only the newest version, so the fault's own step may be
    skipped when a newer save supersedes it; the fault then hits the next push instead.
    """
    original = getattr(owner, name)
    first_only = [True]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fire = first_only[0] and step_of(*args) >= fault["step"]
        if fire:
            first_only[0] = False
        hit = action or (lambda: die(f"{fault['when']} {owner.__name__}.{name} of step {step_of(*args)}"))
        if fire and fault["when"] == "before":
            hit()
        result = original(*args, **kwargs)
        if fire and fault["when"] == "after":
            hit()
        return result

    setattr(owner, name, wrapped)


def step_argument_of(method: Callable[..., Any]) -> Callable[..., int]:
    """step_of for wrap(): the value of method's parameter named "step" in a call's arguments.

    Bound by name, not position (and to the method's signature taken before wrap() replaces it), so
    that a change of the signature breaks this loudly instead of silently never firing the fault.
    """
    signature = inspect.signature(method)
    return lambda *args: int(signature.bind(*args).arguments["step"])


def install_fault(fault: dict[str, Any], p: dict[str, Any], peer_pids: list[int]) -> None:
    """Arm this rank's fault (only the faulted rank calls this)."""
    from ml_flashpoint_nemo.core import save_worker
    from ml_flashpoint_nemo.dcp import writer as dcp_writer
    from ml_flashpoint_nemo.megatron import strategies
    from ml_flashpoint_nemo.replication.service import ReplicationService

    kind = fault["kind"]
    push_step = step_argument_of(ReplicationService._push_object)
    if kind == "kill_stage":
        wrap(strategies._StagingWriter, "_stage", fault)
    elif kind == "kill_write" and p["worker"] == "fork":
        wrap(save_worker, "seal_object", fault)
    elif kind == "kill_write":
        pass  # a spawned worker does not see patches: the request of the fault's step carries it (main)
    elif kind == "kill_commit":
        wrap(dcp_writer, "write_commit", fault)
    elif kind == "kill_node_copy":
        wrap(strategies, "write_version_copy", fault)
    elif kind == "kill_replicate":
        wrap(ReplicationService, "_push_object", fault, step_of=push_step)
    elif kind == "kill_peer":  # the receiving node dies while this rank pushes to it
        def kill_peer() -> None:
            peer = peer_pids[(dist.get_rank() + 1) % len(peer_pids)]
            print(f"FAULT: SIGKILL of peer pid {peer} during a push (step {CURRENT_STEP})", flush=True)
            os.kill(peer, signal.SIGKILL)
        wrap(ReplicationService, "_push_object", dict(fault, when="before"), kill_peer, step_of=push_step)
    elif kind == "kill_random":
        pass  # armed when training starts (arm_random_kill), not while the rank recovers or its worker boots
    elif kind == "manager_fail":  # a real start failure: the spawned interpreter cannot run
        multiprocessing.set_executable("/bin/false")
    elif kind != "enospc" and not kind.startswith(("flip_", "wipe_")):
        raise ValueError(f"unknown fault kind {kind!r}")


def arm_random_kill(fault: dict[str, Any]) -> None:
    def later() -> None:
        time.sleep(fault["delay_s"])
        die(f"at a random time ({fault['delay_s']:.2f}s into training)")
    threading.Thread(target=later, daemon=True).start()


def fill_tmpfs(base: str) -> Path:
    """Take all but 64 KiB of the file system holding base: the next saves hit a real ENOSPC."""
    ballast = Path(base).parent / f"ballast-rank{dist.get_rank()}"
    vfs = os.statvfs(base)
    free = vfs.f_bavail * vfs.f_frsize - (64 << 10)
    with open(ballast, "wb") as f:
        chunk = b"\0" * (1 << 20)
        while free > 0:
            try:
                f.write(chunk[:min(free, len(chunk))])
                f.flush()
            except OSError:
                break
            free -= len(chunk)
    print(f"FAULT: tmpfs filled ({ballast.stat().st_size} bytes of ballast)", flush=True)
    return ballast


# --- the run ------------------------------------------------------------------------------------

def finalize(queue: AsyncCallsQueue, blocking: bool) -> list[str]:
    """Finalize finished saves (blocking: all of them); a failed flashpoint save is reported, training goes on."""
    failures = []
    while queue.get_num_unfinalized_calls():
        pending = queue.get_num_unfinalized_calls()
        try:
            queue.maybe_finalize_async_calls(blocking=blocking)
        except Exception as exc:  # noqa: BLE001 - the contract: a failed RAM save never stops training
            if queue.get_num_unfinalized_calls() == pending:
                raise  # not a failed save but a failed collective (a peer is gone): the job is broken
            print(f"SAVE FAILED: {type(exc).__name__}: {exc}", flush=True)
            failures.append(str(exc))
            continue  # the failed call is off the queue; later ones may be done too
        if not blocking:
            break
    return failures


def start_save_queue(worker: str) -> AsyncCallsQueue:
    """The IO's default PersistentWorkerQueue, its worker started now (it boots during recovery), or a fork per save."""
    if worker == "fork":
        return AsyncCallsQueue()
    queue = PersistentWorkerQueue()
    queue.start_worker()
    return queue


def wait_for_worker(queue: AsyncCallsQueue) -> None:
    """Train once the persistent worker is up, so that the saves use it; a worker that died booting (the
    Manager fault breaks every spawn) leaves the saves to forked workers, as in the product."""
    if not isinstance(queue, PersistentWorkerQueue):
        return
    deadline = time.monotonic() + WORKER_BOOT_TIMEOUT_S
    while not queue.worker_ready(timeout=0.1) and queue.persistent_caller.process.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the persistent save worker was not up within {WORKER_BOOT_TIMEOUT_S} s")


def main() -> None:
    global CURRENT_STEP
    p = json.loads(sys.argv[1])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks before it kills a stuck rank;
    # forked async-save workers inherit this, so a stuck worker prints its stack too
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    time.sleep(p.get("startup_delay_s", {}).get(os.environ["RANK"], 0.0))  # a test's stand-in for slow imports
    # The harness's hang budget counts from here: a slow start (imports, a peer still importing) is no hang.
    init_process_group_reporting_start("gloo", COLLECTIVE_TIMEOUT)
    faulthandler.dump_traceback_later(p.get("stack_dump_after_s", 100.0), exit=False)  # where a hang hangs, in the log
    rank = dist.get_rank()
    p["base"] = p["bases"][rank]
    model = Model(rank)
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    fault = p.get("fault") if p["incarnation"] == 0 else None
    if fault is not None and fault["rank"] == rank:
        install_fault(fault, p, pids)
    queue = start_save_queue(p["worker"] if p["flashpoint"] else "fork")  # the reference run saves nothing
    write_fault = fault if fault is not None and fault["rank"] == rank and fault["kind"] == "kill_write" \
        and p["worker"] != "fork" else None
    run_dir = Path(p["run_dir"])
    started = time.monotonic()
    resumed, source = recover(model, p) if p["flashpoint"] else (0, "scratch")
    result = {"rank": rank, "resumed_step": resumed, "source": source, "resumed_digest": model.digest(resumed),
              "recover_s": round(time.monotonic() - started, 3)}
    (run_dir / f"result-rank{rank}-inc{p['incarnation']}.json").write_text(json.dumps(result))
    print(f"RESUMED step {resumed} from {source}", flush=True)

    strategy = FlashpointSaveStrategy(replication=ReplicationConfig(factor=2, connect_timeout_s=2.0, io_timeout_s=10.0,
                                                                    retries=1, backoff_s=0.1))
    wait_for_worker(queue)
    if fault is not None and fault["rank"] == rank and fault["kind"] == "kill_random":
        arm_random_kill(fault)
    ledger = open(run_dir / f"ledger-rank{rank}.jsonl", "a")  # noqa: SIM115 - lives as long as the run
    ballast = None
    failures: list[str] = []
    for step in range(resumed + 1, p["steps"] + 1):
        model.train_step(step)
        ledger.write(json.dumps({"step": step, "digest": model.digest(step), "inc": p["incarnation"]}) + "\n")
        ledger.flush()
        os.fsync(ledger.fileno())
        if step % DURABLE_EVERY == 0:
            save_durable(model, step, Path(p["durable"]))
        if not p["flashpoint"]:
            continue
        failures += finalize(queue, blocking=False)
        if fault is not None and fault["kind"] == "enospc" and fault["rank"] == rank:
            if step == fault["step"]:
                ballast = fill_tmpfs(p["base"])
            elif ballast is not None and step == fault["step"] + 2:
                ballast.unlink()
                ballast = None
        CURRENT_STEP = step
        version = Path(p["base"]) / f"step-{step}"
        version.mkdir(exist_ok=True)  # on every node, as the checkpoint IO does before a save
        try:
            check_room_on_every_rank(p["base"])  # Megatron writes common.pt on rank 0 alone: agree first
            request = dist_checkpointing.save(model.sharded_state(step), str(version), sharded_strategy=strategy,
                                              async_sharded_save=True)
        except FlashpointError as exc:  # raised on every rank (e.g. ManagerStartError): skip this save
            print(f"SAVE FAILED: {type(exc).__name__}: {exc}", flush=True)
            failures.append(str(exc))
        else:
            if write_fault is not None and step >= write_fault["step"]:
                request = request._replace(async_fn=KillRankAroundWrite(request.async_fn, write_fault["when"], step,
                                                                         os.getpid()))
                write_fault = None
            queue.schedule_async_request(request)
        if fault is not None and fault.get("stop_after") == step:
            failures += finalize(queue, blocking=True)  # collective: the save of this step committed (or failed)
            if fault["rank"] == rank:
                die("after a complete step")
    failures += finalize(queue, blocking=True)
    final = {"final_step": p["steps"], "final_digest": model.digest(p["steps"]), "save_failures": len(failures),
             "seconds": round(time.monotonic() - started, 3)}
    (run_dir / f"final-rank{rank}-inc{p['incarnation']}.json").write_text(json.dumps(final))
    queue.close()  # every save was finalized above
    strategy.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
