"""Which ranks share a node, found through torch.distributed.

A node is the set of ranks that see the same base directory: the same host name and
the same resolved base path. On a cluster that is one machine; in tests, several
"nodes" share a machine and each has its own base directory. Ranks are grouped by one
all_gather_object, never by GPU counts or launcher guesses.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ml_flashpoint_nemo import errors
from ml_flashpoint_nemo.errors import BaseDirError, FlashpointError


def node_identity(base_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """What makes two ranks share a node: the host and the resolved base directory."""
    return socket.gethostname(), os.path.realpath(base_dir)


@dataclass(frozen=True)
class NodeTopology:
    """Node of every global rank (nodes numbered by their lowest rank) and this rank."""

    node_of_rank: tuple[int, ...]
    rank: int

    @classmethod
    def from_identities(cls, identities: list[Any], rank: int) -> "NodeTopology":
        numbers: dict[Any, int] = {}
        node_of_rank = tuple(numbers.setdefault(tuple(identity), len(numbers)) for identity in identities)
        return cls(node_of_rank, rank)

    @property
    def node_count(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    def ranks_of_node(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    @property
    def leaders(self) -> list[int]:
        """The lowest rank of each node, in node order: it writes the node's version-level files."""
        return [self.ranks_of_node(n)[0] for n in range(self.node_count)]

    @property
    def is_leader(self) -> bool:
        return self.rank in self.leaders


def discover_nodes(base_dir: str | os.PathLike[str]) -> NodeTopology:
    """Collective: every rank must call it. One all_gather_object of the node identities.

    A rank that cannot tell its identity sends why instead, and every rank raises BaseDirError.
    """
    rank = dist.get_rank()
    mine: Any
    try:
        mine = node_identity(base_dir)
    except Exception as exc:  # noqa: BLE001 - every rank learns it through the gather below
        mine = f"rank {rank} cannot resolve its base directory {str(base_dir)!r}: {type(exc).__name__}: {exc}"
    identities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, mine)
    problems = [identity for identity in identities if isinstance(identity, str)]
    if problems:
        raise BaseDirError("the ranks cannot tell which of them share a node: " + "; ".join(problems)
                           + ". Give every rank a usable RAM checkpoint directory")
    return NodeTopology.from_identities(identities, rank)


def highest_of_every_rank(value: int) -> int:
    """Collective: the largest of every rank's small int (one all-reduce; on NCCL a CUDA tensor).

    Lets a rank fold "I failed" into a flag the ranks exchange anyway, at no extra collective.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    reduced = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return int(reduced.item())


def any_rank(flag: bool) -> bool:
    """Collective: whether flag is true on any rank (one small all-reduce)."""
    return bool(highest_of_every_rank(int(flag)))


def problems_of_every_rank(problem: str | None) -> list[str]:
    """Collective: every rank's problem (None: none), so that every rank takes the same branch.

    One small all-reduce when no rank has a problem (the usual case); only then are the
    messages gathered (pickled), by every rank alike.
    """
    if not any_rank(bool(problem)):
        return []
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return [p for p in problems if p]


def raise_if_any_rank_failed(error: BaseException | None, what: str) -> None:
    """Collective: return on every rank if no rank's local step failed, else raise on every rank.

    Every rank raises the same type: the lowest failing rank's when it is one of
    ml_flashpoint_nemo.errors' types (a ChecksumError as CorruptCheckpointError), else
    FlashpointError; the message is `what` and every failing rank's error.
    """
    mine = None if error is None else (type(error).__name__,
                                       f"rank {dist.get_rank()}: {type(error).__name__}: {error}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [g for g in gathered if g]
    if failed:
        raise _agreed_type(failed[0][0])(f"{what}: " + "; ".join(text for _, text in failed)) from error


def _agreed_type(name: Any) -> type[FlashpointError]:
    found = getattr(errors, name, None) if isinstance(name, str) else None
    if not isinstance(found, type) or not issubclass(found, FlashpointError):
        return FlashpointError
    return errors.CorruptCheckpointError if issubclass(found, errors.ChecksumError) else found
