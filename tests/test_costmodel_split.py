"""Split placement's memory: the generation group holds only the rollout weights, the KV pages and
the sampler's working set, and the training group holds the training state (costmodel/candidates.py).
Reference: a brute-force search, per table row, for the most slots whose generation memory
(stages.generate_memory, weights + KV + working set on one generation device) fits the budget,
floored onto the 4-steps-per-octave grid by a formula written here."""

import math

import numpy as np
import pytest

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


def test_decoding_ahead_on_processes_with_their_own_cores_prices_the_overlap():
    """A shared-host profile (the CPU) serialises every group: one machine's cores. With
    process_hosts (each process pinned to cores of its own, bench R2-MP) a process's devices share
    its cores only (a device of a 1-device process gets the whole host's rates, not half), and a split
    across 2 processes decoding ahead costs about max(generation, training) per step, not the sum."""
    import dataclasses

    cpu = load_hardware("cpu", calibrated=False)
    own = dataclasses.replace(cpu, process_hosts=True, local_devices=1)
    assert S.rates(own, "float32", 2)[0] == 2 * S.rates(cpu, "float32", 2)[0]
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "data.prompts_per_step=16",
            "rl.group_size=8",
            "rollout.max_new_tokens=64",
            "pipeline.staleness=1",
            "rollout.admission=continuous",
        ],
    )
    pipe = PipelineConfig(staleness=1, placement="split", split_sizes=(1, 1))
    ctx_one = CX.make_context(cfg, 2, cpu, processes=2)
    ctx_own = CX.make_context(cfg, 2, dataclasses.replace(cpu, process_hosts=True), processes=2)
    assert ctx_own.hw.local_devices == 1 and SC.shared_resource(ctx_one) and not SC.shared_resource(ctx_own)
    out = {}
    for name, ctx in (("one", ctx_one), ("own", ctx_own)):
        for ahead in (False, True):
            g = apply_pipeline(ctx.base, pipe, "continuous", ahead)
            tab = SC.family_table(ctx, g, "split", {}, [(1, 1)], ours=False)
            dur, _ = SC.durations(ctx, g, tab)
            period, _ = SC.periods(ctx, g, tab)
            i = int(np.argmin(period))
            gen = float(dur["generate"][i])
            train = sum(float(v[i]) for k, v in dur.items() if k not in ("generate", "reward"))
            out[name, ahead] = (float(period[i]), gen, train)
    p, gen, train = out["own", True]
    assert p == pytest.approx(max(gen, train), rel=0.05)  # overlapped on their own cores
    p_turns, gen_t, train_t = out["own", False]
    assert p_turns == pytest.approx(gen_t + train_t, rel=0.05)  # taking turns: the sum
    p_one, gen_1, train_1 = out["one", True]
    assert p_one == pytest.approx(gen_1 + train_1, rel=0.05)  # one machine's shared cores: the sum
