"""Per-rank replication service: a TransferServer, the job secret, peer addresses, background pushes.

Lifecycle (collective where noted; every rank calls in the same order):

    service = ReplicationService.start(base_dir, topology, config)   # collective (first save)
    keep = service.keep_for_next_save(keep)                           # collective (every save)
    service.replicate(step)              # after step committed on every node; returns at once
    service.replication_status(step)     # this rank's view: pending / replicated / under-replicated
    service.close()                      # stops the thread and the server; no thread or fd left

`start` agrees on the job secret (see replication.secret: from the environment or a secret
file, checked by a keyed hash; else rank 0 draws one and broadcasts it; never logged) and
exchanges every rank's server address with one all_gather_object; each server then admits
connections only from those addresses, and from loopback only when one of them is loopback (a
single-node job; docs/security.md). One background thread per rank pushes this rank's objects
of each committed version to the same-local-rank server of each target node (see placement).
Peers authenticate as ranks, and each server admits only what the placement sends it
(transfer_policy): a rank may push its own objects to the servers it replicates to, nothing
else; any rank may fetch objects and version files. A version is "replicated" on a rank once
every target acknowledged every object; it is replicated for the job once that holds on every
rank, which `keep_for_next_save` learns with one fixed-size all-reduce per save.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import remote_objects
from ml_flashpoint_nemo.core.format import ObjectRecord, whole_object_crc32c
from ml_flashpoint_nemo.core.layout import (
    OBJECT_NAME_PATTERN,
    PEER_VERSION_FILES,
    REPLICA_SPARES,
    VERSION_DIR_PATTERN,
    CheckpointLayout,
    rank_of_object,
    spare_name,
    version_relpath,
)
from ml_flashpoint_nemo.core.topology import NodeTopology, reduced_ints
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.errors import CorruptCheckpointError, FormatVersionError, ReplicationConfigError
from ml_flashpoint_nemo.replication.placement import (
    DEFAULT_FACTOR,
    effective_factor,
    nodes_replicating_inside_their_domain,
    push_sources,
    push_targets,
)
from ml_flashpoint_nemo.replication.secret import agree_on_secret

logger = logging.getLogger(__name__)

HOST_ENV = "FLASHPOINT_REPLICATION_HOST"
# Allowed besides the gathered addresses only when one of those is loopback (a single-node job):
# a connection to any 127.x address leaves from 127.0.0.1 (allowed_peer_addresses).
LOOPBACK_PEERS = ("127.0.0.1", "::1")
DEFAULT_CLOSE_WAIT_S = 10.0  # how long close() waits for a push in progress

PENDING = "pending"
REPLICATED = "replicated"
UNDER_REPLICATED = "under-replicated"
SKIPPED = "skipped"  # a newer version was committed before this one's push began: never pushed, nothing failed
UNKNOWN = "unknown"
OFF = "off"


def check_admission_limits(request_timeout_s: float, queue_timeout_s: float, max_queued_per_rank: int | None) -> None:
    """Raise ReplicationConfigError unless the server's admission limits are in the ranges it accepts.

    Checked when the config is made, so a bad value fails alike on every rank, before any collective.
    """
    def seconds_in(name: str, value: object, high: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
            raise ReplicationConfigError(f"ReplicationConfig.{name} must be a number of seconds in (0, {high:g}], "
                                         f"got {value!r}; pass a value in that range or leave the default")

    seconds_in("request_timeout_s", request_timeout_s, 3600)
    seconds_in("queue_timeout_s", queue_timeout_s, 86400)
    if max_queued_per_rank is not None and (isinstance(max_queued_per_rank, bool)
                                            or not isinstance(max_queued_per_rank, int)
                                            or not 1 <= max_queued_per_rank <= 65536):
        raise ReplicationConfigError(f"ReplicationConfig.max_queued_per_rank must be an integer in 1..65536 or None "
                                     f"(a quarter of the queue, at most 4), got {max_queued_per_rank!r}")


@dataclass(frozen=True)
class ReplicationConfig:
    """Replication settings; the same on every rank."""

    factor: int = DEFAULT_FACTOR          # copies of each object, counting the writer's node (capped at nodes)
    host: str | None = None               # address to bind and advertise (else $FLASHPOINT_REPLICATION_HOST,
    port: int = 0                         # else the host name's address); port 0: ephemeral
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    retries: int = 2
    backoff_s: float = 0.2
    max_connections: int = 4
    # Admit connections only from the ranks' gathered addresses (plus loopback when those include a
    # loopback address: a single-node job; see allowed_peer_addresses). False: from any
    # address (only the secret keeps strangers out), e.g. when nodes reach each other through
    # addresses other than those they bind.
    restrict_peers: bool = True
    enabled: bool = True
    # Bytes of retired replicas kept as spare files, so received replicas overwrite warm tmpfs
    # pages instead of faulting in fresh ones. None: one version's replicas on this node (what
    # the next version's replicas will need); 0: delete retired replicas as before.
    spare_bytes: int | None = None
    # Once its data flows, a transfer (either side) must average at least this many bytes/s after
    # its first rate_grace_s seconds (None: io_timeout_s), else it ends: a stuck or hostile peer
    # frees its worker. 0: no floor.
    min_rate_bytes_per_s: int = 1 << 20
    rate_grace_s: float | None = None
    # Bytes a push into this node, or a recovery's fetch onto it, must leave free for the node's own
    # saves (None: 1/32 of its file system).
    space_margin_bytes: int | None = None
    # Admission limits of this rank's transfer server (docs/security.md, "Availability"): an
    # authenticated connection must send its whole request within request_timeout_s (in (0, 3600]),
    # a request waits at most queue_timeout_s (in (0, 86400]) for a worker, and one rank has at most
    # max_queued_per_rank requests waiting (1..65536; None: a quarter of the queue, at most 4).
    request_timeout_s: float = 2.0
    queue_timeout_s: float = 10.0
    max_queued_per_rank: int | None = None
    # This node's failure domain (a rack, switch or placement group: 1-64 of letters, digits and
    # ._:/@+=-), read once per rank when the nodes are discovered; None from it, or no callable and no
    # $FLASHPOINT_FAILURE_DOMAIN: the node is a domain of its own. The placement puts a node's
    # copies in other domains (replication.placement); every rank of a node must name the same.
    failure_domain: Callable[[], str | None] | None = None

    def __post_init__(self) -> None:
        check_admission_limits(self.request_timeout_s, self.queue_timeout_s, self.max_queued_per_rank)

    def server_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of this rank's _core.TransferServer that this config sets."""
        return {"max_connections": self.max_connections, "io_timeout_s": self.io_timeout_s,
                "min_rate_bytes_per_s": self.min_rate_bytes_per_s, "rate_grace_s": self.rate_grace_s,
                "space_margin_bytes": self.space_margin_bytes, "request_timeout_s": self.request_timeout_s,
                "queue_timeout_s": self.queue_timeout_s, "max_queued_per_rank": self.max_queued_per_rank or 0}

    def transfer_kwargs(self) -> dict[str, Any]:
        return {"connect_timeout_s": self.connect_timeout_s, "io_timeout_s": self.io_timeout_s,
                "retries": self.retries, "backoff_s": self.backoff_s,
                "min_rate_bytes_per_s": self.min_rate_bytes_per_s, "rate_grace_s": self.rate_grace_s}


