"""A second, independent implementation of the transfer protocol (docs/protocol.md; C++ in csrc/transfer_wire.cpp), in Python.

Tests use it to play peers the C++ code must not trust: one that corrupts a byte but sends the
CRC32C of the original data, one that sends half an object and stalls or dies, one that sends
hostile request fields. Besides the standard library it uses only the `cryptography` package's
AES-256-GCM for its tags (another binding of a reviewed library than the extension's), so a
subprocess running it starts fast.

Run as a script, it is the "peer killed mid-transfer" helper:

    python -m tests.support.transfer_peer push-half HOST PORT SECRET_HEX PATH SIZE [RANK]

authenticates (as RANK, default 0, to a server of rank 0), announces a PUSH of SIZE bytes,
sends half of them, prints HALF and sleeps until killed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"MLFPXFR\0"
VERSION = 3
RANK_KEY_LABEL = b"mlfp-xfer-v3 rank"
SERVER_LABEL = b"mlfp-xfer-v3 server"
CLIENT_LABEL = b"mlfp-xfer-v3 client"
SESSION_LABEL = b"mlfp-xfer-v3 session"
KEY_CLIENT_TO_SERVER = b"mlfp-xfer-v3 key client->server"
KEY_SERVER_TO_CLIENT = b"mlfp-xfer-v3 key server->client"
OP_PUSH, OP_FETCH = 1, 2
OK, BAD_REQUEST, PATH_REFUSED, TOO_LARGE, NOT_FOUND, CHECKSUM, IO_ERROR, INTEGRITY, FORBIDDEN, NO_SPACE = range(10)
FRAME_REQUEST, FRAME_RESPONSE, FRAME_DATA, FRAME_TRAILER = 1, 2, 3, 4
CLIENT_TO_SERVER, SERVER_TO_CLIENT = 1, 2  # the first byte of a tag's nonce
TRAILER_MAGIC = 0x21444E45
CHUNK = 256 << 10
TAG = 16  # AES-256-GMAC


class HandshakeFailed(Exception):
    pass


class TagMismatch(Exception):
    pass


def crc32c(data: bytes, crc: int = 0) -> int:
    from ml_flashpoint_nemo import _core  # the fast one; the tests check it against a reference

    return _core.crc32c(data, crc)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def mac(secret: bytes, label: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(secret, label + nonce_c + nonce_s, hashlib.sha256).digest()


def rank_key(secret: bytes, rank: int) -> bytes:
    """The key that proves a rank: HMAC-SHA256(secret, label || u32 rank)."""
    return hmac.new(secret, RANK_KEY_LABEL + struct.pack("<I", rank), hashlib.sha256).digest()


def transcript(client_rank: int, server_rank: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return struct.pack("<II", client_rank, server_rank) + nonce_c + nonce_s


def session_secret(client_key: bytes, server_key: bytes, transcript_bytes: bytes) -> bytes:
    """Keyed by both ranks' keys; the direction keys derive from it (Session)."""
    return hmac.new(client_key + server_key, SESSION_LABEL + transcript_bytes, hashlib.sha256).digest()


def connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def nonce(direction: int, kind: int, seq: int) -> bytes:
    """A message's GMAC nonce: u8 direction, u8 kind, u16 zero, u64 sequence number (little-endian)."""
    return struct.pack("<BBHQ", direction, kind, 0, seq)


class _Tagger:
    """One direction's GMAC key: AES-256-GCM with the message as additional data and nothing to encrypt."""

    def __init__(self, key: bytes, direction: int):
        self.aead = AESGCM(key)
        self.direction = direction

    def tag(self, seq: int, kind: int, body: bytes) -> bytes:
        return self.aead.encrypt(nonce(self.direction, kind, seq), b"", body)


