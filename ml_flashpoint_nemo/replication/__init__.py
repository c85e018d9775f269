"""Replication of RAM checkpoint versions to peer nodes, and fetching them back during recovery.

    placement   which nodes hold copies of which rank's objects (pure functions)
    service     per-rank TransferServer, job secret and addresses, background pushes, status
    recovery    fetch the objects / version files a node lacks from peers before choosing a version
"""

from ml_flashpoint_nemo.replication.placement import (
    DEFAULT_FACTOR,
    effective_factor,
    holder_nodes,
    push_sources,
    push_targets,
    target_nodes,
)
from ml_flashpoint_nemo.replication.service import (
    ReplicationConfig,
    ReplicationService,
    ReplicationStatus,
    peer_endpoints,
)

__all__ = [
    "DEFAULT_FACTOR",
    "ReplicationConfig",
    "ReplicationService",
    "ReplicationStatus",
    "effective_factor",
    "holder_nodes",
    "peer_endpoints",
    "push_sources",
    "push_targets",
    "target_nodes",
]