@dataclass(frozen=True)
class ReplicationStatus:
    """One version as this rank sees it: state and, when under-replicated, the peers that failed and why."""

    step: int
    state: str
    failed_peers: dict[int, str] = field(default_factory=dict)
    pushed_bytes: int = 0
    seconds: float = 0.0

    @property
    def replicated(self) -> bool:
        return self.state == REPLICATED


def advertised_host(option: str | None = None) -> str:
    """Address this rank's server binds to and peers connect to."""
    if option:
        return option
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PeerEndpoints:
    """This rank's running TransferServer, the job secret, this rank and every rank's (host, port) or None."""

    def __init__(self, server: _core.TransferServer | None, secret: bytes, addresses: list[tuple[str, int] | None],
                 rank: int) -> None:
        self.server = server
        self.secret = secret
        self.addresses = addresses
        self.rank = rank

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def transfer_policy(topology: NodeTopology, factor: int | None) -> _core.TransferPolicy:
    """What peers may do on this rank's transfer server (a _core.TransferPolicy).

    Push: the ranks the placement says replicate to this rank (factor None: none), each only its
    own objects, in the layout's names. Fetch: any rank of the job, objects and version files.
    """
    pushers = {} if factor is None else {source: [source] for source in push_sources(topology, topology.rank, factor)}
    return _core.TransferPolicy(world_size=len(topology.node_of_rank), own_ranks=topology.ranks_of_node(topology.node),
                                pushers=pushers, version_dir_pattern=VERSION_DIR_PATTERN,
                                object_name_pattern=OBJECT_NAME_PATTERN, version_files=list(PEER_VERSION_FILES))