class Session:
    """An authenticated connection after the handshake: every message carries an AES-256-GMAC tag
    whose nonce holds its direction, its kind and its direction's sequence number (docs/protocol.md)."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce_c: bytes, nonce_s: bytes, is_client: bool):
        self.sock = sock
        c2s = _Tagger(mac(secret, KEY_CLIENT_TO_SERVER, nonce_c, nonce_s), CLIENT_TO_SERVER)
        s2c = _Tagger(mac(secret, KEY_SERVER_TO_CLIENT, nonce_c, nonce_s), SERVER_TO_CLIENT)
        self._send, self._recv = (c2s, s2c) if is_client else (s2c, c2s)
        self.send_seq = self.recv_seq = 0

    # socket-like, so tests can treat a Session as the connection
    def sendall(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def frame(self, kind: int, body: bytes) -> bytes:
        """body + its tag, consuming one send sequence number."""
        tag = self._send.tag(self.send_seq, kind, body)
        self.send_seq += 1
        return body + tag

    def check(self, kind: int, body: bytes, tag: bytes) -> None:
        expected = self._recv.tag(self.recv_seq, kind, body)
        self.recv_seq += 1
        if not hmac.compare_digest(expected, tag):
            raise TagMismatch(f"tag of a kind-{kind} message does not match")

    def send_request(self, op: int, path: bytes, size: int, *, path_len: int | None = None, flags: int = 0) -> None:
        self.sock.sendall(self.frame(FRAME_REQUEST, request(op, path, size, path_len=path_len, flags=flags)))

    def send_response(self, status: int, value: int = 0, msg: str = "") -> None:
        raw = msg.encode()
        self.sock.sendall(self.frame(FRAME_RESPONSE, struct.pack("<IIQ", status, len(raw), value) + raw))

    def recv_response(self) -> tuple[int, int, str]:
        head = recv_exact(self.sock, 16)
        status, msg_len, value = struct.unpack("<IIQ", head)
        raw = recv_exact(self.sock, msg_len)
        self.check(FRAME_RESPONSE, head + raw, recv_exact(self.sock, TAG))
        return status, value, raw.decode("utf-8", "replace")

    def recv_request(self) -> tuple[int, bytes, int]:
        head = recv_exact(self.sock, 24)
        op, path_len, size, _, _ = struct.unpack("<IIQII", head)
        path = recv_exact(self.sock, path_len)
        self.check(FRAME_REQUEST, head + path, recv_exact(self.sock, TAG))
        return op, path, size

    def data(self, data: bytes) -> bytes:
        """The object's chunks, each followed by its tag (all tagged before any is sent: for small
        objects; larger ones go through send_data or data_frames)."""
        return b"".join(self.data_frames(data))

    def data_frames(self, data: bytes) -> Iterator[bytes]:
        """The object's chunks, each followed by its tag, tagged one at a time (pure-Python GMAC
        takes ~0.1 s per chunk: a peer that tagged everything first would let the receiver's
        io_timeout_s expire before its first byte)."""
        for i in range(0, len(data), CHUNK):
            yield self.frame(FRAME_DATA, data[i:i + CHUNK])

    def send_data(self, data: bytes, limit: int | None = None) -> None:
        """Sends the tagged chunks as they are tagged; with limit, only their first limit bytes."""
        for frame in self.data_frames(data):
            if limit is not None:
                if limit <= 0:
                    return
                frame = frame[:limit]
                limit -= len(frame)
            self.sock.sendall(frame)

    def recv_data(self, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            chunk = recv_exact(self.sock, min(CHUNK, size - len(out)))
            self.check(FRAME_DATA, chunk, recv_exact(self.sock, TAG))
            out += chunk
        return bytes(out)

    def trailer(self, nbytes: int, crc: int) -> bytes:
        return self.frame(FRAME_TRAILER, trailer(nbytes, crc))

    def recv_trailer(self) -> tuple[int, int]:
        body = recv_exact(self.sock, 16)
        self.check(FRAME_TRAILER, body, recv_exact(self.sock, TAG))
        nbytes, crc, _ = struct.unpack("<QII", body)
        return nbytes, crc


def client_handshake(sock: socket.socket, secret: bytes, rank: int = 0, peer_rank: int = 0, *,
                     proof_key: bytes | None = None) -> Session:
    """Authenticate as rank to a server that must prove peer_rank. proof_key: the key the proof is
    made with (default: rank's own) - another rank's key plays a member claiming a rank it is not."""
    nonce_c = os.urandom(32)
    sock.sendall(MAGIC + struct.pack("<II", VERSION, rank) + nonce_c)
    reply = recv_exact(sock, 80)
    if reply[:8] != MAGIC:
        raise HandshakeFailed("bad magic from server")
    server_rank = struct.unpack("<I", reply[12:16])[0]
    if server_rank != peer_rank:
        raise HandshakeFailed(f"the server is rank {server_rank}, not {peer_rank}")
    nonce_s, server_mac = reply[16:48], reply[48:80]
    t = transcript(rank, peer_rank, nonce_c, nonce_s)
    client_key, server_key = rank_key(secret, rank), rank_key(secret, peer_rank)
    if not hmac.compare_digest(server_mac, hmac.new(server_key, SERVER_LABEL + t, hashlib.sha256).digest()):
        raise HandshakeFailed("server proof does not match our secret")
    sock.sendall(hmac.new(proof_key or client_key, CLIENT_LABEL + t, hashlib.sha256).digest())
    return Session(sock, session_secret(client_key, server_key, t), nonce_c, nonce_s, is_client=True)


def server_handshake(sock: socket.socket, secret: bytes, version: int = VERSION, rank: int = 0, *,
                     proof_key: bytes | None = None) -> Session:
    """Serve as rank; the client's rank is whatever its hello names (its proof must match it).
    proof_key: the key the server's proof is made with (default: rank's own)."""
    hello = recv_exact(sock, 48)
    if hello[:8] != MAGIC:
        raise HandshakeFailed("bad magic from client")
    client_rank = struct.unpack("<I", hello[12:16])[0]
    nonce_c = hello[16:48]
    nonce_s = os.urandom(32)
    t = transcript(client_rank, rank, nonce_c, nonce_s)
    client_key, server_key = rank_key(secret, client_rank), rank_key(secret, rank)
    server_mac = hmac.new(proof_key or server_key, SERVER_LABEL + t, hashlib.sha256).digest()
    sock.sendall(MAGIC + struct.pack("<II", version, rank) + nonce_s + server_mac)
    proof = recv_exact(sock, 32)
    if not hmac.compare_digest(proof, hmac.new(client_key, CLIENT_LABEL + t, hashlib.sha256).digest()):
        raise HandshakeFailed("client proof does not match")
    return Session(sock, session_secret(client_key, server_key, t), nonce_c, nonce_s, is_client=False)


def request(op: int, path: bytes, size: int, *, path_len: int | None = None, flags: int = 0) -> bytes:
    """A request's bytes without its tag (Session.send_request adds it)."""
    n = len(path) if path_len is None else path_len
    return struct.pack("<IIQII", op, n, size, flags, 0) + path


