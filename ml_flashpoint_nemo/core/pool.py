"""Per-rank buffers reused across saves, so a save writes into pages that are already there.

A fresh tmpfs page costs a fault on first write (here a copy into new tmpfs memory
runs at about a tenth of memcpy speed). The pool therefore keeps buffers alive
between saves: a buffer is filled in the pool directory, renamed into a version
directory as that version's object, and renamed back into the pool when the
version is retired. Renames keep both the pages and this process's mapping, so
steady-state saves never fault.

The pool only ever hands out files from its own directory. Objects of committed
versions live in version directories and come back only through ``recycle``,
which callers use for retired versions alone; so neither a restart nor a save
can overwrite the newest committed version.

While an object is placed, its buffer also serves loads in this process:
find_placed_buffer hands the loader the mapping, already populated, so a load
right after a save copies from it without the per-page kernel work of reading
the file (docs/performance.md, "Core").
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import lifecycle
from ml_flashpoint_nemo.core.layout import BUFFER_PREFIX, LOCK_NAME, CheckpointLayout, buffer_name
from ml_flashpoint_nemo.core.pinning import CudaHostRegistry
from ml_flashpoint_nemo.errors import OutOfSpaceError, PoolBusyError

logger = logging.getLogger(__name__)

_MIN_SLACK = 4 << 20


def buffer_size_for(nbytes: int) -> int:
    """Bytes to allocate for objects of about nbytes of data.

    The slack covers the header, record alignment and index (about 160 bytes per record),
    and lets a slowly growing state reuse its buffers instead of growing them every save.
    """
    return nbytes + max(_MIN_SLACK, nbytes // 64)


def raise_if_out_of_space(exc: OSError, what: str) -> None:
    """Turn ENOSPC/EDQUOT into OutOfSpaceError with advice; other errors pass through."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise OutOfSpaceError(
            f"no space left for {what}: the tmpfs is full. The save was abandoned and earlier versions are "
            "intact. Free memory in the tmpfs, enlarge it (mount -o remount,size=...), keep fewer versions, "
            "or save less often."
        ) from exc


# The open pools of this process, for find_placed_buffer; a pool leaves on close (or when collected).
_live_pools: "weakref.WeakSet[BufferPool]" = weakref.WeakSet()
_live_pools_lock = threading.Lock()


def find_placed_buffer(object_path: str | os.PathLike[str]) -> _core.ShmBuffer | None:
    """The buffer an open pool of this process placed at object_path, or None.

    Only a hint: the file at that path may have been replaced since, and the buffer may
    be closed at any moment. Callers check that it maps the file they opened.
    """
    with _live_pools_lock:
        pools = list(_live_pools)
    for pool in pools:
        buffer = pool.placed_buffer(object_path)
        if buffer is not None:
            return buffer
    return None


