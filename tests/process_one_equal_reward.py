"""A reward plugin for tests/test_multihost_continuous.py: `plugins=[process_one_equal_reward]` with
`data.reward=process_one_equal_reward`. On process 1 every completion gets 1.0 (every group there is
filtered under rl.filter_groups=zero_variance); elsewhere a function of the completion's tokens (a
group's rewards differ). So dynamic sampling runs out on one process's shard only."""

import jax

from rpeg_jax.data.rewards import Sample, register_reward


@register_reward("process_one_equal_reward", overwrite=True)
def process_one_equal_reward(sample: Sample) -> float:
    if jax.process_index() == 1:
        return 1.0
    return float(sum((j + 1) * t for j, t in enumerate(sample.completion_ids)) % 997)
