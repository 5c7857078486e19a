"""Prompts, tokenizers and rewards for RL runs (host-side Python; no device code).

The runtime's view:

    from rpeg_jax import data
    pipe = data.build_pipeline(cfg, shard_index=jax.process_index(), shard_count=jax.process_count())
    reward_name, reward_fn = data.resolve_reward(cfg.data)     # at start-up: unknown names fail early
    batch = next(pipe)                                         # PromptBatch
    tokens_BxP, positions_BxP, segments_BxP = data.left_pad(batch.prompt_tokens, P, pipe.tokenizer.pad_id)
    samples = data.make_samples(batch.prompts, batch.answers, batch.records, completions_BxR, pipe.tokenizer,
                                group_size=G, lengths=lens_B)
    rewards_B, num_errors = data.score(samples, reward_fn, cfg.data.reward_on_error, reward_name)
    state = pipe.get_state(); pipe.set_state(state)            # JSON; saved with checkpoints

Modules: tokenizer (char + tokenizer.json), chat (chat templates, message prompts), tasks (built-in
tasks), answers (GSM8K/MATH answer extraction), rewards (registry, scoring), jsonl (reading prompt
files), pipeline (grain).
"""

from rpeg_jax.data.answers import answers_match, extract_answer, normalize_answer
from rpeg_jax.data.jsonl import DataError, read_jsonl
from rpeg_jax.data.pipeline import PromptBatch, PromptPipeline, build_pipeline, left_pad, load_records
from rpeg_jax.data.rewards import (
    RewardError,
    Sample,
    get_reward,
    make_samples,
    register_reward,
    registered_rewards,
    resolve_reward,
    score,
)
from rpeg_jax.data.tasks import TASKS, Task, make_records
from rpeg_jax.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, completion_ids, load_tokenizer

__all__ = [
    "answers_match",
    "extract_answer",
    "normalize_answer",
    "DataError",
    "read_jsonl",
    "PromptBatch",
    "PromptPipeline",
    "build_pipeline",
    "left_pad",
    "load_records",
    "RewardError",
    "Sample",
    "get_reward",
    "make_samples",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "score",
    "TASKS",
    "Task",
    "make_records",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "completion_ids",
    "load_tokenizer",
]
