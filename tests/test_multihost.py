"""Multi-process tests (2 local processes x 4 CPU devices, gloo): cross-process resharding, and a
lost process making the survivor exit non-zero, in bounded time, naming the lost process.
Plus the pure parts of start-up (where coordinator / process count / id come from)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rpeg_jax.runtime import distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    mode, pid, port, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    from rpeg_jax.runtime import distributed as dist
    spec = dist.resolve_spec(f"127.0.0.1:{port}", 2, pid)
    dist.initialize(spec, heartbeat_timeout_s=timeout, initialization_timeout_s=60)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from rpeg_jax.sharding import Resharder, make_mesh, sub_meshes

    if mode == "reshard":
        subs = sub_meshes({"train": (4, {"fsdp": -1}), "gen": (-1, {"data": 2, "tensor": 2})})
        everyone = make_mesh({"data": 2, "fsdp": 4})
        rng = np.random.default_rng(0)
        tree = {"w": rng.normal(size=(8, 12)).astype(np.float32), "b": rng.normal(size=(6,)).astype(np.float32),
                "s": np.float32(-0.0), "i": np.arange(10, dtype=np.int32)}
        def put(sh):
            return {k: jax.make_array_from_callback(np.shape(v), sh[k], lambda idx, v=v: np.asarray(v)[idx],
                                                    dtype=np.asarray(v).dtype) for k, v in tree.items()}
        def check(y, sh, tag):
            for k, v in tree.items():
                assert y[k].sharding == sh[k], (tag, k, y[k].sharding)
                for s in y[k].addressable_shards:  # bitwise equal, -0.0 included
                    assert np.asarray(s.data).tobytes() == np.asarray(v)[s.index].tobytes(), (tag, k)
        gen = {"w": NamedSharding(subs["gen"], P(None, "tensor")), "b": NamedSharding(subs["gen"], P("tensor")),
               "s": NamedSharding(subs["gen"], P()), "i": NamedSharding(subs["gen"], P("data"))}
        for name, mesh in (("disjoint", subs["train"]), ("overlapping", everyone)):
            train = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P()),
                     "s": NamedSharding(mesh, P()), "i": NamedSharding(mesh, P())}
            rs = Resharder()
            x = put(train)
            y = rs(x, gen)
            check(y, gen, name + " train->generate")
            z = rs(y, train)
            check(z, train, name + " generate->train")
            rs(rs(z, gen), train)
            assert rs.plans_built == 2, rs.plans_built
            assert set(rs.plan(x, gen).methods) == {"collective"}, rs.plan(x, gen).methods
        print(f"RESHARD_OK {pid}", flush=True)
    elif mode == "listen":  # where process 0's coordination service listens, while both are connected
        if pid == 0:
            rows = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                with open(table) as f:
                    for line in f.readlines()[1:]:
                        local, state = line.split()[1], line.split()[3]
                        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == int(port):  # 0A: LISTEN
                            rows.append(local)
            print("LISTEN " + " ".join(rows), flush=True)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("listed")
    else:  # "hang": sit in collectives until a peer dies
        mesh = make_mesh({"data": -1})
        x = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("data")))
        f = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
        watchdog = dist.Watchdog(pid, 2, timeout).start()
        float(f(x))
        print(f"READY {pid}", flush=True)
        end = time.time() + 120
        while time.time() < end:
            f(x).block_until_ready()
            time.sleep(0.01)
        print("NOT LOST", flush=True)
""")


