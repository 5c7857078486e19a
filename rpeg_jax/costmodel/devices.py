"""Which devices a run would see, and the hardware profile that describes them.

    info = local_devices()                      # imports JAX (lazily): count, processes, platform, kind
    name = profile_for(info.platform, info.kind)  # "cpu", "h200", "h100", "gh200"
    hw, n, procs = resolve(cfg, num_devices, hardware, processes)   # what the planner plans for

`costmodel.hardware: auto` (the default) means "the profile of the devices this run sees": the
CPU profile on a CPU backend, the GPU profile named by the device kind on a GPU. `rpeg plan`
without --gpus plans for the devices `make run` would see (jax.device_count(): 1 on a plain
CPU, 8 under --xla_force_host_platform_device_count=8). The planner asks JAX only when the caller
did not say (a named profile, a device count and a process count given explicitly never touch
JAX); in the runtime JAX is imported already. The rest of the cost model stays device-free.

Callers: costmodel/planner.py (choose_plan, search), rpeg_jax/cli/plan.py (`rpeg plan`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# Device-kind substrings (jax Device.device_kind, lower case) -> profile name; first match wins.
GPU_KINDS = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"))
DEFAULT_GPU = "h200"


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


def processes_of_running_jax() -> int:
    """jax.process_count() when JAX is already imported (the runtime), else 1: the planner never
    initialises a backend just to learn it."""
    if "jax" not in sys.modules:
        return 1
    import jax

    return int(jax.process_count())


def resolve(cfg, num_devices: int | None, hardware, processes: int | None):
    """(HardwareProfile, device count, process count) to plan for: explicit arguments, else the
    config (costmodel.hardware / costmodel.num_devices), else the local devices."""
    from rpeg_jax.costmodel.hardware import HardwareProfile, load_hardware

    name = hardware if hardware is not None else cfg.costmodel.hardware
    n = num_devices or cfg.costmodel.num_devices
    auto = isinstance(name, str) and name == "auto"
    info = local_devices() if (auto or not n) else None
    if isinstance(name, HardwareProfile):
        hw = name
    else:
        hw = load_hardware(profile_for(info.platform, info.kind) if auto else name)
    if not n:
        n = info.count
    if processes is None:
        processes = info.processes if info is not None else processes_of_running_jax()
    return hw, int(n), int(processes)
