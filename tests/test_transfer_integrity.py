"""Protocol v3: everything after the handshake is authenticated (AES-256-GMAC tags) (docs/protocol.md, docs/security.md).

A real relay (a socket proxy thread that does not know the secret) sits between a real C++
client and a real TransferServer. It forwards the handshake untouched, then tampers with one
message: the request path, a data byte, a whole chunk, a response status or the trailer. Every
case must end in TransferIntegrityError on the side that detects it, with the target untouched
and no temporary file left; an honest relay must still work. On protocol v1 the path rewrite
landed attacker-routed bytes in step-5/COMMIT and the push reported success.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from ml_flashpoint_nemo import _core
from tests.support import transfer_peer as peer
from tests.support.server_errors import wait_for_error

SECRET = b"job-secret-0123456789abcdef"
HOST = "127.0.0.1"
KiB = 1 << 10
CLIENT_HELLO, CLIENT_PROOF = 48, 32
HANDSHAKE_S2C = 80  # server hello
COMMIT_BYTES = b'{"step": 5, "objects": ["rank-00000-0.fpo"]}\n'


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    return peer.recv_exact(sock, n)


class Relay:
    """Forwards one connection between a client and upstream, message by message, letting a
    tamper hook rewrite each (kind, index, bytes) on the way. It never knows the secret."""

    def __init__(self, upstream_port: int, tamper: Callable[[str, int, bytes], bytes | None]):
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        self.tamper = tamper
        self.op: int | None = None
        self.push_size = 0
        self.request_seen = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _send(self, sock: socket.socket, kind: str, index: int, raw: bytes) -> None:
        out = self.tamper(kind, index, raw)
        if out is None:
            raise _Cut()
        sock.sendall(out)

    def _chunks(self, src: socket.socket, dst: socket.socket, size: int, kind: str) -> None:
        done = i = 0
        while done < size:
            n = min(peer.CHUNK, size - done)
            self._send(dst, kind, i, _recv_exact(src, n + peer.TAG))
            done += n
            i += 1
        self._send(dst, kind.replace("data", "trailer"), 0, _recv_exact(src, 16 + peer.TAG))

    def _client_to_server(self, c: socket.socket, s: socket.socket) -> None:
        s.sendall(_recv_exact(c, CLIENT_HELLO))  # the proof follows only after the server's hello
        s.sendall(_recv_exact(c, CLIENT_PROOF))
        head = _recv_exact(c, 24)
        op, path_len, size, _, _ = struct.unpack("<IIQII", head)
        raw = head + _recv_exact(c, path_len + peer.TAG)
        self.op, self.push_size = op, size
        self.request_seen.set()
        self._send(s, "request", 0, raw)
        if op == peer.OP_PUSH:
            self._chunks(c, s, size, "push-data")
        self._pump(c, s)

    def _server_to_client(self, s: socket.socket, c: socket.socket) -> None:
        c.sendall(_recv_exact(s, HANDSHAKE_S2C))
        for i in range(2):
            head = _recv_exact(s, 16)
            status, msg_len, value = struct.unpack("<IIQ", head)
            self._send(c, "response", i, head + _recv_exact(s, msg_len + peer.TAG))
            self.request_seen.wait(10)
            if self.op == peer.OP_FETCH:
                if status == peer.OK:
                    self._chunks(s, c, value, "fetch-data")
                break
            if status != peer.OK:
                break
        self._pump(s, c)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(65536):
            dst.sendall(data)

    def _run(self) -> None:
        try:
            c, _ = self.listener.accept()
        except OSError:
            return
        s = socket.create_connection((HOST, self.upstream_port))
        c.settimeout(20)
        s.settimeout(20)

        def direction(fn, a, b):
            try:
                fn(a, b)
            except _Cut:
                pass
            except (OSError, ConnectionError) as e:
                self.errors.append(e)
            finally:
                for sock in (b,):
                    try:
                        sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass

        t = threading.Thread(target=direction, args=(self._server_to_client, s, c), daemon=True)
        t.start()
        direction(self._client_to_server, c, s)
        t.join(20)
        c.close()
        s.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(20)


class _Cut(Exception):
    """The tamper hook ended the stream here."""


def only(kind: str, index: int, change: Callable[[bytes], bytes]) -> Callable[[str, int, bytes], bytes]:
    def tamper(k: str, i: int, raw: bytes) -> bytes:
        return change(raw) if (k, i) == (kind, index) else raw
    return tamper


def rewrite_path(raw: bytes) -> bytes:
    """The attack of issue 13: same size and tag, another path (step-5/COMMIT)."""
    _, path_len, size, flags, reserved = struct.unpack("<IIQII", raw[:24])
    new_path = b"step-5/COMMIT"
    return struct.pack("<IIQII", peer.OP_PUSH, len(new_path), size, flags, reserved) + new_path + raw[-peer.TAG:]


def flip_byte(offset: int) -> Callable[[bytes], bytes]:
    def change(raw: bytes) -> bytes:
        b = bytearray(raw)
        b[offset] ^= 0x01
        return bytes(b)
    return change


def status_to(status: int) -> Callable[[bytes], bytes]:
    def change(raw: bytes) -> bytes:
        return struct.pack("<I", status) + raw[4:]
    return change


def swap_chunks(first: int, second: int) -> Callable[[str, int, bytes], bytes]:
    """Sends chunk second (with its own tag) before chunk first."""
    held: list[bytes] = []

    def tamper(k: str, i: int, raw: bytes) -> bytes:
        if (k, i) == ("push-data", first):
            held.append(raw)
            return b""
        if (k, i) == ("push-data", second):
            return raw + held.pop()
        return raw
    return tamper


def truncated_tag(raw: bytes) -> bytes:
    """The trailer with its tag cut to half its length, padded back to length with zeros."""
    half = peer.TAG // 2
    return raw[: 16 + half] + bytes(peer.TAG - half)


@pytest.fixture
def dirs(shm_dir: Path):
    server, client = shm_dir / "server", shm_dir / "client"
    server.mkdir()
    client.mkdir()
    (server / "step-5").mkdir()
    (server / "step-5" / "COMMIT").write_bytes(COMMIT_BYTES)
    return server, client


@pytest.fixture
def server(dirs):
    with _core.TransferServer(dirs[0], SECRET, io_timeout_s=5, max_connections=2) as srv:
        yield srv


def leftovers(root: Path) -> list[str]:
    return [str(Path(d) / f) for d, _, fs in os.walk(root) for f in fs if f.startswith(".xfer-")]


def push_through(relay: Relay, client: Path, rel: str, data: bytes):
    (client / rel).parent.mkdir(parents=True, exist_ok=True)
    (client / rel).write_bytes(data)
    return _core.transfer_push(HOST, relay.port, SECRET, client, rel, retries=0, io_timeout_s=5)


OBJ = "step-7/rank-00000-0.fpo"
DATA = os.urandom(3 * peer.CHUNK + 1234)  # 4 chunks, the last one short


def assert_nothing_landed(server_base: Path) -> None:
    assert (server_base / "step-5" / "COMMIT").read_bytes() == COMMIT_BYTES
    assert not (server_base / "step-7" / "rank-00000-0.fpo").exists()
    deadline = time.monotonic() + 5
    while leftovers(server_base) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert leftovers(server_base) == []


@pytest.mark.parametrize("tamper", [
    pytest.param(only("request", 0, rewrite_path), id="a-request-path-to-step-5-COMMIT"),
    pytest.param(only("push-data", 3, flip_byte(100)), id="b-flip-one-data-byte"),
    pytest.param(lambda k, i, raw: b"" if (k, i) == ("push-data", 1) else raw, id="c-drop-a-chunk"),
    pytest.param(lambda k, i, raw: raw + raw if (k, i) == ("push-data", 0) else raw, id="c-duplicate-a-chunk"),
    pytest.param(None, id="c-swap-two-chunks"),
    pytest.param(only("push-trailer", 0, truncated_tag), id="e-truncated-trailer-tag"),
    pytest.param(only("push-trailer", 0, flip_byte(0)), id="e-trailer-claims-another-length"),
])
def test_server_detects_tampering_and_stores_nothing(dirs, server, tamper):
    server_base, client = dirs
    tamper = tamper or swap_chunks(1, 2)
    relay = Relay(server.port, tamper)
    try:
        with pytest.raises(_core.TransferIntegrityError, match="tampered with or corrupted"):
            push_through(relay, client, OBJ, DATA)
    finally:
        relay.close()
    errors = wait_for_error(server, "tampered with")
    assert server.stats()["integrity_failures"] >= 1, errors
    assert server.stats()["pushes_ok"] == 0
    assert_nothing_landed(server_base)


def test_client_detects_a_rewritten_response_status(dirs, server):
    """(d) The server's "ready" turned into a refusal: the client notices before sending data."""
    server_base, client = dirs
    relay = Relay(server.port, only("response", 0, status_to(peer.PATH_REFUSED)))
    try:
        with pytest.raises(_core.TransferIntegrityError, match="response"):
            push_through(relay, client, OBJ, DATA)
    finally:
        relay.close()
    wait_for_error(server, "closed by the peer")
    assert_nothing_landed(server_base)


