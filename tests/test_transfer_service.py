"""The TCP transfer service of ``_core`` (replication transport): real sockets, real processes.

Peers the C++ code must not trust are played by tests/support/transfer_peer.py, an independent
Python implementation of the protocol. After every hostile input the tests check that nothing
outside the base directory changed (a sentinel directory), that no partial object is visible,
that no hidden temporary file is left, and that the server still serves a legitimate push.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ml_flashpoint_nemo import _core
from tests.support import transfer_peer as peer
from tests.support.server_errors import wait_for_error

SECRET = b"job-secret-0123456789abcdef"
HOST = "127.0.0.1"
MiB = 1 << 20
IO_TIMEOUT = 1.0
REPO = Path(__file__).resolve().parents[1]


# --- helpers ----------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under root: files with their content hash, symlinks with their target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = (0, os.readlink(p))
            elif p.is_file():
                out[rel] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).digest())
            else:
                out[rel] = (-1, b"dir")
    return out


def hidden_files(root: Path) -> list[str]:
    return [str(Path(d) / f) for d, _, fs in os.walk(root) for f in fs if f.startswith(".")]


def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def count_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def dirs(shm_dir: Path):
    """(server base, client base, sentinel dir outside both) with a secret in the sentinel."""
    server = shm_dir / "server"
    client = shm_dir / "client"
    sentinel = shm_dir / "sentinel"
    for d in (server, client, sentinel):
        d.mkdir()
    (sentinel / "secret.txt").write_bytes(b"do not touch")
    return server, client, sentinel


@pytest.fixture
def server(dirs):
    base, _, _ = dirs
    with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT, handshake_timeout_s=IO_TIMEOUT,
                              max_connections=3, max_object_bytes=256 * MiB) as srv:
        yield srv


def write_object(base: Path, rel: str, data: bytes) -> Path:
    p = base / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def assert_still_serves(srv, client_base: Path, server_base: Path) -> None:
    data = os.urandom(4096 + 13)
    write_object(client_base, "check/ok.fpo", data)
    r = _core.transfer_push(HOST, srv.port, SECRET, client_base, "check/ok.fpo", retries=0, io_timeout_s=5)
    assert r["nbytes"] == len(data)
    assert (server_base / "check" / "ok.fpo").read_bytes() == data


@pytest.fixture
def hostile(dirs, server):
    """Runs a hostile scenario; afterwards checks confinement, leftovers and that the server still serves."""
    base, client, sentinel = dirs
    before = snapshot(sentinel)
    yield server, base, client, sentinel
    assert snapshot(sentinel) == before, "something outside the base directory changed"
    assert hidden_files(base) == [], "a temporary file was left behind"
    assert_still_serves(server, client, base)


def auth_sock(srv) -> peer.Session:
    s = peer.connect(HOST, srv.port, timeout=5)
    return peer.client_handshake(s, SECRET)


def assert_closed(s: socket.socket) -> None:
    """The server closed the connection (a close with unread input arrives as a reset)."""
    try:
        assert s.recv(100) == b""
    except ConnectionResetError:
        pass


# --- HMAC-SHA256 (libcrypto) --------------------------------------------------------------------

RFC4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b"),  # truncated to 128 bits
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size data. "
     b"The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key,msg,expected", RFC4231, ids=[f"case{i + 1}" for i in range(7)])
def test_hmac_sha256_rfc4231(key, msg, expected):
    assert _core.hmac_sha256(key, msg).hex()[: len(expected)] == expected


def test_hmac_sha256_agrees_with_the_standard_library():
    for n in (0, 1, 55, 56, 63, 64, 65, 119, 120, 1000, 4097):  # every SHA-256 padding boundary
        data = os.urandom(n)
        for key in (b"", os.urandom(1), os.urandom(n % 150), os.urandom(200)):  # empty and longer than a block
            assert _core.hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest(), (n, len(key))


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 3 * MiB + 7, 64 * MiB], ids=["empty", "1B", "3MiB", "64MiB"])
def test_push_and_fetch_round_trip(dirs, server, nbytes):
    base, client, _ = dirs
    data = os.urandom(nbytes) if nbytes < MiB else os.urandom(MiB) * (nbytes // MiB) + os.urandom(nbytes % MiB)
    write_object(client, "step-12/rank-00003-0.fpo", data)
    r = _core.transfer_push(HOST, server.port, SECRET, client, "step-12/rank-00003-0.fpo")
    assert r["nbytes"] == nbytes and r["crc32c"] == _core.crc32c(data) and r["attempts"] == 1
    assert (base / "step-12" / "rank-00003-0.fpo").read_bytes() == data  # step-12/ created on the server

    r = _core.transfer_fetch(HOST, server.port, SECRET, "step-12/rank-00003-0.fpo", client, "back/copy.fpo")
    assert r["nbytes"] == nbytes and r["crc32c"] == _core.crc32c(data)
    assert (client / "back" / "copy.fpo").read_bytes() == data
    assert hidden_files(base) == [] and hidden_files(client) == []
    deadline = time.monotonic() + 5  # the server counts the fetch once the client's ack arrived
    while server.stats()["fetches_ok"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = server.stats()
    assert stats["pushes_ok"] == 1 and stats["fetches_ok"] == 1
    assert server.errors() == []


def test_push_without_sendfile_and_from_fd(dirs, server):
    base, client, _ = dirs
    data = os.urandom(2 * MiB + 5)
    p = write_object(client, "a.fpo", data)
    _core.transfer_push(HOST, server.port, SECRET, client, "a.fpo", "copy/b.fpo", zero_copy=False)
    assert (base / "copy" / "b.fpo").read_bytes() == data
    with open(p, "rb") as f:
        r = _core.transfer_push_fd(HOST, server.port, SECRET, f.fileno(), "part.fpo", offset=4097, length=MiB)
        assert f.tell() == 0
    assert r["nbytes"] == MiB and (base / "part.fpo").read_bytes() == data[4097:4097 + MiB]
    # Replacing an existing object is atomic: the new content, nothing in between.
    _core.transfer_push(HOST, server.port, SECRET, client, "a.fpo", "part.fpo")
    assert (base / "part.fpo").read_bytes() == data


def test_fetch_missing_object_and_refused_local_paths(dirs, server):
    _, client, sentinel = dirs
    with pytest.raises(_core.TransferNotFoundError, match="nope"):
        _core.transfer_fetch(HOST, server.port, SECRET, "step-1/nope.fpo", client)
    # The client confines its own side too: the local destination and source paths.
    for bad in ("../sentinel/x", "/etc/passwd", "a//b", "a/./b", "a/b/", "", "a\0b"):
        with pytest.raises(_core.TransferPathError) as info:
            _core.transfer_fetch(HOST, server.port, SECRET, "x", client, bad)
        assert isinstance(info.value, ValueError) and "refused" in str(info.value)
    os.symlink(sentinel, client / "out")
    write_object(server_base := dirs[0], "obj", b"data")
    with pytest.raises(_core.TransferPathError, match="out"):
        _core.transfer_fetch(HOST, server.port, SECRET, "obj", client, "out/stolen")
    with pytest.raises(_core.TransferPathError, match="out"):
        _core.transfer_push(HOST, server.port, SECRET, client, "out/secret.txt")
    assert not (sentinel / "stolen").exists() and server_base.exists()


def test_tampering_pusher_is_refused(hostile):
    srv, base, _, _ = hostile
    data = os.urandom(MiB + 3)
    status, _, msg = peer.push(HOST, srv.port, SECRET, "step-1/obj.fpo", data, corrupt_at=12345)
    assert status == peer.CHECKSUM and "CRC32C mismatch" in msg
    assert not (base / "step-1" / "obj.fpo").exists()
    wait_for_error(srv, "CRC32C mismatch")
    # The same peer without tampering gets through.
    assert peer.push(HOST, srv.port, SECRET, "step-1/obj.fpo", data)[0] == peer.OK
    assert (base / "step-1" / "obj.fpo").read_bytes() == data


@pytest.mark.parametrize("mode", ["corrupt", "stall"])
def test_tampering_or_stalling_server_is_refused_by_fetch(dirs, mode):
    _, client, _ = dirs
    data = os.urandom(2 * MiB)
    listener = socket.create_server((HOST, 0))
    results: list = []
    kwargs = {"corrupt_at": 777} if mode == "corrupt" else {"stall_after": MiB}
    t = threading.Thread(target=peer.serve_one_fetch, args=(listener, SECRET, data),
                         kwargs={**kwargs, "results": results})
    t.start()
    expected = _core.TransferChecksumError if mode == "corrupt" else _core.TransferTimeoutError
    t0 = time.monotonic()
    with pytest.raises(expected) as info:
        _core.transfer_fetch(HOST, listener.getsockname()[1], SECRET, "step-1/x.fpo", client,
                             retries=0, io_timeout_s=IO_TIMEOUT)
    elapsed = time.monotonic() - t0
    t.join(10)
    listener.close()
    assert not (client / "step-1" / "x.fpo").exists() and hidden_files(client) == []
    if mode == "corrupt":
        assert "CRC32C mismatch" in str(info.value)
        assert results and results[0][0] == peer.CHECKSUM  # the client told the server
    else:
        assert isinstance(info.value, TimeoutError) and elapsed < IO_TIMEOUT + 2


# --- hostile inputs against a running server --------------------------------------------------


def test_no_handshake_is_closed_within_the_timeout(hostile):
    srv = hostile[0]
    with socket.create_connection((HOST, srv.port)) as s:
        s.settimeout(IO_TIMEOUT + 3)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed without a word
        assert time.monotonic() - t0 < IO_TIMEOUT + 1.5
    wait_for_error(srv, "timed out")


def test_slow_peer_does_not_block_others(hostile):
    srv, base, client, _ = hostile
    stalled = [socket.create_connection((HOST, srv.port)) for _ in range(3)]  # as many as workers
    try:
        t0 = time.monotonic()
        assert_still_serves(srv, client, base)  # queued until a stalled one times out, then served
        assert time.monotonic() - t0 < IO_TIMEOUT + 2
    finally:
        for s in stalled:
            s.close()


def test_wrong_secret_both_directions(hostile):
    srv, _, client, _ = hostile
    write_object(client, "x.fpo", b"payload")
    t0 = time.monotonic()
    with pytest.raises(_core.TransferAuthError, match="authentication"):
        _core.transfer_push(HOST, srv.port, b"another-jobs-secret-xx", client, "x.fpo", retries=3)
    assert time.monotonic() - t0 < 1.0  # never retried
    # A peer that ignores the server's proof and sends a made-up one is cut off.
    with peer.connect(HOST, srv.port) as s:
        s.sendall(peer.MAGIC + struct.pack("<II", peer.VERSION, 0) + os.urandom(32))
        peer.recv_exact(s, 80)
        s.sendall(os.urandom(32) + peer.request(peer.OP_PUSH, b"evil", 4) + b"evil")
        assert_closed(s)
    errors = wait_for_error(srv, "failed authentication")
    assert srv.stats()["auth_failures"] >= 1, errors
    with pytest.raises(ValueError, match="16 bytes"):
        _core.transfer_push(HOST, srv.port, b"short", client, "x.fpo")


def test_wrong_magic_version_and_garbage(hostile):
    srv = hostile[0]
    for blob in (os.urandom(200), b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40,
                 peer.MAGIC + struct.pack("<II", 99, 0) + os.urandom(32)):
        with peer.connect(HOST, srv.port) as s:
            s.sendall(blob)
            if blob.startswith(peer.MAGIC):  # an unknown version hears ours (MAC zero), then the close
                hello = peer.recv_exact(s, 80)
                assert struct.unpack("<I", hello[8:12])[0] == peer.VERSION and hello[16:] == bytes(64)
            assert_closed(s)
    errors = wait_for_error(srv, "version 99")
    assert any("bad protocol magic" in e for e in errors)


@pytest.mark.parametrize("path", ["../x", "a/../../x", "../sentinel/secret.txt", "/abs/x", "a//b", "./a", "a/",
                                  "a\0b", "link/secret.txt", "link/new.fpo", "leak"])
def test_path_traversal_is_refused(hostile, path):
    srv, base, _, sentinel = hostile
    os.symlink(sentinel, base / "link")
    os.symlink(sentinel / "secret.txt", base / "leak")
    with auth_sock(srv) as s:
        s.send_request(peer.OP_FETCH, path.encode(), 0)
        status, _, msg = s.recv_response()
    assert status == peer.PATH_REFUSED and "refused" in msg, (status, msg)
    if path != "leak":  # pushing to "leak" would replace the symlink itself (confined), tested below
        with auth_sock(srv) as s:
            s.send_request(peer.OP_PUSH, path.encode(), 5)
            status, _, msg = s.recv_response()
            assert status == peer.PATH_REFUSED and "refused" in msg, (status, msg)
    os.unlink(base / "link")
    os.unlink(base / "leak")


def test_push_over_a_symlink_replaces_the_link_not_its_target(hostile):
    srv, base, _, sentinel = hostile
    os.symlink(sentinel / "secret.txt", base / "leak")
    assert peer.push(HOST, srv.port, SECRET, "leak", b"new bytes")[0] == peer.OK
    assert not (base / "leak").is_symlink() and (base / "leak").read_bytes() == b"new bytes"


@pytest.mark.parametrize("path_len", [0, 4097, 0xFFFFFFFF])
def test_bad_path_length_is_refused(hostile, path_len):
    """The length says where the request's tag is: one no client sends cannot be authenticated, so it is
    answered as tampering, before any other field is looked at."""
    srv = hostile[0]
    with auth_sock(srv) as s:
        s.send_request(peer.OP_PUSH, b"x", 1, path_len=path_len)
        status, _, msg = s.recv_response()
        assert status == peer.INTEGRITY and f"path length of {path_len}" in msg, (status, msg)
        assert_closed(s)
    assert srv.stats()["integrity_failures"] >= 1


@pytest.mark.parametrize("size", [256 * MiB + 1, 2**63, 2**64 - 1], ids=["over-max", "2^63", "minus-1"])
def test_oversized_or_negative_size_is_refused(hostile, size):
    srv, base, _, _ = hostile
    with auth_sock(srv) as s:
        s.send_request(peer.OP_PUSH, b"big.fpo", size)
        status, _, msg = s.recv_response()
    assert status == peer.TOO_LARGE and "max_object_bytes" in msg
    assert not (base / "big.fpo").exists()


def test_bad_op_and_flags_are_refused(hostile):
    srv = hostile[0]
    for args, kwargs in (((7, b"x", 0), {}), ((peer.OP_PUSH, b"x", 1), {"flags": 1}),
                         ((peer.OP_FETCH, b"x", 5), {})):
        with auth_sock(srv) as s:
            s.send_request(*args, **kwargs)
            assert s.recv_response()[0] == peer.BAD_REQUEST


@pytest.mark.parametrize("how", ["close", "stall", "short-then-trailer"])
def test_truncated_push_leaves_nothing(hostile, how):
    srv, base, _, _ = hostile
    data = os.urandom(3 * MiB)
    with auth_sock(srv) as s:
        s.send_request(peer.OP_PUSH, b"step-2/obj.fpo", len(data))
        assert s.recv_response()[0] == peer.OK
        s.send_data(data[: len(data) // 2])
        if how == "stall":
            s.settimeout(IO_TIMEOUT + 3)
            t0 = time.monotonic()
            assert s.recv(100) == b""
            assert time.monotonic() - t0 < IO_TIMEOUT + 1.5
        elif how == "short-then-trailer":
            s.sendall(s.trailer(len(data) // 2, peer.crc32c(data[: len(data) // 2])))
            time.sleep(0.1)
    wait_for_error(srv, {"close": "closed by the peer", "stall": "timed out",
                         "short-then-trailer": "closed by the peer"}[how])
    assert not (base / "step-2" / "obj.fpo").exists()


def test_peer_killed_mid_transfer(hostile):
    srv, base, _, _ = hostile
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.transfer_peer", "push-half", HOST, str(srv.port), SECRET.hex(),
         "step-3/obj.fpo", str(64 * MiB)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "HALF"
        # Mid-transfer: the temp file exists, the object does not.
        assert not (base / "step-3" / "obj.fpo").exists() and len(hidden_files(base)) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    wait_for_error(srv, "obj.fpo")
    deadline = time.monotonic() + 5
    while hidden_files(base) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (base / "step-3" / "obj.fpo").exists()


# --- lifecycle, errors, arguments, retries ---------------------------------------------------


def test_stop_leaves_no_threads_or_fds(dirs):
    base, client, _ = dirs
    write_object(client, "o.fpo", os.urandom(MiB))
    fds, threads = count_fds(), count_threads()
    srv = _core.TransferServer(base, SECRET, max_connections=3, io_timeout_s=30)
    assert count_threads() == threads + 4  # 3 workers + the accept loop
    _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo")
    accepted = srv.stats()["accepted"]
    hanging = [socket.create_connection((HOST, srv.port)) for _ in range(5)]  # in the handshake stage
    requests = [auth_sock(srv) for _ in range(4)]
    for i, s in enumerate(requests):  # pushes that stall after their request: two served (a rank gets at most
        s.send_request(peer.OP_PUSH, f"stalled-{i}.fpo".encode(), MiB)  # max_connections - 1 workers), two queued
    hanging += requests
    deadline = time.monotonic() + 10  # until the server has accepted all nine and queued the four requests
    while (srv.stats()["accepted"] < accepted + len(hanging) or srv.stats()["handshakes_ok"] < 5
           or srv.stats()["handshaking"] > 5) and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = srv.stats()
    assert stats["accepted"] == accepted + len(hanging) and stats["handshaking"] == 5, stats
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 2  # does not wait for the 30 s io timeout
    srv.stop()  # idempotent
    assert not srv.running
    for s in hanging:
        s.settimeout(2)
        if isinstance(s, peer.Session) and select.select([s.sock], [], [], 0)[0]:
            try:
                s.recv_response()  # a served push's "ready"
            except ConnectionError:
                pass
        assert_closed(s)  # the server closed its end
        s.close()
    assert count_fds() == fds and count_threads() == threads
    errors = srv.errors()
    assert any("server is stopping" in e for e in errors), errors
    assert srv.errors() == []  # cleared by the previous call
    with pytest.raises(_core.TransferError):
        _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo", retries=0)


def test_transfer_errors_are_flashpoint_errors_and_still_os_errors(dirs):
    """The README: every error derives from FlashpointError; callers that catch OSError keep working."""
    from ml_flashpoint_nemo import errors

    classes = [v for k, v in vars(_core).items() if k.startswith("Transfer") and k.endswith("Error")]
    assert len(classes) == 10
    for cls in classes:
        assert issubclass(cls, errors.FlashpointError) and issubclass(cls, OSError), cls.__mro__
    assert errors.TransferError is _core.TransferError and errors.TransferIntegrityError is _core.TransferIntegrityError
    base, client, _ = dirs
    with socket.create_server((HOST, 0)) as listener:  # nobody answers: a failed fetch, raised from C++
        port = listener.getsockname()[1]
    with pytest.raises(errors.FlashpointError) as info:
        _core.transfer_fetch(HOST, port, SECRET, "o.fpo", client, retries=0, connect_timeout_s=1)
    assert isinstance(info.value, _core.TransferError) and isinstance(info.value, OSError)


def test_bad_arguments(dirs):
    base, client, _ = dirs
    for kwargs in ({"secret": b"x" * 15}, {"max_connections": 0}, {"io_timeout_s": 0}, {"port": 70000},
                   {"max_object_bytes": 0}):
        with pytest.raises(ValueError):
            _core.TransferServer(base, **{"secret": SECRET, **kwargs})
    with pytest.raises(FileNotFoundError):
        _core.TransferServer(base / "missing", SECRET)
    with pytest.raises(TypeError):
        _core.TransferServer(base, "a str is not a secret")
    write_object(client, "o.fpo", b"x")
    for kwargs in ({"io_timeout_s": -1}, {"connect_timeout_s": 0}, {"retries": -1}, {"backoff_s": -0.1}):
        with pytest.raises(ValueError):
            _core.transfer_push(HOST, 1234, SECRET, client, "o.fpo", **kwargs)
    with pytest.raises(ValueError):
        _core.transfer_push(HOST, 0, SECRET, client, "o.fpo")
    with pytest.raises(FileNotFoundError):
        _core.transfer_push(HOST, 1234, SECRET, client, "missing.fpo")


def test_client_retries_connect_failures_with_backoff(dirs):
    _, client, _ = dirs
    write_object(client, "o.fpo", b"x")
    probe = socket.create_server((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    t0 = time.monotonic()
    with pytest.raises(_core.TransferError, match="after 3 attempt") as info:
        _core.transfer_push(HOST, port, SECRET, client, "o.fpo", retries=2, backoff_s=0.1)
    assert 0.3 <= time.monotonic() - t0 < 2  # slept 0.1 + 0.2
    assert isinstance(info.value, OSError) and "refused" in str(info.value).lower()


def test_client_retries_timeouts_then_raises_timeout_error(dirs):
    _, client, _ = dirs
    write_object(client, "o.fpo", b"x")
    silent = socket.create_server((HOST, 0))  # accepts (backlog) but never answers the hello
    try:
        t0 = time.monotonic()
        with pytest.raises(_core.TransferTimeoutError, match="after 2 attempt") as info:
            _core.transfer_push(HOST, silent.getsockname()[1], SECRET, client, "o.fpo", retries=1,
                                backoff_s=0.05, io_timeout_s=0.3)
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, _core.TransferError)
        assert 0.6 <= time.monotonic() - t0 < 2
    finally:
        silent.close()


def test_retry_succeeds_once_the_server_is_up(dirs):
    base, client, _ = dirs
    write_object(client, "o.fpo", b"late")
    probe = socket.create_server((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    holder: list = []
    timer = threading.Timer(0.15, lambda: holder.append(_core.TransferServer(base, SECRET, port=port)))
    timer.start()
    try:
        r = _core.transfer_push(HOST, port, SECRET, client, "o.fpo", retries=5, backoff_s=0.1)
        assert r["attempts"] > 1 and (base / "o.fpo").read_bytes() == b"late"
    finally:
        timer.join()
        for s in holder:
            s.stop()


# --- known CRC on the sender, spare files on the receiver ----------------------------------------

SPARES = "pool/replica-spares"


@pytest.fixture
def spare_server(dirs):
    """A server whose receptions take their files from base/pool/replica-spares."""
    base, _, _ = dirs
    (base / SPARES).mkdir(parents=True)
    with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT, max_connections=4,
                              max_object_bytes=256 * MiB, spare_dir=SPARES) as srv:
        yield srv


def add_spare(base: Path, name: str, nbytes: int) -> Path:
    p = base / SPARES / name
    p.write_bytes(os.urandom(nbytes))
    return p


@pytest.mark.parametrize("zero_copy", [True, False], ids=["sendfile", "send"])
def test_push_with_the_known_crc_sends_and_stores_it(dirs, server, zero_copy):
    base, client, _ = dirs
    data = os.urandom(3 * MiB + 11)
    p = write_object(client, "step-1/o.fpo", data)
    crc = _core.crc32c(data)
    r = _core.transfer_push(HOST, server.port, SECRET, client, "step-1/o.fpo", crc32c=crc, zero_copy=zero_copy)
    assert r["crc32c"] == crc and (base / "step-1" / "o.fpo").read_bytes() == data
    with open(p, "rb") as f:  # a range of a file, with the CRC of exactly that range
        part = data[5:5 + MiB]
        r = _core.transfer_push_fd(HOST, server.port, SECRET, f.fileno(), "part.fpo", offset=5, length=MiB,
                                   crc32c=_core.crc32c(part), zero_copy=zero_copy)
    assert r["nbytes"] == MiB and (base / "part.fpo").read_bytes() == part
    assert hidden_files(base) == []


@pytest.mark.parametrize("zero_copy", [True, False], ids=["sendfile", "send"])
def test_source_changed_after_its_crc_was_taken_is_refused(hostile, zero_copy):
    """The sender does not read the data; the receiver's own CRC of what arrived catches the flipped byte."""
    srv, base, client, _ = hostile
    data = bytearray(os.urandom(2 * MiB + 3))
    crc_of_original = _core.crc32c(bytes(data))
    data[MiB + 17] ^= 0x40  # the RAM copy changed after the save
    write_object(client, "step-4/rank-00001-0.fpo", bytes(data))
    with pytest.raises(_core.TransferChecksumError, match="CRC32C mismatch") as info:
        _core.transfer_push(HOST, srv.port, SECRET, client, "step-4/rank-00001-0.fpo", crc32c=crc_of_original,
                            zero_copy=zero_copy, retries=0)
    assert "discarded" in str(info.value)
    assert not (base / "step-4" / "rank-00001-0.fpo").exists()
    wait_for_error(srv, "CRC32C mismatch")