def peer_endpoints(base_dir: str | os.PathLike[str], config: ReplicationConfig | None = None, *,
                   topology: NodeTopology, receive_pushes: bool = False) -> PeerEndpoints:
    """Collective: agree on a fresh job secret, start this rank's server on base_dir, exchange addresses.

    The secret comes from replication.secret (the environment or a secret file, else a c10d
    broadcast); a rank whose server cannot start is listed as None (peers then treat it as
    unreachable), the reason logged on that rank. The same collectives on every rank and path;
    a secret problem raises ReplicationSecretError on every rank before any server starts.
    receive_pushes: the server admits the pushes of config.factor's placement (else fetches only).
    """
    config = config or ReplicationConfig()
    secret = agree_on_secret()
    server, address = None, None
    try:
        Path(base_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        host = advertised_host(config.host)
        policy = transfer_policy(topology, config.factor if receive_pushes else None)
        server = _core.TransferServer(os.fspath(base_dir), secret, host=host, port=config.port,
                                      spare_dir=REPLICA_SPARES, rank=topology.rank, policy=policy,
                                      **config.server_kwargs())
        address = (host, server.port)
    except Exception as exc:  # noqa: BLE001 - peers learn this rank is unreachable through the gather
        logger.warning("Rank %d: the replication transfer server did not start: %s: %s",
                       dist.get_rank(), type(exc).__name__, exc)
    addresses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, address)
    gathered = [tuple(a) if a else None for a in addresses]
    if server is not None and config.restrict_peers:
        try:  # nothing may raise on one rank here: the next collective would wait for it
            server.allowed_peers = allowed_peer_addresses(a[0] for a in gathered if a)
        except Exception as exc:  # noqa: BLE001 - the server then keeps admitting any address
            logger.warning("Rank %d: the replication transfer server admits any address (the allow-list of the "
                           "job's peers could not be set: %s: %s)", dist.get_rank(), type(exc).__name__, exc)
    return PeerEndpoints(server, secret, gathered, topology.rank)


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped 127.x address (numeric text; anything else: False)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def allowed_peer_addresses(hosts: Iterable[str]) -> list[str]:
    """The transfer server's allow-list: the numeric addresses of the ranks' gathered hosts (names resolved).

    Loopback (127.0.0.1 and ::1) is added only when one of those addresses is itself loopback: a
    job whose ranks advertise loopback addresses runs on one node, and a connection to any
    127.x address leaves from 127.0.0.1. A job advertising node addresses does not need it (a
    connection to this node's own address leaves from that address), so a local user of a shared
    node who is not in the job cannot connect through loopback.

    A host name that does not resolve here is left out with a warning: its rank cannot connect
    to this one (its pushes fail and are reported as under-replication), nothing else breaks.
    """
    found: list[str] = []
    for host in sorted(set(hosts)):
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            logger.warning("Replication peer host %r does not resolve on this node (%s); connections from it are "
                           "refused", host, exc)
            continue
        found += [str(info[4][0]).split("%", 1)[0] for info in infos]
    if any(is_loopback(a) for a in found):
        found += LOOPBACK_PEERS
    return sorted(set(found))


