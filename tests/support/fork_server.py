"""A fork server for NeMo and scenario rank processes: heavy modules imported once, each rank a fork (tests only).

Importing NeMo, Lightning and Megatron-core takes about 11 s of CPU per process on this machine, most of a
tiny 2-rank training run, and the tests start hundreds of rank processes. A server imports the preload list
once; each rank is then forked from it and runs its script (or module) as ``__main__`` in a session of its
own, with the environment, working directory, stdout and stderr it was given, and exits as ``python
script.py`` would (the interpreter's own exit: atexit hooks, thread joins, status 1 and a traceback on an
uncaught exception). Everything after start-up is its own: process, gloo, signals, SIGKILL, exit status.

What differs from ``python script.py``, and how it is kept from mattering:
- The preloaded modules were imported under the server's environment. A server is started with the
  environment of its first request; a request whose variables read at import (``TORCH_*``, ``NEMO_*``,
  ``PYTHON*``, thread counts...) differ from its server's is refused, except OMP_NUM_THREADS (applied with
  torch.set_num_threads), PYTHONPATH (its entries are put on sys.path) and what the preloaded imports set
  themselves (a rank gets those, as its own imports would have set them). NeMo reads the rank at import
  (its logger's rank 0), so NeMo ranks get a server per rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE),
  which also gives each rank its own string-hash seed; torch and Megatron read no rank at import.
- A rank inherits the server's open descriptors and its multiprocessing authkey is replaced.
- No code of ml_flashpoint_nemo is imported before the fork, so the preload runs untraced under coverage; a rank
  is traced exactly when its environment asks coverage to start, as a fresh interpreter would be.
- The preloaded objects are frozen (gc.freeze, as the gc module's documentation advises for a server that forks):
  a rank's cyclic collections, and its exit, skip them. Without it each collection walks the whole preloaded heap,
  writing to every page of it (copy-on-write), and a NeMo rank's normal exit took ~6 s more on 2 cores. What a rank
  creates is collected as usual; a frozen object is never freed, nor listed by gc.get_objects or gc.get_referrers.
The launchers a user runs (torchrun, ft_launcher, examples/launch.py on its own, the CLI) are tested with
real interpreters elsewhere.

Each rank has a supervisor (a fork of the server that forks the rank and waits for it); it reports the rank's
pid and then its exit status, as Popen's returncode (negative for a signal), over the request's socket.
A server exits when the test process closes its stdin (or dies); a dead server is replaced.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

REPO = Path(__file__).resolve().parents[2]
TORCH_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint")
MEGATRON_PRELOAD = (*TORCH_PRELOAD, "megatron.core", "megatron.core.dist_checkpointing",
                    "megatron.core.dist_checkpointing.strategies.fully_parallel")
NEMO_PRELOAD = (*MEGATRON_PRELOAD, "lightning.pytorch", "nemo_run", "fiddle", "nemo.lightning", "nemo.collections.llm")
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# Variables that the interpreter, torch, NeMo or the thread pools read when they start or are imported.
_IMPORT_TIME_PREFIXES = ("TORCH_", "NEMO_", "PYTHON", "CUDA_", "NCCL_", "OMP_", "KMP_", "GOMP_", "MKL_",
                         "OPENBLAS_", "MALLOC_")
_APPLIED_AFTER_FORK = {"OMP_NUM_THREADS", "PYTHONPATH"}
_HEADER = 8  # bytes of the request's length, before its JSON
COVERAGE_VARIABLES = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")  # what starts coverage in a new process


class ForkServerError(RuntimeError):
    """The fork server did not start, refused a request, or lost a rank's supervisor."""