def test_client_detects_a_forged_final_status(dirs, server):
    """(d) A refusal rewritten into "stored": the client does not report a success."""
    server_base, client = dirs
    (server_base / "step-7").write_bytes(b"a file where a directory is needed")  # the push is refused
    relay = Relay(server.port, only("response", 0, status_to(peer.OK)))
    try:
        with pytest.raises(_core.TransferIntegrityError):
            push_through(relay, client, OBJ, DATA)
    finally:
        relay.close()
    assert (server_base / "step-7").read_bytes() == b"a file where a directory is needed"
    assert leftovers(server_base) == []


@pytest.mark.parametrize("tamper", [
    pytest.param(only("fetch-data", 1, flip_byte(7)), id="flip-one-byte"),
    pytest.param(lambda k, i, raw: b"" if (k, i) == ("fetch-data", 0) else raw, id="drop-a-chunk"),
    pytest.param(only("fetch-trailer", 0, truncated_tag), id="truncated-trailer-tag"),
    pytest.param(only("response", 0, lambda raw: raw[:8] + struct.pack("<Q", 10) + raw[16:]),
                 id="response-size-rewritten"),
])
def test_fetching_client_detects_tampering_and_keeps_nothing(dirs, server, tamper):
    server_base, client = dirs
    (server_base / "step-7").mkdir()
    (server_base / OBJ).write_bytes(DATA)
    relay = Relay(server.port, tamper)
    try:
        with pytest.raises(_core.TransferIntegrityError, match="tampered with or corrupted"):
            _core.transfer_fetch(HOST, relay.port, SECRET, OBJ, client, retries=0, io_timeout_s=5)
    finally:
        relay.close()
    assert not (client / OBJ).exists()
    assert leftovers(client) == []
    assert (server_base / OBJ).read_bytes() == DATA


