"""The fork server that starts the NeMo and scenario ranks (tests/support/fork_server.py) must behave as
`python script.py` / `python -m module` under subprocess.Popen would: argv, environment, directory, session,
stdout/stderr, exit status (signals negative), tracebacks, and a normal interpreter exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import fork_server
from tests.support.fork_server import ForkServer, ForkServerError

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys
    atexit.register(lambda: print("atexit ran", flush=True))
    mode = sys.argv[1]
    if mode == "report":
        torch = sys.modules.get("torch")
        print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "path": sys.path[:3],
                          "env": os.environ.get("FORK_TEST"), "rank": os.environ.get("RANK"),
                          "sid_is_pid": os.getsid(0) == os.getpid(), "preloaded": "json" in sys.modules,
                          "threads": torch.get_num_threads() if torch else None}))
        print("to stderr", file=sys.stderr)
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise ValueError("the script failed")
    elif mode == "kill":
        os.kill(os.getpid(), 9)
    elif mode == "sleep":
        import time
        time.sleep(60)
    """)


@pytest.fixture(scope="module")
def server():
    server = ForkServer(preload=("json",))
    yield server
    server.close()


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    return str(path)


def run(server: ForkServer, args: list[str], **kwargs) -> tuple[int | None, str, str]:
    proc = server.popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        **kwargs)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_a_script_gets_its_argv_environment_directory_and_session_and_exits_normally(server, script, tmp_path):
    env = dict(os.environ, FORK_TEST="given", RANK="1")
    code, out, err = run(server, [script, "report", "x y"], env=env, cwd=tmp_path, start_new_session=True)
    assert code == 0, err
    report = json.loads(out.splitlines()[0])
    assert report["argv"] == [script, "report", "x y"] and report["name"] == "__main__"
    assert report["cwd"] == str(tmp_path) and report["path"][0] == str(tmp_path)
    assert report["env"] == "given" and report["rank"] == "1"
    assert report["sid_is_pid"] and report["preloaded"]
    assert out.splitlines()[1] == "atexit ran" and err == "to stderr\n"


def test_exit_codes_tracebacks_and_signals_are_reported_as_popen_does(server, script):
    assert run(server, [script, "exit", "3"])[0] == 3
    code, _, err = run(server, [script, "raise"])
    assert code == 1 and "ValueError: the script failed" in err and "Traceback" in err
    code, out, _ = run(server, [script, "kill"])
    assert code == -signal.SIGKILL and "atexit ran" not in out


def test_a_module_runs_as_python_dash_m_runs_it(server, script, tmp_path):
    (tmp_path / "fork_probe.py").write_text(Path(script).read_text())
    code, out, err = run(server, ["-m", "fork_probe", "report"], cwd=tmp_path)
    assert code == 0, err
    report = json.loads(out.splitlines()[0])
    assert report["argv"] == [str(tmp_path / "fork_probe.py"), "report"] and report["name"] == "__main__"
    assert report["path"][0] == str(tmp_path)
    with pytest.raises(ValueError, match="runs"):
        server.popen(["/bin/true"])


