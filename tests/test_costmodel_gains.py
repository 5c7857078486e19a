"""The planner's comparisons: utilization on fixed reference work, the systems / algorithmic split
of the gain over verl-like, and the ReaL-like baseline's own search space.
References: the reference work counted here by hand in forward-equivalents of the model (one
generation, one forward per scoring pass, three per update) from ModelShape.forward_flops; brute
force over the candidate tables for the family bests."""

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.costmodel import planner as P
from rpeg_jax.costmodel.hardware import load_hardware

GH = load_hardware("gh200", calibrated=False)
P1 = [
    "model.dtype=bfloat16",
    "model.param_dtype=float32",
    "data.max_prompt_len=512",
    "costmodel.prompt_len=512",
    "rollout.max_new_tokens=4096",
    "costmodel.response_len_min=256",
    "costmodel.response_len_median=1024",
    "costmodel.response_len_sigma=0.8",
    "costmodel.sequence_packing=true",
]
PPO = ["rl.algorithm=ppo", "rl.group_size=1", "data.prompts_per_step=128", "rl.kl_coef=0.05"]


def cfg_of(*extra, model="qwen2-1.5b"):
    return load_config(None, [f"model.preset={model}", *P1, *extra])


def _one_forward(ctx, ms):
    lens = ctx.st.dist.lengths(ctx.st.B).astype(float)
    tok, scored, sq = np.sum(ctx.st.P + lens), np.sum(lens), np.sum((ctx.st.P + lens) ** 2)
    return float(ms.forward_flops(tok, scored, sq, True))


def test_utilization_is_on_the_reference_work_of_the_synchronous_unfused_graph():
    # PPO with KL, one-step rewrites on: the chosen plan drops old_forward and critic_forward, yet it
    # is credited with verl's work: generate + ref + old + critic forwards + 3 (actor) + 3 (critic).
    cfg = cfg_of(*PPO)
    res = P.search(cfg, 8, GH)
    ctx = P.make_context(cfg, 8, GH)
    roles = P.roles_of(ctx, ctx.base)
    a, c = _one_forward(ctx, roles.actor), _one_forward(ctx, roles.critic)
    ref_work = a + a + a + c + 3 * a + 3 * c  # generate, ref, old, critic forward, two updates
    peak = GH.peak(roles.actor.dtype) * 8
    c0 = res.chosen
    assert not {"old_forward", "critic_forward"} & set(c0.stage_times_s), "the rewrite did not happen"
    for p in (c0, *res.runners_up, *res.baselines.values()):
        assert p.utilization * p.step_time_s * peak == pytest.approx(ref_work, rel=1e-3), p.label
    # Own work: the chosen plan runs fewer passes than the reference, so it is credited less.
    own = P.useful_flops(ctx.st, P.apply_pipeline(ctx.base, _pipe(c0)))
    assert c0.utilization_own_work * c0.step_time_s * peak == pytest.approx(own, rel=1e-9)
    assert c0.utilization_own_work < c0.utilization
    # A faster plan on the same reference work has the higher utilization.
    verl = res.baselines["verl_like"]
    assert c0.step_time_s < verl.step_time_s and c0.utilization > verl.utilization
    assert verl.utilization == pytest.approx(verl.utilization_own_work, rel=1e-9)
    assert c0.plan.predicted["utilization_own_work"] == c0.utilization_own_work


def _pipe(p):
    from rpeg_jax.config.pipeline import PipelineConfig

    k = dict(p.knobs)
    k["fuse"] = tuple(k.get("fuse") or ())
    k["split_sizes"] = tuple(k.get("split_sizes") or ())
    return PipelineConfig(**{f: v for f, v in k.items() if f in PipelineConfig.__dataclass_fields__})
