"""Scenarios in which one rank fails locally between two collectives (run by tests/test_one_rank_failures.py).

Every rank must either proceed or raise the same error; a rank left waiting in a collective
shows as a timeout of the whole world in the test.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo.core.topology import discover_nodes
from ml_flashpoint_nemo.replication import service as service_module
from ml_flashpoint_nemo.replication.service import ReplicationConfig, ReplicationService
from tests.support import transfer_peer as peer
from tests.support.multiproc import scenario_main

logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True, format="%(levelname)s %(name)s: %(message)s")


def _node_base(p: dict[str, Any]) -> Path:
    return Path(p["root"]) / f"node-{dist.get_rank()}"


def keep_after_a_local_failure(p: dict[str, Any]) -> None:
    """Rank 0's server holds an error naming byte 0xff, or rank 1 cannot list its versions."""
    base = _node_base(p)
    base.mkdir(parents=True, exist_ok=True)
    service = ReplicationService.start(base, discover_nodes(base), ReplicationConfig(io_timeout_s=2.0))
    try:
        if dist.get_rank() == 0 and p["failure"] == "peer_name":
            host, port = service.addresses[0]
            with peer.connect(host, port, timeout=5) as sock:
                session = peer.client_handshake(sock, service._endpoints.secret)
                session.send_request(peer.OP_FETCH, b"step-1/\xff\nforged", 0)
                assert session.recv_response()[0] == peer.FORBIDDEN  # not a name of the layout
        if dist.get_rank() == 1 and p["failure"] == "listing":
            def broken(layout: Any) -> list[int]:
                raise PermissionError(13, "Permission denied", os.fspath(layout.base_dir))
            service_module.committed_steps = broken
        dist.barrier()
        print(f"KEEP {service.keep_for_next_save(1)}", flush=True)
    finally:
        service.close()


def agree_on_secret(p: dict[str, Any]) -> None:
    """Each rank's environment from p["env"][rank]; prints the outcome and a digest of the secret agreed."""
    from ml_flashpoint_nemo.replication.secret import agree_on_secret as agree
    from ml_flashpoint_nemo.replication.secret import secret_check

    os.environ.update(p["env"][dist.get_rank()])
    try:
        secret = agree()
    except Exception as exc:  # noqa: BLE001 - printed for the test
        print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"AGREED {secret_check(secret).hex()} {len(secret)}", flush=True)
    dist.barrier()  # every rank is still in the job: nobody was left in a collective


def choose_after_a_listing_failure(p: dict[str, Any]) -> None:
    """Rank 1 cannot list its versions: every rank agrees that no RAM version is usable."""
    from ml_flashpoint_nemo.replication import choice as recovery

    base = _node_base(p)
    base.mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 1:
        def broken(layout: Any) -> list[int]:
            raise PermissionError(13, "Permission denied", os.fspath(layout.base_dir))
        recovery.committed_steps = broken
    os.environ["FLASHPOINT_REPLICATION_SECRET"] = "5453228015bd9dfd225c4642584964855c1666bb89fb27f5f2e30aa45493b0e8"
    print(f"CHOSEN {recovery.choose_version(base).step}", flush=True)


def choose_after_an_inventory_failure(p: dict[str, Any]) -> None:
    """Two nodes; rank 1 cannot even list its base directory (the inventory before the peer fetch fails)."""
    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.replication import choice as recovery

    base = _node_base(p)
    base.mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 1:
        def broken(layout: Any) -> list[int]:
            raise PermissionError(13, "Permission denied", os.fspath(layout.base_dir))
        CheckpointLayout.version_steps = broken  # type: ignore[method-assign]
    os.environ["FLASHPOINT_REPLICATION_SECRET"] = "5453228015bd9dfd225c4642584964855c1666bb89fb27f5f2e30aa45493b0e8"
    print(f"CHOSEN {recovery.choose_version(base).step}", flush=True)


