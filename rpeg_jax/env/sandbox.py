"""Running untrusted Python code in a confined child process (the `python` tool's engine).

    box = PythonSandbox(SandboxLimits(timeout_s=5, cpu_s=5, memory_mb=512))
    res = box.run("print(2 ** 10)")      # SandboxResult: stdout "1024\\n", exit_code 0, report {...}

Each run gets a fresh, empty working directory (removed afterwards), no inherited environment (a
minimal PATH, HOME/TMPDIR set to the working directory, one-thread BLAS settings), stdin from
/dev/null, stdout and stderr into anonymous temporary files (bounded by RLIMIT_FSIZE; the first and
last `max_output_chars` are read back), and its own process group, which is killed (SIGKILL) when
the wall-clock timeout passes and again when the run ends, so nothing it started outlives it. The
child runs env/sandbox_child.py first, which confines itself (rlimits, identity, Landlock,
seccomp-BPF; its docstring and docs/agentic.md list what each covers and what it does not), reports
what it applied as JSON on a pipe, and only then execs the interpreter on the code. The code is
never evaluated in this process.

Thread-safe: the env's tool calls run it from several threads at once. Called by env/tools/python.py.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc")
OPEN_FILES = 256  # RLIMIT_NOFILE of the code
SETUP_TIMEOUT_S = 10.0  # the launcher confines itself in ~30 ms; this bounds a wedged one
_PATHS_SNIPPET = (
    "import json, sys, sysconfig, site\n"
    "p = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sysconfig.get_paths().values()]\n"
    "p += site.getsitepackages() if hasattr(site, 'getsitepackages') else []\n"
    "print(json.dumps({'paths': p, 'stdlib': sysconfig.get_paths()['stdlib']}))\n"
)


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock; then the process group is killed
    cpu_s: int = 10  # RLIMIT_CPU seconds (SIGXCPU, SIGKILL one second later)
    memory_mb: int = 1024  # RLIMIT_AS: address space of each process
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it writes, stdout/stderr included
    max_processes: int = 16  # RLIMIT_NPROC when the sandbox has its own user namespace (else: no new processes)
    max_output_chars: int = 4096  # characters of stdout (head) and of stderr (tail) read back


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # the process's status; None when killed by a signal or the timeout
    signal: int | None  # the signal that ended it (SIGKILL after a timeout or RLIMIT_CPU, SIGXCPU, ...)
    timed_out: bool  # the wall-clock timeout passed
    seconds: float  # wall time of the run
    report: dict = field(default_factory=dict)  # what the launcher applied; {"error": why} when it refused
    dropped_chars: int = 0  # characters of stdout + stderr not read back
    pid: int | None = None  # the child's pid, also its process group's id (killed at the end)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and "error" not in self.report


@functools.cache
def interpreter_paths(exe: str) -> tuple[tuple[str, ...], str]:
    """(directories the interpreter reads: prefixes, stdlib, site-packages; its stdlib) by asking the
    interpreter itself (a trusted snippet, once per executable)."""
    out = subprocess.run(
        [exe, "-I", "-c", _PATHS_SNIPPET], capture_output=True, text=True, timeout=60, env={}, check=True
    )
    info = json.loads(out.stdout)
    dirs = [p for p in info["paths"] if p and os.path.isdir(p)]
    dirs.append(os.path.dirname(os.path.realpath(exe)))
    return tuple(dict.fromkeys(dirs)), info["stdlib"]


def _remove_tree(path: str) -> None:
    def retry(func, p, _exc):  # a directory the code made unreadable: make it ours again
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def _read_back(f, limit: int, tail: bool) -> tuple[str, int]:
    """(text, characters dropped) of a temporary output file: its first (or last) `limit` characters."""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - 4 * limit) if tail else 0)
    text = f.read(4 * limit).decode("utf-8", errors="replace")
    dropped = max(0, size - 4 * limit)  # bytes never read: at least this many characters... or fewer
    if len(text) > limit:
        dropped += len(text) - limit
        text = text[-limit:] if tail else text[:limit]
    return text, dropped


class PythonSandbox:
    """Runs Python source in a confined child (module doc). `executable`: the interpreter (default:
    this process's)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), executable: str | None = None):
        self.limits = limits
        self.executable = executable or sys.executable
        with open(CHILD, encoding="utf-8") as f:
            self._launcher = f.read()

    def _settings(self, work: str, report_fd: int) -> dict:
        dirs, stdlib = interpreter_paths(self.executable)
        lim = self.limits
        return {
            "exe": self.executable,
            "argv": [self.executable, "-I", "-B", "-X", "utf8", "main.py"],
            "env": {
                "PATH": "/usr/bin:/bin",
                "HOME": work,
                "TMPDIR": work,
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            },
            "limits": {
                "cpu_s": lim.cpu_s,
                "memory_mb": lim.memory_mb,
                "file_mb": lim.file_mb,
                "max_processes": lim.max_processes,
                "open_files": OPEN_FILES,
            },
            "work": work,
            "read_paths": [*dirs, *SYSTEM_READ_PATHS],
            "need_paths": [stdlib],
            "report_fd": report_fd,
            "parent_pid": os.getpid(),
        }

    def run(self, code: str) -> SandboxResult:
        work = tempfile.mkdtemp(prefix="rpeg-py-")
        try:
            with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                return self._run(work, out, err)
        finally:
            _remove_tree(work)

    def _run(self, work: str, out, err) -> SandboxResult:
        lim = self.limits
        r, w = os.pipe()
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(
                [self.executable, "-I", "-S", "-c", self._launcher, json.dumps(self._settings(work, w))],
                cwd=work,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(w,),
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError, ValueError) as e:  # no interpreter: nothing ran
            os.close(r)
            why = f"cannot start {self.executable}: {type(e).__name__}: {e}"
            return SandboxResult("", "", None, None, False, time.perf_counter() - t0, {"error": why})
        finally:
            os.close(w)
        try:
            report = self._report(r)
            timed_out = False
            try:
                proc.wait(timeout=max(0.0, lim.timeout_s - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the code and whatever it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            os.close(r)
        seconds = time.perf_counter() - t0
        stdout, d1 = _read_back(out, lim.max_output_chars, tail=False)
        stderr, d2 = _read_back(err, lim.max_output_chars, tail=True)
        rc = proc.returncode
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=rc if rc >= 0 and not timed_out else None,
            signal=-rc if rc < 0 else None,
            timed_out=timed_out,
            seconds=seconds,
            report=report,
            dropped_chars=d1 + d2,
            pid=proc.pid,
        )

    @staticmethod
    def _report(fd: int) -> dict:
        """The launcher's JSON line (or {"error": ...} when it wrote none)."""
        data = b""
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
        try:
            return json.loads(data.decode() or "null") or {"error": "the launcher reported nothing"}
        except ValueError:
            return {"error": f"unreadable launcher report {data[:200]!r}"}
