"""Qwen3-MoE in RL (issue 33): the router load-balancing loss (rl.router_aux_loss, moe/aux_loss) and
routing replay (rl.routing=replay, moe/routing_agreement), on the qwen3_moe_tiny fixture.

References: transformers' own aux_loss (Qwen3MoeForCausalLM(output_router_logits=True), stored by
tests/fixtures/make_qwen3_moe_aux.py for left-padded rows with an attention mask) and a float64
numpy Switch/Qwen3-MoE formula over transformers' router logits; for replay, the sampler's own
logprobs and expert records under a router with a constructed near-tie that the trainer's copy
breaks the other way."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rpeg_jax.config.rl import RLConfig
from rpeg_jax.models import load_hf
from rpeg_jax.rl import make_actor_update
from rpeg_jax.runtime.kernels import EXPERTS, forward_fn
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


@pytest.fixture(scope="module")
def moe():
    return load_hf(os.path.join(HF, "qwen3_moe_tiny"))


@pytest.fixture(scope="module")
def aux_case():
    return dict(np.load(os.path.join(HF, "qwen3_moe_tiny_aux.npz")))


def switch_aux_f64(logits_BxTxLxX, mask_BxT, k):
    """X · Σ_x f_x · P_x over every (real token, sparse layer): f_x the fraction of the k·N
    assignments... counted per token (Σ_x f_x = k), P_x the mean router probability (float64)."""
    x = logits_BxTxLxX.shape[-1]
    z = logits_BxTxLxX.astype(np.float64).reshape(-1, x)
    m = np.repeat(mask_BxT.reshape(-1).astype(np.float64), logits_BxTxLxX.shape[2])
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    counts = np.zeros(x)
    for row, w in zip(p, m):
        for e in np.argsort(-row, kind="stable")[:k]:
            counts[e] += w
    return x * np.sum(counts / m.sum() * (p * m[:, None]).sum(0) / m.sum())


def _completions(case, r=4):
    mask = case["mask"]
    return {
        "tokens_BxS": jnp.asarray(case["tokens"]),
        "positions_BxS": jnp.asarray(case["positions"]),
        "segment_ids_BxS": jnp.asarray(mask),
        "response_mask_BxR": jnp.ones((mask.shape[0], r), jnp.float32),
    }


def test_aux_loss_matches_transformers_and_numpy(moe, aux_case):
    """moe/aux_loss of the update's forward over left-padded rows = transformers' aux_loss (its
    attention mask = our segment ids) and the float64 formula over transformers' router logits;
    our router logits equal transformers' at real tokens."""
    graphdef, params = nnx.split(moe, nnx.Param)
    c = _completions(aux_case)
    out = jax.jit(forward_fn(graphdef, temperature=1.0, logp=True, entropy=False, values=False, router=True))(params, c)
    ref64 = switch_aux_f64(aux_case["router_logits"], aux_case["mask"], 2)
    assert float(aux_case["aux_loss"]) == pytest.approx(ref64, rel=1e-6)  # the formula is transformers'
    assert float(out["router"]["aux_loss"]) == pytest.approx(ref64, rel=2e-6)
    _, _, route = moe.hidden_routed(c["tokens_BxS"], c["positions_BxS"], c["segment_ids_BxS"])
    real = aux_case["mask"] > 0
    np.testing.assert_allclose(np.asarray(route["logits"])[real], aux_case["router_logits"][real], atol=1e-5)
    # padding counts: without the mask the value differs (the mask is not a no-op here)
    assert abs(switch_aux_f64(aux_case["router_logits"], np.ones_like(aux_case["mask"]), 2) - ref64) > 1e-4


def _actor_batch(case, adv):
    c = _completions(case)
    b, r = c["response_mask_BxR"].shape
    return {**c, "advantages_BxR": jnp.full((b, r), adv, jnp.float32), "old_logp_BxR": jnp.zeros((b, r), jnp.float32)}


