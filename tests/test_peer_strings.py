"""Bytes a peer chooses reach Python text only as printable ASCII (issue 13, section 3).

A peer picks object names and the messages of its responses. Before, a name with byte 0xff
made TransferServer.errors() raise UnicodeDecodeError (and, inside keep_for_next_save, one
rank left its collective), and a "\\n" in a peer's message started a forged log line. The
bindings now escape every such string: printable ASCII stays, every other byte is \\xNN.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from ml_flashpoint_nemo import _core
from tests.support import transfer_peer as peer
from tests.support.server_errors import wait_for_error

SECRET = b"job-secret-0123456789abcdef"
HOST = "127.0.0.1"
FORGED = "\nCRITICAL root: forged line"


def printable(text: str) -> bool:
    return all(0x20 <= ord(c) < 0x7f for c in text)


@pytest.fixture
def server(shm_dir: Path):
    base = shm_dir / "server"
    base.mkdir()
    with _core.TransferServer(base, SECRET, io_timeout_s=2.0, max_connections=2) as srv:
        yield srv, base


def raw_request(srv, op: int, path: bytes, size: int = 0) -> tuple[int, int, str]:
    with peer.connect(HOST, srv.port, timeout=5) as sock:
        s = peer.client_handshake(sock, SECRET)
        s.send_request(op, path, size)
        return s.recv_response()


def test_fetching_a_name_with_byte_ff_then_errors_is_escaped_text(server):
    srv, _ = server
    status, _, _ = raw_request(srv, peer.OP_FETCH, b"step-1/rank-\xff.fpo")
    assert status == peer.NOT_FOUND
    errors = wait_for_error(srv, "rank-\\xff.fpo")  # raised UnicodeDecodeError before
    assert all(printable(e) for e in errors), errors


def test_pushing_a_name_with_byte_ff_and_a_newline_then_errors_is_escaped_text(server):
    srv, base = server
    # A directory component that is a file: the push is refused and the refusal names the path.
    (base / "step-1").write_bytes(b"not a directory")
    status, _, message = raw_request(srv, peer.OP_PUSH, b"step-1/\xff\nforged.fpo", 10)
    assert status != peer.OK
    errors = wait_for_error(srv, "\\xff\\x0aforged.fpo")
    assert all(printable(e) for e in errors), errors
    assert (base / "step-1").read_bytes() == b"not a directory"  # nothing was lost


def _serve_one_fetch_answering(listener: socket.socket, status: int, message: bytes) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        s = peer.server_handshake(conn, SECRET)
        s.recv_request()
        conn.sendall(s.frame(peer.FRAME_RESPONSE, peer.struct.pack("<IIQ", status, len(message), 0) + message))


@pytest.mark.parametrize("status", [peer.NOT_FOUND, peer.IO_ERROR, peer.PATH_REFUSED])
def test_a_peer_message_with_a_newline_and_byte_ff_is_escaped_in_the_exception(shm_dir, status):
    listener = socket.create_server((HOST, 0))
    thread = threading.Thread(target=_serve_one_fetch_answering,
                              args=(listener, status, b"gone \xff" + FORGED.encode()), daemon=True)
    thread.start()
    try:
        with pytest.raises(_core.TransferRefusedError) as caught:
            _core.transfer_fetch(HOST, listener.getsockname()[1], SECRET, "step-1/x.fpo", shm_dir, retries=0,
                                 io_timeout_s=5)
    finally:
        thread.join(10)
        listener.close()
    text = str(caught.value)
    assert printable(text), repr(text)
    assert "gone \\xff\\x0aCRITICAL root: forged line" in text
    assert not list(shm_dir.rglob("*x.fpo*")), "nothing may be stored from a refused fetch"


def test_a_clients_report_with_a_newline_is_escaped_in_errors(server):
    """A fetching peer's final status message lands in the server's errors(): escaped."""
    srv, base = server
    (base / "step-1").mkdir()
    (base / "step-1" / "obj.fpo").write_bytes(b"abc")
    with peer.connect(HOST, srv.port, timeout=5) as sock:
        s = peer.client_handshake(sock, SECRET)
        s.send_request(peer.OP_FETCH, b"step-1/obj.fpo", 0)
        status, size, _ = s.recv_response()
        assert status == peer.OK
        s.recv_data(size)
        s.recv_trailer()
        report = b"bad \xfe" + FORGED.encode()
        sock.sendall(s.frame(peer.FRAME_RESPONSE, peer.struct.pack("<IIQ", peer.CHECKSUM, len(report), 0) + report))
    errors = wait_for_error(srv, "bad \\xfe\\x0aCRITICAL root: forged line")
    assert all(printable(e) for e in errors), errors
    assert (base / "step-1" / "obj.fpo").read_bytes() == b"abc"
