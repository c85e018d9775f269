"""Per-rank authorization and bounds of the transfer service (issue 13, section 2): real servers and sockets.

The server plays rank 2 of a job of 2 nodes x 2 ranks (ranks 0 and 1 on node 0, ranks 2 and 3
on node 1) with the policy the replication service gives it at factor 2: rank 0 may push its own
objects here, no one else may push anything, any rank of the job may fetch objects and version
files. Buggy members are played by the C++ client and by tests/support/transfer_peer.py. On
protocol v2 every hostile push below was accepted (over another rank's committed object, over
COMMIT, a nested path that made the next CheckpointSaver.save of that step fail, a 4 KiB path that
created 2,045 nested directories), slow peers held the workers for as long as they trickled, and
two pushes that did not fit together were both accepted.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.layout import COMMIT_NAME, CheckpointLayout, object_name, version_relpath
from ml_flashpoint_nemo.core.saver import CheckpointSaver
from ml_flashpoint_nemo.core.topology import NodeTopology
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.replication.service import transfer_policy
from tests.support import transfer_peer as peer
from tests.support.server_errors import wait_for_error
from tests.support.tmpfs import mounted_tmpfs
from tests.test_transfer_service import assert_closed, snapshot

SECRET = b"job-secret-0123456789abcdef"
HOST = "127.0.0.1"
MiB = 1 << 20
JOB = NodeTopology((0, 0, 1, 1), rank=2)  # this server: rank 2, on node 1
FACTOR = 2  # rank 0 replicates to rank 2, rank 1 to rank 3
ME, PUSHER, OTHER = 2, 0, 1


def state(seed: int, nbytes: int = 64 << 10) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(nbytes // 4, dtype=torch.int32) + seed}


def own_save(base: Path, step: int, nbytes: int = 64 << 10) -> None:
    """This node's own save: rank 2's object of version step of the 4-rank job, committed."""
    saver = CheckpointSaver(base, rank=ME)
    try:
        written = saver.write_object(step, state(step, nbytes))
        saver.commit(step, [written.record], world_size=len(JOB.node_of_rank))
    finally:
        saver.pool.close()


NEIGHBOUR = 3  # the other rank of this node


def saved_here(base: Path, *steps: int) -> None:
    """This node's own save of each step has begun: its rank 3 placed its object (not committed)."""
    for step in steps:
        (base / f"step-{step}").mkdir(parents=True, exist_ok=True)
        (base / version_relpath(step, object_name(NEIGHBOUR))).write_bytes(b"rank 3's own object")


def committed_node(base: Path) -> Path:
    """Node 1's base: committed step 5 (rank 2's own object, rank 0's replica, the version files)."""
    own_save(base, 5)
    step = base / "step-5"
    (step / object_name(PUSHER)).write_bytes(os.urandom(5000))
    (step / ".metadata").write_bytes(b"dcp metadata")
    (step / "common.pt").write_bytes(b"common state")
    return base


@pytest.fixture
def node(shm_dir: Path) -> Path:
    return committed_node(shm_dir / "node-1")


def policy_server(base: Path, **kwargs) -> _core.TransferServer:
    return _core.TransferServer(base, SECRET, rank=ME, policy=transfer_policy(JOB, FACTOR),
                                **{"io_timeout_s": 5.0, "max_connections": 3, **kwargs})


@pytest.fixture
def server(node: Path):
    with policy_server(node) as srv:
        yield srv


def push(srv, data: bytes, remote: str, *, rank: int = PUSHER, **kwargs):
    """A real C++ client pushing data (from a scratch file) as rank to the server (rank 2)."""
    scratch = Path(f"/dev/shm/flashpoint-authz-src-{os.getpid()}-{threading.get_ident()}")
    scratch.write_bytes(data)
    try:
        with open(scratch, "rb") as f:
            return _core.transfer_push_fd(HOST, srv.port, SECRET, f.fileno(), remote, rank=rank, peer_rank=ME,
                                          **{"retries": 0, "io_timeout_s": 5.0, **kwargs})
    finally:
        scratch.unlink()