def test_poll_wait_and_a_killed_session(server, script):
    proc = server.popen([sys.executable, script, "sleep"], start_new_session=True)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_a_rank_of_a_torch_server_uses_the_thread_count_its_environment_asks_for(script):
    server = ForkServer(preload=("torch",))
    try:
        code, out, err = run(server, [script, "report"], env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert code == 0, err
        assert json.loads(out.splitlines()[0])["threads"] == 1
    finally:
        server.close()


def test_a_server_that_cannot_start_says_so():
    started = time.monotonic()
    with pytest.raises(ForkServerError, match="did not start"):
        ForkServer(preload=("no_such_module_anywhere",))
    assert time.monotonic() - started < 60


def test_a_request_whose_import_time_environment_differs_is_refused_and_pythonpath_is_applied(server, script,
                                                                                             tmp_path):
    for name, value in (("PYTHONHASHSEED", "7"), ("TORCH_DISTRIBUTED_DEBUG", "DETAIL")):
        with pytest.raises(ForkServerError, match=name):
            server.popen([sys.executable, script, "report"], env=dict(os.environ, **{name: value}))
    with pytest.raises(FileNotFoundError):
        server.popen([sys.executable, script, "report"], cwd=tmp_path / "missing")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    code, out, err = run(server, [script, "report"], env=env)
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["path"][1:] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_a_dead_server_is_replaced_and_ranks_of_a_per_rank_server_see_their_rank_at_import(script):
    env = dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    preload = ("json", "tests.support.fork_server")  # a module imported before the fork, under the server's env
    first = fork_server.popen_preloaded(preload, [sys.executable, script, "exit", "0"], per_rank=True, env=env)
    assert first.wait(timeout=60) == 0
    server = fork_server._servers[(preload, ("1", "1", "2", "2"))]
    assert server.env["RANK"] == "1"
    server._proc.kill()
    server._proc.wait()
    second = fork_server.popen_preloaded(preload, [sys.executable, script, "exit", "5"], per_rank=True, env=env)
    assert second.wait(timeout=60) == 5
    assert fork_server._servers[(preload, ("1", "1", "2", "2"))] is not server


def test_what_the_imports_set_in_the_environment_is_neither_compared_nor_lost(tmp_path, script):
    """joblib (imported with NeMo) sets KMP_INIT_AT_FORK when imported, in the server and, later, in the test
    process: a request made before or after that is served, and its rank sees the variable as its own import
    would have left it."""
    (tmp_path / "sets_env.py").write_text("import os\nos.environ.setdefault('KMP_FORK_TEST', 'FALSE')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("KMP_FORK_TEST", None)
    server = ForkServer(preload=("sets_env",), env=env)
    try:
        assert server.set_by_imports == {"KMP_FORK_TEST": "FALSE"}
        probe = "import os, sys; sys.exit(0 if os.environ.get('KMP_FORK_TEST') == 'FALSE' else 3)"
        (tmp_path / "probe.py").write_text(probe)
        for request_env in (env, dict(env, KMP_FORK_TEST="FALSE")):
            proc = server.popen([sys.executable, str(tmp_path / "probe.py")], env=request_env)
            assert proc.wait(timeout=60) == 0
    finally:
        server.close()


def test_a_server_is_replaced_when_this_process_environment_changed_but_a_request_overriding_it_is_refused(
        script, monkeypatch):
    preload = ("json", "tests.support.fork_server", "tests")
    assert fork_server.popen_preloaded(preload, [sys.executable, script, "exit", "0"]).wait(timeout=60) == 0
    first = fork_server._servers[(preload, ())]
    monkeypatch.setenv("KMP_FORK_DRIFT", "FALSE")  # as a library imported here later would
    proc = fork_server.popen_preloaded(preload, [sys.executable, script, "report"], stdout=subprocess.PIPE,
                                       text=True)
    assert proc.communicate(timeout=60)[0] and proc.returncode == 0
    assert fork_server._servers[(preload, ())] is not first and not first.alive
    with pytest.raises(ForkServerError, match="KMP_FORK_DRIFT"):
        fork_server.popen_preloaded(preload, [sys.executable, script, "report"],
                                    env=dict(os.environ, KMP_FORK_DRIFT="TRUE"))


def test_a_rank_is_measured_exactly_when_its_environment_asks_for_coverage(tmp_path):
    """conftest's unmeasured tests drop coverage's variables: their ranks must then run untraced although their
    server is measured, and a measured rank must be traced although its server was started unmeasured."""
    import coverage

    config = coverage.Coverage(data_file=str(tmp_path / "data"), config_file=False).config.serialize()
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\ncov = sys.modules.get('coverage')\n"
                     "print(cov is not None and cov.Coverage.current() is not None)\n")
    plain = {name: value for name, value in os.environ.items() if name not in fork_server.COVERAGE_VARIABLES}
    measured = dict(plain, COVERAGE_PROCESS_CONFIG=config)
    for server_env in (measured, plain):
        server = ForkServer(preload=("json",), env=server_env)
        try:
            for env, expected in ((measured, "True"), (plain, "False")):
                code, out, err = run(server, [str(probe)], env=env)
                assert (code, out.strip()) == (0, expected), (server_env is measured, err)
        finally:
            server.close()