def test_known_crc_must_be_a_crc(dirs, server):
    _, client, _ = dirs
    write_object(client, "o.fpo", b"x")
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="crc32c"):
            _core.transfer_push(HOST, server.port, SECRET, client, "o.fpo", crc32c=bad)


def test_push_takes_the_smallest_spare_that_holds_the_object(dirs, spare_server):
    base, client, _ = dirs
    small, fitting, large = (add_spare(base, n, s) for n, s in (("small", MiB), ("fitting", 3 * MiB),
                                                                  ("large", 9 * MiB)))
    fitting_inode = fitting.stat().st_ino
    data = os.urandom(2 * MiB + 1)
    write_object(client, "o.fpo", data)
    _core.transfer_push(HOST, spare_server.port, SECRET, client, "o.fpo", "step-2/rank-00000-0.fpo",
                        crc32c=_core.crc32c(data))
    stored = base / "step-2" / "rank-00000-0.fpo"
    assert stored.read_bytes() == data and stored.stat().st_size == len(data)  # resized to the object
    assert stored.stat().st_ino == fitting_inode  # the spare's pages, overwritten
    assert sorted(os.listdir(base / SPARES)) == ["large", "small"] and small.exists() and large.exists()
    assert spare_server.stats()["spares_taken"] == 1 and hidden_files(base) == []


