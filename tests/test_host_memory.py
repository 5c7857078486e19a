"""runtime/host_memory.py: with the mallopt settings a large block freed and allocated again is the
same memory (no fresh pages touched), without them every allocation of that size faults its pages in
anew (glibc maps and unmaps it): the mechanism that cost the RS update ~half its time on this VM. Each
case runs in a fresh interpreter (the settings are process-wide, and must come before threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rpeg_jax.runtime import host_memory

CYCLES = """
import contextlib, ctypes, io, json, os, resource, sys, threading
from rpeg_jax.runtime import host_memory
how, choice = sys.argv[1:]
if how == "call":
    applied = host_memory.keep_freed_memory({"RPEG_HOST_MALLOC": choice})
else:  # as `rpeg train --help` applies it, from the environment
    from rpeg_jax.cli import main
    os.environ["RPEG_HOST_MALLOC"], applied = choice, None
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        main(["train", "--help"])
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, faults = 96 << 20, []  # the size of an Eigen packing block in SmolLM2-135M's update

def cycles():  # on a thread of its own, as XLA's workers allocate
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        libc.free(p)

t = threading.Thread(target=cycles)
t.start()
t.join()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def cycle_faults(how: str, choice: str, env: dict | None = None) -> dict:
    env = None if env is None else {**os.environ, **env}
    cmd = [sys.executable, "-c", CYCLES, how, choice]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


PAGES = (96 << 20) // 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_kept_memory_is_reused_and_system_memory_faults_anew():
    system = cycle_faults("call", "system")
    assert system["applied"] is False
    assert min(system["faults"][1:]) > PAGES // 2, system  # every cycle touches fresh pages
    kept = cycle_faults("call", "keep")
    assert kept["applied"] is True
    assert kept["faults"][0] > PAGES // 2  # the first touch is the same
    assert max(kept["faults"][1:]) < PAGES // 20, kept  # then the same memory is reused


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_the_environment_form_keeps_memory_as_mallopt_does():
    """GLIBC_ENV (what bench/rs.py gives a peer process) without any mallopt call."""
    kept = cycle_faults("call", "system", env=host_memory.GLIBC_ENV)
    assert kept["applied"] is False
    assert max(kept["faults"][1:]) < PAGES // 20, kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_the_rpeg_command_applies_it_before_the_subcommand_and_names_a_bad_value():
    assert max(cycle_faults("cli", "keep")["faults"][1:]) < PAGES // 20  # `rpeg train` set it
    assert min(cycle_faults("cli", "system")["faults"][1:]) > PAGES // 2  # and honours system
    bad = subprocess.run(
        [sys.executable, "-m", "rpeg_jax.cli", "train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "RPEG_HOST_MALLOC": "sometimes"},
    )
    assert bad.returncode == 2 and "rpeg train: RPEG_HOST_MALLOC='sometimes'" in bad.stderr, bad.stderr


def test_auto_is_on_for_the_cpu_only_and_a_bad_value_names_the_variable():
    assert host_memory.wanted({}, gpu_plugin=False)
    assert not host_memory.wanted({}, gpu_plugin=True)
    assert host_memory.wanted({"JAX_PLATFORMS": "cpu"}, gpu_plugin=True)
    assert not host_memory.wanted({"JAX_PLATFORMS": "cuda,cpu"}, gpu_plugin=False)
    assert host_memory.wanted({"RPEG_HOST_MALLOC": "keep"}, gpu_plugin=True)
    assert not host_memory.wanted({"RPEG_HOST_MALLOC": "system", "JAX_PLATFORMS": "cpu"})
    with pytest.raises(ValueError, match="RPEG_HOST_MALLOC='sometimes'"):
        host_memory.wanted({"RPEG_HOST_MALLOC": "sometimes"})


RELEASE = """
import ctypes, json, sys
from rpeg_jax.runtime import host_memory
applied = host_memory.keep_freed_memory({"RPEG_HOST_MALLOC": sys.argv[1]})
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(32 << 20) for _ in range(8)]  # 256 MB, freed below a block that stays
pin = libc.malloc(4096)
for p in blocks:
    ctypes.memset(p, 1, 32 << 20)
for p in blocks:
    libc.free(p)
out = {"applied": applied, "kept": host_memory.resident_bytes()}
out["roomy"] = host_memory.release_if_tight(available=1 << 50)  # the host has room: keep
out["after_roomy"] = host_memory.resident_bytes()
out["tight"] = host_memory.release_if_tight(available=1 << 20)  # it holds more than the host could give
out["after_tight"] = host_memory.resident_bytes()
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
@pytest.mark.parametrize("choice", ["keep", "system"])
def test_kept_memory_goes_back_at_a_step_boundary_only_when_the_host_is_short_of_it(choice):
    out = subprocess.run([sys.executable, "-c", RELEASE, choice], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if choice == "system":  # glibc's own behaviour: nothing kept, nothing to release
        assert r["applied"] is False and r["tight"] is False and r["kept"] < 200 << 20, r
        return
    assert r["applied"] is True and r["kept"] > 250 << 20, r  # the freed 256 MB stayed resident
    assert r["roomy"] is False and r["after_roomy"] > 250 << 20, r
    assert r["tight"] is True and r["after_tight"] < r["kept"] - (200 << 20), r  # given back


def test_the_trainer_offers_the_memory_back_after_every_step(tmp_path, monkeypatch):
    from helpers import TINY, run

    calls = []
    monkeypatch.setattr(host_memory, "release_if_tight", lambda *a, **k: calls.append(a) or False)
    run(tmp_path, "release", TINY, steps=3)
    assert len(calls) == 3
