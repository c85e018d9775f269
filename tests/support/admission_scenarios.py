"""Scenarios for tests/test_transfer_admission.py: the replication service's servers admit the job's addresses only.

Rank r binds and advertises 127.0.0.(3 + r) (FLASHPOINT_REPLICATION_HOST) and is a node of its
own; each receives the other's pushes (replication factor 2). 127.0.0.2 plays a stranger on the
network.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.layout import object_name, version_relpath
from ml_flashpoint_nemo.core.topology import NodeTopology
from ml_flashpoint_nemo.replication.service import HOST_ENV, ReplicationConfig, peer_endpoints
from tests.support.multiproc import scenario_main

logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True, format="%(levelname)s %(name)s: %(message)s")

STRANGER = "127.0.0.2"


def allow_list_of_the_job(p: dict[str, Any]) -> None:
    rank = dist.get_rank()
    os.environ[HOST_ENV] = f"127.0.0.{3 + rank}"
    os.environ["FLASHPOINT_REPLICATION_SECRET"] = "5453228015bd9dfd225c4642584964855c1666bb89fb27f5f2e30aa45493b0e8"
    base = Path(p["root"]) / f"node-{rank}"
    topology = NodeTopology((0, 1), rank)  # two nodes of one rank each
    config = ReplicationConfig(io_timeout_s=5.0, restrict_peers=p["restrict"], factor=2)
    endpoints = peer_endpoints(base, config, topology=topology, receive_pushes=True)
    try:
        server = endpoints.server
        print(f"ALLOWED {server.allowed_peers}", flush=True)
        peer_host, peer_port = endpoints.addresses[1 - rank]
        mine, theirs = version_relpath(1, object_name(rank)), version_relpath(1, object_name(1 - rank))
        (base / mine).parent.mkdir(parents=True, exist_ok=True)
        (base / mine).write_bytes(b"from rank %d" % rank)
        dist.barrier()  # every node holds its own object of step 1 before any push of it, as after a commit
        _core.transfer_push(peer_host, peer_port, endpoints.secret, base, mine, retries=0, rank=rank,
                            peer_rank=1 - rank)
        dist.barrier()
        print(f"RECEIVED {(base / theirs).read_bytes().decode()}", flush=True)
        with socket.socket() as stranger:
            stranger.settimeout(2)  # the handshake budget (5 s) holds an admitted one longer
            stranger.bind((STRANGER, 0))
            stranger.connect((server.host, server.port))
            try:
                closed = stranger.recv(10) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False
        print(f"STRANGER {'closed' if closed else 'held'} {server.stats()['rejected_not_allowed']}", flush=True)
        dist.barrier()
    finally:
        endpoints.close()


if __name__ == "__main__":
    scenario_main({f.__name__: f for f in (allow_list_of_the_job,)})
