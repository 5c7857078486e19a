"""Distributed section: multi-host initialisation and failure detection (see
rpeg_jax/runtime/distributed.py for where each value may also come from: flags, SLURM, JAX env)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    coordinator: str | None = None  # host:port of process 0; None -> flags / JAX env / SLURM / single process
    bind_address: str | None = None  # host:port process 0's coordination service listens on; None -> the
    #   coordinator's own address when it is a loopback one (--local-processes: 127.0.0.1), else every
    #   interface of that port (JAX's default: a node's own name may resolve to a loopback alias there)
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: float = 30.0  # s; a lost peer makes the others exit non-zero (code 75) within about this
    initialization_timeout_s: float = 120.0  # s; how long initialize waits for all processes to connect
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"  # collectives between CPU devices of different processes
    watchdog: bool = True  # heartbeat watchdog that names a lost process (else only JAX's own detection)

    def validate(self, path: str) -> None:
        check(self.heartbeat_timeout_s > 0, key(path, "heartbeat_timeout_s"), self.heartbeat_timeout_s, "must be > 0")
        check(
            self.initialization_timeout_s > 0,
            key(path, "initialization_timeout_s"),
            self.initialization_timeout_s,
            "must be > 0",
        )
        for name in ("coordinator", "bind_address"):
            value = getattr(self, name)
            if value is not None:
                host, _, port = value.rpartition(":")
                check(bool(host) and port.isdigit(), key(path, name), value, "must be host:port")
        if self.num_processes is not None:
            check(self.num_processes >= 1, key(path, "num_processes"), self.num_processes, "must be >= 1")
            if self.process_id is not None:
                check(
                    0 <= self.process_id < self.num_processes,
                    key(path, "process_id"),
                    self.process_id,
                    f"must be in [0, num_processes={self.num_processes})",
                )