# Each field of a request, flipped by the relay: (offset in the request, bits to flip). The path
# (OBJ, 23 bytes) makes the length flips one shorter (the tag no longer lines up), longer (the
# server waits for bytes that never come) and beyond the bound (the tag cannot be found).
REQUEST_FLIPS = {
    "op": (0, 0x01),
    "path-length-shorter": (4, 0x01),
    "path-length-longer": (4, 0x08),
    "path-length-out-of-bounds": (7, 0x80),
    "size": (8, 0x01),
    "flags": (16, 0x01),
    "reserved": (20, 0x01),
    "path": (24, 0x01),
    "tag": (-1, 0x01),
}


@pytest.mark.parametrize("op", ["push", "fetch"])
@pytest.mark.parametrize("field", REQUEST_FLIPS)
def test_every_flipped_request_field_is_tampering_and_gets_no_other_answer(dirs, op, field):
    """Tag before action: the server checks a request's tag before it uses any field of it, so a relay
    without the secret learns nothing from the answers (before: an authentic BAD_REQUEST, which the
    client reported as a refusal) and the client sees TransferIntegrityError; nothing is stored."""
    server_base, client = dirs
    assert len(OBJ) == 23
    offset, bits = REQUEST_FLIPS[field]
    statuses: list[int] = []

    def tamper(kind: str, index: int, raw: bytes) -> bytes:
        if kind == "response":
            statuses.append(struct.unpack("<I", raw[:4])[0])
        return flip_bits(raw, offset, bits) if (kind, index) == ("request", 0) else raw

    if op == "fetch":
        (server_base / "step-7").mkdir()
        (server_base / OBJ).write_bytes(DATA)
    with _core.TransferServer(server_base, SECRET, io_timeout_s=5, request_timeout_s=0.5) as srv:
        relay = Relay(srv.port, tamper)
        try:
            with pytest.raises(_core.TransferIntegrityError, match="tampered with or corrupted"):
                if op == "push":
                    push_through(relay, client, OBJ, DATA)
                else:
                    _core.transfer_fetch(HOST, relay.port, SECRET, OBJ, client, retries=0, io_timeout_s=5)
        finally:
            relay.close()
        stats = srv.stats()
        errors = srv.errors()
    assert statuses == [peer.INTEGRITY], (statuses, errors)
    assert stats["integrity_failures"] == 1 and stats["pushes_ok"] == stats["fetches_ok"] == 0, stats
    assert not any("bad request" in e for e in errors), errors
    if op == "push":
        assert_nothing_landed(server_base)
    else:
        assert not (client / OBJ).exists() and leftovers(client) == []


