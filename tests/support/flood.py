"""Connection floods against a transfer server, for the admission tests: idle and slow connections.

A `Flood` holds `idle` connections that never send a byte and `slow` ones that send one byte of
a client hello every `slow_interval_s` (a slowloris), from the given source addresses (any
127.x address works on Linux loopback), in one background thread. Connections the server closes
are reopened every `reopen_interval_s`, so the pressure stays while the test runs. Counts of what
happened are in `opened`, `closed_by_server` and `data_received` (bytes the server sent: zero
unless a hello completed, which these never do).
"""

from __future__ import annotations

import errno
import selectors
import socket
import struct
import threading
import time

from tests.support import transfer_peer as peer

# The start of a plausible client hello, sent one byte at a time: it never completes in time.
SLOW_BYTES = peer.MAGIC + struct.pack("<II", peer.VERSION, 0) + bytes(32)


class _Conn:
    __slots__ = ("sock", "slow", "index", "sent")

    def __init__(self, sock: socket.socket, slow: bool, index: int) -> None:
        self.sock = sock
        self.slow = slow
        self.index = index
        self.sent = 0


class Flood:
    def __init__(self, host: str, port: int, sources: list[str], *, idle: int, slow: int,
                 slow_interval_s: float = 0.25, reopen_interval_s: float = 0.25) -> None:
        self.host, self.port = host, port
        self.sources = sources
        self.idle, self.slow = idle, slow
        self.slow_interval_s = slow_interval_s
        self.reopen_interval_s = reopen_interval_s
        self.opened = 0
        self.closed_by_server = 0
        self.data_received = 0
        self.open_now = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> "Flood":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the flood thread did not stop"
        if self._error is not None:
            raise self._error

    def _open(self, sel: selectors.BaseSelector, slow: bool, index: int) -> bool:
        """False when the connection could not even be started (it is tried again later)."""
        source = self.sources[index % len(self.sources)]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            err = sock.connect_ex((self.host, self.port))
        except OSError:
            sock.close()
            return False
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            return False
        sel.register(sock, selectors.EVENT_READ, _Conn(sock, slow, index))
        self.opened += 1
        return True

    def _close(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        sel.unregister(conn.sock)
        conn.sock.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            missing = [(i >= self.idle, i) for i in range(self.idle + self.slow)]  # (slow, index)
            next_reopen = 0.0
            next_byte = time.monotonic() + self.slow_interval_s
            while not self._stop.is_set():
                now = time.monotonic()
                if missing and now >= next_reopen:
                    missing = [(slow, i) for slow, i in missing if not self._open(sel, slow, i)]
                    next_reopen = now + self.reopen_interval_s
                for key, _ in sel.select(timeout=0.05):
                    conn = key.data
                    try:
                        data = conn.sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data:
                        self.data_received += len(data)
                        continue
                    self.closed_by_server += 1
                    self._close(sel, conn)
                    missing.append((conn.slow, conn.index))
                if time.monotonic() >= next_byte:
                    next_byte = time.monotonic() + self.slow_interval_s
                    for key in list(sel.get_map().values()):
                        conn = key.data
                        if not conn.slow or conn.sent >= len(SLOW_BYTES):
                            continue
                        try:
                            conn.sock.send(SLOW_BYTES[conn.sent:conn.sent + 1])
                            conn.sent += 1
                        except (BlockingIOError, OSError):
                            pass  # not connected yet, or closed: the read side notices
                self.open_now = len(sel.get_map())
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop() in the test's thread
            self._error = exc
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()


def wait_for(srv, what: str, predicate, timeout: float = 10.0) -> dict[str, int]:
    """The server's stats once predicate(stats) holds, polled every 10 ms; AssertionError after timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.stats()
        if predicate(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; stats: {stats}")
        time.sleep(0.01)


def connect_from(source: str, port: int, timeout: float = 5.0, host: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to host:port from the local address `source` (any 127.x on Linux loopback)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect((host, port))
    return sock
