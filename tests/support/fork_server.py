"""A fork server for NeMo rank processes: NeMo is imported once, each rank is a fork of that process (tests only).

Importing NeMo, Lightning and Megatron-core takes about 11 s of CPU per process on this machine, most of a
tiny 2-rank training run, and the end-to-end tests start dozens of such ranks. The server imports them once;
each rank is then forked from it and runs its script as ``__main__`` in a session of its own, with the
environment, working directory, stdout and stderr it was given, and exits as ``python script.py`` would (the
interpreter's own exit: atexit hooks, thread joins, exit status 1 and a traceback on an uncaught exception).
Everything after start-up is unchanged: a process of its own, gloo, signals, SIGKILL, its exit status.

What differs from ``python script.py``: the modules named in the preload list were imported before the fork,
under the server's environment (the test process's, without the rank variables), and the rank inherits the
server's open descriptors. No code of ml_flashpoint_nemo is imported before the fork. The launchers a user
runs (torchrun, ft_launcher, examples/launch.py on its own) are tested elsewhere with real interpreters.

Each rank has a supervisor (a fork of the server, which forks the rank and waits for it) that reports the
rank's pid and then its exit status, as Popen's returncode (negative for a signal), over the request's
socket. The server exits when the test process closes its stdin (or dies).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

REPO = Path(__file__).resolve().parents[2]
TORCH_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint")
MEGATRON_PRELOAD = (*TORCH_PRELOAD, "megatron.core", "megatron.core.dist_checkpointing",
                    "megatron.core.dist_checkpointing.strategies.fully_parallel")
NEMO_PRELOAD = (*MEGATRON_PRELOAD, "lightning.pytorch", "nemo_run", "fiddle", "nemo.lightning", "nemo.collections.llm")
_HEADER = 8  # bytes of the request's length, before its JSON


class ForkServerError(RuntimeError):
    """The fork server did not start, or lost a rank's supervisor."""


class ForkedProcess:
    """A rank forked by the server, with the part of subprocess.Popen that the launchers use (pid, poll, wait,
    communicate, and stdout/stderr pipes)."""

    def __init__(self, conn: socket.socket, timeout: float, pipes: dict[str, int], text: bool) -> None:
        self._conn = conn
        self._buffer = b""
        self._pipes = pipes  # "stdout"/"stderr" -> the read end of a pipe the rank writes
        self._text = text
        self.returncode: int | None = None
        pid = self._read_line(timeout)
        if pid is None or not pid.startswith("pid "):
            raise ForkServerError(f"the fork server did not start the rank: {pid!r}")
        self.pid = int(pid.split()[1])

    def _read_line(self, timeout: float | None) -> str | None:
        """The next line the supervisor sent; None if none came within timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            data = self._conn.recv(4096)
            if not data:
                raise ForkServerError(f"the supervisor of rank process {getattr(self, 'pid', '?')} went away")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self.wait(timeout=0.0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status; None from poll (timeout 0) while running, TimeoutExpired past any other timeout."""
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                if timeout == 0.0:
                    return None
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            self.returncode = int(line.split()[1])
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the piped stdout and stderr to their end, then wait; TimeoutExpired as Popen (call it again)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not hasattr(self, "_read"):
            self._read: dict[str, bytes] = {name: b"" for name in self._pipes}
        open_fds = {fd: name for name, fd in self._pipes.items() if fd >= 0}
        while open_fds:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable = select.select(list(open_fds), [], [], left)[0]
            if not readable:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            for fd in readable:
                data = os.read(fd, 1 << 16)
                if data:
                    self._read[open_fds[fd]] += data
                else:
                    os.close(fd)
                    self._pipes[open_fds.pop(fd)] = -1
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) or None)
        outputs = [self._read.get(name) for name in ("stdout", "stderr")]
        return tuple(out.decode(errors="replace") if self._text and out is not None else out
                     for out in outputs)  # type: ignore[return-value]


