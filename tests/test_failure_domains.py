"""Failure domains: how each node's is learnt and checked, and the placement that keeps copies out of it.

Pure functions over many random topologies (seeded), plus one real 2-rank gloo world for the
gather that learns the domains (tests/support/domain_scenarios.py). The recovery that relies on
the placement: tests/test_failure_domain_recovery.py.
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from ml_flashpoint_nemo.core.topology import (
    FAILURE_DOMAIN_ENV,
    NodeTopology,
    checked_failure_domain,
    failure_domain_of_this_rank,
)
from ml_flashpoint_nemo.errors import FailureDomainError
from ml_flashpoint_nemo.replication import placement
from ml_flashpoint_nemo.replication.placement import (
    effective_factor,
    holder_nodes,
    node_ring,
    nodes_replicating_inside_their_domain,
    push_sources,
    push_targets,
    source_nodes,
    target_nodes,
)
from tests.support.multiproc import run_world

# --- the placement (pure) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 9))
def test_without_domains_or_with_one_node_per_domain_the_ring_is_over_node_index(n):
    """No configuration keeps the placement of before: node i -> i+1..i+k-1 (mod n), bit for bit."""
    for k in range(1, n + 2):
        for node in range(n):
            ring = [(node + d) % n for d in range(1, effective_factor(k, n))]
            assert target_nodes(node, n, k) == ring
            assert target_nodes(node, n, k, [None] * n) == ring
            assert target_nodes(node, n, k, [f"rack-{i}" for i in range(n)]) == ring
    assert node_ring(n) == node_ring(n, [None] * n) == tuple(range(n))


def test_equal_domains_are_interleaved_round_robin():
    assert node_ring(4, ["a", "a", "b", "b"]) == (0, 2, 1, 3)
    assert node_ring(6, ["x", "y", "z", "x", "y", "z"]) == (0, 1, 2, 3, 4, 5)
    # 512 nodes in 16 racks of 32 (rack = node // 32): every node's next k-1 are in other racks
    racks = [f"rack{node // 32}" for node in range(512)]
    for k in (2, 3, 16):
        assert nodes_replicating_inside_their_domain(512, k, racks) == []
        received = Counter(t for node in range(512) for t in target_nodes(node, 512, k, racks))
        assert set(received.values()) == {k - 1}
    assert nodes_replicating_inside_their_domain(512, 17, racks) == list(range(512))  # 17 copies, 16 racks


def _random_topology(rng: random.Random) -> NodeTopology:
    """1-12 nodes of 1-3 ranks each, ranks of a node not always consecutive; domains drawn from a few names or
    None (a node without one), or no domains at all."""
    n = rng.randint(1, 12)
    sizes = [rng.randint(1, 3) for _ in range(n)]
    node_of_rank = [node for node, size in enumerate(sizes) for _ in range(size)]
    first = node_of_rank[: n]  # nodes are numbered by their lowest rank: keep the first n in order
    rest = node_of_rank[n:]
    rng.shuffle(rest)
    node_of_rank = sorted(first) + rest
    names = [f"d{i}" for i in range(rng.randint(1, n))]
    choice = rng.random()
    domains: tuple[str | None, ...] = ()
    if choice < 0.8:
        domains = tuple(None if rng.random() < 0.15 else rng.choice(names) for _ in range(n))
    return NodeTopology(tuple(node_of_rank), rank=0, domain_of_node=domains)


def test_placement_properties_over_random_topologies_domains_and_factors():
    """push_sources is exactly the inverse of push_targets, every node receives k-1 nodes' objects, no node
    replicates to itself, and no copy stays in its node's domain unless a domain holds more than n/k nodes
    (then no ring can keep them apart, and the placement says so)."""
    rng = random.Random(29)
    for case in range(250):
        topology = _random_topology(rng)
        n, domains = topology.node_count, topology.domain_of_node
        ring = node_ring(n, domains)
        assert sorted(ring) == list(range(n)), (case, topology)
        for factor in range(1, 6):
            k = effective_factor(factor, n)
            received: Counter[int] = Counter()
            for node in range(n):
                targets = target_nodes(node, n, factor, domains)
                assert len(set(targets)) == len(targets) == k - 1 and node not in targets, (case, factor)
                received.update(targets)
                assert sorted(source_nodes(node, n, factor, domains)) == sorted(
                    s for s in range(n) if node in target_nodes(s, n, factor, domains))
            assert all(received[node] == k - 1 for node in range(n)), (case, factor, received)
            for rank in range(len(topology.node_of_rank)):
                expected = [s for s in range(len(topology.node_of_rank)) if rank in push_targets(topology, s, factor)]
                assert push_sources(topology, rank, factor) == expected, (case, topology, factor, rank)
                assert holder_nodes(topology, rank, factor)[0] == topology.node_of_rank[rank]
            inside = nodes_replicating_inside_their_domain(n, factor, domains)
            assert inside == [node for node in range(n) if domains and domains[node] is not None and any(
                domains[t] == domains[node] for t in target_nodes(node, n, factor, domains))]
            sizes = Counter(d for d in domains if d is not None)
            assert bool(inside) == any(size * k > n for size in sizes.values()), (case, domains, factor, inside)


def test_the_placement_depends_on_the_grouping_alone_and_is_the_same_every_time():
    """Every rank computes it alone: the names of the domains, the cache and the call order do not matter."""
    rng = random.Random(7)
    for _ in range(100):
        topology = _random_topology(rng)
        n, domains = topology.node_count, topology.domain_of_node
        renamed = tuple(None if d is None else f"other-{d}" for d in domains)
        before = [target_nodes(node, n, 3, domains) for node in range(n)]
        placement._ring_and_positions.cache_clear()
        assert [target_nodes(node, n, 3, renamed) for node in range(n)] == before
        assert [target_nodes(node, n, 3, domains) for node in range(n)] == before


def test_unequal_domains_that_cannot_be_kept_apart_are_counted_and_warned_about_once(caplog):
    """Domains of 3 nodes and 1 at k=2: in any ring at least two of the three are followed by one of their own."""
    from ml_flashpoint_nemo.replication import service

    domains = ("a", "a", "a", "b")
    assert nodes_replicating_inside_their_domain(4, 2, domains) == [1, 2]
    assert node_ring(4, domains) == (0, 3, 1, 2)
    assert nodes_replicating_inside_their_domain(6, 2, ("a", "a", "a", "b", "b", "c")) == []  # 3 of 6: just fits
    with caplog.at_level(logging.INFO, logger=service.__name__):
        service._log_placement(NodeTopology((0, 1, 2, 3), rank=0, domain_of_node=domains), 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("2 of the 4 nodes keep a copy inside their own failure "
                                                         "domain (e.g. node 1, 'a')"), warnings
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=service.__name__):
        service._log_placement(NodeTopology((0, 1, 2, 3), rank=0, domain_of_node=("a", "a", "b", "b")), 2)
        service._log_placement(NodeTopology((0, 1, 2, 3), rank=0), 2)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    assert "node i -> nodes i+1..i+1 mod 4" in caplog.records[1].getMessage()


# --- the domain of a rank, and of a node ----------------------------------------------------------------------


@pytest.mark.parametrize("good", ["rack-12", "pod3/rack12", "us-east1-b:r7", "R", "a" * 64, "sw_2.spine@dc=1+x"])
def test_failure_domain_names_that_are_accepted(good):
    assert checked_failure_domain(good, "x") == good


@pytest.mark.parametrize("bad", ["", " rack", "rack 1", "rack\n", "a" * 65, "räck", "-rack", ".", "r\x00", 5, None,
                                 b"rack"])
def test_failure_domain_names_that_are_refused(bad):
    with pytest.raises(FailureDomainError, match="must name a failure domain"):
        checked_failure_domain(bad, "$" + FAILURE_DOMAIN_ENV)


def test_a_hostile_failure_domain_is_refused_in_a_short_message():
    with pytest.raises(FailureDomainError) as raised:
        checked_failure_domain("\x1b[2J" + "x" * 1_000_000, "$" + FAILURE_DOMAIN_ENV)
    assert len(str(raised.value)) < 400 and "(1000004 characters)" in str(raised.value)


def test_the_domain_comes_from_the_callable_else_the_environment_else_none(monkeypatch):
    monkeypatch.delenv(FAILURE_DOMAIN_ENV, raising=False)
    assert failure_domain_of_this_rank() is None
    monkeypatch.setenv(FAILURE_DOMAIN_ENV, "")
    assert failure_domain_of_this_rank() is None  # empty: unset
    monkeypatch.setenv(FAILURE_DOMAIN_ENV, "rack-3")
    assert failure_domain_of_this_rank() == "rack-3"
    assert failure_domain_of_this_rank(lambda: "rack-9") == "rack-9"  # the callable wins
    assert failure_domain_of_this_rank(lambda: None) is None
    monkeypatch.setenv(FAILURE_DOMAIN_ENV, "rack 3")
    with pytest.raises(FailureDomainError, match=r"\$FLASHPOINT_FAILURE_DOMAIN must name"):
        failure_domain_of_this_rank()

    def broken() -> str:
        raise KeyError("no rack label on this host")

    with pytest.raises(FailureDomainError, match="failure_domain\\(\\) failed: KeyError"):
        failure_domain_of_this_rank(broken)

    def verbose() -> str:
        raise RuntimeError("x" * 100_000)

    with pytest.raises(FailureDomainError) as raised:  # what each rank sends in the gather stays short
        failure_domain_of_this_rank(verbose)
    assert len(str(raised.value)) < 400


def test_a_node_whose_ranks_name_different_domains_is_refused():
    identities = [("h0", "/a"), ("h0", "/a"), ("h1", "/a"), ("h1", "/a")]
    topology = NodeTopology.from_identities(identities, 1, ["r1", "r1", "r2", "r2"])
    assert topology.domain_of_node == ("r1", "r2") and topology.node_of_rank == (0, 0, 1, 1)
    assert NodeTopology.from_identities(identities, 1, [None] * 4) == NodeTopology((0, 0, 1, 1), 1)
    with pytest.raises(FailureDomainError, match=r"node 1 \(ranks 2, 3\): 'r2' on ranks 2, None on ranks 3"):
        NodeTopology.from_identities(identities, 0, ["r1", "r1", "r2", None])
    many = [(f"h{i // 2}", "/a") for i in range(2000)]
    with pytest.raises(FailureDomainError) as raised:
        NodeTopology.from_identities(many, 0, [f"r{i % 2}" for i in range(2000)])
    assert "1000 node(s)" in str(raised.value) and "and 996 more" in str(raised.value)
    assert len(str(raised.value)) < 1000
    with pytest.raises(ValueError, match="2 failure domains for 1 nodes"):
        NodeTopology((0, 0), 0, ("a", "b"))


def test_every_rank_learns_the_domains_in_the_gather_of_the_nodes_and_raises_alike(shm_dir):
    """2 real ranks on one node: agreeing, they learn its domain; disagreeing, or one naming a malformed domain,
    both raise FailureDomainError from the one gather (no rank is left in a collective)."""
    outputs = run_world("domain_scenarios", "discover", 2, {"base": str(shm_dir / "node")}, timeout=120)
    for out in outputs:
        lines = dict(line.split(" ", 1) for line in out.splitlines() if line[:1].isupper())
        assert lines["AGREED"] == "('rack-1',) 1 node", out
        assert lines["DISAGREED"].startswith("FailureDomainError: the ranks of 1 node(s) name different failure "
                                             "domains: node 0 (ranks 0, 1): 'rack-1' on ranks 0, 'rack-2' on ranks 1")
        assert lines["MALFORMED"].startswith("FailureDomainError: 1 rank(s) cannot name their failure domain: rank 1:"
                                             " $FLASHPOINT_FAILURE_DOMAIN must name"), out
        assert lines["CALLABLE"].startswith("FailureDomainError: 1 rank(s) cannot name their failure domain: rank 0:"
                                            " ReplicationConfig.failure_domain() failed: OSError"), out
        assert lines["UNNAMED"] == "() 1 node", out
