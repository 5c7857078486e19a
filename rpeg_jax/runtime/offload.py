"""Host offload (`train.offload`): state kept in host memory between steps, on the device only
inside the programs that use it.

    off = Offload.for_run(cfg, devices)        # what is offloaded, and the host memory kind
    opt_state = off.park_now("actor_opt", opt_state)      # outside jit: into host memory
    ...inside a jitted update:
    fetch, park = off.memory("actor_opt")      # (tree -> device copy, tree -> host copy)

`optimizer` offloads the optimizer states (actor_opt, critic_opt); `optimizer+reference` also
the reference model's weights (a no-op when kl_coef = 0: there is no reference). Placement uses
JAX memory kinds: every state array keeps its NamedSharding and only the memory kind changes
(`sharding.with_memory_kind("pinned_host")`). Inside a program, `jax.device_put` to the device
sharding brings a tree in and `jax.device_put` to the host sharding sends it back, so XLA
schedules the copies inside the program (rl/update.py places them around the optimizer step,
after the backward pass, when the update takes one optimizer step; runtime/kernels.py at the
start of the reference's forward). A program's output put in host memory stays there (no
out_shardings needed: the annotation is the output's memory kind).

Where the backend has no host memory kind (`host_memory_kind` returns None) the same code runs
with the device sharding in place of the host one: the transfers are then sharding constraints
that move nothing, and the numerics are identical either way. CPU JAX 0.10 exposes
`pinned_host` and `unpinned_host` beside `device` (all in RAM), so the tests here run the host
path for real.

Called by: runtime/setup.py (park the initial states), runtime/kernels.py (the updates' and the
reference forward's fetch/park), runtime/placement.py (offloaded states are not resharded
outside the program), runtime/checkpoint.py (finite check of host arrays).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

HOST_KIND = "pinned_host"
OFFLOADS = {
    "none": (),
    "optimizer": ("actor_opt", "critic_opt"),
    "optimizer+reference": ("actor_opt", "critic_opt", "reference"),
}


def host_memory_kind(devices) -> str | None:
    """ "pinned_host" when every device can address a pinned host memory, else None."""
    try:
        kinds = [{m.kind for m in d.addressable_memories()} for d in devices]
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memories
        return None
    return HOST_KIND if kinds and all(HOST_KIND in k for k in kinds) else None


def device_memory_kind(device) -> str:
    """The device's default memory kind ("device" on CPU and GPU)."""
    try:
        return device.default_memory().kind
    except (AttributeError, NotImplementedError, RuntimeError):
        return "device"


def is_host(x) -> bool:
    """Whether array `x` lives in a host memory kind."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind is not None and "host" in kind


class Offload:
    """What is offloaded and the shardings to move it with (recorded when a state is parked)."""

    def __init__(self, names: tuple[str, ...], host_kind: str | None, device_kind: str = "device"):
        self.names = frozenset(names)
        self.host_kind, self.device_kind = host_kind, device_kind
        self._shardings: dict[str, tuple[Any, Any]] = {}  # name -> (device tree, host tree)

    @staticmethod
    def for_run(cfg, devices=None) -> Offload:
        devices = list(devices if devices is not None else jax.devices())
        return Offload(OFFLOADS[cfg.train.offload], host_memory_kind(devices), device_memory_kind(devices[0]))

    def offloaded(self, name: str) -> bool:
        return name in self.names

    def _placements(self, name: str, tree) -> tuple[Any, Any]:
        """(device shardings, host shardings) of `tree`'s arrays (host = device without a host kind)."""
        dev = jax.tree.map(lambda x: x.sharding.with_memory_kind(self.device_kind), tree)
        host = dev if self.host_kind is None else jax.tree.map(lambda s: s.with_memory_kind(self.host_kind), dev)
        return dev, host

    def park_now(self, name: str, tree):
        """Outside jit: `tree` (committed arrays) into host memory when `name` is offloaded; records the
        shardings the programs move it with. Not offloaded: `tree` unchanged."""
        if not self.offloaded(name):
            return tree
        dev, host = self._placements(name, tree)
        self._shardings[name] = (dev, host)
        return jax.device_put(tree, host)

    def memory(self, name: str) -> tuple[Callable, Callable] | None:
        """(fetch, park) for use inside a jitted program: tree -> device copy, tree -> host copy;
        None when `name` is not offloaded."""
        if not self.offloaded(name):
            return None
        if name not in self._shardings:
            raise RuntimeError(f"offload: {name} was never parked (park_now) before its program was built")
        dev, host = self._shardings[name]
        return (lambda tree: jax.device_put(tree, dev)), (lambda tree: jax.device_put(tree, host))

    def fetch(self, name: str, tree):
        """Inside a program: the device copy of `tree` (offloaded), else `tree`."""
        mem = self.memory(name)
        return tree if mem is None else mem[0](tree)