def _readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """The fds that are readable (or closed) within timeout (None: no bound); poll(), so any fd number works."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in poller.poll(None if timeout is None else max(0, int(timeout * 1000)))]


class ForkedProcess:
    """A rank forked by the server, with the part of subprocess.Popen that the launchers use (pid, poll, wait,
    communicate, and stdout/stderr pipes)."""

    def __init__(self, conn: socket.socket, timeout: float, pipes: dict[str, int], text: bool) -> None:
        self._conn = conn
        self._buffer = b""
        self._pipes = pipes  # "stdout"/"stderr" -> the read end of a pipe the rank writes; -1 once at its end
        self._read = {name: b"" for name in pipes}
        self._text = text
        self.returncode: int | None = None
        self.pid = -1
        try:
            pid = self._read_line(timeout)
        except ForkServerError:
            pid = None
        if pid is None or not pid.startswith("pid "):
            self._close()  # the supervisor then kills a rank that starts late
            raise ForkServerError(f"the fork server did not start the rank within {timeout:.0f} s: {pid!r}")
        self.pid = int(pid.split()[1])

    def _read_line(self, timeout: float | None) -> str | None:
        """The next line the supervisor sent; None if none came within timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if not _readable([self._conn.fileno()], None if deadline is None else deadline - time.monotonic()):
                return None
            data = self._conn.recv(4096)
            if not data:
                raise ForkServerError(f"the supervisor of rank process {self.pid} went away")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _wait(self, timeout: float | None) -> int | None:
        """The exit status, or None if the rank still runs after timeout (None: no bound)."""
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                return None
            self.returncode = int(line.split()[1])
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the piped stdout and stderr to their end, then wait; TimeoutExpired as Popen (call it again)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            if deadline is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            return remaining

        open_fds = {fd: name for name, fd in self._pipes.items() if fd >= 0}
        while open_fds:
            for fd in _readable(list(open_fds), left()):
                data = os.read(fd, 1 << 16)
                if data:
                    self._read[open_fds[fd]] += data
                else:
                    os.close(fd)
                    self._pipes[open_fds.pop(fd)] = -1
        while self._wait(left()) is None:
            pass
        outputs = [self._read.get(name) for name in ("stdout", "stderr")]
        return tuple(out.decode(errors="replace") if self._text and out is not None else out
                     for out in outputs)  # type: ignore[return-value]

    def _close(self) -> None:
        self._conn.close()
        for name, fd in self._pipes.items():
            if fd >= 0:
                os.close(fd)
                self._pipes[name] = -1