@pytest.mark.parametrize("micro", [1, pytest.param(3, marks=pytest.mark.slow)])  # [1]: transformers' value too
def test_router_aux_loss_enters_the_actor_loss(moe, aux_case, micro):
    """actor/loss(c) - actor/loss(0) = c · moe/aux_loss; with zero advantages only the aux term has a
    gradient: c = 0 leaves every weight as it was, c > 0 moves the routers but not the LM head."""
    graphdef, params = nnx.split(moe, nnx.Param)
    policy = forward_fn(graphdef, temperature=1.0, logp=True, entropy=False, values=False, router=True)
    batch = _actor_batch(aux_case, 0.0)
    runs = {}
    for coef in (0.0, 0.5):
        cfg = RLConfig(router_aux_loss=coef, micro_batches=micro, behav_weight_cap=None)
        update = jax.jit(make_actor_update(policy, optax.sgd(1.0), cfg))
        runs[coef] = update(params, optax.sgd(1.0).init(params), batch)
    (p0, _, m0), (p1, _, m1) = runs[0.0], runs[0.5]
    aux = float(m1["moe/aux_loss"])
    assert float(m0["moe/aux_loss"]) == pytest.approx(aux, rel=1e-6)
    if micro == 1:  # one micro-batch: the whole batch's aux loss, transformers' value
        assert aux == pytest.approx(float(aux_case["aux_loss"]), rel=2e-6)
    assert float(m1["actor/loss"]) - float(m0["actor/loss"]) == pytest.approx(0.5 * aux, rel=1e-5)
    moved = {
        jax.tree_util.keystr(path): float(jnp.max(jnp.abs(a - b)))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(params))
    }
    stayed = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(params))]
    assert max(stayed) == 0.0
    assert moved[next(k for k in moved if "w_router" in k)] > 1e-6
    # the output side gets no gradient from the aux loss (it reads the router logits only)
    assert all(moved[k] == 0.0 for k in moved if "lm_head" in k or "final_norm" in k)


# ---- routing replay ---------------------------------------------------------------------------------
def tied_router(model, sign: float, eps: float = 1e-4):
    """A copy whose routers score expert 3 as expert 2 plus sign·eps·(h·v) (v a fixed direction):
    a near-tie that the copies with sign +1 and -1 break the other way whenever experts 2 and 3
    compete for the last of the top-k places."""
    m = nnx.clone(model)
    w = np.array(m.layers.w_router[...])  # [S, D, X]
    v = np.random.default_rng(0).normal(size=w.shape[1])
    w[:, :, 3] = w[:, :, 2] + sign * eps * v
    m.layers.w_router.set_value(jnp.asarray(w))
    d = np.array(m.layers.we_down[...])  # [S, X, F, D]: expert 3's output 10x, so a flip shows
    d[:, 3] *= 10.0
    m.layers.we_down.set_value(jnp.asarray(d))
    return m


def rollout(outs):
    """The runtime's rollout layout (runtime/rollout/layout.py) with the sampler's expert records."""
    rows = [(o.prompt_tokens, c) for o in outs for c in o.completions]
    P, R = max(len(p) for p, _ in rows), max(len(c.tokens) for _, c in rows)
    B, (S, k) = len(rows), rows[0][1].experts.shape[1:]
    tok, pos, seg = (np.zeros((B, P + R), np.int32) for _ in range(3))
    mask, behav = np.zeros((B, R), np.float32), np.zeros((B, R), np.float32)
    experts = np.full((B, P + R, S, k), -1, np.int16)
    for i, (p, c) in enumerate(rows):
        n = len(c.tokens)
        tok[i, P - len(p) : P], tok[i, P : P + n] = p, c.tokens
        pos[i, P - len(p) : P + n] = np.arange(len(p) + n)
        seg[i, P - len(p) : P + n] = 1
        experts[i, P - len(p) : P + n] = c.experts
        mask[i, :n], behav[i, :n] = 1, c.logprobs
    c = dict(tokens_BxS=tok, positions_BxS=pos, segment_ids_BxS=seg, response_mask_BxR=mask, **{EXPERTS: experts})
    return {k: jnp.asarray(v) for k, v in c.items()}, behav, mask


def test_replay_reproduces_the_samplers_logprobs_where_recompute_differs(moe):
    """The sampler runs the +eps copy, the trainer the -eps copy (weights 1e-4 apart in two router
    columns). Recomputing the routing picks expert 2 where the sampler picked 3 (or back) on a
    share of the tokens, so its logprobs leave the sampler's by far more than float32 noise and
    its agreement is < 1; replaying the recorded experts brings the logprobs back to the sampler's
    within the sampler-vs-trainer floor (tests/test_sampler.py) and the agreement to 1."""
    sampler_model, trainer_model = tied_router(moe, +1.0), tied_router(moe, -1.0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (6, 3, 9, 5)]
    cfg = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, max_seq_len=32)
    outs = Sampler(sampler_model, cfg).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    )
    c, behav, mask = rollout(outs)
    graphdef, params = nnx.split(trainer_model, nnx.Param)
    res = {}
    for routing in ("recompute", "replay"):
        f = forward_fn(graphdef, temperature=1.0, logp=True, entropy=False, values=False, routing=routing, router=True)
        out = jax.jit(f)(params, c)
        res[routing] = (np.abs(np.asarray(out["logp"]) - behav) * mask, out["router"])
    (gap_re, r_re), (gap_rp, r_rp) = res["recompute"], res["replay"]
    assert float(r_re["routing_agreement"]) < 0.95  # the near-tie flips a share of the tokens
    assert float(r_re["routing_agreement"]) == pytest.approx(float(r_re["topk_agreement"]))
    # measured: recompute max 1.75e-2, agreement 0.61; replay max 2.1e-5, agreement 1
    assert gap_re.max() > 5e-3, gap_re.max()
    assert float(r_rp["routing_agreement"]) == 1.0
    assert float(r_rp["topk_agreement"]) < 0.95  # its own router still disagrees: replay is what agrees
    assert gap_rp.max() < 1e-4, gap_rp.max()
    assert gap_rp.max() * 100 < gap_re.max()