def _log_placement(topology: NodeTopology, factor: int) -> None:
    """Say how copies are placed, and warn when some stay inside their node's failure domain (once, at set-up)."""
    n, domains = topology.node_count, topology.domain_of_node
    k = effective_factor(factor, n)
    if not domains:
        logger.info("RAM checkpoint replication on: %d nodes, factor %d (node i -> nodes i+1..i+%d mod %d)",
                    n, k, k - 1, n)
        return
    named = Counter(d for d in domains if d is not None)
    logger.info("RAM checkpoint replication on: %d nodes in %d named failure domains, factor %d (each node -> "
                "the next %d of a ring interleaving the domains)", n, len(named), k, k - 1)
    inside = nodes_replicating_inside_their_domain(n, factor, domains)
    if inside:
        largest = max(named.values())
        logger.warning("%d of the %d nodes keep a copy inside their own failure domain (e.g. node %d, %r): the "
                       "largest domain has %d nodes, more than 1/%d of the nodes, so a ring cannot keep them "
                       "apart; losing such a domain whole can lose those nodes' RAM checkpoints. Spread the "
                       "nodes over more, or more equal, domains", len(inside), n,
                       inside[0], domains[inside[0]], largest, k)


_said_off = False


def _say_off_once(reason: str) -> None:
    global _said_off
    if not _said_off:
        _said_off = True
        logger.info("RAM checkpoint replication is off: %s", reason)


# Services whose push thread may still run. A daemon thread that is inside the transfer extension when
# the interpreter finalizes is ended by an unwind through C++ frames, which aborts the process (SIGABRT
# at exit); so the exit first closes them and waits for pushes in progress to end (within their I/O
# timeouts). Weak: a closed and dropped service is not kept alive by this.
_RUNNING: "weakref.WeakSet[ReplicationService]" = weakref.WeakSet()


@atexit.register
def _finish_pushes_at_exit() -> None:
    for service in list(_RUNNING):
        service.close(timeout=None)


