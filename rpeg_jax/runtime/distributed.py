"""Multi-host start-up: where the coordinator is, `jax.distributed.initialize`, and a watchdog
that turns a lost process into a prompt, named, non-zero exit instead of a hang.

Callers: launch/multihost.py (the only entry point that initialises), tests.

Where the distributed parameters come from, first found wins:
  1. flags / the config's `distributed.coordinator, num_processes, process_id`;
  2. JAX's variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
  3. SLURM (SLURM_NTASKS > 1): SLURM_PROCID, SLURM_NTASKS, the first host of
     SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) and port RPEG_COORDINATOR_PORT, JAX_COORDINATOR_PORT
     or one derived from SLURM_JOB_ID (as JAX's own SLURM detection does, so all tasks agree);
  4. none of these: a single process, no initialisation.

Failure detection. Each process bumps a heartbeat counter in the coordination service's
key-value store every `timeout / 6` seconds and reads everyone's. A peer whose counter has not
moved for `distributed.heartbeat_timeout_s` (and that has not announced a clean exit) is lost:
the watchdog prints "rpeg: lost process K ..." and ends this process with exit code 75 even if
the main thread is stuck inside a collective. JAX's own heartbeat is set to a longer timeout as
a backstop. If process 0 itself dies, the coordination service dies with it and JAX aborts the
other processes at once (exit 134, its message names "the leader task", i.e. process 0).
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a scheduler may requeue the job
_HB, _DONE = "rpeg/heartbeat/", "rpeg/done/"


class DistributedInitError(RuntimeError):
    """jax.distributed.initialize failed; the message names the coordinator and the source."""


@dataclass(frozen=True)
class DistributedSpec:
    coordinator: str | None
    num_processes: int
    process_id: int
    source: str  # "flags" | "jax-env" | "slurm" | "single"

    @property
    def multi(self) -> bool:
        return self.num_processes > 1


def first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: 'nid[001-004,007],gpu9' -> 'nid001'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise DistributedInitError(f"cannot parse SLURM nodelist {nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def resolve_spec(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedSpec:
    """Decide coordinator / number of processes / process id (see the module docstring)."""
    env = os.environ if env is None else env
    if coordinator is not None or num_processes is not None or process_id is not None:
        missing = [
            n
            for n, v in (("coordinator", coordinator), ("num_processes", num_processes), ("process_id", process_id))
            if v is None
        ]
        if missing and num_processes != 1:
            raise DistributedInitError(
                f"distributed: {', '.join(missing)} missing; give coordinator, num_processes and process_id together"
            )
        return DistributedSpec(coordinator, int(num_processes or 1), int(process_id or 0), "flags")
    if "JAX_COORDINATOR_ADDRESS" in env and "JAX_NUM_PROCESSES" in env:
        return DistributedSpec(
            env["JAX_COORDINATOR_ADDRESS"],
            int(env["JAX_NUM_PROCESSES"]),
            int(env.get("JAX_PROCESS_ID", "0")),
            "jax-env",
        )
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    if "SLURM_JOB_ID" in env and ntasks > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise DistributedInitError("SLURM job without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST")
        port = (
            env.get("RPEG_COORDINATOR_PORT")
            or env.get("JAX_COORDINATOR_PORT")
            or str(int(env["SLURM_JOB_ID"]) % 2**12 + (65535 - 2**12 + 1))
        )
        return DistributedSpec(f"{first_host(nodes)}:{port}", ntasks, int(env["SLURM_PROCID"]), "slurm")
    return DistributedSpec(None, 1, 0, "single")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind_address(coordinator: str, configured: str | None = None) -> str:
    """Where process 0's coordination service listens: `configured` (distributed.bind_address),
    else the coordinator's address itself when it is a loopback one (local processes: nothing
    outside this machine can reach the service), else every interface on its port (JAX's own
    default; on a cluster a node's name may resolve to a loopback alias on that node)."""
    if configured:
        return configured
    host, _, port = coordinator.rpartition(":")
    return coordinator if host.strip("[]") in LOOPBACK else f"[::]:{port}"


def initialize(
    spec: DistributedSpec,
    heartbeat_timeout_s: float,
    initialization_timeout_s: float,
    cpu_collectives: str = "gloo",
    bind: str | None = None,
) -> None:
    """`jax.distributed.initialize` for `spec` (no-op for one process), its service on process 0
    listening on `bind_address(spec.coordinator, bind)`. Any failure raises DistributedInitError
    naming the coordinator, the process and where they came from."""
    if not spec.multi:
        return
    import jax

    where = (
        f"coordinator={spec.coordinator}, num_processes={spec.num_processes}, process_id={spec.process_id} "
        f"(from {spec.source})"
    )
    if spec.process_id != 0:  # JAX aborts the process on a connect timeout; report it ourselves first
        wait_for_coordinator(spec.coordinator, initialization_timeout_s, where)
    try:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        jax.distributed.initialize(
            spec.coordinator,
            spec.num_processes,
            spec.process_id,
            initialization_timeout=max(1, math.ceil(initialization_timeout_s)),
            # JAX's own detection is the backstop; ours (Watchdog) reports first, by name.
            heartbeat_timeout_seconds=max(2, math.ceil(1.5 * heartbeat_timeout_s + 5)),
            shutdown_timeout_seconds=max(2, math.ceil(heartbeat_timeout_s)),
            coordinator_bind_address=bind_address(spec.coordinator, bind),
        )
    except Exception as e:
        raise DistributedInitError(
            f"jax.distributed.initialize failed for {where}: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
        ) from e


def wait_for_coordinator(address: str, timeout_s: float, where: str = "") -> None:
    """Poll a TCP connection to the coordinator until it accepts or `timeout_s` passes."""
    import socket

    host, _, port = address.rpartition(":")
    end, last = time.monotonic() + timeout_s, None
    while time.monotonic() < end:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise DistributedInitError(
        f"coordinator {address} not reachable within {timeout_s:g} s "
        f"(distributed.initialization_timeout_s) for {where or address}: "
        f"{type(last).__name__}: {last}"
    )


def _client():
    from jax._src import distributed as _dist  # the coordination-service client (no public handle)

    client = getattr(_dist.global_state, "client", None)
    if client is None:
        raise DistributedInitError("jax.distributed is not initialized")
    return client


class Watchdog:
    """Heartbeats through the coordination service's key-value store; ends the process with
    EXIT_PEER_LOST and a message naming the lost process(es) when a peer goes silent."""

    def __init__(
        self,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        client: Any = None,
        interval_s: float | None = None,
        exit_fn=os._exit,
        stream=None,
    ):
        self.pid, self.n, self.timeout = process_id, num_processes, float(timeout_s)
        self.interval = interval_s or max(0.05, min(2.0, self.timeout / 6))
        self.client = client if client is not None else _client()
        self.exit_fn, self.stream = exit_fn, stream or sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rpeg-watchdog", daemon=True)
        self.lost: list[int] = []

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self, clean: bool = True) -> None:
        """Stop watching; with `clean`, tell the peers this process is leaving on purpose."""
        self._stop.set()
        self._thread.join(timeout=5)
        if clean:
            try:
                self.client.key_value_set(f"{_DONE}{self.pid}", "1", allow_overwrite=True)
            except Exception:  # the service may already be gone at exit; nothing left to tell
                pass

    def await_verdict(self, seconds: float) -> list[int]:
        """Wait up to `seconds` for the watchdog to find a lost peer (it then exits the process);
        returns the lost processes, [] if none was found."""
        end = time.monotonic() + seconds
        while not self.lost and self._thread.is_alive() and time.monotonic() < end:
            time.sleep(min(0.1, self.interval))
        return self.lost

    def _read(self, prefix: str) -> dict[int, str]:
        return {int(k.rsplit("/", 1)[-1]): v for k, v in self.client.key_value_dir_get(prefix)}

    def _run(self) -> None:
        start = time.monotonic()
        seen = {p: (None, start) for p in range(self.n) if p != self.pid}
        beat, failing_since = 0, None
        while not self._stop.wait(self.interval if beat else 0):
            now = time.monotonic()
            try:
                beat += 1
                self.client.key_value_set(f"{_HB}{self.pid}", str(beat), allow_overwrite=True)
                beats, done = self._read(_HB), self._read(_DONE)
                failing_since = None
            except Exception as e:  # the coordinator (process 0) is unreachable
                failing_since = failing_since or now
                if now - failing_since > self.timeout:
                    self._lose([0], f"coordination service unreachable for {now - failing_since:.1f} s ({e})")
                continue
            for p in seen:
                if beats.get(p) != seen[p][0]:
                    seen[p] = (beats.get(p), now)
            lost = [p for p in seen if p not in done and now - seen[p][1] > self.timeout]
            if lost:
                self._lose(
                    lost,
                    f"no heartbeat for {max(now - seen[p][1] for p in lost):.1f} s > "
                    f"distributed.heartbeat_timeout_s={self.timeout:g}",
                )

    def _lose(self, lost: list[int], why: str) -> None:
        self.lost = lost
        names = ", ".join(str(p) for p in lost)
        print(
            f"rpeg: lost process {names} of {self.n} ({why}); process {self.pid} exits with code {EXIT_PEER_LOST}",
            file=self.stream,
            flush=True,
        )
        self._stop.set()
        self.exit_fn(EXIT_PEER_LOST)


