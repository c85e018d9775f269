"""The two-level gather of the ranks' reports to rank 0 (issue 29): 8 real gloo ranks on 4 simulated nodes.

Each node's ranks gather to their leader over a node group, the leaders to rank 0 over the leaders'
group: (g - 1) + (nodes - 1) steps where one flat gather takes N - 1. Rank 0 must get every rank's
payload in rank order, whatever the nodes' sizes and however their ranks interleave; a problem on one
rank reaches every rank, and a rank that cannot take its receive buffer fails nobody alone.
"""

from __future__ import annotations

import pytest

from tests.support.multiproc import run_world

DEADLINE_S = 90
WORLD = 8

LAYOUTS = {
    # node of each rank
    "four_pairs": [0, 0, 1, 1, 2, 2, 3, 3],
    "unequal_interleaved": [0, 1, 2, 0, 1, 2, 2, 3],  # nodes {0,3} {1,4} {2,5,6} {7}
}


def node_ranks(layout: list[int]) -> list[list[int]]:
    nodes: dict[int, list[int]] = {}
    for rank, node in enumerate(layout):
        nodes.setdefault(node, []).append(rank)
    return list(nodes.values())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_level_gather_brings_rank_0_every_payload_in_rank_order(shm_dir, layout):
    nodes = node_ranks(LAYOUTS[layout])
    leaders = [ranks[0] for ranks in nodes]
    outputs = run_world("collective_scenarios", "two_level_gather", WORLD,
                        {"root": str(shm_dir), "nodes": LAYOUTS[layout]}, timeout=DEADLINE_S)
    payloads = [("report", rank, "x" * (37 * rank)) for rank in range(WORLD)]
    for rank, out in enumerate(outputs):
        assert f"TWO-LEVEL True LEADERS {leaders}" in out and "KEPT True" in out, out
        node = next(ranks for ranks in nodes if rank in ranks)
        # The node's gather (if the node has several ranks), then the leaders' one: never a gather over all 8.
        groups = ([len(node)] if len(node) > 1 else []) + ([len(nodes)] if rank in leaders else [])
        gathered = payloads if rank == 0 else None
        assert f"GATHERED {gathered} ERRORS [] GROUPS {groups}" in out, out
        assert "PROBLEM None ERRORS ['rank 3: disk full']" in out, out
        assert f"FULL True {[['full', r] for r in range(WORLD)] if rank == 0 else None} ERRORS []" in out, out
        # Rank 0 without a buffer: nobody gathers, rank 0 gets None (its caller fails the save on every rank).
        assert "RANK0-NO-MEMORY None ERRORS [] GROUPS []" in out, out
        # Another leader without one: every rank takes the flat gather, which needs rank 0's buffer alone.
        assert f"LEADER-NO-MEMORY {gathered} ERRORS [] GROUPS [{WORLD}]" in out, out
    assert "rank 0 cannot hold" in outputs[0] and f"rank {leaders[1]} cannot hold" in outputs[leaders[1]], outputs
