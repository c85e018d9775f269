"""The references the benchmarks divide by: a plain memcpy and raw TCP on loopback.

They live with the benchmarks, not in the shipped extension: no product path uses them, and a
reference written apart from the code it judges cannot quietly borrow that code's tricks.

- memcpy: libc's memmove through ctypes (ctypes.memmove releases the GIL for the call), on one
  thread (bench_core's `memcpy` row) or on several, each thread a contiguous share of the bytes
  (the plain half of `copy_limit`). Calls copy at most 4 MiB, as the extension's pieces do, so
  glibc does not switch to its own non-temporal stores for a large tensor (its threshold, about
  three quarters of the L3 on most machines, is well above 4 MiB). The copies are cut
  before the timing; each call still costs ~0.3-0.6 us of Python: against the C++ loop the
  extension used to carry, 2.7% more CPU time for bench_core's 1 GiB state (2244 calls) and 4%
  for its 0.5 GiB one (1725 calls), medians of 11.
- raw TCP: two Python threads on one loopback TCP connection, the sender sendall()-ing one
  preallocated chunk over and over, the receiver recv_into() one preallocated chunk, so both ends
  stay in cache; what it measures is the kernel's loopback TCP, which the replication
  benchmarks' ratios are against. The receiver asks for whole chunks (MSG_WAITALL): a return to
  Python per arriving segment cost ~10% more CPU per GB than the C++ send()/recv() loop this
  replaced; whole chunks cost the same CPU (256 MiB, medians of 11, interleaved on 2 loaded
  vCPUs: 0.361 against 0.356 CPU s/GB, and 0.323 against 0.323). On a quiet machine the whole-chunk
  loop also moves more bytes per second than the C++ loop did (4.90 against 3.59 GB/s, medians of
  7 interleaved 256 MiB runs), so ratios to it are lower than those measured before: see
  docs/performance.md.
"""

from __future__ import annotations

import ctypes
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

PIECE_BYTES = 4 << 20  # memmove calls of at most this many bytes (as the extension's copy pieces)
RAW_TCP_CHUNK_BYTES = 256 << 10  # bytes per send and per receive
RAW_TCP_MAX_CHUNK_BYTES = 64 << 20
LOOPBACK = "127.0.0.1"

Copy = tuple[int, int, int]  # (source address, destination address, nbytes)


# ---------------------------------------------------------------- memcpy


def memmove_copies(copies: Sequence[Copy]) -> None:
    """Each copy in order, one libc memmove per copy, on the calling thread."""
    memmove = ctypes.memmove
    for src, dst, nbytes in copies:
        memmove(dst, src, nbytes)


def memmove_shares(shares: Sequence[Sequence[Copy]]) -> None:
    """Each share on a thread of its own (the first on the caller's), all at once: the threads run
    in parallel because memmove runs without the GIL. Cut the shares with split_into_shares."""
    helpers = [threading.Thread(target=memmove_copies, args=(share,)) for share in shares[1:]]
    for helper in helpers:
        helper.start()
    try:
        if shares:
            memmove_copies(shares[0])
    finally:
        for helper in helpers:
            helper.join()


def split_into_shares(copies: Sequence[Copy], shares: int, piece_bytes: int = PIECE_BYTES) -> list[list[Copy]]:
    """The copies' bytes cut into `shares` contiguous runs of (nearly) equal size, each a list of
    copies of at most piece_bytes; empty shares are dropped, so no thread is started for nothing."""
    total = sum(nbytes for _, _, nbytes in copies)
    quota = -(-total // max(1, shares))  # ceiling: the last share is the smaller one
    result: list[list[Copy]] = [[]]
    room = quota
    for src, dst, nbytes in copies:
        done = 0
        while done < nbytes:
            if room == 0:
                result.append([])
                room = quota
            step = min(nbytes - done, room, piece_bytes)
            result[-1].append((src + done, dst + done, step))
            done += step
            room -= step
    return [share for share in result if share]


# ---------------------------------------------------------------- raw TCP


def raw_tcp_throughput(nbytes: int, chunk_bytes: int = RAW_TCP_CHUNK_BYTES) -> dict[str, Any]:
    """nbytes over one loopback TCP connection between two threads of this process, timed from the
    first send to the last byte received; returns nbytes, seconds and bytes_per_s."""
    if not 0 < chunk_bytes <= RAW_TCP_MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{RAW_TCP_MAX_CHUNK_BYTES}")
    with socket.create_server((LOOPBACK, 0)) as listener:
        receiver = _Receiver(listener, nbytes, chunk_bytes)
        receiver.start()
        try:
            started = _send(listener.getsockname(), nbytes, chunk_bytes)
        except BaseException:
            listener.shutdown(socket.SHUT_RDWR)  # a receiver still in accept() returns with an error
            raise
        finally:
            receiver.join()
    if receiver.error is not None:
        raise receiver.error
    seconds = receiver.finished - started
    return {"nbytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds if seconds > 0 else 0.0}


def _send(address: tuple[str, int], nbytes: int, chunk_bytes: int) -> float:
    """Connect, then send nbytes in chunks of one preallocated buffer; returns when sending began."""
    chunk = memoryview((bytes(range(256)) * (chunk_bytes // 256 + 1))[:chunk_bytes])
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        sent = 0
        while sent < nbytes:
            step = min(chunk_bytes, nbytes - sent)
            sock.sendall(chunk[:step])
            sent += step
        return started


class _Receiver(threading.Thread):
    """Accepts one connection and reads nbytes into one reused buffer; records when the last arrived
    and checks that nothing follows."""

    def __init__(self, listener: socket.socket, nbytes: int, chunk_bytes: int) -> None:
        super().__init__(name="raw-tcp-receiver", daemon=True)
        self.listener, self.nbytes, self.chunk_bytes = listener, nbytes, chunk_bytes
        self.finished = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._receive()
        except BaseException as error:  # handed to the caller, which raises it
            self.error = error

    def _receive(self) -> None:
        sink = memoryview(bytearray(self.chunk_bytes))
        conn, _ = self.listener.accept()
        with conn:
            got = 0
            while got < self.nbytes:
                # MSG_WAITALL: one return to Python per chunk, not one per segment that arrived
                received = conn.recv_into(sink, min(self.chunk_bytes, self.nbytes - got), socket.MSG_WAITALL)
                if received == 0:
                    raise ConnectionError(f"raw TCP sender closed after {got} of {self.nbytes} bytes")
                got += received
            self.finished = time.perf_counter()
            if conn.recv_into(sink, 1):  # after the timing: the sender sent exactly nbytes, then closed
                raise ConnectionError(f"raw TCP sender sent more than {self.nbytes} bytes")
