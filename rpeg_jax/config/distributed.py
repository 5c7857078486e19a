"""Distributed section: multi-host initialisation and failure detection."""

from __future__ import annotations

from dataclasses import dataclass

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    coordinator: str | None = None  # host:port; None -> SLURM / JAX environment / single process
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: float = 30.0  # a lost peer makes the others exit non-zero within about this
    initialization_timeout_s: float = 120.0

    def validate(self, path: str) -> None:
        check(self.heartbeat_timeout_s > 0, key(path, "heartbeat_timeout_s"), self.heartbeat_timeout_s, "must be > 0")
        check(self.initialization_timeout_s > 0, key(path, "initialization_timeout_s"),
              self.initialization_timeout_s, "must be > 0")
        if self.num_processes is not None:
            check(self.num_processes >= 1, key(path, "num_processes"), self.num_processes, "must be >= 1")
            if self.process_id is not None:
                check(0 <= self.process_id < self.num_processes, key(path, "process_id"), self.process_id,
                      f"must be in [0, num_processes={self.num_processes})")