class ForkServer:
    """Starts the server process; popen() starts a rank from it (same arguments as subprocess.Popen's)."""

    def __init__(self, preload: Sequence[str] = NEMO_PRELOAD, env: Mapping[str, str] | None = None,
                 timeout: float = 300.0) -> None:
        self.env = dict(os.environ if env is None else env)
        self._dir = tempfile.mkdtemp(prefix="fork-server-")
        self.path = os.path.join(self._dir, "socket")
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.fork_server", self.path, *preload],
                                      cwd=REPO, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        ready = _readable([self._proc.stdout.fileno()], timeout)
        line = self._proc.stdout.readline() if ready else b""
        if not line.startswith(b"ready "):
            self.close()
            raise ForkServerError(f"the fork server for {list(preload)} did not start within {timeout:.0f} s: "
                                  f"{line!r} (its stderr is above)")
        # What its imports put into its environment (e.g. joblib's KMP_INIT_AT_FORK): a fresh process would
        # have done the same, so these are not compared and a rank gets them unless its request sets them.
        self.set_by_imports: dict[str, str] = json.loads(line[len(b"ready "):])

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def popen(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdout: IO[Any] | int | None = None,
              stderr: IO[Any] | int | None = None, text: bool = False, start_new_session: bool = False,
              timeout: float = 60.0) -> ForkedProcess:
        """Fork a rank running args = [sys.executable, script, *argv] or [sys.executable, "-m", module, *argv]
        (what the launchers pass to Popen); stdout and stderr as Popen takes them (None, a file, PIPE, STDOUT)."""
        if len(args) < 2 or args[0] != sys.executable or (args[1] == "-m" and len(args) < 3):
            raise ValueError(f"the fork server runs `{sys.executable} script|-m module ...` only, not {list(args)}")
        env = dict(os.environ if env is None else env)
        differ = self.import_time_differences(env)
        if differ:
            raise ForkServerError(f"{differ} differ from the fork server's environment and are read at start-up "
                                  "or import: start this process with subprocess.Popen instead")
        cwd = os.fspath(cwd or os.getcwd())
        if not os.path.isdir(cwd):
            raise FileNotFoundError(f"no such directory: {cwd!r}")
        pipes: dict[str, int] = {}
        ends: list[int] = []  # write ends to close here once the server has its copies
        out = self._stream(stdout, 1, "stdout", pipes, ends)
        err = out if stderr == subprocess.STDOUT else self._stream(stderr, 2, "stderr", pipes, ends)
        module = args[1] == "-m"
        env = {**self.set_by_imports, **env}
        request = json.dumps({"module": args[2] if module else None,
                              "script": None if module else os.path.abspath(args[1]),
                              "argv": list(args[3:] if module else args[2:]), "env": env, "cwd": cwd,
                              "new_session": start_new_session}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [len(request).to_bytes(_HEADER, "big") + request], [out, err])
        except BaseException:
            conn.close()
            for fd in pipes.values():
                os.close(fd)
            raise
        finally:
            for fd in ends:
                os.close(fd)
        return ForkedProcess(conn, timeout, pipes, text)

    def import_time_differences(self, env: Mapping[str, str]) -> list[str]:
        """The variables read at start-up or import whose value in env differs from the one the server's imports
        ran under (a variable those imports set counts as equal when env does not set it: the rank gets it)."""
        def differs(name: str) -> bool:
            if name in self.set_by_imports:
                return name in env and env[name] != self.set_by_imports[name]
            return env.get(name) != self.env.get(name)

        return sorted(name for name in set(env) | set(self.env)
                      if name.startswith(_IMPORT_TIME_PREFIXES) and name not in _APPLIED_AFTER_FORK and differs(name))

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
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)  # idempotent: a replaced server is closed again at exit


_servers: dict[tuple[tuple[str, ...], tuple[str | None, ...]], ForkServer] = {}
_servers_lock = threading.Lock()


def popen_preloaded(preload: Sequence[str], args: Sequence[str], *, per_rank: bool = False,
                    env: Mapping[str, str] | None = None, **kwargs: Any) -> ForkedProcess:
    """ForkServer.popen of this test process's server for preload (one per rank with per_rank), started at its
    first use from that request's environment, closed at exit. It is replaced when it died, and when this test
    process's own environment has changed since in a variable read at import (e.g. by a library imported here
    later: joblib sets KMP_INIT_AT_FORK), so that its ranks import under the environment they are given; a
    request that sets such a variable to something else than this process has is refused (ForkServer.popen)."""
    env = dict(os.environ if env is None else env)
    key = (tuple(preload), tuple(env.get(name) for name in RANK_VARIABLES) if per_rank else ())
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and not server.alive:
            server.close()
            server = None
        drifted = server.import_time_differences(env) if server is not None else []
        if drifted and all(env.get(name) == os.environ.get(name) for name in drifted):
            server.close()  # type: ignore[union-attr]
            server = None
        if server is None:
            server = _servers[key] = ForkServer(preload, env)
            atexit.register(server.close)
    return server.popen(args, env=env, **kwargs)


def nemo_popen(args: Sequence[str], **kwargs: Any) -> ForkedProcess:
    """A rank forked with NeMo, Lightning, Megatron-core and torch imported (what launch_ranks' popen takes)."""
    return popen_preloaded(NEMO_PRELOAD, args, per_rank=True, **kwargs)


# The server side.

