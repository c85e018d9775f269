"""Which ranks share a node, and each node's failure domain, found through torch.distributed.

A node is the set of ranks that see the same base directory: the same host name and
the same resolved base path. On a cluster that is one machine; in tests, several
"nodes" share a machine and each has its own base directory. Ranks are grouped by one
all_gather_object, never by GPU counts or launcher guesses.

A failure domain is what can fail as a whole (a rack, a switch, a placement group): a
short name each rank reads from a callable or $FLASHPOINT_FAILURE_DOMAIN and sends in
that same gather, so learning it costs no collective. Unnamed, a node is a domain of its own.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from ml_flashpoint_nemo import errors
from ml_flashpoint_nemo.errors import BaseDirError, FailureDomainError, FlashpointError

logger = logging.getLogger(__name__)

FAILURE_DOMAIN_ENV = "FLASHPOINT_FAILURE_DOMAIN"
MAX_FAILURE_DOMAIN_CHARS = 64
# A rack, switch or zone name: printable, no spaces, bounded, so that it is safe in logs and messages.
_FAILURE_DOMAIN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:/@+=-]{{0,{MAX_FAILURE_DOMAIN_CHARS - 1}}}")
_SHOWN_PROBLEMS = 4  # the problems a FailureDomainError names; the rest are counted
_SHOWN_CHARS = 200  # of a failing callable's message


def node_identity(base_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """What makes two ranks share a node: the host and the resolved base directory."""
    return socket.gethostname(), os.path.realpath(base_dir)


@dataclass(frozen=True)
class NodeTopology:
    """Node of every global rank (nodes numbered by their lowest rank) and this rank."""

    node_of_rank: tuple[int, ...]
    rank: int
    # Each node's failure domain, None for a node that named none (a domain of its own); ()
    # when no node named one. replication.placement spreads each node's copies over other domains.
    domain_of_node: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if self.domain_of_node and len(self.domain_of_node) != self.node_count:
            raise ValueError(f"{len(self.domain_of_node)} failure domains for {self.node_count} nodes")

    @classmethod
    def from_identities(cls, identities: list[Any], rank: int,
                        domains: Sequence[str | None] = ()) -> "NodeTopology":
        """Nodes numbered in order of their lowest rank; domains: each rank's failure domain (or None).

        Every rank gets the same lists, so a node whose ranks name different domains raises the
        same FailureDomainError on every rank.
        """
        numbers: dict[Any, int] = {}
        node_of_rank = tuple(numbers.setdefault(tuple(identity), len(numbers)) for identity in identities)
        if not any(domain is not None for domain in domains):
            return cls(node_of_rank, rank)
        named: list[dict[str | None, list[int]]] = [{} for _ in numbers]
        for r, (node, domain) in enumerate(zip(node_of_rank, domains, strict=True)):
            named[node].setdefault(domain, []).append(r)
        split = [f"node {node} (ranks {_ranks_text(sorted(r for ranks in by.values() for r in ranks))}): "
                 + ", ".join(f"{domain!r} on ranks {_ranks_text(ranks)}" for domain, ranks in by.items())
                 for node, by in enumerate(named) if len(by) > 1]
        if split:
            raise FailureDomainError(
                f"the ranks of {len(split)} node(s) name different failure domains: " + _bounded(split)
                + f". Give every rank of a node the same {FAILURE_DOMAIN_ENV} (or ReplicationConfig.failure_domain)")
        return cls(node_of_rank, rank, tuple(next(iter(by)) for by in named))

    @cached_property
    def _ranks_by_node(self) -> tuple[tuple[int, ...], ...]:
        """Every node's ranks, ascending, built once: O(N) here, not at each of the many look-ups."""
        by_node: list[list[int]] = [[] for _ in range(max(self.node_of_rank) + 1)]
        for rank, node in enumerate(self.node_of_rank):
            by_node[node].append(rank)
        return tuple(map(tuple, by_node))

    @property
    def node_count(self) -> int:
        return len(self._ranks_by_node)

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    def ranks_of_node(self, node: int) -> list[int]:
        return list(self._ranks_by_node[node])

    @cached_property
    def leaders(self) -> list[int]:
        """The lowest rank of each node, in node order: it writes the node's version-level files."""
        return [ranks[0] for ranks in self._ranks_by_node]

    @property
    def is_leader(self) -> bool:
        return self._ranks_by_node[self.node][0] == self.rank


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _bounded(problems: list[str]) -> str:
    """The first few problems and how many more: a message stays short on a job of any size."""
    more = len(problems) - _SHOWN_PROBLEMS
    return "; ".join(problems[:_SHOWN_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")


def checked_failure_domain(value: object, source: str) -> str:
    """value if it is a failure domain name (1-64 of letters, digits and ._:/@+=-), else FailureDomainError."""
    if isinstance(value, str) and _FAILURE_DOMAIN.fullmatch(value):
        return value
    shown = (repr(value[:MAX_FAILURE_DOMAIN_CHARS]) + (f" ({len(value)} characters)"
                                                         if len(value) > MAX_FAILURE_DOMAIN_CHARS else "")
             if isinstance(value, str) else f"a {type(value).__name__}")
    raise FailureDomainError(
        f"{source} must name a failure domain (a rack or switch, say) in 1 to {MAX_FAILURE_DOMAIN_CHARS} "
        f"letters, digits and . _ : / @ + = - starting with a letter or digit, got {shown}")


def failure_domain_of_this_rank(source: Callable[[], str | None] | None = None) -> str | None:
    """This rank's failure domain: source() if given, else $FLASHPOINT_FAILURE_DOMAIN; None if neither names one.

    Empty or unset means none: the node is then a domain of its own. Raises FailureDomainError.
    """
    if source is not None:
        try:
            value = source()
        except Exception as exc:  # noqa: BLE001 - the user's callable: its failure is reported as what it is
            said = str(exc)[:_SHOWN_CHARS] + ("..." if len(str(exc)) > _SHOWN_CHARS else "")  # it travels to every rank
            raise FailureDomainError(f"ReplicationConfig.failure_domain() failed: {type(exc).__name__}: {said}. "
                                     "Make it return this node's rack or switch name (or None)") from exc
        return None if value is None else checked_failure_domain(value, "ReplicationConfig.failure_domain()")
    value = os.environ.get(FAILURE_DOMAIN_ENV)
    return checked_failure_domain(value, f"${FAILURE_DOMAIN_ENV}") if value else None


def discover_nodes(base_dir: str | os.PathLike[str],
                   failure_domain: Callable[[], str | None] | None = None) -> NodeTopology:
    """Collective: every rank must call it. One all_gather_object of the node identities and failure domains.

    failure_domain: where this rank reads its domain (see failure_domain_of_this_rank). A rank
    that cannot tell its identity or its domain sends why instead, and every rank raises
    BaseDirError, respectively FailureDomainError; so does a node whose ranks disagree.
    """
    rank = dist.get_rank()
    identity: Any
    try:
        identity = node_identity(base_dir)
    except Exception as exc:  # noqa: BLE001 - every rank learns it through the gather below
        identity = f"rank {rank} cannot resolve its base directory {str(base_dir)!r}: {type(exc).__name__}: {exc}"
    domain, domain_problem = None, None
    try:
        domain = failure_domain_of_this_rank(failure_domain)
    except FailureDomainError as exc:  # every rank learns it through the gather below
        domain_problem = f"rank {rank}: {exc}"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (identity, domain, domain_problem))
    identities = [g[0] for g in gathered]
    problems = [identity for identity in identities if isinstance(identity, str)]
    if problems:
        raise BaseDirError("the ranks cannot tell which of them share a node: " + "; ".join(problems)
                           + ". Give every rank a usable RAM checkpoint directory")
    domain_problems = [g[2] for g in gathered if g[2]]
    if domain_problems:
        raise FailureDomainError(f"{len(domain_problems)} rank(s) cannot name their failure domain: "
                                 + _bounded(domain_problems))
    return NodeTopology.from_identities(identities, rank, [g[1] for g in gathered])


def _collective_device() -> torch.device | None:
    """Where a collective's tensor must live: the current CUDA device on NCCL, the CPU otherwise."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def reduced_ints(values: Sequence[int], op: Any = None) -> list[int]:
    """Collective: the element-wise reduction (default MAX) of every rank's equally long list of int64s.

    One all-reduce of len(values) * 8 bytes whatever the number of ranks: how the ranks share
    flags, counts and steps without gathering anything whose size grows with the job.
    """
    reduced = torch.tensor(list(values), dtype=torch.int64, device=_collective_device())
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX if op is None else op)
    return [int(v) for v in reduced.tolist()]


def highest_of_every_rank(value: int) -> int:
    """Collective: the largest of every rank's small int (one all-reduce; on NCCL a CUDA tensor).

    Lets a rank fold "I failed" into a flag the ranks exchange anyway, at no extra collective.
    """
    return reduced_ints([value])[0]


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
    return _every_problem(problem)


def _every_problem(problem: str | None) -> list[str]:
    """Collective, only once some rank has a problem: every rank's message, on every rank."""
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return [p for p in problems if p]


_LENGTH_BYTES = 8  # each gathered buffer starts with its payload's length


def gathered_on_coordinator(payload: Any, problem: str | None,
                            through: "NodeGather | None" = None) -> tuple[list[str], list[Any] | None]:
    """Collective: (every rank's problem, every rank's payload on rank 0 and None elsewhere).

    What a save's finalize needs at any job size: only the coordinator receives O(N) payloads;
    every other rank receives two all-reduces of 16 and 8 bytes (any problem? the longest pickle?
    can rank 0 hold them all?) and nothing more, unlike all_gather_object, which hands every rank all N payloads. When some
    rank has a problem (or cannot pickle its payload) nothing is gathered and every rank gets
    every problem instead, so that all of them raise alike. Rank 0 failing to receive or decode
    (out of memory, say) is rank 0's problem alone: its payloads are then None and the caller
    reports it to every rank with its next collective. through: the node groups of a two-level
    gather (NodeGather, made once per topology), or None for one flat gather over every rank.
    """
    data, problem = _pickled(payload, problem)
    any_problem, longest = reduced_ints([int(problem is not None), len(data)])
    if any_problem:
        return _every_problem(problem), None
    return [], _gathered_frames(data, longest, through)


def gathered_short_or_full(short: Any, full: Any, problem: str | None, *, coordinator_needs_full: bool,
                           through: "NodeGather | None" = None) -> tuple[list[str], list[Any] | None, bool]:
    """Collective: gathered_on_coordinator of every rank's short payload, or of its full one if rank 0 asks.

    Only rank 0's coordinator_needs_full counts; the third value (rank 0 asked for the full
    payloads) is the same on every rank. Rank 0's wish rides in the all-reduce the gather runs anyway (24 bytes instead of
    16), so the short case costs no extra collective; the full case costs one more all-reduce.
    through: as for gathered_on_coordinator.
    """
    data, problem = _pickled(short, problem)
    wants_full = int(dist.get_rank() == 0 and coordinator_needs_full)
    any_problem, longest, use_full = reduced_ints([int(problem is not None), len(data), wants_full])
    if not any_problem and use_full:
        data, problem = _pickled(full, problem)
        any_problem, longest = reduced_ints([int(problem is not None), len(data)])
    if any_problem:
        return _every_problem(problem), None, bool(use_full)
    return [], _gathered_frames(data, longest, through), bool(use_full)


def _pickled(payload: Any, problem: str | None) -> tuple[bytes, str | None]:
    """This rank's payload as bytes (nothing when it has a problem), or why it cannot be pickled."""
    if problem is not None:
        return b"", problem
    try:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - shared with every rank by the caller's all-reduce
        return b"", f"rank {dist.get_rank()}: cannot pickle its report: {type(exc).__name__}: {exc}"


def _gathered_frames(data: bytes, longest: int, through: "NodeGather | None" = None) -> list[Any] | None:
    """Collective, once no rank has a problem: every rank's payload on rank 0, None elsewhere or if it failed."""
    framed = bytearray(_LENGTH_BYTES + longest)  # equal sizes on every rank, as gather requires
    framed[:_LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")
    framed[_LENGTH_BYTES:_LENGTH_BYTES + len(data)] = data
    if through is not None:
        return through.frames(framed)
    return _flat_frames(framed)


def _receive_buffer(rows: int, width: int, device: torch.device | None = None) -> torch.Tensor | None:
    """rows x width bytes to gather into, or None (logged) if they cannot be had: told to every rank next."""
    try:
        return torch.empty((rows, width), dtype=torch.uint8, device=device)
    except Exception:  # noqa: BLE001 - every caller shares the outcome in an all-reduce before the gather
        logger.exception("rank %d cannot hold %d x %d bytes of the ranks' reports", dist.get_rank(), rows, width)
        return None


def _flat_frames(framed: bytearray) -> list[Any] | None:
    """One gather of every rank's frame to rank 0 over the whole world (N - 1 steps)."""
    device = _collective_device()
    mine = torch.frombuffer(framed, dtype=torch.uint8)
    if device is not None:
        mine = mine.to(device)
    # One flat buffer, so that a failure is one place.
    buffer = _receive_buffer(dist.get_world_size(), mine.numel(), mine.device) if dist.get_rank() == 0 else None
    # An allocation can fail (a CUDA one above all): every rank learns it before it would wait in the gather.
    (cannot_receive,) = reduced_ints([int(dist.get_rank() == 0 and buffer is None)])
    if cannot_receive:
        return None
    dist.gather(mine, list(buffer.unbind(0)) if buffer is not None else None, dst=0)
    if buffer is None:
        return None
    return _decoded(bytes(buffer.cpu().numpy()), [(rank, rank) for rank in range(dist.get_world_size())],
                    mine.numel())


def _decoded(raw: bytes, rows: list[tuple[int, int]], width: int) -> list[Any] | None:
    """Rank 0: the payload of each (rank, row) of raw (rows of width bytes), in rank order; None if one is bad."""
    view = memoryview(raw)
    payloads: list[Any] = [None] * len(rows)
    try:
        for rank, row in rows:
            frame = view[row * width:(row + 1) * width]
            length = int.from_bytes(frame[:_LENGTH_BYTES], "little")
            if length > width - _LENGTH_BYTES:
                raise ValueError(f"rank {rank}'s frame says {length} bytes in a frame of {width}")
            payloads[rank] = pickle.loads(frame[_LENGTH_BYTES:_LENGTH_BYTES + length])
        return payloads
    except Exception:  # noqa: BLE001 - rank 0's alone; the caller reports it with its next collective
        logger.exception("rank 0 cannot decode the reports it gathered")
        return None


class NodeGather:
    """The gloo groups of a two-level gather to rank 0: each node's ranks to their leader, the leaders to rank 0.

    (g - 1) + (nodes - 1) steps instead of N - 1. Made once per topology, collectively (make),
    and kept while the nodes stay the same. CPU tensors whatever the world's backend: the
    payloads are pickles, and gloo needs no device memory nor communicators of its own.
    """

    def __init__(self, topology: NodeTopology, node_group: Any, leaders_group: Any) -> None:
        self.topology = topology
        self.node_group = node_group  # this node's ranks; None on a node of one rank
        self.leaders_group = leaders_group  # every node's leader (rank 0 is node 0's); no group elsewhere
        self.widest = max(len(topology.ranks_of_node(n)) for n in range(topology.node_count))

    @classmethod
    def make(cls, topology: NodeTopology, leaders_group: Any = None) -> "NodeGather | None":
        """Collective on every rank; None where a flat gather takes as few steps (one node, one rank per node).

        Every rank calls new_group for each node of several ranks, in node order (torch's
        rule, without store traffic on the ranks outside a group), then for the leaders unless
        leaders_group (a gloo group of topology.leaders, e.g. NodeCopies') is given.
        """
        if topology.node_count == 1 or topology.node_count == len(topology.node_of_rank):
            return None
        mine = None
        for node in range(topology.node_count):
            ranks = topology.ranks_of_node(node)
            if len(ranks) > 1:
                group = dist.new_group(ranks, backend="gloo")
                if node == topology.node:
                    mine = group
        if leaders_group is None:
            leaders_group = dist.new_group(topology.leaders, backend="gloo")
        return cls(topology, mine, leaders_group)

    def frames(self, framed: bytearray) -> list[Any] | None:
        """Collective: every rank's frame to rank 0 (a leader always: the lowest rank of node 0), decoded there.

        Every leader first takes a buffer for its node's frames (rank 0 one for every node's):
        rank 0 failing gives None as the flat gather does; another leader failing makes every
        rank take the flat gather instead, which needs rank 0's buffer alone.
        """
        top, width = self.topology, len(framed)
        mine = torch.frombuffer(framed, dtype=torch.uint8)
        block = whole = None
        if top.is_leader:
            block = _receive_buffer(self.widest, width)  # this node's frames, rows in its ranks' order
            if top.rank == 0 and block is not None:
                whole = _receive_buffer(top.node_count, self.widest * width)  # a node's block per row
        # One 8-byte all-reduce, as the flat gather's: 2 = rank 0 cannot receive, 1 = another leader cannot.
        (cannot,) = reduced_ints([2 if top.rank == 0 and whole is None else
                                  int(top.is_leader and block is None)])
        if cannot == 2:
            return None
        if cannot == 1:
            return _flat_frames(framed)
        ranks = top.ranks_of_node(top.node)
        if self.node_group is not None:
            dist.gather(mine, list(block[:len(ranks)].unbind(0)) if block is not None else None, dst=ranks[0],
                        group=self.node_group)
        elif block is not None:
            block[0].copy_(mine)
        if block is None:  # not a leader: its frame is on its leader now
            return None
        dist.gather(block.view(-1), list(whole.unbind(0)) if whole is not None else None, dst=0,
                    group=self.leaders_group)
        if whole is None:
            return None
        placed = [(rank, node * self.widest + i) for node in range(top.node_count)
                  for i, rank in enumerate(top.ranks_of_node(node))]
        return _decoded(bytes(whole.numpy()), placed, width)


def raise_if_any_rank_failed(error: BaseException | None, what: str) -> None:
    """Collective: return on every rank if no rank's local step failed, else raise on every rank.

    Every rank raises the same type: the lowest failing rank's when it is one of
    ml_flashpoint_nemo.errors' types (a ChecksumError as CorruptCheckpointError), else
    FlashpointError; the message is `what` and every failing rank's error.
    """
    if not any_rank(error is not None):  # the usual case: one small all-reduce, nothing gathered
        return
    mine = None if error is None else (type(error).__name__,
                                       f"rank {dist.get_rank()}: {type(error).__name__}: {error}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [g for g in gathered if g]
    raise _agreed_type(failed[0][0])(f"{what}: " + "; ".join(text for _, text in failed)) from error


def _agreed_type(name: Any) -> type[FlashpointError]:
    found = getattr(errors, name, None) if isinstance(name, str) else None
    if not isinstance(found, type) or not issubclass(found, FlashpointError):
        return FlashpointError
    return errors.CorruptCheckpointError if issubclass(found, errors.ChecksumError) else found
