"""Where each rank's objects are replicated: a pure function of the node topology and its failure domains.

The nodes are put in a ring and node ring[p] replicates to the next k-1 nodes of the ring
(ring[p+1], ..., ring[p+k-1], modulo n), so every node receives exactly k-1 nodes' objects.
Without failure domains (or with one node per domain) the ring is 0, 1, ..., n-1: node i
replicates to nodes i+1..i+k-1. With domains, the ring interleaves them (node_ring), so that a
node's next k-1 are in other domains whenever no domain holds more than n/k of the nodes.

Ranks are paired by their index within the node: local rank j of a node pushes to local rank
j of each target node (modulo that node's size, so nodes of unequal size still get every
object). With k=1, or a single node, nothing is replicated. Each rank pushes its own objects
only, so a rank's transfer server admits pushes from push_sources alone, each of its own objects.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ml_flashpoint_nemo.core.topology import NodeTopology

DEFAULT_FACTOR = 2


def effective_factor(factor: int, node_count: int) -> int:
    """The replication factor actually used: at least 1, at most the number of nodes."""
    if factor < 1:
        raise ValueError(f"replication factor must be >= 1, got {factor}")
    return min(factor, node_count)


def node_ring(node_count: int, domains: Sequence[str | None] = ()) -> tuple[int, ...]:
    """The order in which nodes replicate to each other; domains: each node's failure domain (None: its own).

    The domains, largest first (ties: the one with the lowest node first), their nodes ascending,
    are written down the columns of a grid with as many rows as the largest domain has nodes,
    and the ring reads the grid row by row. Each domain thus sits in distinct rows, at least a
    row's length apart in the ring: no node's next k-1 share its domain when every domain has
    at most n/k nodes (docs/design.md, "Failure domains"). Equal domains give a round robin over
    them; one node per domain gives 0..n-1.
    """
    return _ring_and_positions(node_count, tuple(domains))[0]


@functools.lru_cache(maxsize=16)
def _ring_and_positions(node_count: int, domains: tuple[str | None, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the ring, each node's position in it); cached: every look-up of a save or a recovery asks again."""
    if node_count < 1:
        raise ValueError(f"a ring needs at least one node, got {node_count}")
    if not domains:
        return tuple(range(node_count)), tuple(range(node_count))
    if len(domains) != node_count:
        raise ValueError(f"{len(domains)} failure domains for {node_count} nodes")
    groups: dict[tuple[str, object], list[int]] = {}
    for node, domain in enumerate(domains):
        groups.setdefault(("node", node) if domain is None else ("domain", domain), []).append(node)
    columns = sorted(groups.values(), key=lambda nodes: (-len(nodes), nodes[0]))
    rows = len(columns[0])
    written = [node for column in columns for node in column]  # down the columns, row = index % rows
    ring = tuple(written[c] for r in range(rows) for c in range(r, node_count, rows))
    positions = [0] * node_count
    for position, node in enumerate(ring):
        positions[node] = position
    return ring, tuple(positions)


def target_nodes(node: int, node_count: int, factor: int, domains: Sequence[str | None] = ()) -> list[int]:
    """The nodes that hold copies of node's objects (besides node itself), in push order."""
    if not 0 <= node < node_count:
        raise ValueError(f"node {node} is not in 0..{node_count - 1}")
    k = effective_factor(factor, node_count)
    ring, positions = _ring_and_positions(node_count, tuple(domains))
    return [ring[(positions[node] + d) % node_count] for d in range(1, k)]


def source_nodes(node: int, node_count: int, factor: int, domains: Sequence[str | None] = ()) -> list[int]:
    """The nodes whose targets include node (the inverse of target_nodes)."""
    k = effective_factor(factor, node_count)
    ring, positions = _ring_and_positions(node_count, tuple(domains))
    return [ring[(positions[node] - d) % node_count] for d in range(1, k)]


def nodes_replicating_inside_their_domain(node_count: int, factor: int, domains: Sequence[str | None]) -> list[int]:
    """The nodes with a copy inside their own failure domain (a node without one never has)."""
    if not domains:
        return []
    k = effective_factor(factor, node_count)
    ring, positions = _ring_and_positions(node_count, tuple(domains))
    return [node for node in range(node_count) if domains[node] is not None and any(
        domains[ring[(positions[node] + d) % node_count]] == domains[node] for d in range(1, k))]


def peer_rank(topology: NodeTopology, rank: int, node: int) -> int:
    """The rank of `node` paired with `rank`: same index within its node (modulo the node's size)."""
    own = topology.ranks_of_node(topology.node_of_rank[rank])
    ranks = topology.ranks_of_node(node)
    return ranks[own.index(rank) % len(ranks)]


def push_targets(topology: NodeTopology, rank: int, factor: int) -> list[int]:
    """The global ranks whose servers receive `rank`'s objects."""
    node = topology.node_of_rank[rank]
    return [peer_rank(topology, rank, t)
            for t in target_nodes(node, topology.node_count, factor, topology.domain_of_node)]


def holder_nodes(topology: NodeTopology, rank: int, factor: int) -> list[int]:
    """Every node that holds `rank`'s objects once replicated: its own node first."""
    node = topology.node_of_rank[rank]
    return [node] + target_nodes(node, topology.node_count, factor, topology.domain_of_node)


def push_sources(topology: NodeTopology, rank: int, factor: int) -> list[int]:
    """The global ranks whose objects `rank`'s server receives (the inverse of push_targets), ascending."""
    node = topology.node_of_rank[rank]
    sources = []
    for source_node in source_nodes(node, topology.node_count, factor, topology.domain_of_node):
        sources += [s for s in topology.ranks_of_node(source_node) if peer_rank(topology, s, node) == rank]
    return sorted(sources)
