"""A second, independent implementation of the transfer protocol (docs/protocol.md; C++ in csrc/transfer_wire.cpp), in Python.

Tests use it to play peers the C++ code must not trust: one that corrupts a byte but sends the
CRC32C of the original data, one that sends half an object and stalls or dies, one that sends
hostile request fields. It only uses the standard library, so a subprocess running it starts fast.

Run as a script, it is the "peer killed mid-transfer" helper:

    python -m tests.support.transfer_peer push-half HOST PORT SECRET_HEX PATH SIZE

authenticates, announces a PUSH of SIZE bytes, sends half of them, prints HALF and sleeps
until killed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import time

MAGIC = b"MLFPXFR\0"
VERSION = 1
SERVER_LABEL = b"mlfp-xfer-v1 server"
CLIENT_LABEL = b"mlfp-xfer-v1 client"
OP_PUSH, OP_FETCH = 1, 2
OK, BAD_REQUEST, PATH_REFUSED, TOO_LARGE, NOT_FOUND, CHECKSUM, IO_ERROR = range(7)
TRAILER_MAGIC = 0x21444E45


class HandshakeFailed(Exception):
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


def connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    nonce_c = os.urandom(32)
    sock.sendall(MAGIC + struct.pack("<II", VERSION, 0) + nonce_c)
    reply = recv_exact(sock, 80)
    if reply[:8] != MAGIC:
        raise HandshakeFailed("bad magic from server")
    nonce_s, server_mac = reply[16:48], reply[48:80]
    if not hmac.compare_digest(server_mac, mac(secret, SERVER_LABEL, nonce_c, nonce_s)):
        raise HandshakeFailed("server proof does not match our secret")
    sock.sendall(mac(secret, CLIENT_LABEL, nonce_c, nonce_s))


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    hello = recv_exact(sock, 48)
    if hello[:8] != MAGIC:
        raise HandshakeFailed("bad magic from client")
    nonce_c = hello[16:48]
    nonce_s = os.urandom(32)
    sock.sendall(MAGIC + struct.pack("<II", VERSION, 0) + nonce_s + mac(secret, SERVER_LABEL, nonce_c, nonce_s))
    proof = recv_exact(sock, 32)
    if not hmac.compare_digest(proof, mac(secret, CLIENT_LABEL, nonce_c, nonce_s)):
        raise HandshakeFailed("client proof does not match")


def request(op: int, path: bytes, size: int, *, path_len: int | None = None, flags: int = 0) -> bytes:
    n = len(path) if path_len is None else path_len
    return struct.pack("<IIQII", op, n, size, flags, 0) + path


def recv_response(sock: socket.socket) -> tuple[int, int, str]:
    status, msg_len, value = struct.unpack("<IIQ", recv_exact(sock, 16))
    return status, value, recv_exact(sock, msg_len).decode("utf-8", "replace")


def send_response(sock: socket.socket, status: int, value: int = 0, msg: str = "") -> None:
    raw = msg.encode()
    sock.sendall(struct.pack("<IIQ", status, len(raw), value) + raw)


def trailer(nbytes: int, crc: int) -> bytes:
    return struct.pack("<QII", nbytes, crc, TRAILER_MAGIC)


def push(host: str, port: int, secret: bytes, path: str | bytes, data: bytes, *,
         corrupt_at: int | None = None, timeout: float = 10.0) -> tuple[int, int, str]:
    """PUSH data; with corrupt_at, flips that byte on the wire but sends the CRC of the original.

    Returns the server's final (status, value, message), or its refusal of the request."""
    raw_path = path.encode() if isinstance(path, str) else path
    with connect(host, port, timeout) as sock:
        client_handshake(sock, secret)
        sock.sendall(request(OP_PUSH, raw_path, len(data)))
        ready = recv_response(sock)
        if ready[0] != OK:
            return ready
        wire = bytearray(data)
        if corrupt_at is not None:
            wire[corrupt_at] ^= 0x40
        sock.sendall(bytes(wire) + trailer(len(data), crc32c(data)))
        return recv_response(sock)


def serve_one_fetch(listener: socket.socket, secret: bytes, data: bytes, *, corrupt_at: int | None = None,
                    stall_after: int | None = None, results: list | None = None) -> None:
    """Serve one FETCH from a C++ client: flips byte corrupt_at (keeping the original CRC), or
    stops sending after stall_after bytes and waits for the client to give up."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(30)
        try:
            server_handshake(conn, secret)
            op, path_len, size, _, _ = struct.unpack("<IIQII", recv_exact(conn, 24))
            recv_exact(conn, path_len)
            send_response(conn, OK, len(data), "sending")
            wire = bytearray(data)
            if corrupt_at is not None:
                wire[corrupt_at] ^= 0x01
            if stall_after is not None:
                conn.sendall(bytes(wire[:stall_after]))
                conn.recv(1)  # returns once the client closes
                if results is not None:
                    results.append("client closed")
                return
            conn.sendall(bytes(wire) + trailer(len(data), crc32c(data)))
            if results is not None:
                results.append(recv_response(conn))
        except (OSError, HandshakeFailed) as e:
            if results is not None:
                results.append(e)


def _push_half(host: str, port: int, secret_hex: str, path: str, size: int) -> None:
    sock = connect(host, port)
    client_handshake(sock, bytes.fromhex(secret_hex))
    sock.sendall(request(OP_PUSH, path.encode(), size))
    status, _, msg = recv_response(sock)
    if status != OK:
        print(f"REFUSED {status} {msg}", flush=True)
        return
    block = b"\xab" * (1 << 20)
    left = size // 2
    while left > 0:
        n = min(left, len(block))
        sock.sendall(block[:n])
        left -= n
    print("HALF", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "push-half":
        _push_half(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
    else:
        sys.exit(__doc__)