class BufferPool:
    """Tmpfs buffers of one rank: adopted after a restart, pre-faulted in the background, reused."""

    def __init__(
        self, layout: CheckpointLayout, rank: int, *, max_free: int = 2, pinning: CudaHostRegistry | None = None
    ) -> None:
        self.layout = layout
        self.pinning = pinning if pinning is not None else CudaHostRegistry()
        self.rank = rank
        self.max_free = max_free
        self.directory = layout.pool_dir(rank)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        self._mutex = threading.Lock()
        self._free: list[_core.ShmBuffer] = []
        self._placed: dict[str, _core.ShmBuffer] = {}  # object path -> buffer backing it
        self._warmup: Future[None] | None = None
        self._closed = False
        self._adopt_free_buffers()
        lifecycle.register(self, BufferPool.close, f"buffer pool {self.directory}")
        with _live_pools_lock:
            _live_pools.add(self)

    def _take_lock(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PoolBusyError(
                f"the buffer pool {self.directory} is held by another live process: two processes cannot save "
                f"as rank {self.rank} into {self.layout.base_dir}. Stop the other process, or give this job its "
                "own base directory."
            ) from None
        return fd

    def _adopt_free_buffers(self) -> None:
        for path in sorted(self.directory.glob(BUFFER_PREFIX + "*")):
            try:
                self._free.append(_core.ShmBuffer.open(str(path), writable=True))
            except (OSError, ValueError) as exc:
                logger.warning("Removing unusable pool buffer %s (%s)", path, exc)
                path.unlink(missing_ok=True)
        if self._free:
            logger.debug("Rank %d adopted %d free buffers from %s", self.rank, len(self._free), self.directory)

    def _new_buffer_path(self) -> str:
        return str(self.directory / buffer_name())

    @property
    def closed(self) -> bool:
        return self._closed

    def start_warmup(self, nbytes: int | None = None, count: int = 1) -> Future[None]:
        """In a background thread, make `count` free buffers of at least nbytes and fault in every free buffer.

        Returns a future that holds any exception of the warm-up (e.g. OutOfSpaceError).
        """
        future: Future[None] = Future()

        def run() -> None:
            try:
                if nbytes:
                    self._ensure_free_buffers(nbytes, count)
                with self._mutex:
                    buffers = list(self._free)
                for buffer in buffers:
                    if self._closed:
                        break
                    try:
                        buffer.prefault()
                        with self._mutex:  # only while still free: acquire may be about to grow it
                            if buffer in self._free:
                                self.pinning.register(buffer)
                    except RuntimeError:  # closed or handed out and retired meanwhile
                        pass
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever waits
                future.set_exception(exc)

        self._warmup = future
        threading.Thread(target=run, name=f"flashpoint-pool-warmup-{self.rank}", daemon=True).start()
        return future

    def _ensure_free_buffers(self, nbytes: int, count: int) -> None:
        target = buffer_size_for(nbytes)
        with self._mutex:
            big_enough = sum(1 for b in self._free if b.size >= target)
        for _ in range(count - big_enough):
            buffer = self._create(target)
            with self._mutex:
                closed = self._closed
                if not closed:
                    self._free.append(buffer)
            if closed:
                self._close(buffer)
                return

    def _create(self, nbytes: int) -> _core.ShmBuffer:
        try:
            return _core.ShmBuffer.create(self._new_buffer_path(), nbytes)
        except OSError as exc:
            raise_if_out_of_space(exc, f"a {nbytes}-byte buffer in {self.directory}")
            raise

    def acquire(self, nbytes: int) -> _core.ShmBuffer:
        """A free buffer of at least nbytes: the smallest that fits, else the largest grown, else a new one."""
        with self._mutex:
            fitting = [b for b in self._free if b.size >= nbytes]
            if fitting:
                buffer = min(fitting, key=lambda b: b.size)
            elif self._free:
                buffer = max(self._free, key=lambda b: b.size)
            else:
                buffer = None
            if buffer is not None:
                self._free.remove(buffer)
        target = buffer_size_for(nbytes)
        if buffer is None:
            buffer = self._create(target)
        elif buffer.size < nbytes:
            old_size = buffer.size
            self.pinning.unregister(buffer)  # the mapping may move
            try:
                buffer.grow(target)
            except OSError as exc:
                self.release(buffer)
                raise_if_out_of_space(exc, f"growing {buffer.path} to {target} bytes")
                raise
            buffer.prefault(old_size)  # the pages it had are warm already
        self.pinning.register(buffer)  # no-op without CUDA or when already registered
        return buffer

    def release(self, buffer: _core.ShmBuffer) -> None:
        """Give back a buffer that was acquired but not placed (e.g. a failed save).

        A buffer whose file was removed meanwhile is closed instead: its memory cannot be reused.
        """
        if not os.path.exists(buffer.path):
            self._close(buffer)
            return
        self._add_free(buffer)

    def place(self, buffer: _core.ShmBuffer, object_path: Path) -> None:
        """Rename a filled buffer into a version directory; it now backs that object."""
        existing = str(object_path)
        if os.path.exists(existing):
            self.recycle(object_path)  # leftover of an uncommitted attempt at this step
        buffer.rename_to(existing)
        with self._mutex:
            self._placed[existing] = buffer

    def placed_buffer(self, object_path: str | os.PathLike[str]) -> _core.ShmBuffer | None:
        """The buffer placed at object_path and not yet recycled or forgotten, or None (also once closed)."""
        with self._mutex:
            return self._placed.get(os.fspath(object_path))

    def recycle(self, object_path: Path) -> None:
        """Take back the file of an object whose version is retired; its pages stay for the next save."""
        key = str(object_path)
        with self._mutex:
            buffer = self._placed.pop(key, None)
        destination = self._new_buffer_path()
        try:
            if buffer is not None:
                buffer.rename_to(destination)
            else:
                os.rename(key, destination)
                buffer = _core.ShmBuffer.open(destination, writable=True)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("Could not reuse %s (%s); deleting it", key, exc)
            for path in (key, destination):
                Path(path).unlink(missing_ok=True)
            return
        self._add_free(buffer)

    def forget(self, object_path: Path) -> None:
        """Stop tracking an object file that was deleted by someone else."""
        with self._mutex:
            buffer = self._placed.pop(str(object_path), None)
        if buffer is not None:
            self._close(buffer)

    def _add_free(self, buffer: _core.ShmBuffer) -> None:
        with self._mutex:
            closed = self._closed
            if not closed:
                self._free.append(buffer)
        if closed:  # e.g. the warm-up thread finishing after a close: nobody would unmap it
            self._close(buffer)
            return
        with self._mutex:
            excess: list[_core.ShmBuffer] = []
            while len(self._free) > self.max_free:
                smallest = min(self._free, key=lambda b: b.size)
                self._free.remove(smallest)
                excess.append(smallest)
        for extra in excess:
            path = extra.path
            self._close(extra)
            Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap every buffer (files stay for the next process) and drop the pool lock; idempotent, thread-safe."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            buffers = self._free + list(self._placed.values())
            self._free, self._placed = [], {}
        with _live_pools_lock:
            _live_pools.discard(self)
        lifecycle.unregister(self)
        for buffer in buffers:
            self._close(buffer)
        if self._warmup is not None and not self._warmup.done():
            try:
                self._warmup.result(timeout=30)
            except BaseException:  # noqa: BLE001 - closing; the warm-up's error no longer matters
                pass
        os.close(self._lock_fd)

    def _close(self, buffer: _core.ShmBuffer) -> None:
        """Unmap a buffer, releasing its CUDA registration first."""
        self.pinning.unregister(buffer)
        try:
            buffer.close()
        except BufferError:
            logger.warning("Buffer %s still has views; leaving it mapped", buffer.path)

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