def _start(tmp_path, mode, timeout_s, extra_env=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = dist.free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PYTHONPATH=ROOT,
        PYTHONUNBUFFERED="1",
        **(extra_env or {}),
    )
    return [
        subprocess.Popen(
            [sys.executable, str(script), mode, str(i), str(port), str(timeout_s)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _finish(procs, timeout):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    return outs


@pytest.mark.multihost
def test_reshard_round_trip_across_two_processes(tmp_path):
    """training (process 0's 4 devices, or all 8) -> generation (process 1's 4 devices) -> training
    is bit-exact; a plain device_put cannot do this in multi-controller JAX."""
    procs = _start(tmp_path, "reshard", 30)
    outs = _finish(procs, timeout=240)
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RESHARD_OK {i}" in out, out[-3000:]


@pytest.mark.multihost
def test_the_coordination_service_of_local_processes_listens_on_loopback_only(tmp_path):
    """Local processes are given 127.0.0.1:PORT: process 0's service binds that address, not every
    interface (JAX's default, [::]:PORT), as the kernel's table of listening sockets shows."""
    procs = _start(tmp_path, "listen", 30)
    outs = _finish(procs, timeout=240)
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    (line,) = [ln for ln in outs[0].splitlines() if ln.startswith("LISTEN")]
    rows = line.split()[1:]
    loopback = ("0100007F:", "0000000000000000FFFF00000100007F:")  # 127.0.0.1 as tcp, and as tcp6 (::ffff:127.0.0.1)
    assert rows and all(r.startswith(loopback) for r in rows), rows  # [::]:PORT would be 000...000:PORT


def test_bind_address_is_the_given_loopback_else_every_interface_else_the_configured_one():
    assert dist.bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert dist.bind_address("localhost:1234") == "localhost:1234"
    assert dist.bind_address("[::1]:1234") == "[::1]:1234"
    assert dist.bind_address("node017:1234") == "[::]:1234"
    assert dist.bind_address("node017:1234", "10.0.0.7:1234") == "10.0.0.7:1234"


def _wait_ready(procs, timeout=180):
    """Read stdout until both processes print READY (line-buffered)."""
    import selectors

    sel = selectors.DefaultSelector()
    for p in procs:
        sel.register(p.stdout, selectors.EVENT_READ, p)
    ready, logs, end = set(), {id(p): [] for p in procs}, time.time() + timeout
    while len(ready) < len(procs) and time.time() < end:
        for key, _ in sel.select(timeout=1):
            line = key.fileobj.readline()
            logs[id(key.data)].append(line)
            if line.startswith("READY"):
                ready.add(id(key.data))
        if any(p.poll() is not None for p in procs):
            break
    sel.close()
    return len(ready) == len(procs), logs


@pytest.mark.multihost
@pytest.mark.parametrize("victim", [1, 0])
def test_lost_process_ends_the_other(tmp_path, victim):
    """SIGKILL one of 2 processes while both sit in collectives: the survivor exits non-zero within
    the heartbeat bound, with a message naming the lost process. Process 1 lost: our watchdog
    (exit 75, "lost process 1"). Process 0 lost: the coordination service goes with it and JAX
    aborts the survivor at once (its message names "the leader task", i.e. process 0)."""
    timeout_s = 4.0
    procs = _start(tmp_path, "hang", timeout_s)
    ok, logs = _wait_ready(procs)
    if not ok:
        for p in procs:
            p.kill()
        pytest.fail("workers did not start: " + "".join(sum(logs.values(), []))[-3000:])
    killed_at = time.monotonic()
    procs[victim].send_signal(signal.SIGKILL)
    survivor = procs[1 - victim]
    bound = 1.5 * timeout_s + 10  # detection after timeout_s, plus polling and a loaded 2-core machine
    try:
        out, _ = survivor.communicate(timeout=bound + 30)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"process {1 - victim} hung after process {victim} was killed")
    elapsed = time.monotonic() - killed_at
    procs[victim].wait()
    out = "".join(logs[id(survivor)]) + out
    assert survivor.returncode != 0, out[-3000:]
    assert "NOT LOST" not in out
    assert elapsed < bound, (elapsed, out[-2000:])
    if victim == 1:
        assert survivor.returncode == dist.EXIT_PEER_LOST, out[-3000:]
        assert "rpeg: lost process 1 of 2" in out, out[-3000:]
    else:
        assert "leader task" in out or "lost process 0" in out, out[-3000:]


# ---- where the distributed parameters come from (pure, no processes) ----


def test_resolve_spec_sources():
    s = dist.resolve_spec("10.0.0.1:1234", 4, 2, env={})
    assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("10.0.0.1:1234", 4, 2, "flags")
    s = dist.resolve_spec(env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "1"})
    assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("h:1", 3, 1, "jax-env")
    slurm = {
        "SLURM_JOB_ID": "4097",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "nid[0007-0008,0011]",
    }
    s = dist.resolve_spec(env=slurm)
    assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("nid0007:61441", 8, 5, "slurm")
    assert dist.resolve_spec(env=dict(slurm, RPEG_COORDINATOR_PORT="999")).coordinator == "nid0007:999"
    assert not dist.resolve_spec(env={"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}).multi
    assert dist.resolve_spec(env={}).source == "single"
    with pytest.raises(dist.DistributedInitError, match="process_id missing"):
        dist.resolve_spec("h:1", 2, None, env={})


def test_first_host():
    assert dist.first_host("gpu01") == "gpu01"
    assert dist.first_host("gpu01,gpu02") == "gpu01"
    assert dist.first_host("nid[001-004,007],x9") == "nid001"
    assert dist.first_host("a-b[7,9]") == "a-b7"


class _FakeKV:
    """The coordination service's key-value store, as the Watchdog uses it."""

    def __init__(self):
        self.kv, self.fail = {}, False

    def key_value_set(self, k, v, allow_overwrite=False):
        if self.fail:
            raise RuntimeError("UNAVAILABLE: socket closed")
        self.kv[k] = v

    def key_value_dir_get(self, prefix):
        if self.fail:
            raise RuntimeError("UNAVAILABLE: socket closed")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def _watch(kv, pid, n, timeout):
    import io

    exits, stream = [], io.StringIO()
    w = dist.Watchdog(pid, n, timeout, client=kv, interval_s=0.02, exit_fn=exits.append, stream=stream)
    return w, exits, stream


def test_watchdog_names_silent_peer_and_spares_finished_one():
    kv = _FakeKV()
    w, exits, stream = _watch(kv, 0, 3, timeout=0.3)
    kv.key_value_set("rpeg/done/2", "1")  # process 2 left cleanly: not lost
    w.start()
    t0 = time.monotonic()
    assert w.await_verdict(5) == [1]
    assert 0.3 <= time.monotonic() - t0 < 3
    assert exits == [dist.EXIT_PEER_LOST] and "lost process 1 of 3" in stream.getvalue()


def test_watchdog_quiet_while_peers_beat_and_names_lost_coordinator():
    kv = _FakeKV()
    w, exits, _ = _watch(kv, 1, 2, timeout=0.3)
    w.start()
    for i in range(20):  # peer 0 keeps beating for 0.6 s > timeout
        kv.key_value_set("rpeg/heartbeat/0", str(i))
        time.sleep(0.03)
    assert exits == [] and w.lost == []
    kv.fail = True  # the coordination service (process 0) is gone
    assert w.await_verdict(5) == [0] and exits == [dist.EXIT_PEER_LOST]


def test_local_processes_die_with_a_killed_launcher(tmp_path):
    """The launcher of local processes SIGKILLed (a test's timeout, the OOM killer): its children
    go with it (PR_SET_PDEATHSIG) instead of spinning on in their collectives."""
    pids = tmp_path / "pids"  # each child writes a file named by its pid
    child = f"import os, time; open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close(); time.sleep(120)"
    launcher = (
        "from rpeg_jax.runtime import distributed as d; import sys;"
        f"d.spawn_local([sys.executable, '-c', {child!r}], 2, 1, grace_s=5.0)"
    )
    pids.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(n) for n in os.listdir(pids)]
    assert len(children) == 2, children
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in children), children