def flip_bits(raw: bytes, offset: int, bits: int) -> bytes:
    b = bytearray(raw)
    b[offset] ^= bits
    return bytes(b)


def test_an_honest_relay_still_works(dirs, server):
    server_base, client = dirs
    relay = Relay(server.port, lambda k, i, raw: raw)
    try:
        r = push_through(relay, client, OBJ, DATA)
    finally:
        relay.close()
    assert r["nbytes"] == len(DATA)
    assert (server_base / OBJ).read_bytes() == DATA
    relay = Relay(server.port, lambda k, i, raw: raw)
    try:
        _core.transfer_fetch(HOST, relay.port, SECRET, OBJ, client, "back.fpo", retries=0, io_timeout_s=5)
    finally:
        relay.close()
    assert (client / "back.fpo").read_bytes() == DATA
    assert server.stats()["integrity_failures"] == 0


def test_a_trailer_cut_off_by_a_closed_connection_stores_nothing(dirs, server):
    """A stream that simply ends looks like a peer that died: an ordinary transfer error, no file."""
    server_base, client = dirs

    def cut(k: str, i: int, raw: bytes) -> bytes | None:
        if k == "push-trailer":
            return None  # the relay closes towards the server instead of sending it
        return raw
    relay = Relay(server.port, cut)
    try:
        with pytest.raises(_core.TransferError):
            push_through(relay, client, OBJ, DATA)
    finally:
        relay.close()
    wait_for_error(server, "closed by the peer")
    assert_nothing_landed(server_base)


def test_every_server_hello_carries_a_fresh_nonce(server):
    """The server's 32-byte handshake nonce (libcrypto's RAND_bytes) is new on every connection."""
    seen = set()
    for _ in range(8):
        with peer.connect(HOST, server.port) as s:
            s.sendall(peer.MAGIC + struct.pack("<II", peer.VERSION, 0) + os.urandom(32))
            seen.add(peer.recv_exact(s, 80)[16:48])
    assert len(seen) == 8 and bytes(32) not in seen


@pytest.mark.parametrize("old", [1, 2], ids=["v1-unauthenticated", "v2-hmac-sha256-tags"])
def test_older_peers_are_refused_with_a_clear_message(dirs, server, old):
    """v1 (nothing authenticated after the handshake) and v2 (HMAC-SHA256 tags, no rank
    identities) both ways."""
    with peer.connect(HOST, server.port) as s:  # an older client
        s.sendall(peer.MAGIC + struct.pack("<II", old, 0) + os.urandom(32))
        hello = peer.recv_exact(s, 80)
        assert struct.unpack("<I", hello[8:12])[0] == peer.VERSION == 3  # it learns what we speak
    wait_for_error(server, f"unsupported protocol version {old} from the client")
    listener = socket.create_server((HOST, 0))  # an older server

    def old_server():
        conn, _ = listener.accept()
        with conn:
            try:
                peer.server_handshake(conn, SECRET, version=old)
            except (OSError, peer.HandshakeFailed):
                pass
    t = threading.Thread(target=old_server, daemon=True)
    t.start()
    try:
        with pytest.raises(_core.TransferError, match=f"unsupported protocol version {old} from the server.*same "
                                                      "ml_flashpoint_nemo version"):
            _core.transfer_fetch(HOST, listener.getsockname()[1], SECRET, OBJ, dirs[1], retries=0, io_timeout_s=5)
    finally:
        t.join(10)
        listener.close()
