"""The python tool's sandbox (rpeg_jax/env/sandbox.py, sandbox_child.py), attacked from inside: a socket
connect to a listener on 127.0.0.1, writes and reads outside the working directory, a fork bomb, a memory
hog, a CPU loop and a sleeping loop are refused or end within their limits, each in a few seconds; nothing
the code starts outlives the run; the working directory is fresh and removed; the environment is empty.

Where it can, each test runs under both ways the launcher confines a process started by root: dropped to
uid 65534 with its own user namespace (RLIMIT_NPROC binds: "rlimit" mode; needs an interpreter that uid
can reach, e.g. /usr/bin/python3) and uid 0 without capabilities (new processes refused: "no_fork" mode;
the trainer's interpreter under /root here). test_a_non_root_parent runs the sandbox from a uid-65534
parent, the case of a cluster user. Linux x86_64 only, like the sandbox.
"""

import errno
import json
import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from rpeg_jax.config.env import EnvConfig
from rpeg_jax.env.sandbox import PythonSandbox, SandboxLimits
from rpeg_jax.env.tools.base import FAILED, TIMEOUT
from rpeg_jax.env.tools.python import Python

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="the sandbox is for Linux x86_64"
)

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
FAST = SandboxLimits(timeout_s=5, cpu_s=2, memory_mb=256, file_mb=1, max_processes=8, max_output_chars=2000)


def _reachable_by_nobody(exe: str | None) -> bool:
    """Whether every directory above exe's real path is searchable by others (so uid 65534 reaches it)."""
    if exe is None:
        return False
    path = os.path.realpath(exe)
    while path != "/":
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
    return True


EXECUTABLES = [pytest.param(None, id="trainer_python")]
if os.geteuid() == 0 and SYSTEM_PYTHON and _reachable_by_nobody(SYSTEM_PYTHON) != _reachable_by_nobody(sys.executable):
    EXECUTABLES.append(pytest.param(SYSTEM_PYTHON, id="system_python"))


@pytest.fixture(params=EXECUTABLES)
def box(request):
    return PythonSandbox(FAST, executable=request.param)


def run(box, code: str, **limits):
    if limits:
        box = PythonSandbox(SandboxLimits(**{**FAST.__dict__, **limits}), executable=box.executable)
    return box.run(textwrap.dedent(code))


