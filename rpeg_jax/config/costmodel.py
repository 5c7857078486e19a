"""Cost-model section: the hardware profile, the planner's search space and budget, and the
workload assumptions the model needs beyond the other sections (the response-length distribution;
the attention kernel is model.attention's, the KV pool rollout.kv_pool's, sequence packing
train.pack_sequences: the cost model prices the keys the run runs). Read by rpeg_jax/costmodel (no JAX)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class CostModelConfig:
    hardware: str = "auto"  # profile name in configs/hardware/, a YAML path, or auto (the devices the run sees)
    calibration: Literal["none", "cached"] = "none"  # the numbers of a named profile: none = the shipped
    #   configs/hardware/<name>.yaml; cached = the copy `rpeg calibrate` fitted on this machine
    #   ($RPEG_CACHE or ~/.cache/rpeg_jax/hardware/<name>.yaml; an error when there is none). A fitted
    #   file elsewhere: costmodel.hardware=<path>. The file used is logged and recorded in plan.json
    num_devices: int | None = None  # None -> the devices JAX sees
    processes: int | None = None  # P, the JAX processes owning the devices (N / P each; SLURM: one per
    #   node). None -> one per node of the hardware profile (node.devices), or the processes JAX sees when
    #   planning for its devices. The planner searches only plans the runtime runs with P processes
    #   (graph/processes.py). At train time the run's own jax.process_count(), as num_devices gives way
    #   to the devices JAX sees
    memory_budget: float = 0.9  # fraction of device memory plans may use
    # Workload assumptions.
    prompt_len: int | None = None  # tokens per prompt (bos included) the model prices; None -> the data's
    #   longest prompt (a built-in task's; data.max_prompt_len for JSONL or another tokenizer). The runtime
    #   pads prompts to their longest, rounded up to 8 (unless shapes are fixed), not to data.max_prompt_len
    response_len_median: float | None = None  # tokens; None -> halfway to rollout.max_new_tokens
    response_len_min: int = 1  # tokens; shortest response
    response_len_sigma: float = 0.6  # lognormal shape of response lengths (long tail); 0 = fixed
    # Search space (structural knobs the planner may change).
    search_algorithmic: bool = False  # may the search change the algorithm the learner runs: staleness
    #   k in 1..max_staleness (it trains on data from a policy up to k updates old) and, for PPO, one
    #   actor-critic backbone (search_share_actor_critic). Off: k = 0 and separate models, unless the
    #   config pins them (pipeline.staleness, pipeline.share_actor_critic). `rpeg plan --allow-algorithmic`
    #   sets it. Either way `rpeg plan` reports the systems and the algorithmic gains apart
    max_staleness: int = 1  # with search_algorithmic: k the planner may choose, 0..max_staleness, each
    #   with rollout.admission step or continuous (costmodel/space.admissions) unless the config sets them;
    #   the candidate tables price k up to it either way (costmodel/pricing.py prices given plans on them)
    search_share_actor_critic: bool = True  # with search_algorithmic, PPO: may share one backbone
    search_fusion: bool = True  # may fuse forwards / advantage
    search_elide_old_forward: bool = True  # may reuse the sampler's logprobs as π_old when k = 0 and the
    #   sampler's distribution is the trainer's (no top_k / top_p / min_p truncation)
    search_one_step_rewrites: bool = True  # with one optimizer step per batch, plans take π_prox and the
    #   critic's values from the updates' own forwards (pipeline.proximal_from_update / values_from_critic_update)
    tensor_sizes: tuple[int, ...] = (1, 2, 4, 8)  # tensor-parallel degrees tried
    runners_up: int = 5  # plans listed after the chosen one

    def validate(self, path: str) -> None:
        if self.calibration == "cached":
            check(
                not (self.hardware.endswith((".yaml", ".yml")) or "/" in self.hardware),
                key(path, "calibration"),
                self.calibration,
                f"costmodel.hardware={self.hardware} is a file: that file is the profile (calibration=none)",
            )
        check(0.0 < self.memory_budget <= 1.0, key(path, "memory_budget"), self.memory_budget, "must be in (0, 1]")
        if self.prompt_len is not None:
            check(self.prompt_len >= 1, key(path, "prompt_len"), self.prompt_len, "must be >= 1")
        if self.num_devices is not None:
            check(self.num_devices >= 1, key(path, "num_devices"), self.num_devices, "must be >= 1")
        if self.processes is not None:
            check(self.processes >= 1, key(path, "processes"), self.processes, "must be >= 1")
            if self.num_devices is not None:
                check(
                    self.num_devices % self.processes == 0,
                    key(path, "processes"),
                    self.processes,
                    f"must divide num_devices={self.num_devices} (each process owns N / P devices)",
                )
        if self.response_len_median is not None:
            check(
                self.response_len_median >= self.response_len_min,
                key(path, "response_len_median"),
                self.response_len_median,
                f"must be >= response_len_min={self.response_len_min}",
            )
        check(self.response_len_min >= 1, key(path, "response_len_min"), self.response_len_min, "must be >= 1")
        check(self.response_len_sigma >= 0, key(path, "response_len_sigma"), self.response_len_sigma, "must be >= 0")
        check(0 <= self.max_staleness <= 16, key(path, "max_staleness"), self.max_staleness, "must be in [0, 16]")
        check(
            len(self.tensor_sizes) >= 1 and all(t >= 1 for t in self.tensor_sizes),
            key(path, "tensor_sizes"),
            list(self.tensor_sizes),
            "must be a non-empty list of positive sizes",
        )
        check(self.runners_up >= 0, key(path, "runners_up"), self.runners_up, "must be >= 0")