def test_push_grows_the_largest_spare_when_none_holds_the_object(dirs, spare_server):
    base, client, _ = dirs
    add_spare(base, "a", MiB)
    b = add_spare(base, "b", 2 * MiB)
    b_inode = b.stat().st_ino
    data = os.urandom(5 * MiB + 3)
    write_object(client, "o.fpo", data)
    _core.transfer_push(HOST, spare_server.port, SECRET, client, "o.fpo", "big.fpo")
    assert (base / "big.fpo").read_bytes() == data and (base / "big.fpo").stat().st_ino == b_inode
    assert os.listdir(base / SPARES) == ["a"]


def test_spares_that_are_not_plain_files_are_left_alone(dirs):
    """Symlinks (even to a file outside the base), directories, FIFOs, hard-linked and hidden files."""
    base, client, sentinel = dirs
    outside = snapshot(sentinel)
    (base / SPARES).mkdir(parents=True)
    spares = base / SPARES
    os.symlink(sentinel / "secret.txt", spares / "link")
    (spares / "dir").mkdir()
    os.mkfifo(spares / "fifo")
    (spares / "linked").write_bytes(os.urandom(MiB))
    os.link(spares / "linked", base / "elsewhere")  # a spare that is also another file
    (spares / ".hidden").write_bytes(os.urandom(MiB))
    before = snapshot(base)
    with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT, spare_dir=SPARES) as srv:
        data = os.urandom(MiB // 2)
        write_object(client, "o.fpo", data)
        _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo", "new/o.fpo")
        assert srv.stats()["spares_taken"] == 0
    assert (base / "new" / "o.fpo").read_bytes() == data
    after = snapshot(base)
    del after["new"], after["new/o.fpo"]
    assert after == before and snapshot(sentinel) == outside


def test_a_failed_reception_into_a_spare_leaves_nothing(dirs, spare_server):
    base, _, _ = dirs
    add_spare(base, "s1", 4 * MiB)
    add_spare(base, "s2", 4 * MiB)
    data = os.urandom(3 * MiB)
    status, _, msg = peer.push(HOST, spare_server.port, SECRET, "step-1/obj.fpo", data, corrupt_at=MiB)
    assert status == peer.CHECKSUM and "CRC32C mismatch" in msg
    assert not (base / "step-1" / "obj.fpo").exists() and hidden_files(base) == []
    with auth_sock(spare_server) as s:  # a peer that goes away half-way
        s.send_request(peer.OP_PUSH, b"step-1/obj.fpo", len(data))
        assert s.recv_response()[0] == peer.OK
        s.send_data(data[: MiB])
    wait_for_error(spare_server, "closed by the peer")
    assert not (base / "step-1" / "obj.fpo").exists() and hidden_files(base) == []
    assert spare_server.stats()["spares_taken"] == 2 and os.listdir(base / SPARES) == []


def test_concurrent_receptions_never_share_a_spare(dirs, spare_server):
    base, client, _ = dirs
    for i in range(3):
        add_spare(base, f"s{i}", 2 * MiB)
    payloads = {f"step-9/rank-{i:05d}-0.fpo": os.urandom(MiB + i) for i in range(8)}
    for i, data in enumerate(payloads.values()):
        write_object(client, f"src{i}.fpo", data)
    errors: list[BaseException] = []

    def push(i: int, name: str) -> None:
        try:
            _core.transfer_push(HOST, spare_server.port, SECRET, client, f"src{i}.fpo", name, retries=2)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(i, name)) for i, name in enumerate(payloads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    inodes = set()
    for name, data in payloads.items():
        assert (base / name).read_bytes() == data
        inodes.add((base / name).stat().st_ino)
    assert len(inodes) == len(payloads)  # no two objects share a file
    taken = spare_server.stats()["spares_taken"]
    assert 1 <= taken <= 3 and len(os.listdir(base / SPARES)) == 3 - taken


def test_fetch_receives_into_a_spare(dirs, server):
    base, client, _ = dirs
    data = os.urandom(2 * MiB + 9)
    write_object(base, "step-5/rank-00002-0.fpo", data)
    (client / SPARES).mkdir(parents=True)
    spare = add_spare(client, "s", 4 * MiB)
    inode = spare.stat().st_ino
    _core.transfer_fetch(HOST, server.port, SECRET, "step-5/rank-00002-0.fpo", client, spare_dir=SPARES)
    fetched = client / "step-5" / "rank-00002-0.fpo"
    assert fetched.read_bytes() == data and fetched.stat().st_ino == inode
    assert os.listdir(client / SPARES) == []
    _core.transfer_fetch(HOST, server.port, SECRET, "step-5/rank-00002-0.fpo", client, "again.fpo",
                         spare_dir=SPARES)  # no spare left: a new file
    assert (client / "again.fpo").read_bytes() == data


def test_spare_dir_is_confined_and_may_be_missing(dirs):
    base, client, sentinel = dirs
    for bad in ("../sentinel", "/tmp", "a//b", ""):
        with pytest.raises(_core.TransferPathError):
            _core.TransferServer(base, SECRET, spare_dir=bad)
        with pytest.raises(ValueError):
            _core.transfer_fetch(HOST, 1234, SECRET, "x", client, spare_dir=bad)
    os.symlink(sentinel, base / "spares-link")
    (sentinel / "bait").write_bytes(os.urandom(MiB))
    for spare_dir in ("missing/spares", "spares-link"):  # absent, or reached through a symlink: no spares
        with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT, spare_dir=spare_dir) as srv:
            write_object(client, "o.fpo", b"payload")
            _core.transfer_push(HOST, srv.port, SECRET, client, "o.fpo")
            assert (base / "o.fpo").read_bytes() == b"payload" and srv.stats()["spares_taken"] == 0
    assert (sentinel / "bait").stat().st_size == MiB


