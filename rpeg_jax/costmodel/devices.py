"""Which devices a run would see, and the hardware profile that describes them.

    info = local_devices()                      # imports JAX (lazily): count, processes, platform, kind
    name = profile_for(info.platform, info.kind)  # "cpu", "h200", "h100", "gh200"
    hw, n, procs = resolve(cfg, num_devices, hardware, processes)   # what the planner plans for
    procs = processes_per_node(hw, n)           # the default process count: one per node

`costmodel.hardware: auto` (the default) means "the profile of the devices this run sees": the
CPU profile on a CPU backend, the GPU profile named by the device kind on a GPU. `rpeg plan`
without --gpus plans for the devices `make run` would see (jax.device_count(): 1 on a plain
CPU, 8 under --xla_force_host_platform_device_count=8). The planner asks JAX only when the caller
did not say (a named profile, a device count and a process count given explicitly never touch
JAX); in the runtime JAX is imported already. The rest of the cost model stays device-free.

Processes: a cluster is planned as the JAX processes that launch on it, since what the runtime can
run depends on them (graph/processes.py). The count is the caller's (`rpeg plan --processes`; the
runtime passes jax.process_count()), else `costmodel.processes`, else, planning for the devices
JAX sees here, their jax.process_count(), else one process per node of the hardware profile, as
SLURM launches one task per node (`node.devices`: 16 processes for 64 GH200).

A CPU profile's memory per device is what this host has: the RAM available now (host_memory:
/proc/meminfo's MemAvailable, capped by a cgroup memory limit; else os.sysconf's available
pages), split evenly between the devices planned for (1 for a plain process, N under
--xla_force_host_platform_device_count=N). Only when neither can be read does the profile's
own `device.memory_gb` stand (configs/hardware/cpu.yaml). A profile passed in as an object
(tests, calibration) is used as it is. Which file a named profile is read from is the config's
choice alone (`profile`: costmodel.calibration), never whatever happens to be in the cache.

Callers: costmodel/planner.py (choose_plan, search), rpeg_jax/cli/plan.py (`rpeg plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass

from rpeg_jax.config.base import ConfigError

log = logging.getLogger("rpeg_jax")

# Device-kind substrings (jax Device.device_kind, lower case) -> profile name; first match wins.
GPU_KINDS = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"))
DEFAULT_GPU = "h200"
MEMINFO = "/proc/meminfo"
CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


@dataclass(frozen=True)
class LocalDevices:
    count: int  # jax.device_count(): devices over all processes
    processes: int  # jax.process_count()
    platform: str  # "cpu" | "gpu" | "tpu"
    kind: str  # device_kind of device 0, e.g. "cpu", "NVIDIA H200"


def force_cpu_devices(n: int) -> None:
    """Before JAX starts: show the CPU backend `n` devices, unless XLA_FLAGS already says how many
    (after JAX is imported the flag would have no effect, so it is left alone)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def local_devices() -> LocalDevices:
    """The devices JAX sees in this process (initialises the backend if it is not yet). On a
    fresh GPU process the memory preallocation is switched off first: we only count devices."""
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    devs = jax.devices()
    return LocalDevices(
        count=len(devs),
        processes=jax.process_count(),
        platform=devs[0].platform,
        kind=str(getattr(devs[0], "device_kind", devs[0].platform)),
    )


def profile_for(platform: str, kind: str) -> str:
    """The hardware profile name for a JAX platform and device kind."""
    if platform == "cpu":
        return "cpu"
    low = kind.lower()
    for sub, name in GPU_KINDS:
        if sub in low:
            return name
    return DEFAULT_GPU


def processes_per_node(hw, num_devices: int) -> int:
    """One process per node of `hw` (node.devices each): 1 up to one node, else the node count; a
    device count that does not fill whole nodes is a ConfigError naming costmodel.processes."""
    from rpeg_jax.config.base import ConfigError

    per = int(hw.node.devices)
    if num_devices <= per:
        return 1
    if num_devices % per:
        raise ConfigError(
            "costmodel.processes",
            None,
            f"{num_devices} devices do not fill whole {per}-device nodes of {hw.name}, so one process per "
            "node is no default: give the process count (costmodel.processes, rpeg plan --processes)",
        )
    return num_devices // per


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # absent, or "max" (no limit)
        return None


def host_memory() -> float | None:
    """Bytes of RAM this process could still get: MemAvailable (Linux, counts reclaimable cache),
    capped by the cgroup's limit minus its usage when one is set; os.sysconf's available physical
    pages where there is no /proc; None when neither is readable."""
    avail = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024  # kB
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    for limit_file, usage_file in CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes a huge number for none
            avail = min(avail, float(max(limit - usage, 0)))
            break
    return avail


def host_budget(hw, num_devices: int, available: float | None = None):
    """A CPU profile whose memory per device is the host's available RAM split between
    `num_devices` (the profile unchanged when the RAM cannot be read)."""
    from rpeg_jax.costmodel.hardware import GB

    available = host_memory() if available is None else available
    if hw.kind != "cpu" or not available:
        return hw
    per = available / max(int(num_devices), 1) / GB
    return dataclasses.replace(hw, device=dataclasses.replace(hw.device, memory_gb=per, usable_memory_gb=per))


_reported: set[str] = set()


def profile(name: str, calibration: str = "none"):
    """The HardwareProfile `name` (a configs/hardware/ name or a YAML path) under
    costmodel.calibration: `none` the profile as named, `cached` the copy `rpeg calibrate` fitted
    on this machine (a ConfigError when there is none). The file used is logged once per process."""
    from rpeg_jax.costmodel.hardware import calibrated_path, describe_source, is_path, load_hardware

    cached = calibration == "cached" and not is_path(name)
    if cached and not os.path.isfile(calibrated_path(name)):
        raise ConfigError(
            "costmodel.calibration",
            calibration,
            f"no calibrated {name} profile at {calibrated_path(name)}: run `rpeg calibrate` first, "
            "or costmodel.calibration=none for the shipped profile",
        )
    hw = load_hardware(name, calibrated=cached)
    if hw.source not in _reported:
        _reported.add(hw.source)
        log.info("cost model: hardware profile %s", describe_source(hw))
    return hw


def resolve(cfg, num_devices: int | None, hardware, processes: int | None):
    """(HardwareProfile, device count, process count) to plan for: explicit arguments, else the
    config (costmodel.hardware / num_devices / processes), else the local devices; processes with
    neither: one per node of the profile (module docstring). The profile follows costmodel.calibration
    (`profile`)."""
    from rpeg_jax.costmodel.hardware import HardwareProfile

    name = hardware if hardware is not None else cfg.costmodel.hardware
    n = num_devices or cfg.costmodel.num_devices
    auto = isinstance(name, str) and name == "auto"
    info = local_devices() if (auto or not n) else None
    if isinstance(name, HardwareProfile):
        hw = name
    else:
        hw = profile(profile_for(info.platform, info.kind) if auto else name, cfg.costmodel.calibration)
    seen = not n  # the devices JAX sees here, in the processes it sees
    if seen:
        n = info.count
    if not isinstance(name, HardwareProfile):  # a CPU profile by name: this host's RAM, split
        hw = host_budget(hw, n)
    if processes is None:
        processes = cfg.costmodel.processes
    if processes is None:
        processes = info.processes if seen else processes_per_node(hw, n)
    return hw, int(n), int(processes)