def choose_after_an_unexpected_check_failure(p: dict[str, Any]) -> None:
    """One node, a committed 2-rank DCP version; rank 1's check fails with an error nobody expected."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ml_flashpoint_nemo.dcp import MemoryStorageWriter
    from ml_flashpoint_nemo.replication import choice as recovery
    from ml_flashpoint_nemo.replication import own_objects

    base = Path(p["root"]) / "shared"
    writer = MemoryStorageWriter(base)
    dcp.save({f"w{dist.get_rank()}": torch.ones(4)}, checkpoint_id=os.fspath(base / "step-3"), storage_writer=writer)
    writer.close()
    if dist.get_rank() == 1:
        def broken(*args: Any, **kwargs: Any) -> None:
            raise ValueError("an unexpected failure in the version check")
        own_objects.verify_object_file = broken  # the check of a version saved at this world size
    print(f"CHOSEN {recovery.choose_version(base).step}", flush=True)


def problems_reach_every_rank(p: dict[str, Any]) -> None:
    """problems_of_every_rank with no problem anywhere, then with one on rank 1; counts the gathers."""
    from ml_flashpoint_nemo.core import topology

    gathers = []
    gather = dist.all_gather_object

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_object = counted
    none = topology.problems_of_every_rank(None)
    print(f"NONE {none} GATHERS {len(gathers)}", flush=True)
    one = topology.problems_of_every_rank("rank 1: disk full" if dist.get_rank() == 1 else None)
    print(f"ONE {one} GATHERS {len(gathers)}", flush=True)


def short_or_full_reports(p: dict[str, Any]) -> None:
    """gathered_short_or_full: only rank 0's wish counts; a full payload that cannot be pickled fails every rank."""
    from ml_flashpoint_nemo.core.topology import gathered_short_or_full

    rank = dist.get_rank()
    cases = {
        "nobody": dict(coordinator_needs_full=rank == 1),  # rank 1's wish is not rank 0's
        "rank0": dict(coordinator_needs_full=rank == 0),
        "unpicklable": dict(coordinator_needs_full=True),
    }
    for name, kwargs in cases.items():
        full: Any = (lambda: None) if name == "unpicklable" and rank == 1 else ["full", rank]
        errors, gathered, sent_full = gathered_short_or_full(("short", rank), full, None, **kwargs)
        print(f"{name.upper()} full={sent_full} gathered={gathered} errors={errors}", flush=True)
    errors, gathered, sent_full = gathered_short_or_full(("short", rank), ["full", rank],
                                                         "rank 1: disk full" if rank == 1 else None,
                                                         coordinator_needs_full=True)
    print(f"PROBLEM full={sent_full} gathered={gathered} errors={errors}", flush=True)


class _NoMemory:
    """torch as core.topology sees it, but torch.empty fails: a rank that cannot take a receive buffer."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no memory left for the reports (injected)")


def two_level_gather(p: dict[str, Any]) -> None:
    """Rank r on simulated node p["nodes"][r]: the node groups' gather of every rank's report to rank 0.

    Prints each case's outcome and the sizes of the groups this rank gathered in.
    """
    import torch

    from ml_flashpoint_nemo.core import topology
    from ml_flashpoint_nemo.core.node_copies import NodeCopies

    rank = dist.get_rank()
    base = Path(p["root"]) / f"node-{p['nodes'][rank]}"
    base.mkdir(parents=True, exist_ok=True)
    copies = NodeCopies.discover(base, None)
    print(f"TWO-LEVEL {copies.gather is not None} LEADERS {copies.topology.leaders}", flush=True)
    again = NodeCopies.discover(base, copies)  # the same nodes: the groups are kept, none made
    print(f"KEPT {again.gather is copies.gather and again.group is copies.group}", flush=True)
    sizes: list[int] = []
    gather = dist.gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        sizes.append(dist.get_world_size(kwargs.get("group")))
        return gather(*args, **kwargs)

    dist.gather = counted
    payload = ("report", rank, "x" * (37 * rank))  # frames of unequal lengths
    errors, gathered = topology.gathered_on_coordinator(payload, None, again.gather)
    print(f"GATHERED {gathered} ERRORS {errors} GROUPS {sizes}", flush=True)
    errors, gathered = topology.gathered_on_coordinator(payload, "rank 3: disk full" if rank == 3 else None,
                                                        again.gather)
    print(f"PROBLEM {gathered} ERRORS {errors}", flush=True)
    errors, gathered, full = topology.gathered_short_or_full(("short", rank), ["full", rank], None,
                                                             coordinator_needs_full=rank == 0, through=again.gather)
    print(f"FULL {full} {gathered} ERRORS {errors}", flush=True)
    for who, case in ((0, "RANK0-NO-MEMORY"), (copies.topology.leaders[1], "LEADER-NO-MEMORY")):
        del sizes[:]
        topology.torch = _NoMemory(torch) if rank == who else torch  # type: ignore[assignment]
        try:
            errors, gathered = topology.gathered_on_coordinator(payload, None, again.gather)
        finally:
            topology.torch = torch
        print(f"{case} {gathered} ERRORS {errors} GROUPS {sizes}", flush=True)
    dist.barrier()  # nobody was left waiting in a collective


if __name__ == "__main__":
    scenario_main({f.__name__: f for f in (keep_after_a_local_failure, agree_on_secret,
                                           choose_after_a_listing_failure, choose_after_an_inventory_failure,
                                           choose_after_an_unexpected_check_failure, problems_reach_every_rank,
                                           short_or_full_reports, two_level_gather)})