def test_repeated_pushes_into_retired_replicas_stay_bit_exact(dirs, spare_server):
    """The steady state: each received replica is retired into the spares and the next push lands on its pages
    (several populate windows, a tail past the spare's pages, a shrinking object), plus a sparse spare."""
    base, client, _ = dirs
    stored = base / "step-1" / "rank-00000-0.fpo"
    for i, nbytes in enumerate([21 * MiB + 5, 21 * MiB + 5, 23 * MiB + 4097, 9 * MiB + 1]):
        data = os.urandom(nbytes)
        write_object(client, "o.fpo", data)
        _core.transfer_push(HOST, spare_server.port, SECRET, client, "o.fpo", "step-1/rank-00000-0.fpo",
                            crc32c=_core.crc32c(data))
        assert stored.read_bytes() == data, f"push {i}"
        os.rename(stored, base / SPARES / f"retired-{i}")
    assert spare_server.stats()["spares_taken"] == 3
    for name in os.listdir(base / SPARES):
        os.unlink(base / SPARES / name)
    sparse = base / SPARES / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(8 * MiB)  # no pages at all: taken, but nothing of it is warm
    data = os.urandom(5 * MiB)
    write_object(client, "o.fpo", data)
    _core.transfer_push(HOST, spare_server.port, SECRET, client, "o.fpo", "step-1/rank-00000-0.fpo")
    assert stored.read_bytes() == data and not sparse.exists() and hidden_files(base) == []