class ReplicationService:
    """Replicates this rank's objects of each committed version to its peers, in a background thread."""

    def __init__(self, base_dir: str | os.PathLike[str], topology: NodeTopology, config: ReplicationConfig,
                 endpoints: PeerEndpoints | None) -> None:
        self.layout = CheckpointLayout(base_dir)
        self.topology = topology
        self.config = config
        self.rank = topology.rank
        self.enabled = endpoints is not None
        self.targets = push_targets(topology, self.rank, config.factor) if self.enabled else []
        self.sources = set(push_sources(topology, self.rank, config.factor)) if self.enabled else set()
        self._endpoints = endpoints
        self._status: dict[int, ReplicationStatus] = {}
        self._newest_replicated: int | None = None
        self._pending: list[int] = []
        self._closing = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._no_pushes: str | None = None  # why this rank pushes nothing (its versions count as under-replicated)
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name=f"flashpoint-replication-{self.rank}", daemon=True)
            try:  # never raises on this rank alone: every rank gathers in keep_for_next_save next
                self._thread.start()
            except RuntimeError as exc:  # "can't start new thread": out of threads or memory on this node
                self._thread = None
                self._no_pushes = f"rank {self.rank}'s replication thread did not start ({exc})"
                logger.error("%s; its RAM checkpoints stay under-replicated and the previous version is kept",
                             self._no_pushes)
            else:
                _RUNNING.add(self)

    # --- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def start(cls, base_dir: str | os.PathLike[str], topology: NodeTopology,
              config: ReplicationConfig | None = None) -> "ReplicationService":
        """Collective unless replication is off (decided from the topology and config, same on every rank)."""
        config = config or ReplicationConfig()
        # Every rank has loaded by now (training steps synchronise them): recovery's server for loads can go.
        remote_objects.stop_fetching(base_dir)
        if not config.enabled:
            _say_off_once("disabled by configuration")
            return cls(base_dir, topology, config, None)
        if topology.node_count < 2:
            _say_off_once("the job runs on a single node, there is no peer to hold a copy")
            return cls(base_dir, topology, config, None)
        if effective_factor(config.factor, topology.node_count) < 2:
            _say_off_once(f"replication factor {config.factor}")
            return cls(base_dir, topology, config, None)
        endpoints = peer_endpoints(base_dir, config, topology=topology, receive_pushes=True)
        service = cls(base_dir, topology, config, endpoints)
        if topology.rank == 0:
            _log_placement(topology, config.factor)
        return service

    def close(self, timeout: float | None = DEFAULT_CLOSE_WAIT_S) -> None:
        """Stop the push thread and the server. Idempotent; returns within about `timeout` s.

        A push in progress cannot be interrupted; the thread (a daemon) is left to end it within
        its I/O timeouts rather than holding up an abort. Whatever it still sends is checked by
        the receiver against the object's checksum, so a buffer reused meanwhile is refused there.
        """
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # kept: the interpreter's exit waits for it (see _finish_pushes_at_exit)
                logger.warning("Rank %d: the replication thread is still in a push after %.1f s; it ends within its "
                               "I/O timeout (%.0f s per try) in the background", self.rank, timeout or 0.0,
                               self.config.io_timeout_s)
            else:
                self._thread = None
        if self._thread is None:
            _RUNNING.discard(self)
        if self._endpoints is not None:
            self._endpoints.close()

    @property
    def server(self) -> _core.TransferServer | None:
        return self._endpoints.server if self._endpoints else None

    @property
    def addresses(self) -> list[tuple[str, int] | None]:
        return self._endpoints.addresses if self._endpoints else []

    # --- per save -------------------------------------------------------------------------------

    def replicate(self, step: int) -> None:
        """Queue a committed version for pushing; never blocks."""
        if not self.enabled:
            return
        self._expect_pushes(step)
        with self._cv:
            if self._no_pushes is not None:
                self._set(ReplicationStatus(step, UNDER_REPLICATED, {p: self._no_pushes for p in self.targets}))
                return
            self._status[step] = ReplicationStatus(step, PENDING)
            self._pending.append(step)
            self._cv.notify_all()

    def _expect_pushes(self, step: int) -> None:
        """Tell this rank's server the sizes, from this node's commit record, of the objects its sources push for step.

        Best effort: without them (an unreadable record, a push that arrives first) the server checks
        its size cap only.
        """
        server = self.server
        if server is None or not self.sources:
            return
        try:
            commit = read_commit(self.layout, step)
            server.expect_sizes(step, {version_relpath(step, o.name): o.nbytes
                                       for o in commit.objects if o.rank in self.sources})
        except Exception as exc:  # noqa: BLE001 - only a tighter check is lost
            logger.debug("Rank %d: the sizes of step %d's incoming replicas are not known (%s: %s)",
                         self.rank, step, type(exc).__name__, exc)

    def replication_status(self, step: int) -> ReplicationStatus:
        if not self.enabled:
            return ReplicationStatus(step, OFF)
        with self._cv:
            return self._status.get(step, ReplicationStatus(step, UNKNOWN))

    def progress(self) -> tuple[int | None, bool]:
        """(newest step this rank pushed to every peer or None, whether a push of a newer step failed).

        A version skipped because a newer one was committed before its push began is not a failure.
        """
        with self._cv:
            newest = self._newest_replicated
            failed = [st.step for st in self._status.values() if st.state == UNDER_REPLICATED]
        return newest, any(newest is None or step > newest for step in failed)

    def _wait_until(self, settled: Callable[[], bool], timeout: float) -> bool:
        """Wait on the condition variable (bounded) until settled() or replication is off; True if it settled."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.enabled and not settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def wait_for_pushes(self, timeout: float) -> bool:
        """Wait (bounded) until no version is queued or being pushed; True if none is left.

        For the end of training: a rank's transfer server must outlive its peers' pushes of the last version.
        """
        return self._wait_until(lambda: all(status.state != PENDING for status in self._status.values()), timeout)

    def wait(self, step: int, timeout: float) -> ReplicationStatus:
        """Wait (bounded) until step is no longer pending; for tests and tools, never called by a save."""
        self._wait_until(lambda: self._status.get(step, ReplicationStatus(step, UNKNOWN)).state != PENDING, timeout)
        return self.replication_status(step)

    def keep_for_next_save(self, keep: int) -> int:
        """Collective when on: how many committed versions the coming save keeps.

        `keep` while the newest committed version is replicated on every rank, else keep + 1,
        so the version before it survives until it is. Failures seen by any rank since the
        last save are logged here on rank 0 (the background thread logged them where they happened).
        """
        if not self.enabled:
            if self.topology.node_count > 1:
                self._prune_replicas()  # objects fetched from peers during a recovery still get removed
            return keep
        votes, newest = self.replication_votes()
        return self.keep_after_votes(keep, reduced_ints(votes), newest)

    def replication_votes(self) -> tuple[list[int], int | None]:
        """This rank's part of keep_for_next_save's all-reduce (MAX) and its newest committed step; never raises.

        A save that runs an all-reduce of its own anyway sends these in it (when on) and calls
        keep_after_votes with the reduced values: the same outcome at no extra collective.
        """
        newest: int | None = None
        replicated, failed = -1, 0  # -1: nothing replicated yet (or unknown)
        try:  # nothing here may raise on this rank alone: the others wait in the all-reduce
            committed = committed_steps(self.layout)
            newest = committed[-1] if committed else None
            with self._cv:
                replicated = -1 if self._newest_replicated is None else self._newest_replicated
                failed = int(any(st.state == UNDER_REPLICATED and st.step == newest for st in self._status.values()))
                server_errors = self.server.errors() if self.server is not None else []
            for message in server_errors:
                logger.warning("Rank %d replication server: %s", self.rank, message)
        except Exception as exc:  # noqa: BLE001 - counted as not replicated: the previous version is kept
            logger.warning("Rank %d: cannot tell whether the newest RAM checkpoint is replicated (%s: %s); the "
                           "previous version is kept", self.rank, type(exc).__name__, exc)
            newest = -1 if newest is None else newest
            replicated = -1
        # The lowest rank's newest replicated step (negated, for MAX) and any failure.
        return [-replicated, failed], newest

    def keep_after_votes(self, keep: int, reduced: list[int], newest: int | None) -> int:
        """keep_for_next_save's answer from every rank's replication_votes reduced (MAX) and this rank's newest."""
        negated_lowest, any_failed = reduced
        everywhere = None if negated_lowest == 1 else -negated_lowest
        if self.rank == 0 and any_failed and newest is not None:
            logger.warning("RAM checkpoint step %d is under-replicated: some ranks could not copy their objects to "
                           "every peer (each logged which peers and why)", newest)
        if newest is None or (everywhere is not None and everywhere >= newest):
            return keep
        return keep + 1

    # --- background thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if self._closing:
                    for step in self._pending:
                        self._set(ReplicationStatus(step, UNDER_REPLICATED,
                                                    {p: "the replication service closed first" for p in self.targets}))
                    self._pending.clear()
                    return
                step = max(self._pending)
                for older in self._pending:
                    if older != step:
                        self._set(ReplicationStatus(older, SKIPPED, {
                            p: f"superseded by step {step} before it was pushed" for p in self.targets}))
                self._pending.clear()
            status = self._push_version(step)
            with self._cv:
                self._set(status)
                if status.replicated and (self._newest_replicated is None or step > self._newest_replicated):
                    self._newest_replicated = step
                self._cv.notify_all()
            if not status.replicated:
                logger.warning("RAM checkpoint step %d is under-replicated: rank %d could not copy its objects to "
                               "ranks %s: %s. Training continues; the previous version is kept.", step, self.rank,
                               sorted(status.failed_peers), "; ".join(status.failed_peers.values()))
            self._prune_replicas()

    def _set(self, status: ReplicationStatus) -> None:
        self._status[status.step] = status
        for old in sorted(self._status)[:-16]:  # bounded history
            del self._status[old]

    def _push_version(self, step: int) -> ReplicationStatus:
        started = time.monotonic()
        failed: dict[int, str] = {}
        pushed = 0
        try:
            commit = read_commit(self.layout, step)
            mine = commit.objects_of_rank(self.rank)
        except Exception as exc:  # noqa: BLE001 - reported through the status
            return ReplicationStatus(step, UNDER_REPLICATED,
                                     {p: f"cannot read the version: {type(exc).__name__}: {exc}" for p in self.targets})
        assert self._endpoints is not None
        for peer in self.targets:
            address = self._endpoints.addresses[peer]
            if address is None:
                failed[peer] = f"rank {peer}: its transfer server did not start"
                continue
            for record in mine:
                if self._closing:
                    failed[peer] = f"rank {peer}: the replication service closed first"
                    break
                try:
                    pushed += self._push_object(address, peer, step, record)
                except Exception as exc:  # noqa: BLE001 - reported through the status
                    failed[peer] = f"rank {peer} at {address[0]}:{address[1]}: {type(exc).__name__}: {exc}"
                    break
        state = UNDER_REPLICATED if failed else REPLICATED
        return ReplicationStatus(step, state, failed, pushed, time.monotonic() - started)

    def _push_object(self, address: tuple[str, int], peer: int, step: int, record: ObjectRecord) -> int:
        """Push the object's nbytes only: a reused pool buffer may be longer than the object it holds.

        The object's CRC32C is derived from its index, so the data is only sendfile()d, never
        read here; the receiver checks the bytes against it.
        """
        assert self._endpoints is not None
        path = self.layout.object_path(step, record.name)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            known_crc = _known_object_crc(fd, str(path), record)
            try:
                result = _core.transfer_push_fd(address[0], address[1], self._endpoints.secret, fd,
                                                version_relpath(step, record.name), length=record.nbytes,
                                                crc32c=known_crc, rank=self.rank, peer_rank=peer,
                                                **self.config.transfer_kwargs())
            except _core.TransferChecksumError as exc:
                if known_crc is None:
                    raise
                raise _core.TransferChecksumError(
                    f"{exc}. The bytes sent from {path} do not match the checksums in its own index, most "
                    "likely because the RAM copy changed after the save (corrupt memory?); it was not replicated"
                ) from exc
        finally:
            os.close(fd)
        return int(result["nbytes"])

    def _prune_replicas(self) -> None:
        """Node leader: retire other nodes' objects from retired versions (their writers are not here to)."""
        if not self.topology.is_leader:
            return
        try:
            prune_foreign_objects(self.layout, self.topology, spare_bytes=self.config.spare_bytes)
        except Exception as exc:  # noqa: BLE001 - cleanup only; logged
            logger.warning("Rank %d: removing replicas of retired versions failed: %s", self.rank, exc)