def raw_request(srv, op: int, path: bytes, size: int, *, rank: int = PUSHER) -> tuple[int, int, str]:
    with peer.connect(HOST, srv.port, timeout=5) as sock:
        s = peer.client_handshake(sock, SECRET, rank, ME)
        s.send_request(op, path, size)
        return s.recv_response()


def temp_files(root: Path) -> list[str]:
    """Receptions' temporary files under root (.xfer-*; other hidden files, .metadata and .lock, are the layout's)."""
    return [str(p) for p in root.rglob(".xfer-*")]


def assert_untouched(base: Path, before: dict) -> None:
    assert snapshot(base) == before, "the base directory changed"
    assert temp_files(base) == [], "a temporary file was left behind"


# --- who may push what --------------------------------------------------------------------------


@pytest.mark.parametrize("rank, remote, why", [
    (PUSHER, "step-5/rank-00002-0.fpo", "lives on this node"),       # the receiver's own committed object
    (PUSHER, "step-5/rank-00003-0.fpo", "lives on this node"),       # its node neighbour's
    (PUSHER, "step-5/rank-00001-0.fpo", r"only the objects of rank\(s\) 0"),  # another member's, same node as the pusher
    (OTHER, "step-5/rank-00001-0.fpo", "replicates nothing to this rank"),  # rank 1 pushes to rank 3, not here
    (3, "step-5/rank-00000-0.fpo", "replicates nothing to this rank"),  # rank 3 over rank 0's replica
])
def test_a_member_cannot_push_over_another_ranks_object(node, server, rank, remote, why):
    before = snapshot(node)
    with pytest.raises(_core.TransferForbiddenError, match=why) as info:
        push(server, os.urandom(4096), remote, rank=rank)
    assert isinstance(info.value, PermissionError) and "not permitted" in str(info.value)
    assert_untouched(node, before)
    assert server.stats()["forbidden"] == 1 and server.stats()["pushes_ok"] == 0
    wait_for_error(server, f"(rank {rank}): push of '{remote}' refused (not permitted)")


@pytest.mark.parametrize("name", ["COMMIT", ".metadata", "common.pt", "metadata.json"])
def test_version_files_are_never_pushed(node, server, name):
    before = snapshot(node)
    with pytest.raises(_core.TransferForbiddenError, match="version files are never pushed"):
        push(server, b"forged", version_relpath(5, name))
    assert_untouched(node, before)
    assert read_commit(CheckpointLayout(node), 5).objects[0].name == object_name(ME)


LONG = "a/" * 2047 + "a"  # 4095 bytes, 2048 components


@pytest.mark.parametrize("remote", [
    "step-1/sub/x", "step-1/sub/rank-00000-0.fpo", LONG, "step-1/" + "d/" * 2030 + object_name(PUSHER),
    "step-6", "step-5", object_name(PUSHER), "step-1/x.fpo", "step-6/rank-0-0.fpo", "step-6/rank-00000-00.fpo",
    "step-06/rank-00000-0.fpo", "step-6/rank-00000-0.fpo.tmp", "step-6/.xfer-0123456789abcdef.tmp",
    "pool/rank-00002/buf-00", "pool/replica-spares/spare-00", "checkpoints/step-6/rank-00000-0.fpo",
    "step-6/rank-00000-0.fpo/x", "step-99999999999999999999/rank-00000-0.fpo",
], ids=lambda r: r if len(r) < 40 else f"{r[:20]}...({len(r)} bytes)")
def test_names_outside_the_layout_are_refused_and_create_nothing(node, server, remote):
    before = snapshot(node)
    with pytest.raises(_core.TransferForbiddenError):
        push(server, os.urandom(100), remote)
    assert_untouched(node, before)  # not one directory: on v2 the 4 KiB path made 2,045 of them
    # The step a refused nested push aimed at is still a step this node can save (on v2: IsADirectoryError).
    own_save(node, 1)
    assert committed_steps(CheckpointLayout(node)) == [1, 5]