def alive_in_group(pgid: int, wait_s: float = 2.0) -> list[int]:
    """Pids of live (not zombie) processes in process group pgid, once they had `wait_s` to die (SIGKILL
    is delivered at once, but a process takes a moment to exit)."""
    deadline = time.monotonic() + wait_s
    while (alive := _alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _alive(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state ppid pgrp ...
            out.append(int(d))
    return out


def test_code_runs_and_its_output_comes_back(box):
    res = run(box, "import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)\nraise SystemExit(3)")
    assert res.stdout == "42\n" and res.stderr == "warn\n" and res.exit_code == 3 and not res.timed_out
    assert res.report.get("seccomp") is True and res.report.get("rlimits") is True, res.report
    assert res.seconds < 3


def test_a_fresh_empty_working_directory_that_is_removed(box):
    res = run(
        box,
        """
        import os
        print(sorted(os.listdir('.')))
        with open('notes.txt', 'w') as f:
            f.write('kept only during the run')
        os.makedirs('sub/dir')
        print(open('notes.txt').read())
        print(os.getcwd())
        """,
    )
    listing, text, cwd = res.stdout.splitlines()
    assert listing == "['main.py']" and text == "kept only during the run", res
    assert cwd.startswith(tempfile.gettempdir()) and not os.path.exists(cwd)


def test_no_inherited_environment(box, monkeypatch):
    monkeypatch.setenv("RPEG_SECRET_TOKEN", "hunter2")
    res = run(box, "import json, os\nprint(json.dumps(sorted(os.environ)))")
    keys = json.loads(res.stdout)
    assert "RPEG_SECRET_TOKEN" not in res.stdout
    assert set(keys) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                         "MKL_NUM_THREADS"}  # fmt: skip


def test_a_socket_connect_to_localhost_is_refused(box):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        res = run(
            box,
            f"""
            import socket
            try:
                s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
                s.sendall(b"leak")
                print("connected")
            except OSError as e:
                print("refused", e.errno)
            """,
        )
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever connected
    finally:
        server.close()
    assert res.stdout.split() == ["refused", str(errno.EPERM)], res  # socket() itself fails: seccomp


def test_a_write_outside_its_directory_is_refused(box):
    """The target directory is world-writable, so only the sandbox (Landlock) stands in the way."""
    outside = tempfile.mkdtemp(prefix="rpeg-outside-", dir="/tmp")
    os.chmod(outside, 0o777)
    target = os.path.join(outside, "escaped.txt")
    try:
        res = run(
            box,
            f"""
            import os
            for path in [{target!r}, "/tmp/rpeg-escaped-{os.getpid()}.txt"]:
                try:
                    with open(path, "w") as f:
                        f.write("x")
                    print("wrote", path)
                except OSError as e:
                    print("refused", e.errno)
            try:
                os.mkdir({outside!r} + "/d")
                print("made a directory")
            except OSError as e:
                print("refused", e.errno)
            """,
        )
        assert res.report.get("landlock_abi", 0) >= 1, f"the kernel has no Landlock here: {res.report}"
        assert res.stdout.split() == ["refused", "13"] * 3, res
        assert os.listdir(outside) == [] and not os.path.exists(f"/tmp/rpeg-escaped-{os.getpid()}.txt")
    finally:
        shutil.rmtree(outside)


def test_a_read_outside_the_interpreter_and_system_directories_is_refused(box):
    secret_dir = tempfile.mkdtemp(prefix="rpeg-secret-", dir="/tmp")
    os.chmod(secret_dir, 0o755)
    secret = os.path.join(secret_dir, "token")
    with open(secret, "w") as f:
        f.write("hunter2")
    os.chmod(secret, 0o644)  # readable by anyone: only Landlock refuses it
    try:
        res = run(box, f"print(open({secret!r}).read())")
        assert "hunter2" not in res.stdout and "PermissionError" in res.stderr, res
    finally:
        shutil.rmtree(secret_dir)


def test_seccomp_refuses_sessions_namespaces_and_sockets(box):
    res = run(
        box,
        """
        import ctypes, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        out = []
        for name, call in [
            ("setsid", os.setsid),
            ("unix_socket", lambda: socket.socket(socket.AF_UNIX)),
            ("udp_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
        ]:
            try:
                call()
                out.append(f"{name}:allowed")
            except OSError as e:
                out.append(f"{name}:{e.errno}")
        rc = libc.unshare(0x10000000)  # CLONE_NEWUSER
        out.append(f"unshare:{ctypes.get_errno() if rc else 'allowed'}")
        print(" ".join(out))
        """,
    )
    assert res.stdout.split() == ["setsid:1", "unix_socket:1", "udp_socket:1", "unshare:1"], res


def test_a_fork_bomb_is_contained_and_nothing_outlives_the_run(box):
    """Forking until refused: at most max_processes tasks (rlimit mode) or none (no_fork mode); the run
    ends at its wall-clock timeout and every process it started is gone."""
    res = run(
        box,
        """
        import os, sys, time
        n = 0
        while True:
            try:
                pid = os.fork()
            except OSError as e:
                print("refused after", n, e.errno, flush=True)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            n += 1
        time.sleep(60)
        """,
        timeout_s=2,
    )
    assert res.timed_out and res.seconds < 4, res
    words = res.stdout.split()
    assert words[:2] == ["refused", "after"], res
    forked, err = int(words[2]), int(words[3])
    if res.report["processes"] == "no_fork":
        assert (forked, err) == (0, errno.EPERM)
    else:
        assert res.report["processes"] == f"rlimit {FAST.max_processes}"
        assert 0 < forked < FAST.max_processes and err == errno.EAGAIN
    assert alive_in_group(res.pid) == []


def test_an_endless_fork_bomb_ends_at_its_timeout(box):
    res = run(
        box,
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        timeout_s=1.5,
    )
    assert res.timed_out and res.seconds < 3.5, res
    assert alive_in_group(res.pid) == []


def test_a_memory_hog_ends_with_a_memory_error(box):
    res = run(box, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))", memory_mb=256)
    assert res.exit_code == 1 and "MemoryError" in res.stderr and res.seconds < 3, res