def mappings_under(root: Path) -> list[str]:
    """This process's file mappings of files under root (a deleted file shows as '<path> (deleted)')."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f
                       if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith(str(root))})


def test_kept_mappings_are_reused_and_never_pin_a_deleted_file(dirs, spare_server):
    """A reception through a spare keeps its mapping for the next reception into the same file; once the
    file is deleted the mapping goes within about a second, so its memory is freed."""
    base, client, _ = dirs
    add_spare(base, "s", 8 * MiB)
    stored = base / "step-1" / "rank-00000-0.fpo"
    for i in range(3):
        data = os.urandom(6 * MiB + i)
        write_object(client, "o.fpo", data)
        _core.transfer_push(HOST, spare_server.port, SECRET, client, "o.fpo", "step-1/rank-00000-0.fpo")
        assert stored.read_bytes() == data
        if i < 2:
            os.rename(stored, base / SPARES / f"retired-{i}")
    stats = spare_server.stats()
    assert stats["spares_taken"] == 3 and stats["mappings_reused"] == 2
    assert mappings_under(base) == [str(stored)]  # kept while the file lives
    stored.unlink()
    deadline = time.monotonic() + 5
    while mappings_under(base) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mappings_under(base) == []
    add_spare(base, "t", 8 * MiB)
    _core.transfer_push(HOST, spare_server.port, SECRET, client, "o.fpo", "again.fpo")
    assert mappings_under(base) == [str(base / "again.fpo")]
    spare_server.stop()  # and the server lets go of every mapping when it stops
    assert mappings_under(base) == []


# --- hard links and stale temporary files ----------------------------------------------------


def test_fetch_refuses_a_hard_linked_file(dirs, server):
    """A hard link in the served tree may name a file from outside it: fetch serves none."""
    base, client, sentinel = dirs
    (base / "step-3").mkdir()
    os.link(sentinel / "secret.txt", base / "step-3" / "rank-00000-0.fpo")
    with pytest.raises(_core.TransferPathError, match="hard links"):
        _core.transfer_fetch(HOST, server.port, SECRET, "step-3/rank-00000-0.fpo", client, retries=0)
    assert not (client / "step-3").exists() and hidden_files(client) == []
    assert (sentinel / "secret.txt").read_bytes() == b"do not touch"
    # The same file, singly linked again, is served.
    os.unlink(sentinel / "secret.txt")
    _core.transfer_fetch(HOST, server.port, SECRET, "step-3/rank-00000-0.fpo", client, retries=0)
    assert (client / "step-3" / "rank-00000-0.fpo").read_bytes() == b"do not touch"


def _age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_stale_temp_files_are_swept_when_the_server_starts(dirs):
    """Temp files of receptions that died are removed at start; live, fresh and other files stay."""
    import fcntl

    base, _, _ = dirs
    step = base / "step-5"
    step.mkdir()
    stale_top = base / ".xfer-0123456789abcdef.tmp"
    stale_step = step / ".xfer-fedcba9876543210.tmp"
    held = step / ".xfer-00000000000000aa.tmp"   # a live reception (of this process) holds it
    fresh = step / ".xfer-00000000000000bb.tmp"  # just created: its lock may not be taken yet
    others = [step / ".xfer-notatempname.tmp", step / "rank-00000-0.fpo", step / "COMMIT",
              step / ".xfer-0123456789ABCDEF.tmp"]
    for p in (stale_top, stale_step, held, fresh, *others):
        p.write_bytes(b"x" * 100)
    for p in (stale_top, stale_step, held, *others):
        _age(p, 60)
    deep = step / ".xfer-00000000000000cc.tmp"  # a directory with a temp name is not a file
    deep.mkdir()
    with open(held, "rb") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT) as srv:
            assert srv.stats()["temp_files_swept"] == 2
    assert not stale_top.exists() and not stale_step.exists()
    assert held.exists() and fresh.exists() and deep.is_dir()
    assert all(p.read_bytes() == b"x" * 100 for p in others)


def test_a_server_killed_mid_reception_leaves_a_temp_file_that_the_next_start_sweeps(dirs):
    """The real case: the receiving process is SIGKILLed mid-push; its successor frees the space."""
    base = dirs[0]
    code = ("import sys, time; from ml_flashpoint_nemo import _core; "
            "s = _core.TransferServer(sys.argv[1], bytes.fromhex(sys.argv[2]), io_timeout_s=60); "
            "print(s.port, flush=True); time.sleep(600)")
    server_proc = subprocess.Popen([sys.executable, "-c", code, str(base), SECRET.hex()], cwd=REPO,
                                   stdout=subprocess.PIPE, text=True)
    pusher = None
    try:
        port = int(server_proc.stdout.readline())
        pusher = subprocess.Popen(
            [sys.executable, "-m", "tests.support.transfer_peer", "push-half", HOST, str(port), SECRET.hex(),
             "step-3/rank-00001-0.fpo", str(8 * MiB)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert pusher.stdout.readline().strip() == "HALF"
        deadline = time.monotonic() + 10
        while not list(base.rglob(".xfer-*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.02)
        server_proc.send_signal(signal.SIGKILL)
        server_proc.wait(10)
    finally:
        for proc in (server_proc, pusher):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
    leftovers = list(base.rglob(".xfer-*.tmp"))
    assert len(leftovers) == 1, leftovers
    _age(leftovers[0], 60)
    with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT) as srv:
        assert srv.stats()["temp_files_swept"] == 1
    assert list(base.rglob(".xfer-*.tmp")) == [] and not (base / "step-3" / "rank-00001-0.fpo").exists()


# --- the receiver's low-water mark (SO_RCVLOWAT): never a wait for bytes that do not come -------------

CHUNK = 256 << 10  # kChunkBytes, also the receiver's low-water mark
TAG = 16
LOW_WATER_SIZES = [0, 1, TAG - 1, TAG, TAG + 1, CHUNK - TAG - 1, CHUNK - TAG, CHUNK - 1, CHUNK, CHUNK + 1,
                   CHUNK + TAG, 4 * CHUNK + 7, 5 * CHUNK - TAG + 3, 9 * CHUNK - 1]
# Spares of at least 1 MiB are received into through a mapping; "smaller" ends inside a chunk of the larger
# objects (mapped part, then written), "larger" holds every object whole.
SPARE_SIZES = {"none": None, "smaller": MiB + 5 * 4096 + 100, "larger": 3 * MiB}


@pytest.mark.parametrize("spare", list(SPARE_SIZES))
@pytest.mark.parametrize("way", ["push-send", "push-sendfile", "fetch"])
def test_every_size_around_chunks_and_tags_is_received_without_waiting_out_a_timeout(dirs, way, spare):
    """The receiver sets a low-water mark from the rest of each chunk and its tag, and back to 1 for a tag's
    rest and the trailer: sizes around those edges, each way, into no spare, a mapped spare that ends
    mid-chunk, or one that holds the object; each must arrive whole, with its CRC, without a retry (retries=0)
    and without a server error, and every spare must be used."""
    base, client, _ = dirs
    spare_bytes = SPARE_SIZES[spare]
    with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT, handshake_timeout_s=IO_TIMEOUT,
                              max_object_bytes=256 * MiB, spare_dir=SPARES) as srv:
        (base / SPARES).mkdir(parents=True, exist_ok=True)
        (client / SPARES).mkdir(parents=True, exist_ok=True)
        for n in LOW_WATER_SIZES:
            data = os.urandom(n)
            name = f"lw/{way}-{spare}-{n}.fpo"
            receiver_base = base if way.startswith("push") else client
            if spare_bytes and n:
                add_spare(receiver_base, f"s-{n}", spare_bytes)  # each reception of n > 0 bytes takes one
            if way.startswith("push"):
                write_object(client, name, data)
                r = _core.transfer_push(HOST, srv.port, SECRET, client, name, retries=0, io_timeout_s=IO_TIMEOUT,
                                        zero_copy=way == "push-sendfile")
                got = (base / name).read_bytes()
            else:
                write_object(base, name, data)
                r = _core.transfer_fetch(HOST, srv.port, SECRET, name, client, f"back/{n}.fpo", retries=0,
                                         io_timeout_s=IO_TIMEOUT, spare_dir=SPARES)
                got = (client / "back" / f"{n}.fpo").read_bytes()
            assert got == data and r["nbytes"] == n and r["crc32c"] == _core.crc32c(data), n
        assert srv.errors() == [] and hidden_files(base) == [] and hidden_files(client) == []
        if spare_bytes:  # every spare was used: the mapped and the written paths both ran
            assert os.listdir(base / SPARES) == [] and os.listdir(client / SPARES) == []


def test_a_peer_slower_than_the_low_water_mark_per_io_timeout_still_gets_through(dirs):
    """With the rate floor off, a peer is judged by the io timeout alone: any byte within it keeps the
    transfer going, also while the receiver waits for a chunk's worth (its waits wake to read what is
    queued). Here 160 KiB/s against a 1 s timeout: a whole chunk takes 1.6 s to arrive."""
    base, _, _ = dirs
    data = os.urandom(CHUNK + 5000)
    with _core.TransferServer(base, SECRET, io_timeout_s=IO_TIMEOUT, handshake_timeout_s=IO_TIMEOUT,
                              max_object_bytes=256 * MiB, min_rate_bytes_per_s=0) as srv:
        with peer.connect(HOST, srv.port, timeout=10) as sock:
            s = peer.client_handshake(sock, SECRET)
            s.send_request(peer.OP_PUSH, b"slow/o.fpo", len(data))
            assert s.recv_response()[0] == peer.OK
            for frame in s.data_frames(data):
                for i in range(0, len(frame), 16 << 10):
                    sock.sendall(frame[i:i + (16 << 10)])
                    time.sleep(0.1)  # the pace under test: 16 KiB per 0.1 s
            sock.sendall(s.trailer(len(data), peer.crc32c(data)))
            status, nbytes, message = s.recv_response()
        assert (status, nbytes) == (peer.OK, len(data)), message
        assert srv.errors() == []
    assert (base / "slow" / "o.fpo").read_bytes() == data
