"""The step's useful FLOPs (perf/flops, bench/rl_step.py's limit fraction) against a count written
out here per weight matrix, for GRPO, GRPO with a reference model, and PPO with a critic."""

import pytest

from rpeg_jax.config import load_config
from rpeg_jax.runtime.rollout.stats import step_flops


def matmul_flops_per_token(cfg, head=True):
    d, h, k, e, f, L, v = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_size,
        cfg.intermediate_size,
        cfg.num_layers,
        cfg.vocab_size,
    )
    per_layer = d * h * e + 2 * d * k * e + h * e * d + 3 * d * f
    return 2 * L * per_layer, 2 * d * v if head else 0


def expected(cfg, prompt, resp, passes_actor, passes_critic):
    """One sequence as if its group were 1: generation (prompt once, response tokens with logits), then
    full passes over prompt + response; attention 4·L·H·E per query-key pair (causal)."""
    m = cfg.model
    body, head = matmul_flops_per_token(m)
    attn = 4 * m.num_layers * m.num_heads * m.head_size
    gen = body * prompt + (body + head) * resp + attn * resp * (prompt + resp / 2)
    seq = prompt + resp
    one_pass = body * seq + head * resp + attn * seq * seq / 2
    cbody, _ = matmul_flops_per_token(cfg.critic_model, head=False)
    critic_pass = cbody * seq + attn * seq * seq / 2
    return gen + passes_actor * one_pass + passes_critic * critic_pass


def prompt_share(cfg, prompt, passes_actor, passes_critic):
    """What a group of G saves on one sequence's prompt when it is computed once per group:
    (1 - 1/G) of its body FLOPs and of its own attention pairs, in generation and every pass."""
    m = cfg.model
    body, _ = matmul_flops_per_token(m)
    cbody, _ = matmul_flops_per_token(cfg.critic_model, head=False)
    attn = 4 * m.num_layers * m.num_heads * m.head_size
    share = 1 - 1 / cfg.rl.group_size
    actor = (body * prompt + attn * prompt * prompt / 2) * share
    critic = (cbody * prompt + attn * prompt * prompt / 2) * share
    return body * prompt * share + passes_actor * actor + passes_critic * critic


@pytest.mark.parametrize(
    "overrides,actor,critic",
    [
        ([], 3, 0),  # GRPO: update = forward + backward
        (["rl.kl_coef=0.04"], 4, 0),  # + reference forward
        (["rl.kl_coef=0.04", "pipeline.staleness=1", "rl.minibatches=2"], 5, 0),  # + proximal forward (decoupled PPO)
        (["rl.kl_coef=0.04", "pipeline.staleness=1"], 4, 0),  # one optimizer step: π_prox from the update's forward
        (["rl.algorithm=ppo", "rl.minibatches=2"], 3, 4),  # critic: value forward + update
        (["rl.algorithm=ppo"], 3, 3),  # one step: the values from the critic update's forward
        (["rl.algorithm=ppo", "pipeline.share_actor_critic=true"], 3, 0),
    ],
)
def test_step_flops_match_a_per_matrix_count(overrides, actor, critic):
    cfg = load_config(None, ["rl.group_size=2"] + overrides)
    prompt, resp = 5, 3
    stats = {
        "resp": resp,
        "prompt": prompt,
        "seq": prompt + resp,
        "resp_ctx": resp * (prompt + resp / 2),
        "prompt_sq": prompt * prompt / 2,
    }
    got = step_flops(cfg, stats, cfg.pipeline.staleness)
    # a group's prompt counts once per group (G = 2 here): generation and every pass
    want = expected(cfg, prompt, resp, actor, critic) - prompt_share(cfg, prompt, actor, critic)
    assert got == pytest.approx(want, rel=2e-3)  # norm weights counted as matmul weights: < 0.2%
