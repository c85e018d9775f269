"""Replication scenarios run on several gloo ranks by tests/test_replication.py.

A "node" is its own base directory and ranks_per_node consecutive ranks. Logs go to stdout
so the test can assert what was said.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import psutil  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ml_flashpoint_nemo import _core  # noqa: E402
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name, version_relpath  # noqa: E402
from ml_flashpoint_nemo.core.topology import FAILURE_DOMAIN_ENV  # noqa: E402
from ml_flashpoint_nemo.core.versions import committed_steps  # noqa: E402
from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.replication import ReplicationConfig  # noqa: E402
from ml_flashpoint_nemo.replication.choice import choose_version  # noqa: E402
from tests.support.megatron_scenarios import check_loaded, load, save  # noqa: E402
from tests.support.multiproc import node_base, scenario_main  # noqa: E402

logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                    format="%(levelname)s %(name)s: %(message)s")


def _config(p: dict[str, Any]) -> ReplicationConfig:
    """With p["domains"] (one per node), each rank names its node's failure domain through the config's callable."""
    domains = p.get("domains")
    return ReplicationConfig(factor=p.get("factor", 2), connect_timeout_s=2.0, io_timeout_s=5.0, retries=1,
                             backoff_s=0.1,
                             failure_domain=(lambda: domains[dist.get_rank() // p["ranks_per_node"]]) if domains
                             else None)


def replicate(p: dict[str, Any]) -> None:
    """Save p["steps"] with replication; wait (test only) for each push; print every rank's status.

    With stop_server_rank / stop_before_step, that rank's transfer server stops before that step
    (a peer that became unreachable); the save must still commit and the status say why.
    """
    strategy = FlashpointSaveStrategy(replication=_config(p), keep=p.get("keep", 1))
    mine = dict(p, base=node_base(p))
    for step in p["steps"]:
        if step == p.get("stop_before_step") and strategy._replication is not None:
            if dist.get_rank() == p["stop_server_rank"]:
                strategy._replication.server.stop()
            dist.barrier()
        started = time.monotonic()
        save(mine, step, None, strategy)
        print(f"SAVED {step} in {time.monotonic() - started:.2f}s", flush=True)
        status = strategy._replication.wait(step, timeout=60)
        print(f"STATUS {step} {status.state} failed={sorted(status.failed_peers)} "
              f"{'; '.join(status.failed_peers.values())}", flush=True)
        dist.barrier()  # every rank's pushes of this step are done before the next save
    newest, failed = strategy.replication.progress()
    print(f"PROGRESS newest={newest} failed={failed}", flush=True)
    _push_over_the_targets_own_object(strategy.replication, p["steps"][-1])
    dist.barrier()  # no server closes before every rank has tried
    addresses = strategy._replication.addresses
    print(f"ADDRESSES {addresses}", flush=True)
    print(f"COMMITTED {committed_steps(CheckpointLayout(node_base(p)))}", flush=True)
    strategy.close()
    threads = [t.name for t in __import__("threading").enumerate() if t.name.startswith("flashpoint-replication")]
    assert not threads, threads


def _push_over_the_targets_own_object(service: Any, step: int) -> None:
    """A buggy member: this rank pushes its object of step under the name of its target's own object.

    The target's server (started by the replication service) must refuse it; prints the outcome."""
    if not service.targets or service.addresses[service.targets[0]] is None:
        return
    target = service.targets[0]
    host, port = service.addresses[target]
    with open(service.layout.object_path(step, object_name(service.rank)), "rb") as f:
        try:
            _core.transfer_push_fd(host, port, service._endpoints.secret, f.fileno(),
                                   version_relpath(step, object_name(target)), rank=service.rank, peer_rank=target,
                                   retries=0, io_timeout_s=5.0)
            print("FOREIGN PUSH ACCEPTED", flush=True)
        except _core.TransferError as exc:
            print(f"FOREIGN PUSH {type(exc).__name__}: {exc}", flush=True)