# ---- the run config and the runtime ---------------------------------------------------------------
MOE = [
    "model.arch=qwen3_moe",
    "model.qk_norm=true",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=64",
]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["rl.router_aux_loss=0.01"], "rl.router_aux_loss"),  # a dense model has no router
        (["rl.routing=replay"], "rl.routing"),
        (
            MOE + ["rl.routing=replay", "env.name=tools", "env.tools=[calculator]", "data.chat_template=chatml"],
            "rl.routing",
        ),
        (MOE + ["rl.router_aux_loss=-1"], "rl.router_aux_loss"),
    ],
)
def test_bad_moe_settings_are_one_line_naming_the_key(overrides, key):
    from rpeg_jax.config import load_config
    from rpeg_jax.config.base import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,extra",
    [
        ("replay", ["rl.routing=replay", "rl.router_aux_loss=0.01"]),
        ("recompute", []),
        ("continuous", ["rl.routing=replay", "rollout.admission=continuous", "pipeline.staleness=1"]),
        ("packed", ["rl.routing=replay", "train.pack_sequences=true", "rl.router_aux_loss=0.01"]),
    ],
)
def test_moe_runs_log_routing(tmp_path, name, extra):
    """Training runs (step and continuous admission) carry the sampler's records into the update:
    moe/aux_loss and the agreements are logged every step; under replay the experts the update used
    are the sampler's (agreement 1 to float32 rounding of the micro-batch weights)."""
    from helpers import TINY, run

    r = run(tmp_path, name, TINY + MOE + extra, steps=2)
    for m in r.metrics:
        assert 0 < m["moe/aux_loss"] < 4  # X·Σ f·P: k = 2 when balanced, X = 4 at most
        assert 0.5 < m["moe/routing_agreement"] <= 1.0 + 1e-6 and 0.5 < m["moe/topk_agreement"] <= 1.0 + 1e-6
        if "rl.routing=replay" in extra:
            assert m["moe/routing_agreement"] == pytest.approx(1.0, abs=1e-6)
        if "train.pack_sequences=true" in extra:  # the update really ran packed rows
            assert "perf/actor_pack_fill" in m


def test_packed_pass_equals_the_plain_pass(moe):
    """train.pack_sequences on a mixture: the packed forward (runtime/packed_forward.py) gives the
    plain pass's logprobs at every real response token and the same routing metrics (aux loss,
    routing and top-k agreement over the same real tokens), under recompute and replay; on the
    near-tie case of the replay test, so that replay's records visibly reach the packed rows
    (agreement 1 vs < 0.95 under recompute). The rows really are packed (a row holds two sequences)."""
    from rpeg_jax.rl import packing
    from rpeg_jax.runtime.packed_forward import packed_forward_fn

    sampler_model, trainer_model = tied_router(moe, +1.0), tied_router(moe, -1.0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (6, 3, 9, 5)]
    cfg = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, max_seq_len=32)
    params_s = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    lengths = [[3, 12], [2, 5], [12, 4], [6, 1]]  # varied lengths, so that short sequences share rows
    c, _, mask = rollout(Sampler(sampler_model, cfg).generate(prompts, params_s, lengths=lengths))
    plan = {k: v[0] for k, v in packing.forward_plan({k: np.asarray(v) for k, v in c.items()}, 1).items()}
    assert int(np.max(plan["seg_NxT"])) >= 2  # some packed row holds two sequences
    graphdef, params = nnx.split(trainer_model, nnx.Param)
    kw = dict(temperature=1.0, logp=True, entropy=True, values=False, router=True)
    for routing in ("recompute", "replay"):
        plain = jax.jit(forward_fn(graphdef, routing=routing, **kw))(params, c)
        packed = jax.jit(packed_forward_fn(graphdef, routing=routing, **kw))(params, {**c, packing.PLAN_KEY: plan})
        for name in ("logp", "entropy"):
            np.testing.assert_allclose(np.asarray(packed[name]) * mask, np.asarray(plain[name]) * mask, atol=2e-5)
        for name, v in plain["router"].items():
            np.testing.assert_allclose(float(packed["router"][name]), float(v), rtol=1e-5, err_msg=name)
        agreement = float(packed["router"]["routing_agreement"])
        assert agreement == 1.0 if routing == "replay" else agreement < 0.95
