"""Losing a whole failure domain: 4 nodes in 2 domains, k=2, real processes (gloo) and sockets.

A "node" is a base directory of its own and one rank (tests/support/replication_scenarios.py).
With the ring over node index, nodes 0 and 1 would hold each other's only copies; the placement
by domain puts each node's copy in the other domain, so losing both nodes of one domain loses
nothing, whether the restart names the same domains or none (then the objects are found off the
placement, by asking every node).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ml_flashpoint_nemo.core.layout import object_name
from ml_flashpoint_nemo.replication.placement import target_nodes
from tests.support.multiproc import run_world

DOMAINS = ["rack-a", "rack-a", "rack-b", "rack-b"]


def _run(scenario: str, bases: list[str], **params) -> list[str]:
    return run_world("replication_scenarios", scenario, len(bases), dict(params, bases=bases, ranks_per_node=1),
                     timeout=180)


def _wipe_domain_a(bases: list[str], snapshot: Path) -> None:
    for base in bases:
        shutil.rmtree(base, ignore_errors=True)
        shutil.copytree(snapshot / Path(base).name, base)
    shutil.rmtree(bases[0])
    shutil.rmtree(bases[1])


def test_both_nodes_of_one_domain_lost_together_lose_nothing(shm_dir):
    bases = [str(shm_dir / f"node-{n}") for n in range(4)]
    outputs = _run("replicate", bases, steps=[1], domains=DOMAINS)
    assert all(re.search(r"^STATUS 1 replicated failed=\[\]", out, re.M) for out in outputs), outputs
    # node 0 -> 2, 2 -> 1, 1 -> 3, 3 -> 0: each node's copy is in the other rack
    assert [target_nodes(n, 4, 2, DOMAINS) for n in range(4)] == [[2], [3], [1], [0]]
    assert [target_nodes(n, 4, 2) for n in range(4)] == [[1], [2], [3], [0]]  # the old ring: 0's copy in rack a
    for node, source in enumerate([3, 2, 0, 1]):
        assert object_name(source) in os.listdir(Path(bases[node]) / "step-1"), (node, source)
    snapshot = shm_dir / "snapshot"
    shutil.copytree(shm_dir, snapshot, ignore=shutil.ignore_patterns("snapshot"))

    _wipe_domain_a(bases, snapshot)  # rack a fails whole; the restart names the same racks
    outputs = _run("restart_load", bases, domains_env=DOMAINS)
    assert all("CHOSEN 1" in out and "LOADED 1 OK" in out for out in outputs), outputs
    assert all("fetched 1 of its objects of step 1" in outputs[n] for n in (0, 1)), outputs

    _wipe_domain_a(bases, snapshot)  # again, and the restart names no domain: its ring says nodes 0 and 1 hold
    outputs = _run("restart_load", bases)  # node 0's copies, both lost; rank 0 asks the other nodes
    assert all("CHOSEN 1" in out and "LOADED 1 OK" in out for out in outputs), outputs
    assert all("fetched 1 of its objects of step 1" in outputs[n] for n in (0, 1)), outputs
