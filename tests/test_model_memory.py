"""What a layer keeps for backward: the SwiGLU has a backward that saves only gate and up
(models/llama.swiglu); its gradient equals JAX's own and a float64 formula, and the rewrite is
visible in the residuals JAX saves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from rpeg_jax.config.model import model_preset
from rpeg_jax.models import init_model, token_logprobs
from rpeg_jax.models.llama import swiglu


def test_swiglu_gradient_equals_jax_and_a_float64_formula():
    rng = np.random.default_rng(0)
    g, u, w = (rng.normal(size=(3, 5, 7)).astype(np.float32) * 3 for _ in range(3))
    ours = jax.grad(lambda a, b: jnp.sum(swiglu(a, b) * w), argnums=(0, 1))(g, u)
    theirs = jax.grad(lambda a, b: jnp.sum(jax.nn.silu(a) * b * w), argnums=(0, 1))(g, u)
    x, b, w64 = g.astype(np.float64), u.astype(np.float64), w.astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-x))
    ref = (w64 * b * s * (1 + x * (1 - s)), w64 * x * s)
    for o, t, r in zip(ours, theirs, ref):
        np.testing.assert_allclose(o, t, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(o, r, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(swiglu(g, u), jax.nn.silu(g) * u)  # the forward is JAX's own


def test_a_layer_saves_three_mlp_arrays(capsys):
    # One unscanned layer of a SmolLM-shaped model (F = 1536): the residuals JAX keeps for backward.
    # With JAX's own silu there were 6 mlp-sized arrays (gate, up, three of silu's, the product);
    # now gate, up and the product (the down projection's input).
    cfg = model_preset("smollm2-135m", num_layers=1, vocab_size=256, max_position_embeddings=64)
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model, nnx.Param)
    B, T = 2, 16
    tok = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.ones((B, T), jnp.int32)

    def loss(p):
        return token_logprobs(nnx.merge(graphdef, p), tok, pos, seg, tok, start=0, length=T)[0].sum()

    capsys.readouterr()
    print_saved_residuals(loss, state)  # one line a residual: "f32[2,16,1536] output of ... (where)"
    res = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    F = cfg.intermediate_size
    mlp = [r for r in res if r.startswith((f"f32[{B},{T},{F}]", f"f32[{B * T},{F}]"))]
    assert len(mlp) == 3, mlp
    assert not [r for r in mlp if "silu" in r], mlp