def _known_object_crc(fd: int, path: str, record: ObjectRecord) -> int | None:
    """The object's whole CRC32C from its header and index; None: let the sender compute it while sending."""
    try:
        return whole_object_crc32c(fd, path, record)
    except (CorruptCheckpointError, FormatVersionError, OSError) as exc:
        # A damaged object is refused by every reader anyway; replicate it as before, checksummed on the way.
        logger.debug("Replicating %s with a checksum computed while sending: its header or index cannot "
                     "vouch for its bytes (%s)", path, exc)
        return None


def prune_foreign_objects(layout: CheckpointLayout, topology: NodeTopology, *,
                          spare_bytes: int | None = None) -> list[int]:
    """Retire objects of ranks not on this node from retired version directories; returns the steps touched.

    A version directory is retired once its commit record is gone and a newer version is
    committed (core.versions.retire_version removes the record first). Each rank retires only
    its own objects there, so replicas received from other nodes (or fetched during recovery)
    would stay forever; this moves them into the replica spare directory (up to spare_bytes,
    see ReplicationConfig.spare_bytes), where the next received replica reuses their pages,
    deletes the rest and then removes the empty directory.

    Orphans go the same way: uncommitted directories newer than the newest commit (or with no
    commit at all) that hold other nodes' objects, none of this node's and no version file. No
    placement makes them a version here (a push needs this node's own object or version file in
    its step, docs/security.md), so they are what an older release let in, and they must not take
    the room of this node's own saves.
    """
    committed = committed_steps(layout)
    own = set(topology.ranks_of_node(topology.node))
    newest = committed[-1] if committed else -1
    retired = {step: _foreign_objects(layout.version_dir(step), own) for step in layout.version_steps()
               if step < newest and not layout.is_committed(step)}
    retired.update(_orphans(layout, own, newer_than=newest))
    if not retired and not committed:
        return []
    if spare_bytes is None:  # one version's replicas: the newest's, or a retired one's while the newest's arrive
        newest_files = _foreign_objects(layout.version_dir(newest), own) if committed else []
        versions = [newest_files, *retired.values()]
        spare_bytes = max(sum(size for _, size in files) for files in versions)
    spares = SpareFiles(layout, spare_bytes)
    for step, files in retired.items():
        for path, size in files:
            spares.retire(path, size)
        try:
            layout.version_dir(step).rmdir()
        except OSError:
            pass  # this node's own ranks still have objects there; they remove the directory
    spares.trim()
    return sorted(step for step, files in retired.items() if files)


