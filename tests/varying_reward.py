"""A reward plugin for runs under dynamic sampling (rl.filter_groups): `plugins=[varying_reward]`
with `data.reward=varying_test_reward`. A third of the prompts (a hash of the text) get rewards
that differ within their group (a function of the completion's tokens); the others get 1.0 for
every completion, so their groups are filtered. (tests/test_dapo_filters.py has its own copy, with
its reference of which prompts vary.)"""

import zlib

from rpeg_jax.data.rewards import Sample, register_reward


@register_reward("varying_test_reward", overwrite=True)
def varying_test_reward(sample: Sample) -> float:
    if zlib.crc32(sample.prompt.encode()) % 3:
        return 1.0
    return float(sum((j + 1) * t for j, t in enumerate(sample.completion_ids)) % 997) + 0.5 * len(sample.completion_ids)
