"""Cost-model section: the hardware profile and the planner's search budget."""

from __future__ import annotations

from dataclasses import dataclass

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class CostModelConfig:
    hardware: str = "cpu"  # profile name in configs/hardware/ or a YAML path
    num_devices: int | None = None  # None -> the devices JAX sees
    memory_budget: float = 0.9  # fraction of device memory plans may use
    max_plans: int = 200000  # search budget
    log_predictions: bool = True  # log predicted vs measured time per stage each step

    def validate(self, path: str) -> None:
        check(0.0 < self.memory_budget <= 1.0, key(path, "memory_budget"), self.memory_budget, "must be in (0, 1]")
        check(self.max_plans >= 1, key(path, "max_plans"), self.max_plans, "must be >= 1")
        if self.num_devices is not None:
            check(self.num_devices >= 1, key(path, "num_devices"), self.num_devices, "must be >= 1")
