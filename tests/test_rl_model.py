"""A real update on the tiny Transformer (2 layers, hidden 64) through the shared actor-critic step.

The policy function is built the way the runtime builds it: `token_logprobs` over the rollout
layout of runtime/rollout/layout.py (prompts left-padded to P, responses right-padded to R, response token i at
column P+i predicted from column P+i-1), values from the value head on the same hidden states.
Checks after one SGD step (first order, lr small): every positive-advantage response's summed
log-probability rises, every negative one's falls; the value loss falls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rpeg_jax import rl
from rpeg_jax.config import RLConfig, model_preset
from rpeg_jax.models import Transformer, token_logprobs

P, R = 4, 5


def make_policy_fn(graphdef):
    def policy_fn(params, b):
        model = nnx.merge(graphdef, params)
        tokens = b["tokens_BxS"]
        targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        logp, ent, h = token_logprobs(
            model,
            tokens,
            b["positions_BxS"],
            b["segment_ids_BxS"],
            targets,
            start=P - 1,
            length=R,
            with_entropy=True,
            return_hidden=True,
        )
        return {"logp": logp, "entropy": ent, "values": model.values(h)}

    return policy_fn


def rollout_batch(cfg, seed):
    rng = np.random.default_rng(seed)
    b = 4
    plen = np.array([4, 2, 3, 4])
    rlen = np.array([5, 3, 1, 4])
    tokens = np.zeros((b, P + R), np.int32)
    seg = np.zeros((b, P + R), np.int32)
    for i in range(b):
        tokens[i, P - plen[i] : P + rlen[i]] = rng.integers(3, cfg.vocab_size, plen[i] + rlen[i])
        seg[i, P - plen[i] : P + rlen[i]] = 1
    pos = np.maximum(np.cumsum(seg, 1) - 1, 0).astype(np.int32)
    mask = (np.arange(R)[None] < rlen[:, None]).astype(np.float32)
    return {
        "tokens_BxS": jnp.asarray(tokens),
        "positions_BxS": jnp.asarray(pos),
        "segment_ids_BxS": jnp.asarray(seg),
        "response_mask_BxR": jnp.asarray(mask),
    }


def test_shared_update_on_tiny_transformer_moves_logprobs_with_advantage():
    mcfg = model_preset(
        "tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, value_head=True
    )
    graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    policy_fn = make_policy_fn(graphdef)
    batch = rollout_batch(mcfg, 1)
    mask = np.asarray(batch["response_mask_BxR"])
    out = jax.jit(policy_fn)(params, batch)
    sign = np.array([1.0, -1.0, 1.0, -1.0])
    batch.update(
        {
            "old_logp_BxR": out["logp"],
            "advantages_BxR": jnp.asarray(sign[:, None] * mask, jnp.float32),
            "values_BxR": out["values"],
            "returns_BxR": jnp.asarray(mask * 0.5, jnp.float32),
        }
    )
    cfg = RLConfig(algorithm="ppo", vf_coef=0.5, loss_agg="seq-mean-token-mean")
    tx = optax.sgd(0.05)
    update = jax.jit(rl.make_actor_critic_update(policy_fn, tx, cfg))
    new, _, m = update(params, tx.init(params), batch)
    after = jax.jit(policy_fn)(new, batch)
    seq_delta = np.sum((np.asarray(after["logp"]) - np.asarray(out["logp"])) * mask, 1)
    assert np.all(seq_delta[sign > 0] > 0) and np.all(seq_delta[sign < 0] < 0), seq_delta
    vf = lambda v: np.sum(0.5 * (np.asarray(v) - 0.5) ** 2 * mask)  # noqa: E731
    assert vf(after["values"]) < vf(out["values"])
    assert float(m["actor/updates"]) == 1 and np.isfinite(float(m["actor/grad_norm"]))