def _serve(listener: socket.socket) -> dict[str, Any]:
    """Accept requests until stdin closes; returns only in a forked rank, with its request."""
    while True:
        readable = _readable([listener.fileno(), 0], 1.0)
        _reap_supervisors()
        if 0 in readable and not os.read(0, 4096):
            sys.exit(0)  # the test process closed our stdin, or died
        if listener.fileno() in readable:
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
    conn.settimeout(30)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    if len(fds) != 2 or len(data) < _HEADER:
        for fd in fds:
            os.close(fd)
        raise ForkServerError(f"malformed request: {len(data)} bytes, {len(fds)} descriptors")
    size = int.from_bytes(data[:_HEADER], "big")
    data = data[_HEADER:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ForkServerError("the request ended early")
        data += more
    conn.settimeout(None)
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
    rank = 0
    try:  # the supervisor (and, after the next fork, the rank's set-up)
        listener.close()
        rank = os.fork()
        if rank == 0:
            _become_rank(request, fds, conn)
            return request
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"pid {rank}\n".encode())
        except OSError:  # the test process gave up waiting: nobody would reap or kill this rank
            try:
                os.kill(rank, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = os.waitpid(rank, 0)[1]
        try:
            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass
    except BaseException:  # noqa: BLE001 - neither may return into the server's loop
        traceback.print_exc()  # the rank's stderr once _become_rank redirected it, else the server's
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _become_rank(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """Give this fork the rank's session, descriptors, directory, environment, argv and sys.path."""
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
    server_pythonpath = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(request["env"])
    _measure_as_requested()
    import multiprocessing

    multiprocessing.current_process().authkey = os.urandom(32)  # as a fresh interpreter draws its own
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # OpenMP read it when torch loaded
        sys.modules["torch"].set_num_threads(int(threads))
    if request["module"]:
        sys.argv = ["-m", *request["argv"]]  # runpy puts the module's path first, as `python -m` has it
        sys.path[0] = request["cwd"]
    else:
        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = os.path.dirname(request["script"])  # as `python script.py` has it
    pythonpath = os.environ.get("PYTHONPATH", "")
    if pythonpath != server_pythonpath:  # the interpreter puts PYTHONPATH's entries right after sys.path[0]
        sys.path[1:1] = [os.path.abspath(entry) for entry in pythonpath.split(os.pathsep) if entry]


def _running_coverage() -> Any:
    """The coverage measurement running in this process (scripts/coverage.sh), or None."""
    if "coverage" not in sys.modules:
        return None
    return sys.modules["coverage"].Coverage.current()


def _measure_as_requested() -> None:
    """Measure a rank's coverage exactly when a fresh interpreter with its environment would: coverage's
    subprocess patch asks for it through COVERAGE_PROCESS_CONFIG, which an unmeasured test removes (conftest)."""
    wanted = any(os.environ.get(name) for name in COVERAGE_VARIABLES)
    measuring = _running_coverage()
    if measuring is not None and not wanted:
        measuring.stop()
    elif measuring is None and wanted:
        import coverage

        coverage.process_startup(force=True)


def _main() -> None:
    path, preload = sys.argv[1], sys.argv[2:]
    before = dict(os.environ)
    measuring = _running_coverage()
    if measuring is not None:  # the preload runs no code of ours; traced, it takes ~50% more CPU
        measuring.stop()
    for name in preload:
        importlib.import_module(name)
    if measuring is not None:
        measuring.start()
    set_by_imports = {name: value for name, value in os.environ.items() if before.get(name) != value}
    if threading.active_count() != 1:  # a fork would copy a lock another thread may hold
        sys.exit(f"fork server: importing {preload} started Python threads {threading.enumerate()}; "
                 "forking it is not safe")
    gc.collect()  # the imports' garbage, not to be frozen with the rest
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the terminal is the test process's to handle
    print("ready", json.dumps(set_by_imports), flush=True)
    request = _serve(listener)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import runpy

    if request["module"]:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["script"], run_name="__main__")


if __name__ == "__main__":
    _main()
