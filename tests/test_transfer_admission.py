"""Admission of the transfer service: peers without the secret never hold a worker, and floods stay bounded.

A real TransferServer on 127.0.0.1, real sockets. Other loopback addresses play other machines:
127.0.0.1 is the legitimate peer (the `_core` client connects from it), 127.0.0.2 a stranger the
job does not know, 127.0.0.3 and up job nodes whose stuck agents flood the port
(docs/security.md, "Availability"). Waits poll the server's counters with a deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import resource
import select
import socket
import struct
import time
from pathlib import Path
from statistics import median

import pytest

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.layout import object_name, version_relpath
from ml_flashpoint_nemo.core.topology import NodeTopology
from ml_flashpoint_nemo.replication.service import LOOPBACK_PEERS, allowed_peer_addresses, is_loopback, transfer_policy
from tests.support import transfer_peer as peer
from tests.support.flood import SLOW_BYTES, Flood, connect_from, wait_for
from tests.support.multiproc import run_world

SECRET = b"job-secret-0123456789abcdef"
HOST = "127.0.0.1"
STRANGER = "127.0.0.2"
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(3, 13)]  # ten job nodes whose agents flood
KiB = 1 << 10
HELLO = peer.MAGIC + struct.pack("<II", peer.VERSION, 0) + bytes(32)


# --- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def enough_fds():
    """The flood holds hundreds of sockets on both ends in this process: raise the soft limit if needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the flood needs {want} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_without_a_word(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True when the server closed the connection (EOF or reset) within timeout without sending a byte."""
    sock.settimeout(timeout)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def still_open(sock: socket.socket) -> bool:
    """Nothing arrived and no EOF: the server still holds the connection (checked without waiting)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def write_object(base: Path, rel: str, data: bytes) -> None:
    path = base / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def legit_round(srv, server_base: Path, client_base: Path, tag: str, count: int = 6,
                nbytes: int = 512 * KiB) -> list[float]:
    """count pushes then count fetches from 127.0.0.1, no retries; each one's seconds; the bytes checked."""
    durations = []
    for i in range(count):
        data = os.urandom(nbytes)
        write_object(client_base, f"{tag}/push-{i}.fpo", data)
        t0 = time.monotonic()
        _core.transfer_push(HOST, srv.port, SECRET, client_base, f"{tag}/push-{i}.fpo", retries=0, io_timeout_s=5)
        durations.append(time.monotonic() - t0)
        assert (server_base / tag / f"push-{i}.fpo").read_bytes() == data
    for i in range(count):
        t0 = time.monotonic()
        _core.transfer_fetch(HOST, srv.port, SECRET, f"{tag}/push-{i}.fpo", client_base, f"{tag}/fetched-{i}.fpo",
                             retries=0, io_timeout_s=5)
        durations.append(time.monotonic() - t0)
        assert (client_base / tag / f"fetched-{i}.fpo").read_bytes() == (server_base / tag / f"push-{i}.fpo").read_bytes()
    return durations


def hello_then_wait(sock: socket.socket, rank: int = 0) -> bytes:
    """Sends a client hello (rank, nonce zero) and returns the server hello: the connection now waits for its proof."""
    sock.sendall(peer.MAGIC + struct.pack("<II", peer.VERSION, rank) + bytes(32))
    return peer.recv_exact(sock, 80)


def proof_for(sock: socket.socket, reply: bytes, rank: int = 0) -> tuple[bytes, peer.Session]:
    """The client proof answering reply (to hello_then_wait's hello as rank) and the session it starts on sock."""
    server_rank = struct.unpack("<I", reply[12:16])[0]
    nonce_c, nonce_s = bytes(32), reply[16:48]
    t = peer.transcript(rank, server_rank, nonce_c, nonce_s)
    client_key, server_key = peer.rank_key(SECRET, rank), peer.rank_key(SECRET, server_rank)
    proof = hmac.new(client_key, peer.CLIENT_LABEL + t, hashlib.sha256).digest()
    return proof, peer.Session(sock, peer.session_secret(client_key, server_key, t), nonce_c, nonce_s, is_client=True)


def prove(sock: socket.socket, reply: bytes, rank: int = 0) -> peer.Session:
    """Completes hello_then_wait's handshake: sends the proof, returns the session."""
    proof, session = proof_for(sock, reply, rank)
    sock.sendall(proof)
    return session


# --- the flood --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_handshakes", [64, 512], ids=["stage-full", "stage-holds-the-flood"])
def test_idle_and_slow_floods_leave_legitimate_transfers_on_time(dirs, enough_fds, max_handshakes):
    """200 idle + 50 slowloris (1 byte/s) connections from job nodes, reopened as the server closes them.

    stage-full: the stage (64) cannot hold the flood, so new connections displace the oldest
    handshakes of the busiest address; stage-holds-the-flood: they all fit and are closed at the
    handshake budget. Either way every legitimate push and fetch (no retries) succeeds in about the
    time it takes without the flood, while the flood turns over at least twice, and the error
    list stays short.
    """
    base, client = dirs
    budget = 1.0
    with _core.TransferServer(base, SECRET, io_timeout_s=5.0, handshake_timeout_s=budget,
                              max_handshakes=max_handshakes, allowed_peers=[HOST, *FLOOD_SOURCES]) as srv:
        legit_round(srv, base, client, "warm", count=2)  # page cache, code paths
        quiet = legit_round(srv, base, client, "quiet")
        srv.errors()
        with Flood(HOST, srv.port, FLOOD_SOURCES, idle=200, slow=50, slow_interval_s=1.0) as flood:
            held = min(max_handshakes, 250)
            start = wait_for(srv, "the flood to fill the stage", lambda s: s["handshaking"] >= held * 0.8)
            flooded: list[float] = []
            in_stage: list[int] = []  # after each round: how much of the flood the stage held
            t0 = time.monotonic()
            while True:  # rounds until the flood turned over twice (and at least two handshake budgets)
                flooded += legit_round(srv, base, client, f"flooded-{len(flooded)}", count=2)
                stats = srv.stats()
                in_stage.append(stats["handshaking"])
                turned_over = stats["handshakes_dropped"] + stats["handshake_timeouts"]
                if turned_over >= 500 and time.monotonic() - t0 >= 2 * budget:
                    break
                assert time.monotonic() - t0 < 30, f"the flood did not turn over twice in 30 s: {stats}"
            assert sorted(in_stage)[len(in_stage) // 2] >= held * 0.5, in_stage  # flooded most of the time
            assert flood.data_received == 0  # no flood connection ever got as far as a server hello
        assert stats["accepted"] - start["accepted"] >= 250, stats  # the flood came back after it was closed
        if max_handshakes < 250:
            assert stats["handshakes_dropped"] >= 500, stats
        else:
            assert stats["handshake_timeouts"] >= 500 and stats["handshakes_dropped"] == 0, stats
        print(f"\nflood {max_handshakes}: {len(flooded)} transfers of 512 KiB; median/max {median(quiet) * 1e3:.1f}/"
              f"{max(quiet) * 1e3:.1f} ms without the flood, {median(flooded) * 1e3:.1f}/{max(flooded) * 1e3:.1f} ms "
              f"with it; {stats['accepted'] - start['accepted']} flood connections accepted meanwhile, "
              f"{stats['handshakes_dropped']} displaced, {stats['handshake_timeouts']} timed out")
        bound = 5 * max(quiet) + 1.0  # generous for a loaded machine; a transfer that waited for a budget is over it
        late = [f"{d:.3f}s" for d in flooded if d > bound]
        assert not late, (f"{len(late)} of {len(flooded)} transfers under the flood took {late}, more than "
                          f"{bound:.3f} s; without it at most {max(quiet):.3f} s; {stats}")
        assert stats["handshakes_ok"] == 4 + len(quiet) + len(flooded)  # the legitimate ones, nothing else
        assert stats["auth_failures"] == 0 and stats["rejected_busy"] == 0, stats
        errors = srv.errors()
        assert len(errors) <= 11, errors  # at most 10 a minute, plus one count of the rest
        assert "suppressed" in errors[-1] and srv.stats()["errors_suppressed"] > 0, errors


def test_unauthenticated_connections_never_occupy_a_worker(dirs):
    """One worker, a queue of one: idle connections and stalled hellos used to take both, then every push failed."""
    base, client = dirs
    with _core.TransferServer(base, SECRET, io_timeout_s=10.0, max_connections=1, max_pending=1) as srv:
        idle = [socket.create_connection((HOST, srv.port)) for _ in range(10)]
        stalled = [socket.create_connection((HOST, srv.port)) for _ in range(5)]
        try:
            for s in stalled:
                s.sendall(HELLO)  # a valid hello, then never a proof
            t0 = time.monotonic()
            durations = legit_round(srv, base, client, "meanwhile", count=3, nbytes=64 * KiB)
            assert time.monotonic() - t0 < 5, durations
            assert all(still_open(s) for s in idle)  # not dropped either: the stage has room
        finally:
            for s in idle + stalled:
                s.close()


# --- the budget, the allow-list and the caps --------------------------------------------------


def test_a_handshake_has_a_budget_counted_from_accept(dirs):
    """Idle, one byte at a time, or stalled before the proof: closed at handshake_timeout_s, not io_timeout_s."""
    base, _ = dirs
    budget = 0.5
    with _core.TransferServer(base, SECRET, io_timeout_s=30.0, handshake_timeout_s=budget) as srv:
        t0 = time.monotonic()
        idle = connect_from(HOST, srv.port)
        slow = connect_from(HOST, srv.port)
        proofless = connect_from(HOST, srv.port)
        hello_then_wait(proofless)
        sent = 0
        while time.monotonic() - t0 < budget + 2 and sent < len(SLOW_BYTES):
            try:
                slow.send(SLOW_BYTES[sent:sent + 1])  # a byte every 50 ms keeps each wait short, not the budget
            except OSError:
                break
            sent += 1
            if not still_open(slow):
                break
            time.sleep(0.05)
        assert 3 <= sent < len(SLOW_BYTES)
        for sock in (idle, slow, proofless):
            assert closed_without_a_word(sock, timeout=budget + 2)
            sock.close()
        elapsed = time.monotonic() - t0
        assert budget * 0.8 <= elapsed < budget + 2, elapsed
        stats = wait_for(srv, "three timeouts", lambda s: s["handshake_timeouts"] == 3)
        assert stats["handshaking"] == 0
        errors = srv.errors()
        assert sum("handshake timed out" in e for e in errors) == 3, errors
        assert any("client proof" in e for e in errors) and any("of the client hello" in e for e in errors), errors


def test_a_stranger_is_refused_before_a_byte_is_read_and_takes_no_place(dirs):
    """Only 127.0.0.1 is allowed and the stage holds one handshake: 100 strangers leave it to the peer."""
    base, client = dirs
    with _core.TransferServer(base, SECRET, io_timeout_s=5.0, max_handshakes=1, allowed_peers=[HOST]) as srv:
        assert srv.allowed_peers == [HOST]
        member = connect_from(HOST, srv.port)
        reply = hello_then_wait(member)  # in the stage, waiting for its proof
        for _ in range(100):
            stranger = connect_from(STRANGER, srv.port)
            try:
                stranger.sendall(HELLO)
            except OSError:
                pass  # already reset
            assert closed_without_a_word(stranger)
            stranger.close()
        stats = wait_for(srv, "100 refusals", lambda s: s["rejected_not_allowed"] == 100)
        assert stats["handshaking"] == 1 and stats["handshakes_dropped"] == 0, stats
        assert stats["protocol_failures"] == 0, stats  # nothing of theirs was read
        # The member's handshake survived the strangers: it completes and is served.
        session = prove(member, reply)
        session.send_request(peer.OP_FETCH, b"missing.fpo", 0)
        assert session.recv_response()[0] == peer.NOT_FOUND
        member.close()
        errors = srv.errors()
        assert len(errors) == 12, errors  # 10 refusals listed, the member's "not found", the count of the rest
        assert sum("127.0.0.2 is not one of the job's peer addresses" in e for e in errors) == 10, errors
        assert errors[-1].startswith("90 more error(s)") and "suppressed" in errors[-1], errors
        assert srv.stats()["errors_suppressed"] == 90
        write_object(client, "ok.fpo", b"still serves")
        _core.transfer_push(HOST, srv.port, SECRET, client, "ok.fpo", retries=0)
        assert (base / "ok.fpo").read_bytes() == b"still serves"


def test_per_address_cap_displaces_its_own_handshakes_then_refuses(dirs):
    """Two connections per address: a third displaces that address's oldest handshake; with none, it is refused."""
    base, client = dirs
    other = FLOOD_SOURCES[0]
    with _core.TransferServer(base, SECRET, io_timeout_s=10.0, max_connections_per_peer=2, max_connections=3,
                              allowed_peers=[HOST, other]) as srv:
        first, second = connect_from(other, srv.port), connect_from(other, srv.port)
        wait_for(srv, "two handshakes", lambda s: s["handshaking"] == 2)
        third = connect_from(other, srv.port)
        assert closed_without_a_word(first)  # the oldest of that address
        stats = wait_for(srv, "one displaced", lambda s: s["handshakes_dropped"] == 1 and s["handshaking"] == 2)
        assert still_open(second) and still_open(third), stats

        # 127.0.0.1 holds two authenticated pushes, each stalled in a worker after its request ...
        held = [peer.client_handshake(connect_from(HOST, srv.port), SECRET) for _ in range(2)]
        for i, session in enumerate(held):
            session.send_request(peer.OP_PUSH, f"stalled-{i}.fpo".encode(), 1 << 20)
            assert session.recv_response()[0] == peer.OK
        wait_for(srv, "two admitted", lambda s: s["handshakes_ok"] == 2)
        write_object(client, "o.fpo", b"payload")
        with pytest.raises(_core.TransferError):  # closed at accept(): EOF or reset, whichever arrives first
            _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo", retries=0)
        stats = wait_for(srv, "one refusal", lambda s: s["rejected_peer_cap"] == 1)
        assert stats["handshaking"] == 2 and stats["handshakes_dropped"] == 1, stats
        assert not (base / "o.fpo").exists()
        # ... while the other address still gets through (displacing its own stalled handshake).
        with peer.client_handshake(connect_from(other, srv.port), SECRET, rank=1) as session:  # another rank
            session.send_request(peer.OP_FETCH, b"missing.fpo", 0)
            assert session.recv_response()[0] == peer.NOT_FOUND
        assert closed_without_a_word(second)
        # Once 127.0.0.1's connections end, its places are free again.
        for session in held:
            session.close()
        _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo", retries=5, backoff_s=0.05)
        assert (base / "o.fpo").read_bytes() == b"payload"
        third.close()


def test_a_full_stage_displaces_the_busiest_address_not_a_lone_peer(dirs):
    """Room for 4 handshakes: one address's connections displace each other, never the lone peer's."""
    base, _ = dirs
    busy = FLOOD_SOURCES[0]
    with _core.TransferServer(base, SECRET, io_timeout_s=10.0, max_handshakes=4) as srv:
        crowd = [connect_from(busy, srv.port) for _ in range(3)]
        member = connect_from(HOST, srv.port)
        reply = hello_then_wait(member)
        crowd += [connect_from(busy, srv.port) for _ in range(10)]
        # The counters are separate atomics: a displacement counts before its newcomer joins the stage.
        stats = wait_for(srv, "ten displaced, four handshaking",
                         lambda s: s["handshakes_dropped"] == 10 and s["handshaking"] == 4)
        assert stats["handshakes_dropped"] == 10 and stats["handshaking"] == 4, stats
        assert all(closed_without_a_word(s) for s in crowd[:10])  # the oldest ten of the busy address
        assert all(still_open(s) for s in crowd[10:])
        session = prove(member, reply)
        session.send_request(peer.OP_FETCH, b"missing.fpo", 0)
        assert session.recv_response()[0] == peer.NOT_FOUND
        member.close()
        for s in crowd:
            s.close()


def test_the_rank_proved_in_the_stage_is_the_rank_the_policy_checks(shm_dir):
    """Rank 1's server of a job of two one-rank nodes, where rank 0 replicates to rank 1.

    The stage authenticates the client's rank and hands it to the worker with the connection:
    rank 0's push of its object lands (its request sent in the same segment as its proof, which
    the stage must leave unread), the same push proved as rank 1 is refused by the policy, and
    rank 2, outside the job, is refused in the stage without reaching a worker.
    """
    base = shm_dir / "node-1"
    (base / "step-3").mkdir(parents=True)
    (base / version_relpath(3, object_name(1))).write_bytes(b"rank 1's own object")  # this node saved step 3
    obj = version_relpath(3, object_name(0))
    data = os.urandom(100 * KiB)
    policy = transfer_policy(NodeTopology((0, 1), rank=1), 2)
    with _core.TransferServer(base, SECRET, rank=1, policy=policy, io_timeout_s=5.0) as srv:
        with connect_from(HOST, srv.port) as sock:
            proof, session = proof_for(sock, hello_then_wait(sock, rank=0), rank=0)
            request = peer.request(peer.OP_PUSH, obj.encode(), len(data))
            sock.sendall(proof + session.frame(peer.FRAME_REQUEST, request))
            assert session.recv_response()[0] == peer.OK
            session.send_data(data)
            sock.sendall(session.trailer(len(data), peer.crc32c(data)))
            assert session.recv_response()[0] == peer.OK
        assert (base / obj).read_bytes() == data

        with connect_from(HOST, srv.port) as sock:
            session = prove(sock, hello_then_wait(sock, rank=1), rank=1)
            session.send_request(peer.OP_PUSH, obj.encode(), len(data))
            status, _, message = session.recv_response()
            assert status == peer.FORBIDDEN and "rank 1 replicates nothing to this rank" in message, message

        with connect_from(HOST, srv.port) as sock:
            prove(sock, hello_then_wait(sock, rank=2), rank=2)
            assert closed_without_a_word(sock)
        stats = wait_for(srv, "the refusal of rank 2", lambda s: s["auth_failures"] == 1)
        assert stats["handshakes_ok"] == 2 and stats["pushes_ok"] == 1 and stats["forbidden"] == 1, stats
        errors = srv.errors()
        assert any("authenticated as rank 2, but the job has 2 ranks" in e for e in errors), errors


def test_allowed_peers_argument(dirs):
    base, client = dirs
    with _core.TransferServer(base, SECRET) as srv:
        assert srv.allowed_peers is None  # any address
        srv.allowed_peers = ["::ffff:127.0.0.1", "::1", "fe80::1%lo", "127.0.0.1"]
        assert srv.allowed_peers == ["::1", "127.0.0.1", "fe80::1"]
        with pytest.raises(ValueError, match="not a numeric IPv4 or IPv6 address: 'node-1'"):
            srv.allowed_peers = ["127.0.0.1", "node-1"]
        assert srv.allowed_peers == ["::1", "127.0.0.1", "fe80::1"]  # unchanged
        with pytest.raises(ValueError, match="not a numeric"):
            srv.allowed_peers = ["127.0.0.1\x00junk"]
        with pytest.raises(TypeError):
            srv.allowed_peers = "127.0.0.1"
        write_object(client, "o.fpo", b"x")
        srv.allowed_peers = ["127.0.0.9"]
        with pytest.raises(_core.TransferError):
            _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo", retries=0)
        assert srv.stats()["rejected_not_allowed"] == 1
        srv.allowed_peers = None
        _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo", retries=0)
    for kwargs in ({"handshake_timeout_s": 0}, {"max_handshakes": 0}, {"max_connections_per_peer": 0},
                   {"allowed_peers": ["localhost"]}):
        with pytest.raises(ValueError):
            _core.TransferServer(base, SECRET, **kwargs)


# --- the replication service ------------------------------------------------------------------


NODE_ADDRESSES = ["10.11.0.5", "10.11.0.6", "fd00:11::7"]  # a job's nodes on their network (never this host)


def test_loopback_is_allowed_only_when_the_job_advertises_loopback():
    """A blanket loopback allow would let any local user of a shared node in; only single-node jobs need it."""
    assert allowed_peer_addresses(NODE_ADDRESSES) == sorted(NODE_ADDRESSES)
    for loopback in ("127.0.0.3", "127.0.1.1", "::1", "::ffff:127.0.0.9", "localhost"):
        allowed = allowed_peer_addresses([*NODE_ADDRESSES, loopback])
        assert set(LOOPBACK_PEERS) <= set(allowed) and set(NODE_ADDRESSES) <= set(allowed), (loopback, allowed)
    assert allowed_peer_addresses(["127.0.0.3", "127.0.0.4"]) == ["127.0.0.1", "127.0.0.3", "127.0.0.4", "::1"]
    assert [a for a in ("127.0.0.1", "127.255.0.1", "::1", "::ffff:127.0.0.1") if not is_loopback(a)] == []
    assert [a for a in ("10.0.0.1", "fd00::1", "::ffff:10.0.0.1", "0.0.0.0", "::", "node-1") if is_loopback(a)] == []


@pytest.mark.parametrize("source", ["127.0.0.1", "::1"])
def test_loopback_is_refused_when_the_job_lists_only_node_addresses(dirs, source):
    """The list the service builds for a job of node addresses: a local process on loopback is refused at accept()."""
    base, client = dirs
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    with _core.TransferServer(base, SECRET, host=source, io_timeout_s=5.0,
                              allowed_peers=allowed_peer_addresses(NODE_ADDRESSES)) as srv:
        assert not any(is_loopback(a) for a in srv.allowed_peers), srv.allowed_peers
        with socket.socket(family, socket.SOCK_STREAM) as local:
            local.bind((source, 0))
            local.connect((source, srv.port))
            assert closed_without_a_word(local)
        write_object(client, "o.fpo", b"x")
        with pytest.raises(_core.TransferError):
            _core.transfer_push(source, srv.port, SECRET, client, "o.fpo", retries=0)
        stats = wait_for(srv, "two refusals", lambda s: s["rejected_not_allowed"] == 2)
        assert stats["handshakes_ok"] == 0 and not (base / "o.fpo").exists(), stats
        # The same job with one rank on loopback (a single-node run) lets this node's loopback in.
        srv.allowed_peers = allowed_peer_addresses([*NODE_ADDRESSES, "127.0.0.3"])
        _core.transfer_push(source, srv.port, SECRET, client, "o.fpo", retries=0)
        assert (base / "o.fpo").read_bytes() == b"x"


@pytest.mark.parametrize("restrict", [True, False])
def test_the_service_admits_the_gathered_addresses_only(shm_dir, restrict):
    """Two ranks bound to 127.0.0.3 and 127.0.0.4 push to each other; a stranger at 127.0.0.2 is refused.

    The ranks advertise loopback addresses (one node), so the list also holds 127.0.0.1 and ::1.
    """
    outputs = run_world("admission_scenarios", "allow_list_of_the_job", 2,
                        {"root": str(shm_dir), "restrict": restrict}, timeout=90)
    for rank, out in enumerate(outputs):
        expected = ["::1", "127.0.0.1", "127.0.0.3", "127.0.0.4"] if restrict else None
        assert f"ALLOWED {expected}" in out, out
        assert f"RECEIVED from rank {1 - rank}" in out, out
        assert ("STRANGER closed 1" if restrict else "STRANGER held 0") in out, out