class ForkServer:
    """Starts the server process; popen() starts a rank from it (same arguments as subprocess.Popen's)."""

    def __init__(self, preload: Sequence[str] = NEMO_PRELOAD, timeout: float = 300.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="fork-server-")
        self.path = os.path.join(self._dir, "socket")
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.fork_server", self.path, *preload],
                                      cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        ready = select.select([self._proc.stdout], [], [], timeout)[0]
        line = self._proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise ForkServerError(f"the fork server did not start within {timeout:.0f} s: {line!r}")

    def popen(self, args: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
              stdout: IO[Any] | int | None = None, stderr: IO[Any] | int | None = None, text: bool = False,
              start_new_session: bool = False, timeout: float = 60.0) -> ForkedProcess:
        """Fork a rank running args = [sys.executable, script, *argv] or [sys.executable, "-m", module, *argv]
        (what the launchers pass to Popen); stdout and stderr as Popen takes them (None, a file, PIPE, STDOUT)."""
        if len(args) < 2 or args[0] != sys.executable or (args[1] == "-m" and len(args) < 3):
            raise ValueError(f"the fork server runs `{sys.executable} script|-m module ...` only, not {list(args)}")
        pipes: dict[str, int] = {}
        ends: list[int] = []  # write ends to close here once the server has its copies
        out = self._stream(stdout, 1, "stdout", pipes, ends)
        err = out if stderr == subprocess.STDOUT else self._stream(stderr, 2, "stderr", pipes, ends)
        module = args[1] == "-m"
        request = json.dumps({"module": args[2] if module else None,
                              "script": None if module else os.path.abspath(args[1]),
                              "argv": list(args[3:] if module else args[2:]),
                              "env": dict(os.environ if env is None else env), "cwd": os.fspath(cwd or os.getcwd()),
                              "new_session": start_new_session}).encode()
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.path)
            socket.send_fds(conn, [len(request).to_bytes(_HEADER, "big") + request], [out, err])
        finally:
            for fd in ends:
                os.close(fd)
        return ForkedProcess(conn, timeout, pipes, text)

    @staticmethod
    def _stream(stream: IO[Any] | int | None, default: int, name: str, pipes: dict[str, int], ends: list[int]) -> int:
        if stream is None:
            return default
        if stream == subprocess.PIPE:
            read_end, write_end = os.pipe()
            pipes[name] = read_end
            ends.append(write_end)
            return write_end
        return stream if isinstance(stream, int) else stream.fileno()

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


_servers: dict[tuple[str, ...], ForkServer] = {}
_servers_lock = threading.Lock()


def popen_preloaded(preload: Sequence[str], args: Sequence[str], **kwargs: Any) -> ForkedProcess:
    """ForkServer.popen of this test process's server for preload, started at its first use, closed at exit."""
    with _servers_lock:
        server = _servers.get(tuple(preload))
        if server is None:
            server = _servers[tuple(preload)] = ForkServer(preload)
            atexit.register(server.close)
    return server.popen(args, **kwargs)


def nemo_popen(args: Sequence[str], **kwargs: Any) -> ForkedProcess:
    """A rank forked with NeMo, Lightning, Megatron-core and torch imported (what launch_ranks' popen takes)."""
    return popen_preloaded(NEMO_PRELOAD, args, **kwargs)


# The server side.

def _serve(listener: socket.socket) -> dict[str, Any]:
    """Accept requests until stdin closes; returns only in a forked rank, with its request."""
    while True:
        readable = select.select([listener, sys.stdin], [], [], 1.0)[0]
        _reap_supervisors()
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            sys.exit(0)  # the test process closed our stdin, or died
        if listener in readable:
            conn, _ = listener.accept()
            request = _start_rank(listener, conn)
            if request is not None:
                return request


def _reap_supervisors() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    if len(fds) != 2 or len(data) < _HEADER:
        raise ForkServerError(f"malformed request: {len(data)} bytes, {len(fds)} descriptors")
    size = int.from_bytes(data[:_HEADER], "big")
    data = data[_HEADER:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ForkServerError("the request ended early")
        data += more
    return json.loads(data), fds


def _start_rank(listener: socket.socket, conn: socket.socket) -> dict[str, Any] | None:
    """Fork a supervisor, which forks the rank; returns the request in the rank, None in the server."""
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError, ForkServerError) as exc:
        print(f"fork server: {exc}", file=sys.stderr, flush=True)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork():  # the server
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    try:  # the supervisor
        listener.close()
        rank = os.fork()
        if rank == 0:
            _become_rank(request, fds, conn)
            return request
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {rank}\n".encode())
        status = os.waitpid(rank, 0)[1]
        conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except BaseException:  # noqa: BLE001 - the supervisor must never return into the server's loop
        os._exit(1)
    os._exit(0)


def _become_rank(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """Give this fork the rank's session, descriptors, directory, environment and argv."""
    conn.close()
    if request["new_session"]:
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in set(fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # OpenMP read it when torch loaded
        sys.modules["torch"].set_num_threads(int(threads))
    if request["module"]:
        sys.argv = ["-m", *request["argv"]]  # runpy puts the module's path first, as `python -m` has it
        sys.path[0] = request["cwd"]
    else:
        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = os.path.dirname(request["script"])  # as `python script.py` has it


def _main() -> None:
    path, preload = sys.argv[1], sys.argv[2:]
    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the terminal is the test process's to handle
    print("ready", flush=True)
    request = _serve(listener)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import runpy

    if request["module"]:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["script"], run_name="__main__")


if __name__ == "__main__":
    _main()