def _orphans(layout: CheckpointLayout, own: set[int], *, newer_than: int) -> dict[int, list[tuple[Path, int]]]:
    """Uncommitted version directories newer than newer_than holding other nodes' objects, none of own's and no
    version file (which only this node writes)."""
    found = {}
    for step in layout.version_steps():
        if step <= newer_than or layout.is_committed(step):
            continue
        try:
            names = os.listdir(layout.version_dir(step))
        except FileNotFoundError:
            continue
        owners = {rank_of_object(name) for name in names} - {None}
        if owners and not owners & own and not set(names) & set(PEER_VERSION_FILES):
            found[step] = _foreign_objects(layout.version_dir(step), own)
    return found


def _foreign_objects(directory: Path, own: set[int]) -> list[tuple[Path, int]]:
    """(path, size) of the objects in a version directory written by ranks not in own."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        owner = rank_of_object(name)
        if owner is None or owner in own:
            continue
        try:
            found.append((directory / name, os.stat(directory / name, follow_symlinks=False).st_size))
        except FileNotFoundError:
            continue
    return found


class SpareFiles:
    """The replica spare directory: files of retired replicas, bounded by a byte budget.

    Transfer servers take spares by renaming them away (atomically, so a file is taken by one
    reception at most); everything here tolerates a spare vanishing at any moment.
    """

    def __init__(self, layout: CheckpointLayout, budget: int) -> None:
        self.directory = layout.replica_spares_dir
        self.budget = budget
        self._held: int | None = None  # bytes in the directory, listed on first need

    def retire(self, path: Path, size: int) -> None:
        """Move a retired replica of size bytes into the spare directory if it fits the budget, else delete it."""
        if self.budget > 0 and self.held() + size <= self.budget:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                os.rename(path, self.directory / spare_name())
                self._held = self.held() + size
                return
            except OSError as exc:
                logger.debug("Could not keep %s as a spare (%s); deleting it", path, exc)
        path.unlink(missing_ok=True)

    def held(self) -> int:
        if self._held is None:
            self._held = sum(size for _, size in self._listing())
        return self._held

    def trim(self) -> None:
        """Delete spares beyond the budget, smallest first (a big spare can hold any object)."""
        listing = sorted(self._listing(), key=lambda item: item[1])
        total = sum(size for _, size in listing)
        for path, size in listing:
            if total <= self.budget:
                break
            path.unlink(missing_ok=True)
            total -= size
        self._held = None

    def _listing(self) -> list[tuple[Path, int]]:
        try:
            entries = list(os.scandir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False):
                    found.append((Path(entry.path), entry.stat(follow_symlinks=False).st_size))
            except FileNotFoundError:
                continue
        return found
