"""Every node's own copy of a committed version's files, sent from the coordinator to the node leaders.

Used by the Megatron strategies and the NVRx manager on jobs with a base directory per node.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo.core.format import FILES_KEY, CommitRecord
from ml_flashpoint_nemo.core.layout import COMMIT_NAME, CheckpointLayout
from ml_flashpoint_nemo.core.topology import (
    NodeGather,
    NodeTopology,
    discover_nodes,
    problems_of_every_rank,
    reduced_ints,
)
from ml_flashpoint_nemo.core.version_files import reusable_version_file, version_copy, write_version_copy
from ml_flashpoint_nemo.core.versions import read_commit
from ml_flashpoint_nemo.errors import FlashpointError

__all__ = ["NodeCopies"]


class NodeCopies:
    """Gives every node its own copy of a committed version's files (common state, metadata, commit record).

    Megatron writes the common state on global rank 0 only and the coordinator commits on
    its own node; with a base directory per node, each other node's leader writes the same
    checked files, so any node can load its ranks' data and the common state by itself.

    DCP's `.metadata` lists every chunk of the job (O(N*T) bytes) but repeats from save to save
    while the structure does; a file whose size and CRC32C equal the last one sent is not sent
    again: each leader copies it from its copy of the previous version, checked against the new
    commit record. Only a leader that no longer has it (a retired or damaged copy) gets it again,
    in a second broadcast that every leader joins.
    """

    def __init__(self, topology: NodeTopology, group: dist.ProcessGroup | None,
                 gather: NodeGather | None = None) -> None:
        self.topology = topology
        self.group = group  # gloo group of the node leaders; None on a single node
        self.gather = gather  # the two-level gather of the ranks' reports to rank 0; None: a flat one
        self._sent: dict[str, tuple[int, Any]] = {}  # rank 0: file name -> (newest step copied with, size and CRC)

    @classmethod
    def discover(cls, base_dir: Path, previous: "NodeCopies | None",
                 failure_domain: Callable[[], str | None] | None = None) -> "NodeCopies":
        """Collective on every rank; the leaders' group is kept while the leaders stay the same, and
        the two-level gather's node groups (NodeGather, sharing the leaders' group) while the nodes do.

        failure_domain: where each rank reads its node's failure domain (core.topology.discover_nodes).
        """
        topology = discover_nodes(base_dir, failure_domain)
        if topology.node_count == 1:
            return cls(topology, None)
        if previous is not None and previous.group is not None and previous.topology.leaders == topology.leaders:
            group = previous.group
        else:
            group = dist.new_group(topology.leaders, backend="gloo")
        if (previous is not None and previous.group is group
                and previous.topology.node_of_rank == topology.node_of_rank):
            return cls(topology, group, previous.gather)
        return cls(topology, group, NodeGather.make(topology, group))

    def copy_version_to_every_node(self, layout: CheckpointLayout, step: int) -> None:
        """After the coordinator committed: the other nodes' leaders write the version's files; errors reach all."""
        if self.group is None:
            return
        is_copier = self.topology.is_leader and self.topology.node != self.topology.node_of_rank[0]
        in_group = dist.get_rank() == 0 or is_copier
        missed, error = self._broadcast(layout, step, resend=False, write=is_copier) if in_group else (False, None)
        (any_missed,) = reduced_ints([int(missed)])
        if any_missed and in_group:  # some leader lacks a file it was told to reuse: every leader joins once more
            _, again = self._broadcast(layout, step, resend=True, write=missed)
            error = error or again  # a leader that failed in the first broadcast stays failed
        failed = problems_of_every_rank(error)
        if failed:
            self._sent.clear()  # the next save sends every file again
            raise FlashpointError(
                f"step {step} is committed on the coordinator's node but not on every node: " + "; ".join(failed)
            )

    def _broadcast(self, layout: CheckpointLayout, step: int, *, resend: bool, write: bool) -> tuple[bool, str | None]:
        """One broadcast of the version's files in the leaders' group; this rank's (missed a file, error)."""
        box: list[Any] = [None]
        error = None
        if dist.get_rank() == 0:
            try:
                box[0] = self._files_to_send(layout, step, resend=resend)
            except Exception as exc:  # noqa: BLE001 - the leaders still need the broadcast to end
                box[0] = error = f"rank 0 reading step {step}: {type(exc).__name__}: {exc}"
        dist.broadcast_object_list(box, src=0, group=self.group)
        if write and isinstance(box[0], dict):
            return self._write_copy(layout, step, box[0])
        return False, error

    def _files_to_send(self, layout: CheckpointLayout, step: int, *, resend: bool) -> dict[str, Any]:
        """Rank 0: each file's bytes, or (step, None) for a file the leaders hold unchanged in that step's copy."""
        commit = read_commit(layout, step)
        reused: dict[str, Any] = {}
        for name, description in (commit.metadata.get(FILES_KEY) or {}).items():
            sent = self._sent.get(name)
            if not resend and sent is not None and sent[1] == description and sent[0] != step:
                reused[name] = (sent[0], None)
            self._sent[name] = (step, description)  # the leaders hold it with this step next (else it is cleared)
        sent_now = [name for name in commit.metadata.get(FILES_KEY) or {} if name not in reused]
        return {**version_copy(layout, commit, sent_now), **reused}  # unchanged files are not even read

    def _write_copy(self, layout: CheckpointLayout, step: int, files: dict[str, Any]) -> tuple[bool, str | None]:
        """A leader: write the version's files, reusing those it already holds; (missed one, error).

        A file to reuse that this node no longer holds as the commit record describes it is a miss,
        not an error: the second broadcast brings it.
        """
        try:
            commit = CommitRecord.decode(files[COMMIT_NAME], f"the commit record of step {step} received")
            resolved: dict[str, bytes] = {}
            for name, content in files.items():
                if isinstance(content, tuple):  # (step it came with, None): this node holds it already
                    reused = reusable_version_file(layout, content[0], name, commit)
                    if reused is None:
                        return True, None
                    content = reused
                resolved[name] = content
            write_version_copy(layout, step, resolved)  # checks every file against the new commit record
            return False, None
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            return False, f"rank {dist.get_rank()} (node {self.topology.node}): {type(exc).__name__}: {exc}"
