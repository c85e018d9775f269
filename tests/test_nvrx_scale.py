"""FlashpointLocalCheckpointManager on more simulated nodes than replicas: a lost node, agreement, flat collectives.

Real gloo ranks (tests/support/nvrx_scale_scenarios.py), 2 per "node" (its own base directory),
replication factor 2: 4 ranks on 2 nodes and 6 ranks on 3 nodes. Each world saves 3 iterations (the
last of 4 times as many tensors T), loses one node's RAM (and, on 3 nodes, one more rank's object elsewhere), restarts the manager,
and every rank must find and load the same newest iteration, bit for bit. Comparing the two worlds
shows what a rank receives per save does not grow with the ranks N, except where docs/design.md
("Scaling") says it does: rank 0 gathers every rank's object record and each node leader receives
the commit record, ~100 B per rank; comparing the last two saves shows none of it grows with T.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from tests.conftest import SHM
from tests.support.multiproc import run_world

PER_NODE = 2
SAVES = 3  # 2 and 3 are steady saves (the first also finds the nodes and the peers), of 4 and 16 tensors
WORLDS = {  # world size -> the node whose base directory is wiped, a rank of another node that loses its object
    4: {"lost_node": 0, "lost_object_rank": None},  # the coordinator's node: its commit record goes too
    6: {"lost_node": 1, "lost_object_rank": 5},  # node 1's replicas are on node 2, rank 5's (node 2) on node 0
}
PER_RANK_RECORD_BYTES = 250  # what rank 0 and the leaders may receive more per rank added (measured: 141 B, 72 B)


def world(base_dir: Path, n: int) -> list[dict]:
    bases = [str(base_dir / f"node{node}") for node in range(n // PER_NODE)]
    params = {"bases": bases, "ranks_per_node": PER_NODE, "factor": 2, "saves": SAVES, **WORLDS[n]}
    outputs = run_world("nvrx_scale_scenarios", "save_lose_ram_and_load", n, params, timeout=120)
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    seen = {}
    for n in WORLDS:
        base = SHM / f"flashpoint-test-{uuid.uuid4().hex[:12]}"
        try:
            seen[n] = world(base, n)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return seen


@pytest.mark.parametrize("n", list(WORLDS))
def test_every_rank_loads_the_newest_iteration_bit_exact_after_a_node_lost_its_ram(results, n):
    ranks = results[n]
    assert all(save["replication"] == "replicated" for r in ranks for save in r["saves"]), ranks
    assert [r["latest"] for r in ranks] == [SAVES] * n, ranks
    assert [r["ckpt_id"] for r in ranks] == [[SAVES, rank, "job"] for rank in range(n)], ranks
    assert all(r["bit_exact"] for r in ranks), ranks


def steady_save(rank: dict) -> int:
    """Bytes this rank received in the collectives of the last save."""
    return rank["saves"][-1]["received"]


def test_what_a_rank_receives_per_save_does_not_grow_with_the_ranks(results):
    small, large = results[min(WORLDS)], results[max(WORLDS)]
    added = len(large) - len(small)

    def others(ranks):  # neither the coordinator nor a node leader: fixed-size all-reduces only
        return {steady_save(r) for r in ranks if r["rank"] % PER_NODE != 0}

    assert len(others(small)) == 1 and others(small) == others(large), (others(small), others(large))
    assert next(iter(others(large))) <= 128, others(large)
    for rank in range(0, len(small), PER_NODE):  # rank 0 and the leaders: O(N) records, ~100 B a rank
        grown = steady_save(large[rank]) - steady_save(small[rank])
        assert 0 <= grown <= PER_RANK_RECORD_BYTES * added, (rank, steady_save(small[rank]), steady_save(large[rank]))
    # a load reads this rank's own object: one fixed-size all-reduce, the same on every rank of both worlds
    assert {r["load"]["received"] for ranks in results.values() for r in ranks} == {8}, results


def test_what_a_rank_receives_per_save_does_not_grow_with_the_tensors(results):
    """One object per rank whatever its tensors: only the numbers in its record (its size) take a byte or two more."""
    for n, ranks in results.items():
        for r in ranks:
            fewer, more = r["saves"][-2]["received"], r["saves"][-1]["received"]  # 4 and 16 tensors
            assert 0 <= more - fewer <= 4 * n, (n, r["rank"], fewer, more)
            if r["rank"] % PER_NODE != 0:
                assert more == fewer, (n, r["rank"], fewer, more)