def trailer(nbytes: int, crc: int) -> bytes:
    """A trailer's bytes without its tag (Session.trailer adds it)."""
    return struct.pack("<QII", nbytes, crc, TRAILER_MAGIC)


def push(host: str, port: int, secret: bytes, path: str | bytes, data: bytes, *,
         corrupt_at: int | None = None, timeout: float = 10.0, rank: int = 0,
         peer_rank: int = 0) -> tuple[int, int, str]:
    """PUSH data; with corrupt_at, flips that byte before tagging (a sender whose memory is bad:
    the tags match, the CRC32C of the original data does not).

    Returns the server's final (status, value, message), or its refusal of the request."""
    raw_path = path.encode() if isinstance(path, str) else path
    with connect(host, port, timeout) as sock:
        s = client_handshake(sock, secret, rank, peer_rank)
        s.send_request(OP_PUSH, raw_path, len(data))
        ready = s.recv_response()
        if ready[0] != OK:
            return ready
        wire = bytearray(data)
        if corrupt_at is not None:
            wire[corrupt_at] ^= 0x40
        s.send_data(bytes(wire))
        sock.sendall(s.trailer(len(data), crc32c(data)))
        return s.recv_response()


def serve_one_fetch(listener: socket.socket, secret: bytes, data: bytes, *, corrupt_at: int | None = None,
                    stall_after: int | None = None, results: list | None = None) -> None:
    """Serve one FETCH from a C++ client: flips byte corrupt_at before tagging (keeping the
    original CRC), or stops sending after stall_after bytes and waits for the client to give up."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(30)
        try:
            s = server_handshake(conn, secret)
            s.recv_request()
            s.send_response(OK, len(data), "sending")
            wire = bytearray(data)
            if corrupt_at is not None:
                wire[corrupt_at] ^= 0x01
            if stall_after is not None:
                s.send_data(bytes(wire), limit=stall_after)
                conn.recv(1)  # returns once the client closes
                if results is not None:
                    results.append("client closed")
                return
            s.send_data(bytes(wire))
            conn.sendall(s.trailer(len(data), crc32c(data)))
            if results is not None:
                results.append(s.recv_response())
        except (OSError, HandshakeFailed, TagMismatch) as e:
            if results is not None:
                results.append(e)


def _push_half(host: str, port: int, secret_hex: str, path: str, size: int, rank: int = 0) -> None:
    sock = connect(host, port)
    s = client_handshake(sock, bytes.fromhex(secret_hex), rank)
    s.send_request(OP_PUSH, path.encode(), size)
    status, _, msg = s.recv_response()
    if status != OK:
        print(f"REFUSED {status} {msg}", flush=True)
        return
    block = b"\xab" * CHUNK
    left = size // 2
    while left > 0:
        n = min(left, len(block))
        sock.sendall(s.frame(FRAME_DATA, block[:n]))
        left -= n
    print("HALF", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    if len(sys.argv) in (7, 8) and sys.argv[1] == "push-half":
        _push_half(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]), *map(int, sys.argv[7:]))
    else:
        sys.exit(__doc__)
