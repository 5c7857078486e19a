"""The group-shared-prompt pass (models/prefix.py) against the plain pass over every row's copy of
the prompt (`token_logprobs`, itself tested against a float64 numpy decoder in test_models.py):
logprobs, entropies, hidden states and parameter gradients at response tokens, with left-padded
prompts of different lengths per group and right-padded responses; a row whose prompt differs
from its group's gets NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import group_rollout

from rpeg_jax.config import model_preset
from rpeg_jax.models import init_model, token_logprobs
from rpeg_jax.models.prefix import group_hidden, group_token_logprobs

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, init_std=0.2)
N_GROUPS, G, P, R = 3, 4, 6, 7


def rollout_batch(seed=0):
    """Rollout layout: groups of G rows with one prompt (left-padded to P), responses right-padded."""
    tok, pos, seg = group_rollout(np.random.default_rng(seed), N_GROUPS, G, P, R)
    mask = (seg[:, P:] > 0).astype(np.float32)
    return jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg), mask


def plain(model, tok, pos, seg, **kw):
    targets = jnp.concatenate([tok[:, 1:], jnp.zeros_like(tok[:, :1])], 1)
    return token_logprobs(model, tok, pos, seg, targets, start=P - 1, length=R, **kw)


@pytest.fixture(scope="module")
def models():
    return {
        "llama": init_model(model_preset("tiny", value_head=True, **SMALL), seed=3),
        "qwen": init_model(model_preset("tiny", arch="qwen2", qkv_bias=True, tie_embeddings=True, **SMALL), seed=1),
    }


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_shared_prompt_equals_plain_pass(models, name):
    """Values at response tokens (float32 tolerance 2e-5 absolute) and gradients (2e-5 + 1e-4 rel)."""
    model = models[name]
    tok, pos, seg, mask = rollout_batch()
    lp0, ent0, h0 = plain(model, tok, pos, seg, temperature=0.8, with_entropy=True, return_hidden=True)
    lp1, ent1, h1 = group_token_logprobs(
        model, tok, pos, seg, response_len=R, group_size=G, temperature=0.8, with_entropy=True, return_hidden=True
    )
    m = mask > 0
    np.testing.assert_allclose(np.asarray(lp1)[m], np.asarray(lp0)[m], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent1)[m], np.asarray(ent0)[m], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(h1)[m], np.asarray(h0)[m], atol=2e-5, rtol=1e-5)

    graphdef, params = nnx.split(model, nnx.Param)
    w = jnp.asarray(np.random.default_rng(1).normal(size=mask.shape) * mask, jnp.float32)

    def loss(params, shared):
        mdl = nnx.merge(graphdef, params)
        if shared:
            lp, ent = group_token_logprobs(mdl, tok, pos, seg, response_len=R, group_size=G, with_entropy=True)
        else:
            lp, ent = plain(mdl, tok, pos, seg, with_entropy=True)
        return jnp.sum(jnp.where(mask > 0, lp + 0.3 * ent, 0.0) * w)

    g0, g1 = jax.grad(loss)(params, False), jax.grad(loss)(params, True)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-5, rtol=1e-4, err_msg=str(path))


def test_values_from_shared_hidden(models):
    model = models["llama"]
    tok, pos, seg, mask = rollout_batch(2)
    _, _, h0 = plain(model, tok, pos, seg, return_hidden=True)
    h1, bad = group_hidden(model, tok, pos, seg, response_len=R, group_size=G)
    assert not np.any(np.asarray(bad))
    m = mask > 0
    np.testing.assert_allclose(np.asarray(model.values(h1))[m], np.asarray(model.values(h0))[m], atol=2e-5)


def test_row_with_another_prompt_gets_nan(models):
    tok, pos, seg, _ = rollout_batch()
    tok = tok.at[5, P - 1].set(tok[5, P - 1] + 1)  # row 5 (group 1) has another prompt
    lp, _ = group_token_logprobs(models["llama"], tok, pos, seg, response_len=R, group_size=G)
    rows_nan = np.isnan(np.asarray(lp)).all(axis=1)
    assert rows_nan[5] and rows_nan.sum() == 1


def test_bad_shapes_are_rejected(models):
    tok, pos, seg, _ = rollout_batch()
    with pytest.raises(ValueError, match="group_size"):
        group_token_logprobs(models["llama"], tok, pos, seg, response_len=R, group_size=5)
    with pytest.raises(ValueError, match="response_len"):
        group_token_logprobs(models["llama"], tok, pos, seg, response_len=1, group_size=G)