def test_hostile_request_bytes_are_refused_with_a_status(node, server):
    """Bytes no client of ours sends (a NUL, byte 0xff, a newline) in a name: refused, escaped in the log."""
    before = snapshot(node)
    for path in (b"step-6/rank-00000-0.fpo\0x", b"step-6/rank-\xff.fpo", b"step-6/\nrank-00000-0.fpo"):
        status, _, message = raw_request(server, peer.OP_PUSH, path, 10)
        assert status == peer.FORBIDDEN, (path, status, message)
    assert_untouched(node, before)
    assert all(e.isprintable() for e in server.errors())


def test_the_placements_push_lands_and_may_be_repeated(node, server):
    """What replication sends: rank 0's own object into a new version directory (one level), twice (a retry)."""
    saved_here(node, 6, 7)
    data = os.urandom(3 * MiB + 5)
    for _ in range(2):
        r = push(server, data, version_relpath(6, object_name(PUSHER, 1)), crc32c=_core.crc32c(data))
        assert r["nbytes"] == len(data)
    assert (node / "step-6" / object_name(PUSHER, 1)).read_bytes() == data
    assert sorted(os.listdir(node / "step-6")) == [object_name(PUSHER, 1), object_name(NEIGHBOUR)]
    # The independent implementation agrees on every byte of the v3 handshake and session.
    assert peer.push(HOST, server.port, SECRET, version_relpath(7, object_name(PUSHER)), b"abc", peer_rank=ME)[0] == peer.OK
    assert server.stats()["forbidden"] == 0 and server.errors() == []


def test_fetch_serves_only_objects_and_version_files(node, server, shm_dir):
    client = shm_dir / "client"
    client.mkdir()
    (node / "pool" / "replica-spares").mkdir(parents=True)
    (node / "pool" / "replica-spares" / "spare-00").write_bytes(b"not checkpoint data")
    (node / "step-5" / ".xfer-0123456789abcdef.tmp").write_bytes(b"a reception in progress")
    (node / "notes.txt").write_bytes(b"something else")
    (node / "pool" / "rank-00002" / "buf-00").write_bytes(b"a free pool buffer")
    for rank in (OTHER, 3):  # any member, of either node
        for name in ("COMMIT", ".metadata", "common.pt", object_name(ME), object_name(PUSHER)):
            _core.transfer_fetch(HOST, server.port, SECRET, version_relpath(5, name), client, f"got-{rank}-{name}",
                                 rank=rank, peer_rank=ME, retries=0)
            assert (client / f"got-{rank}-{name}").read_bytes() == (node / "step-5" / name).read_bytes()
    pool_files = [str(p.relative_to(node)) for p in (node / "pool").rglob("*") if p.is_file()]
    assert len(pool_files) == 3  # the pool's lock, a buffer and a spare
    for remote in ["step-5/.xfer-0123456789abcdef.tmp", "notes.txt", "step-5", *pool_files]:
        with pytest.raises(_core.TransferForbiddenError):
            _core.transfer_fetch(HOST, server.port, SECRET, remote, client, "stolen", rank=OTHER, peer_rank=ME,
                                 retries=0)
        assert not (client / "stolen").exists() and temp_files(client) == []


# --- who is who: the handshake ------------------------------------------------------------------


def test_a_peer_claiming_a_rank_it_is_not_is_refused_at_the_handshake(node, server):
    """Rank 1 (who may push nothing here) claims to be rank 0 but can only prove rank 1's key."""
    before = snapshot(node)
    with peer.connect(HOST, server.port) as sock:
        s = peer.client_handshake(sock, SECRET, rank=PUSHER, peer_rank=ME,
                                  proof_key=peer.rank_key(SECRET, OTHER))
        s.send_request(peer.OP_PUSH, version_relpath(6, object_name(PUSHER)).encode(), 5)
        assert_closed(sock)  # no request is read
    wait_for_error(server, "failed authentication as rank 0")
    assert server.stats()["auth_failures"] == 1
    assert_untouched(node, before)


def test_a_rank_outside_the_job_is_refused(node, server):
    with peer.connect(HOST, server.port) as sock:
        s = peer.client_handshake(sock, SECRET, rank=4, peer_rank=ME)
        s.send_request(peer.OP_FETCH, b"step-5/COMMIT", 0)
        assert_closed(sock)
    wait_for_error(server, "authenticated as rank 4, but the job has 4 ranks")