def restart_load(p: dict[str, Any]) -> None:
    """A restarted job: agree on a version (fetching from peers), then load it and compare bit-exactly.

    With p["domains_env"] (one per node), each rank names its node's failure domain in the environment.
    """
    Path(node_base(p)).mkdir(parents=True, exist_ok=True)
    if p.get("domains_env"):
        os.environ[FAILURE_DOMAIN_ENV] = p["domains_env"][dist.get_rank() // p["ranks_per_node"]]
    step = choose_version(node_base(p)).step
    print(f"CHOSEN {step}", flush=True)
    if step is not None:
        check_loaded(load(dict(p, base=node_base(p)), step), step)
        print(f"LOADED {step} OK", flush=True)


def _version_files_here(base: Path) -> set[str]:
    """Every file of every version directory of this node (not its pool or spares), relative to base."""
    return {str(f.relative_to(base)) for f in base.glob("step-*/*") if f.is_file()} | \
        {str(f.relative_to(base)) for f in base.glob("step-*/.*") if f.is_file()}


def restart_counting_fetches(p: dict[str, Any]) -> None:
    """A restarted job that prints, per node, which files its choice and its load brought onto the node."""
    base = Path(node_base(p))
    base.mkdir(parents=True, exist_ok=True)
    before = _version_files_here(base)
    dist.barrier()
    step = choose_version(str(base)).step
    dist.barrier()
    chosen = _version_files_here(base)
    from ml_flashpoint_nemo.replication import own_objects

    checks = []
    verify = own_objects.verify_object_file

    def counted(*args: Any, **kwargs: Any) -> Any:  # the load's full checks of other ranks' objects
        checks.append(args[0])
        return verify(*args, **kwargs)

    own_objects.verify_object_file = counted
    check_loaded(load(dict(p, base=str(base)), step), step)
    print(f"RANK {dist.get_rank()} LOAD CHECKS {len(checks)}", flush=True)
    dist.barrier()
    loaded = _version_files_here(base)
    if dist.get_rank() % p["ranks_per_node"] == 0:
        node = dist.get_rank() // p["ranks_per_node"]
        print(f"NODE {node} CHOSEN {step} CHOICE FETCHED {sorted(chosen - before)} "
              f"LOAD FETCHED {sorted(loaded - chosen)}", flush=True)


def close_during_a_stuck_push(p: dict[str, Any]) -> None:
    """2 nodes x 1 rank. Rank 1's transfer server is replaced by a socket that never answers, so rank 0's
    push of step 2 waits in its handshake; closing the service must return within its bound anyway."""
    strategy = FlashpointSaveStrategy(replication=_config(p))
    mine = dict(p, base=node_base(p))
    save(mine, 1, None, strategy)
    replicated = strategy.replication.wait(1, timeout=60).state == "replicated"
    dist.barrier()  # every rank's push of step 1 is done before rank 1's server is swapped out
    assert replicated
    silent = None
    if dist.get_rank() == 1:
        host, port = strategy.replication.addresses[1]
        strategy.replication.server.stop()
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind((host, port))
        silent.listen(8)  # connections complete in the backlog and are never served
    dist.barrier()
    save(mine, 2, None, strategy)
    if dist.get_rank() == 0:
        _, silent_port = strategy.replication.addresses[1]
        deadline = time.monotonic() + 60
        while not _connected_to(silent_port):  # the push of step 2 is in its handshake
            assert time.monotonic() < deadline, "the push of step 2 never connected"
            time.sleep(0.01)
        started = time.monotonic()
        strategy.replication.close(timeout=1.0)
        print(f"CLOSED in {time.monotonic() - started:.2f}s", flush=True)
    dist.barrier()
    strategy.close()
    if silent is not None:
        silent.close()


def _connected_to(port: int) -> bool:
    """True while this process has an established TCP connection to the given port."""
    return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
               for c in psutil.Process().net_connections("tcp"))


if __name__ == "__main__":
    scenario_main({f.__name__: f for f in (replicate, restart_load, close_during_a_stuck_push,
                                           restart_counting_fetches)})