def is_primary() -> bool:
    """True on process 0: the one that writes metrics and log lines."""
    import jax

    return jax.process_index() == 0


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a local child, before exec: SIGKILL when the launcher dies, whatever kills it (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing). Without it a launcher killed by SIGKILL (a test's timeout,
    an OOM kill) left its processes behind, deadlocked ones spinning in gloo for hours."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _signal_name(rc: int) -> str:
    import signal

    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


def spawn_local(
    cmd: list[str], num_processes: int, devices_per_process: int, grace_s: float, env: Mapping[str, str] | None = None
) -> int:
    """Run `cmd + [--coordinator 127.0.0.1:PORT --num-processes N --process-id i]` N times on
    this machine with `devices_per_process` CPU devices each (gloo collectives). Returns 0 if
    all succeed, else the first failure's code; a process still running `grace_s` after the
    first failure is killed (the survivors' own watchdogs should have ended them by then)."""
    import subprocess

    port = free_port()
    base = dict(os.environ if env is None else env)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", base.get("XLA_FLAGS", ""))
    base.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices_per_process}")
    if base.get("JAX_COMPILATION_CACHE_DIR"):  # one cache folder per process topology: an executable that
        # process 0 of an N-process CPU client wrote is not guaranteed loadable by another topology's client
        base["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
            base["JAX_COMPILATION_CACHE_DIR"], f"local_{num_processes}x{devices_per_process}"
        )
    procs = [
        subprocess.Popen(
            cmd + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes), "--process-id", str(i)],
            env=base,
            preexec_fn=_die_with_parent,
        )
        for i in range(num_processes)
    ]
    first: tuple[int, int] | None = None
    deadline = None
    interrupts = 0

    def forward_sigterm(signum, frame):  # SIGTERM to the launcher (a scheduler's stop) reaches every child
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, forward_sigterm)
    while any(p.poll() is None for p in procs):
        try:
            for i, p in enumerate(procs):
                rc = p.poll()
                if rc not in (None, 0) and first is None:
                    first, deadline = (i, rc), time.monotonic() + grace_s
                    print(
                        f"rpeg launch: process {i} of {num_processes} failed ({_signal_name(rc)})",
                        file=sys.stderr,
                        flush=True,
                    )
            if deadline is not None and time.monotonic() > deadline:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        print(
                            f"rpeg launch: process {i} still running {grace_s:g} s after process {first[0]} "
                            f"failed; killing it",
                            file=sys.stderr,
                            flush=True,
                        )
                        p.kill()
            time.sleep(0.1)
        except KeyboardInterrupt:
            # Ctrl-C reaches the children too (one process group): each stops at the next step
            # boundary and writes its checkpoint, so keep waiting; a second Ctrl-C ends them now.
            interrupts += 1
            if interrupts > 1:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait()
                return 130
            print(
                "rpeg launch: Ctrl-C: the processes stop after the step in flight (again: at once)",
                file=sys.stderr,
                flush=True,
            )
    if first is None:
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
        first = bad[0] if bad else None
    if first is None:
        return 0
    return first[1] if first[1] > 0 else 128 - first[1]