def test_the_client_refuses_a_server_that_is_not_the_rank_it_means(node, server, shm_dir):
    t0 = time.monotonic()
    with pytest.raises(_core.TransferAuthError, match="the server is rank 2, not rank 3"):
        _core.transfer_fetch(HOST, server.port, SECRET, "step-5/COMMIT", shm_dir, "x", rank=OTHER, peer_rank=3,
                             retries=3)
    assert time.monotonic() - t0 < 1.0  # never retried
    # A server that names the right rank but can only prove another one's key.
    listener = socket.create_server((HOST, 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            try:
                peer.server_handshake(conn, SECRET, rank=3, proof_key=peer.rank_key(SECRET, ME))
            except (OSError, peer.HandshakeFailed):
                pass

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(_core.TransferAuthError, match="server failed authentication as rank 3"):
            _core.transfer_fetch(HOST, listener.getsockname()[1], SECRET, "step-5/COMMIT", shm_dir, "x",
                                 rank=OTHER, peer_rank=3, retries=0)
    finally:
        thread.join(10)
        listener.close()
    assert not (shm_dir / "x").exists()


def test_policy_arguments_are_checked():
    good = dict(world_size=4, own_ranks=[2, 3], pushers={0: [0]}, version_dir_pattern="step-{step}",
                object_name_pattern="rank-{rank:05d}-{index}.fpo", version_files=["COMMIT"])
    _core.TransferPolicy(**good)
    for bad, match in [({"world_size": 0}, "world_size"), ({"own_ranks": [4]}, "not below world_size"),
                       ({"pushers": {0: [2]}}, "on this node"), ({"pushers": {5: [0]}}, "not below"),
                       ({"version_dir_pattern": "step-{n}"}, "unknown field"),
                       ({"version_dir_pattern": "step-{step}{step}"}, "twice"),
                       ({"object_name_pattern": "rank-{rank:05d}{index}.fpo"}, "separated"),
                       ({"object_name_pattern": "rank-{rank:05d}7-{index}"}, "start with a digit"),
                       ({"object_name_pattern": "a/{rank}-{index}"}, "literals"),
                       ({"object_name_pattern": "rank-{rank:5}-{index}"}, "format"),
                       ({"object_name_pattern": "rank-{rank}.fpo"}, "missing"),
                       ({"version_files": ["a/b"]}, "plain file name"),
                       ({"version_files": ["rank-00001-0.fpo"]}, "no object name")]:
        with pytest.raises(ValueError, match=match):
            _core.TransferPolicy(**{**good, **bad})
    with pytest.raises(ValueError, match="not below the policy's world_size"):
        _core.TransferServer("/dev/shm", SECRET, rank=4, policy=_core.TransferPolicy(**good))
    for bad in ({"min_rate_bytes_per_s": -1}, {"min_rate_bytes_per_s": float("inf")}, {"rate_grace_s": -1},
                {"space_margin_bytes": -1}):
        with pytest.raises(ValueError):
            _core.TransferServer("/dev/shm", SECRET, **bad)
        if "space_margin_bytes" not in bad:
            with pytest.raises(ValueError):
                _core.transfer_fetch(HOST, 1234, SECRET, "step-1/COMMIT", "/dev/shm", **bad)
    with pytest.raises(TypeError):  # a rank is an unsigned 32-bit number
        _core.transfer_fetch(HOST, 1234, SECRET, "step-1/COMMIT", "/dev/shm", rank=-1)


# --- bounds -------------------------------------------------------------------------------------


def trickle(port: int, remote: str, size: int, every_s: float, for_s: float, results: list, i: int,
            started: threading.Semaphore) -> None:
    """An authenticated pusher (rank 0) that sends its data one byte every every_s seconds.

    Releases started once its push is accepted; records in results[i] the seconds from then until the
    server closed the connection, or None if it never did."""
    with peer.connect(HOST, port, timeout=10) as sock:
        s = peer.client_handshake(sock, SECRET, PUSHER, ME)
        s.send_request(peer.OP_PUSH, remote.encode(), size)
        assert s.recv_response()[0] == peer.OK
        ready = time.monotonic()
        started.release()
        while time.monotonic() - ready < for_s:
            try:
                sock.send(b"\xab")
                if select.select([sock], [], [], every_s)[0] and sock.recv(16) == b"":
                    break
            except OSError:  # reset: the server closed with our bytes unread
                break
        else:
            results[i] = None
            return
        results[i] = time.monotonic() - ready


def test_slow_authenticated_peers_are_cut_at_the_minimum_rate(node):
    """Three members trickle one byte every 0.3 s (never an io timeout of 2 s): on v2 they held all three
    workers for as long as they liked. Now each ends about rate_grace_s after its data began, and an
    honest push that was queued behind them gets through."""
    saved_here(node, 6)
    with policy_server(node, io_timeout_s=2.0, rate_grace_s=0.5) as srv:
        srv.expect_sizes(6, {**{version_relpath(6, object_name(PUSHER, i)): 4 * MiB for i in range(3)},
                             version_relpath(6, object_name(PUSHER, 9)): MiB})  # this node's commit record
        results: list = [None] * 3
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=trickle, args=(srv.port, version_relpath(6, object_name(PUSHER, i)),
                                                          4 * MiB, 0.3, 8.0, results, i, started)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:  # every worker is held by a trickler
            assert started.acquire(timeout=10)
        data = os.urandom(MiB)
        r = push(srv, data, version_relpath(6, object_name(PUSHER, 9)), io_timeout_s=10.0)
        for t in threads:
            t.join(20)
        assert r["nbytes"] == MiB
        assert all(s is not None and s < 3.0 for s in results), results  # ~0.5 s each, far below the 8 s offered
        wait_for_error(srv, "fell below its minimum rate")
        assert srv.stats()["too_slow"] == 3
        deadline = time.monotonic() + 5
        while temp_files(node) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert temp_files(node) == []
        assert sorted(os.listdir(node / "step-6")) == [object_name(PUSHER, 9), object_name(NEIGHBOUR)]


def test_a_fetching_client_ends_a_trickling_server(shm_dir):
    """The same floor on the client side: a server that trickles an object ends in TransferTimeoutError."""
    listener = socket.create_server((HOST, 0))

    def trickling_server() -> None:
        conn, _ = listener.accept()
        with conn:
            try:
                s = peer.server_handshake(conn, SECRET, rank=ME)
                s.recv_request()
                s.send_response(peer.OK, MiB, "sending")
                for _ in range(100):
                    conn.sendall(b"\x01")
                    time.sleep(0.2)
            except OSError:
                pass

    thread = threading.Thread(target=trickling_server, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(_core.TransferTimeoutError, match="minimum rate"):
            _core.transfer_fetch(HOST, listener.getsockname()[1], SECRET, "step-5/COMMIT", shm_dir, rank=OTHER,
                                 peer_rank=ME, retries=0, io_timeout_s=2.0, rate_grace_s=0.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        listener.close()
        thread.join(30)
    assert temp_files(shm_dir) == [] and not (shm_dir / "step-5" / "COMMIT").exists()


def test_pushes_that_do_not_fit_together_are_refused_before_their_data(tmp_path):
    """A 64 MiB tmpfs, 40 MiB arriving: a second 40 MiB push is refused at once, the node's own save
    still fits, and the first push completes."""
    with mounted_tmpfs(tmp_path / "tmpfs", "64m") as mount:
        base = mount / "node-1"
        saved_here(base, 5)
        with policy_server(base, rate_grace_s=60.0) as srv:
            size = 40 * MiB
            first = os.urandom(MiB) * 40
            with peer.connect(HOST, srv.port, timeout=30) as sock:
                s = peer.client_handshake(sock, SECRET, PUSHER, ME)
                s.send_request(peer.OP_PUSH, version_relpath(5, object_name(PUSHER, 0)).encode(), size)
                assert s.recv_response()[0] == peer.OK
                wire = s.data(first)
                sock.sendall(wire[: len(wire) // 4])  # 10 MiB landed, 30 MiB still promised
                with pytest.raises(_core.TransferNoSpaceError, match="promised to 1 reception"):
                    push(srv, os.urandom(MiB) * 40, version_relpath(5, object_name(PUSHER, 1)))
                assert srv.stats()["no_space"] == 1
                own_save(base, 5, 8 * MiB)  # this node's own save
                sock.sendall(wire[len(wire) // 4:] + s.trailer(size, peer.crc32c(first)))
                assert s.recv_response()[0] == peer.OK
        assert (base / "step-5" / object_name(PUSHER, 0)).read_bytes() == first
        assert not (base / "step-5" / object_name(PUSHER, 1)).exists() and temp_files(base) == []
        assert committed_steps(CheckpointLayout(base)) == [5]


def test_a_fetch_leaves_the_margin_for_the_nodes_own_saves(tmp_path, shm_dir):
    """A fetch into a 32 MiB tmpfs keeps the margin a server keeps (default 1/32, 1 MiB here): 31.5 MiB
    is refused before its data (before: it filled the tmpfs), nothing is left, and the node's own save
    then fits; a fetch that leaves the margin succeeds."""
    served = shm_dir / "served"
    served.mkdir()
    big, fits = os.urandom(MiB) * 31 + os.urandom(MiB // 2), os.urandom(MiB) * 16
    (served / "big.fpo").write_bytes(big)
    (served / "fits.fpo").write_bytes(fits)
    with mounted_tmpfs(tmp_path / "tmpfs", "32m") as mount, _core.TransferServer(served, SECRET) as srv:
        base = mount / "node-0"
        base.mkdir()
        with pytest.raises(_core.TransferNoSpaceError, match="kept free for this node's own saves"):
            _core.transfer_fetch(HOST, srv.port, SECRET, "big.fpo", base, retries=0)
        assert os.listdir(base) == [] and srv.stats()["fetches_ok"] == 0
        with pytest.raises(_core.TransferNoSpaceError):  # an explicit margin: 16 MiB of 32 after 16 MiB is 0
            _core.transfer_fetch(HOST, srv.port, SECRET, "fits.fpo", base, retries=0, space_margin_bytes=17 * MiB)
        assert os.listdir(base) == []
        _core.transfer_fetch(HOST, srv.port, SECRET, "fits.fpo", base, retries=0)
        assert (base / "fits.fpo").read_bytes() == fits
        (base / "own-save").write_bytes(os.urandom(MiB) * 14)  # the node's own save still fits
        with pytest.raises(ValueError, match="space_margin_bytes"):
            _core.transfer_fetch(HOST, srv.port, SECRET, "fits.fpo", base, "again.fpo", space_margin_bytes=-1)


def test_a_push_must_match_the_size_the_commit_record_gives(node, server):
    layout = CheckpointLayout(node)
    saved_here(node, 6, 7)
    expected = {version_relpath(6, object_name(PUSHER)): 1000}
    server.expect_sizes(6, expected)
    with pytest.raises(_core.TransferForbiddenError, match="announces 2000 bytes.*lists 1000"):
        push(server, os.urandom(2000), version_relpath(6, object_name(PUSHER)))
    with pytest.raises(_core.TransferForbiddenError, match="step 6 does not list it"):
        push(server, os.urandom(1000), version_relpath(6, object_name(PUSHER, 1)))
    assert os.listdir(layout.version_dir(6)) == [object_name(NEIGHBOUR)]
    data = os.urandom(1000)
    push(server, data, version_relpath(6, object_name(PUSHER)))
    assert layout.object_path(6, object_name(PUSHER)).read_bytes() == data
    push(server, os.urandom(3000), version_relpath(7, object_name(PUSHER)))  # step 7 unknown: the cap only


# --- no space for pushes that cannot become a version (issue 31, finding 2) -----------------------


@pytest.mark.parametrize("step", [6, 4, 10**12], ids=["the-next-step", "an-older-step", "far-ahead"])
def test_a_push_into_a_step_this_node_has_not_saved_is_refused_and_creates_nothing(node, server, step):
    """Before: accepted into any step (future ones never retired). A placement pushes a step only after this
    node's own ranks placed their objects of it, so without one of them there it cannot become a version."""
    before = snapshot(node)
    with pytest.raises(_core.TransferForbiddenError, match=f"no version file in step {step}"):
        push(server, os.urandom(1000), version_relpath(step, object_name(PUSHER)))
    assert_untouched(node, before)
    assert server.stats()["forbidden"] == 1


def test_a_node_that_restarted_empty_takes_pushes_of_the_steps_it_saves(shm_dir):
    """A fresh server on an empty base: nothing is accepted until this node's own save of that step placed
    an object (uncommitted, the server told nothing); then the placement's push lands. A node whose ranks
    saved nothing of a step still holds its copy of the commit record, which is enough."""
    base = shm_dir / "node-1"
    base.mkdir()
    data = os.urandom(5000)
    with policy_server(base) as srv:
        with pytest.raises(_core.TransferForbiddenError, match="has not saved that step"):
            push(srv, data, version_relpath(1, object_name(PUSHER)))
        assert os.listdir(base) == []
        saved_here(base, 1)
        push(srv, data, version_relpath(1, object_name(PUSHER)))
        (base / "step-2").mkdir()
        (base / "step-2" / COMMIT_NAME).write_bytes(b"this node's copy of the commit record")
        push(srv, data, version_relpath(2, object_name(PUSHER)))
    assert (base / version_relpath(1, object_name(PUSHER))).read_bytes() == data
    assert (base / version_relpath(2, object_name(PUSHER))).read_bytes() == data


def test_without_a_commit_record_an_object_grows_at_most_8_times_its_previous_size(node, server):
    """Step 5 holds rank 0's 5000-byte replica. Into step 6 (saved here, no commit record yet) rank 0 may push
    up to 8 x 5000 bytes of that object; more is refused (too large) before its data. An object with no
    earlier copy here (the first save) and one whose size the commit record gives are not bounded by it."""
    saved_here(node, 6)
    name = object_name(PUSHER)
    with pytest.raises(_core.TransferRefusedError, match="too large.*more than 8 times the 5000 bytes"):
        push(server, os.urandom(8 * 5000 + 1), version_relpath(6, name))
    assert not (node / version_relpath(6, name)).exists() and temp_files(node) == []
    push(server, os.urandom(8 * 5000), version_relpath(6, name))
    push(server, os.urandom(100_000), version_relpath(6, object_name(PUSHER, 1)))  # no earlier copy
    server.expect_sizes(6, {version_relpath(6, name): 100_000})  # a genuinely larger object, recorded
    grown = os.urandom(100_000)
    push(server, grown, version_relpath(6, name))
    assert (node / version_relpath(6, name)).read_bytes() == grown


def test_a_member_pushing_into_future_steps_cannot_make_the_nodes_own_save_fail(tmp_path):
    """The review's 14 x 8 MiB in small form: a 64 MiB tmpfs holding committed step 5; a member pushes its
    own-named 4 MiB objects into steps 6..19. Before, all 14 landed (56 MiB, never retired) and the node's
    own 8 MiB save of step 6 then failed with OutOfSpaceError. Now every one is refused and the save fits."""
    with mounted_tmpfs(tmp_path / "tmpfs", "64m") as mount:
        base = mount / "node-1"
        own_save(base, 5, 4 * MiB)
        outcomes = []
        with policy_server(base) as srv:
            for step in range(6, 20):
                try:
                    push(srv, os.urandom(4 * MiB), version_relpath(step, object_name(PUSHER)))
                    outcomes.append("stored")
                except _core.TransferError as exc:
                    outcomes.append(type(exc).__name__)
            pushed = srv.stats()["pushes_ok"]
        own_save(base, 6, 8 * MiB)  # before: OutOfSpaceError
        assert outcomes == ["TransferForbiddenError"] * 14 and pushed == 0
        assert committed_steps(CheckpointLayout(base)) == [5, 6]
        assert CheckpointLayout(base).version_steps() == [5, 6]
