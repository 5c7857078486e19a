"""Split placement's memory: the generation group holds only the rollout weights, the KV pages and
the sampler's working set, and the training group holds the training state (costmodel/candidates.py).
Reference: a brute-force search, per table row, for the most slots whose generation memory
(stages.generate_memory, weights + KV + working set on one generation device) fits the budget,
floored onto the 4-steps-per-octave grid by a formula written here."""

import math

import numpy as np

from rpeg_jax.config import load_config
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import scoring as SC
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.graph.passes import apply_pipeline

H100 = load_hardware("h100", calibrated=False)
WORKLOAD = [
    "model.preset=qwen2-7b",
    "model.dtype=bfloat16",
    "model.param_dtype=float32",
    "data.prompts_per_step=128",
    "rl.group_size=16",
    "data.max_prompt_len=512",
    "costmodel.prompt_len=512",
    "rollout.max_new_tokens=4096",
    "costmodel.response_len_min=256",
    "costmodel.response_len_median=1024",
    "train.pack_sequences=true",
    "rl.kl_coef=0.001",
]


def _grid_floor(s: int) -> int:
    """The largest floor(2^(j/4)) <= s (j >= 0), 0 for s < 1."""
    if s < 1:
        return 0
    j = 0
    while math.floor(2 ** ((j + 1) / 4)) <= s:
        j += 1
    return math.floor(2 ** (j / 4))


def test_split_generation_kv_capacity_ignores_the_training_groups_state():
    ctx = CX.make_context(load_config(None, WORKLOAD), 16, H100)
    g = apply_pipeline(ctx.base, PipelineConfig(placement="split", split_sizes=(1, 1), plan="manual"))
    tab = SC.family_table(ctx, g, "split", {}, allocs=[(8, 8)])
    assert len(tab.n_gen), "no split row fits"
    actor = CX.roles_of(ctx, g).actor
    budget = ctx.st.budget_bytes
    checked = 0
    for t_g in np.unique(tab.t_g):
        reps = 8 // int(t_g)
        n_rep = -(-ctx.st.B // reps)
        s = 0  # brute force: the most slots whose generation memory fits on a generation device
        while float(S.generate_memory(ctx.st, actor, int(t_g), s + 1, reps)) <= budget:
            s += 1
        want = min(_grid_floor(s), n_rep) if s < n_rep else n_rep
        rows = tab.t_g == t_g
        assert set(tab.slots[rows].tolist()) == {want}, (int(t_g), s, n_rep)
        checked += int(want < n_rep)  # a KV-limited layout: where the bug showed
        assert np.all(tab.mem_gen[rows] <= budget)
    assert checked, "no generation layout was KV-limited: the test would not see the bug"
