"""Host memory on the CPU backend: freed memory stays in the process instead of going back to the kernel.

    from rpeg_jax.runtime import host_memory
    host_memory.keep_freed_memory()     # the `rpeg` command does, for train and eval, before any import

Why (measured 2026-12-06, bench/NOTES.md "session 27"): XLA:CPU's Eigen matrix products allocate
their packing blocks with malloc on every call, up to ~95 MB each in SmolLM2-135M's update. glibc
serves an allocation that large with its own mmap and frees it with munmap, so every call touches
fresh pages: 1.4 million page faults (5.6 GB) and 4-5 s of kernel time per RS update
(bench/WORKLOADS.md), and the update inside `rpeg train` took 16-23 s instead of 10.5-11.2 s.
Three glibc settings (mallopt) keep that memory: one arena (a thread's own arena maps anything over
its 64 MB heap whatever the other settings say), no mmap for large blocks, and no trimming of the
heap's top (with a 2 GB threshold the update's freed temporaries were still given back: 16.2 s).
The peak resident memory barely moves (the blocks are reused, not added: RS's peak RSS 7.7 -> 8.0
GB); what a step frees stays resident for the next one, unless the process holds more than the
machine could still give it: then the trainer gives it back at the step boundary (`release_if_tight`).
Library use (`trainer.train` from Python) keeps glibc's defaults unless the caller calls this first.

When: `RPEG_HOST_MALLOC` = `auto` (the default: on when the run is on the CPU, i.e. JAX_PLATFORMS
names only cpu, or no GPU plugin of JAX is installed), `keep` (always) or `system` (never: glibc's
own behaviour). Only glibc has mallopt; elsewhere this does nothing.

Called by: cli/__init__.py main (for `rpeg train` / `rpeg eval` / launch/multihost.py, before the
subcommand's module, and JAX with it, is imported); runtime/trainer.py (`release_if_tight` after each
step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os

ENV = "RPEG_HOST_MALLOC"
CHOICES = ("auto", "keep", "system")
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
TRIM_THRESHOLD = -1  # never trim (mallopt(3): -1 disables trimming)
# The same three settings as glibc's environment variables, for a process started but not run by us
# (bench/rs.py's peers); the environment has no spelling of mallopt's -1 trim threshold, 2**62 never trims.
GLIBC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
_KEEPING = False  # keep_freed_memory applied its settings in this process


def _libc_function(name: str):
    """glibc's `name` through ctypes, None where there is no such C library function (not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def wanted(env=None, gpu_plugin: bool | None = None) -> bool:
    """Whether to keep freed memory: RPEG_HOST_MALLOC, and for `auto` whether the run is on the CPU."""
    env = os.environ if env is None else env
    choice = env.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={env.get(ENV)!r}: must be one of {', '.join(CHOICES)}")
    if choice != "auto":
        return choice == "keep"
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return all(p == "cpu" for p in platforms)
    if gpu_plugin is None:
        gpu_plugin = any(importlib.util.find_spec(name) is not None for name in GPU_PLUGINS)
    return not gpu_plugin


def keep_freed_memory(env=None) -> bool:
    """Apply the three mallopt settings when `wanted`; True when they were applied."""
    if not wanted(env):
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_ARENA_MAX, 1) and mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    global _KEEPING
    _KEEPING = bool(ok)
    return bool(ok)


def resident_bytes() -> int | None:
    """This process's resident set now (Linux /proc/self/statm), None where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def release_if_tight(available: float | None = None, resident: int | None = None) -> bool:
    """At a step boundary: give the freed memory this process keeps back to the kernel (glibc's
    malloc_trim(0), which also releases free pages inside the heap) when the process holds more than
    the machine could still give it (`available`: costmodel.devices.host_memory, MemAvailable capped
    by the cgroup). A later step does not always find the kept blocks reusable and can grow past
    them: SmolLM2-135M at 8 x 8 x 256 at T = 0.7 (18.4 GB resident in its update under glibc's
    defaults) was killed for memory in its second step on a 24 GB machine, and peaks at 14.7 GB
    with this (bench/NOTES.md, session 29). Below that line nothing is released, so a run with room
    (RS: 8 GB of 24) keeps every block and faults nothing in anew. True when it released."""
    if not _KEEPING:
        return False
    if available is None:
        from rpeg_jax.costmodel.devices import host_memory

        available = host_memory()
    resident = resident_bytes() if resident is None else resident
    if available is None or resident is None or resident <= available:
        return False
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
