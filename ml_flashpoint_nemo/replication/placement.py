"""Where each rank's objects are replicated: a pure function of the node topology.

Node i replicates to the next k-1 nodes (i+1, ..., i+k-1, modulo n). Ranks are paired by
their index within the node: local rank j of node i pushes to local rank j of each target
node (modulo that node's size, so nodes of unequal size still get every object). With
k=1, or a single node, nothing is replicated. Each rank pushes its own objects only, so a
rank's transfer server admits pushes from push_sources alone, each of its own objects.
"""

from __future__ import annotations

from ml_flashpoint_nemo.core.topology import NodeTopology

DEFAULT_FACTOR = 2


def effective_factor(factor: int, node_count: int) -> int:
    """The replication factor actually used: at least 1, at most the number of nodes."""
    if factor < 1:
        raise ValueError(f"replication factor must be >= 1, got {factor}")
    return min(factor, node_count)


def target_nodes(node: int, node_count: int, factor: int) -> list[int]:
    """The nodes that hold copies of node's objects (besides node itself), in push order."""
    if not 0 <= node < node_count:
        raise ValueError(f"node {node} is not in 0..{node_count - 1}")
    k = effective_factor(factor, node_count)
    return [(node + d) % node_count for d in range(1, k)]


def peer_rank(topology: NodeTopology, rank: int, node: int) -> int:
    """The rank of `node` paired with `rank`: same index within its node (modulo the node's size)."""
    own = topology.ranks_of_node(topology.node_of_rank[rank])
    ranks = topology.ranks_of_node(node)
    return ranks[own.index(rank) % len(ranks)]


def push_targets(topology: NodeTopology, rank: int, factor: int) -> list[int]:
    """The global ranks whose servers receive `rank`'s objects."""
    node = topology.node_of_rank[rank]
    return [peer_rank(topology, rank, t) for t in target_nodes(node, topology.node_count, factor)]


def holder_nodes(topology: NodeTopology, rank: int, factor: int) -> list[int]:
    """Every node that holds `rank`'s objects once replicated: its own node first."""
    node = topology.node_of_rank[rank]
    return [node] + target_nodes(node, topology.node_count, factor)


def push_sources(topology: NodeTopology, rank: int, factor: int) -> list[int]:
    """The global ranks whose objects `rank`'s server receives (the inverse of push_targets), ascending."""
    node = topology.node_of_rank[rank]
    k = effective_factor(factor, topology.node_count)
    sources = []
    for d in range(1, k):  # the nodes whose targets include this node
        source_node = (node - d) % topology.node_count
        sources += [s for s in topology.ranks_of_node(source_node) if peer_rank(topology, s, node) == rank]
    return sorted(sources)
