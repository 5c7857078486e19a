"""rpeg_jax.sampling: the in-house paged-attention sampler (generation engine for RL rollouts).

    from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
    outs = Sampler(model, SamplerConfig(max_slots=128, max_seq_len=64)).generate(prompts, SamplingParams(n=8))

Modules: types (configs and results), sampler (the host loop and public API), scheduler (slots,
admission, reservation, preemption), allocator (pages), engine (jitted prefill/decode), forward (how the
model runs inside them), paged_attention, transforms (temperature/top-k/top-p/min-p, logprobs), stops,
weights, sharding.
"""

from rpeg_jax.sampling.allocator import OutOfPages, PageAllocator, ShardedPages
from rpeg_jax.sampling.sampler import Sampler
from rpeg_jax.sampling.types import Completion, RequestOutput, SamplerConfig, SamplingParams

__all__ = [
    "OutOfPages",
    "PageAllocator",
    "ShardedPages",
    "Sampler",
    "Completion",
    "RequestOutput",
    "SamplerConfig",
    "SamplingParams",
]