def test_an_infinite_loop_ends_at_its_cpu_limit(box):
    res = run(box, "while True:\n    pass", cpu_s=1, timeout_s=8)
    assert res.signal in (signal.SIGXCPU, signal.SIGKILL) and not res.timed_out, res
    assert res.seconds < 6


def test_a_sleeping_loop_ends_at_its_wall_clock_timeout(box):
    res = run(box, "import time\nwhile True:\n    time.sleep(0.05)", timeout_s=1)
    assert res.timed_out and res.signal == signal.SIGKILL and 1 <= res.seconds < 2.5, res


def test_output_and_files_are_bounded(box):
    res = run(
        box,
        """
        import sys
        sys.stdout.write("a" * 3_000_000)
        sys.stdout.flush()
        try:
            with open("big.bin", "wb") as f:
                f.write(b"x" * (2 << 20))
            print("wrote 2 MiB")
        except OSError as e:
            print("refused", e.errno, file=sys.stderr)
        """,
        file_mb=1,
    )
    assert len(res.stdout) == FAST.max_output_chars and res.dropped_chars > 0
    assert f"refused {errno.EFBIG}" in res.stderr or "File too large" in res.stderr, res


def test_a_missing_interpreter_runs_nothing_and_says_so():
    res = PythonSandbox(FAST, executable="/nonexistent/python3").run("print(1)")
    assert not res.ok and "cannot start" in res.report["error"] and res.stdout == ""


def test_the_python_tool_reports_failures_as_error_results():
    tool = Python(EnvConfig(tool_timeout_s=1.5, python_cpu_s=1, python_memory_mb=256))
    ok = tool.run({"code": "print(sum(range(10)))"})
    assert ok.content == "45\n" and ok.error is None and ok.metadata["report"]["seccomp"] is True
    failed = tool.run({"code": "1/0"})
    assert failed.error == FAILED and "ZeroDivisionError" in failed.content and "[exit status 1]" in failed.content
    slept = tool.run({"code": "import time\ntime.sleep(30)"})
    assert slept.error == TIMEOUT and "[timed out after 1.5 s]" in slept.content
    quiet = tool.run({"code": "x = 1"})
    assert quiet.content == "[no output]" and quiet.error is None


_NON_ROOT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
mod = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
box = mod.PythonSandbox(mod.SandboxLimits(timeout_s=3, cpu_s=2, memory_mb=256, max_processes=6))
code = '''
import os, socket
n = 0
try:
    while True:
        if os.fork() == 0:
            import time; time.sleep(30)
        n += 1
except OSError as e:
    print("forks", n, e.errno)
try:
    open(ESCAPE, "w")
    print("wrote")
except OSError as e:
    print("write", e.errno)
try:
    socket.socket()
except OSError as e:
    print("socket", e.errno)
'''
res = box.run(code.replace("ESCAPE", repr(sys.argv[2])))
print(json.dumps({"stdout": res.stdout, "stderr": res.stderr, "report": res.report}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not _reachable_by_nobody(SYSTEM_PYTHON), reason="needs root to start a uid-65534 parent"
)
def test_a_non_root_parent(tmp_path):
    """The trainer as an ordinary user (uid 65534 here): the sandbox keeps its uid, gets its own user
    namespace (so RLIMIT_NPROC counts only its own processes), and refuses the same things."""
    sandbox_py = os.path.join(os.path.dirname(__file__), os.pardir, "rpeg_jax", "env", "sandbox.py")
    child_py = os.path.join(os.path.dirname(sandbox_py), "sandbox_child.py")
    for f in (sandbox_py, child_py):
        if not os.stat(f).st_mode & stat.S_IROTH:
            pytest.skip("the sources are not readable by uid 65534")

    escape = f"/tmp/rpeg-nonroot-escape-{os.getpid()}.txt"
    out = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", _NON_ROOT, os.path.abspath(sandbox_py), escape],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        user=65534,
        group=65534,
        extra_groups=[],
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["report"]["identity"] == "uid 65534 (the parent's)" and res["report"]["processes"] == "rlimit 6"
    assert res["stdout"].split() == ["forks", "5", str(errno.EAGAIN), "write", "13", "socket", "1"], res
    assert not os.path.exists(escape)
