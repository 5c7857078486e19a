"""models/moe.py against float64 numpy references (JAX in float32) written as HF's Qwen3MoeSparseMoeBlock and
load_balancing_loss_func compute them (a loop over tokens and experts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpeg_jax.models.moe import load_balancing_loss, moe_block, routing_agreement


def _params(rng, D=8, X=5, F=6):
    return {
        "w_router": rng.normal(size=(D, X)),
        "we_gate": rng.normal(size=(X, D, F)) * 0.3,
        "we_up": rng.normal(size=(X, D, F)) * 0.3,
        "we_down": rng.normal(size=(X, F, D)) * 0.3,
    }


def _ref_block(h, p, k, norm):
    N, D = h.shape
    logits = h @ p["w_router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    for n in range(N):
        w = probs[n, chosen[n]]
        if norm:
            w = w / w.sum()
        for j, e in enumerate(chosen[n]):
            g = h[n] @ p["we_gate"][e]
            u = h[n] @ p["we_up"][e]
            a = g / (1 + np.exp(-g)) * u
            out[n] += w[j] * (a @ p["we_down"][e])
    return out, logits, chosen


def _ref_aux(logits, k):
    X = logits.shape[-1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    mask = np.eye(X)[chosen]  # [N, k, X]
    tokens_per_expert = mask.mean(0)
    prob_per_expert = probs.mean(0)
    return X * np.sum(tokens_per_expert * prob_per_expert[None])


@pytest.mark.parametrize("norm", [True, False])
def test_moe_block_matches_reference(norm):
    rng = np.random.default_rng(0)
    p = _params(rng)
    h = rng.normal(size=(2, 7, 8))
    y, logits, experts = moe_block(
        jnp.asarray(h, jnp.float32), {n: jnp.asarray(w, jnp.float32) for n, w in p.items()}, 2, norm
    )
    ref, ref_logits, ref_experts = _ref_block(h.reshape(14, 8), p, 2, norm)
    np.testing.assert_allclose(np.asarray(logits).reshape(14, -1), ref_logits, atol=2e-5)
    np.testing.assert_array_equal(np.sort(np.asarray(experts).reshape(14, 2), -1), np.sort(ref_experts, -1))
    np.testing.assert_allclose(np.asarray(y).reshape(14, 8), ref, atol=2e-5)


def test_moe_block_gradient_matches_dense_formulation():
    """The ragged_dot path's gradient equals that of a dense all-experts formulation (masked)."""
    rng = np.random.default_rng(1)
    p = {n: jnp.asarray(w, jnp.float32) for n, w in _params(rng).items()}
    h = jnp.asarray(rng.normal(size=(1, 6, 8)), jnp.float32)

    def dense(p, h):
        x = h.reshape(-1, 8)
        probs = jax.nn.softmax(x @ p["w_router"], -1)
        w, e = jax.lax.top_k(probs, 2)
        w = w / w.sum(-1, keepdims=True)
        gate = jnp.einsum("nd,xdf->nxf", x, p["we_gate"])
        up = jnp.einsum("nd,xdf->nxf", x, p["we_up"])
        out = jnp.einsum("nxf,xfd->nxd", jax.nn.silu(gate) * up, p["we_down"])
        wx = jnp.sum(jax.nn.one_hot(e, 5) * w[..., None], axis=1)  # [N, X]
        return jnp.sum(jnp.einsum("nx,nxd->nd", wx, out) ** 2)

    def ragged(p, h):
        return jnp.sum(moe_block(h, p, 2, True)[0] ** 2)

    g1, g2 = jax.grad(dense)(p, h), jax.grad(ragged)(p, h)
    for n in p:
        np.testing.assert_allclose(g2[n], g1[n], rtol=2e-4, atol=2e-5)


def test_forced_experts_and_agreement():
    rng = np.random.default_rng(2)
    p = {n: jnp.asarray(w, jnp.float32) for n, w in _params(rng).items()}
    h = jnp.asarray(rng.normal(size=(1, 4, 8)), jnp.float32)
    _, _, free = moe_block(h, p, 2, True)
    forced = jnp.flip(free, -1)  # same sets, other order: same output
    y1 = moe_block(h, p, 2, True)[0]
    y2, _, e2 = moe_block(h, p, 2, True, experts_BxTxK=forced)
    np.testing.assert_allclose(y2, y1, atol=1e-6)
    assert float(routing_agreement(free.reshape(-1, 2), e2.reshape(-1, 2))) == 1.0
    other = (free + 1) % 5
    assert float(routing_agreement(free.reshape(-1, 2), other.reshape(-1, 2))) < 1.0


def test_load_balancing_loss_matches_hf_formula():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(20, 6))
    got = float(load_balancing_loss(jnp.asarray(logits, jnp.float32), 2))
    assert got == pytest.approx(_ref_aux(logits, 2), rel=1e-5)


def _moe_cfg(**kw):
    from rpeg_jax.config.model import ModelConfig

    base = dict(
        arch="qwen3_moe",
        qk_norm=True,
        vocab_size=64,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    base.update(kw)
    cfg = ModelConfig(**base)
    cfg.validate("model")
    return cfg


@pytest.mark.slow
def test_model_mixed_layers_use_their_own_mlp():
    """mlp_only_layers=(1,): layer 1 keeps a dense SwiGLU, layers 0 and 2 are sparse; the parameter
    count matches the arrays; scanned == unrolled when every layer is sparse."""
    from flax import nnx

    from rpeg_jax.models.llama import init_model

    cfg = _moe_cfg(mlp_only_layers=(1,))
    assert cfg.sparse_layers == (True, False, True) and not cfg.scanned
    m = init_model(cfg, seed=0)
    assert m.layers.w_gate.shape == (1, 32, 48) and m.layers.we_gate.shape == (2, 4, 32, 16)
    n = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))
    assert n == cfg.num_params()
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    logits = m(tok)
    assert logits.shape == (2, 9, 64) and bool(jnp.all(jnp.isfinite(logits)))
    # the dense layer's MLP is used: zeroing it changes the output
    m.layers.w_down[...] = jnp.zeros_like(m.layers.w_down[...])
    assert not np.allclose(m(tok), logits)

    cfg_s = _moe_cfg(num_layers=5, scan_layers=True)
    cfg_u = _moe_cfg(num_layers=5, scan_layers=False)
    ms, mu = init_model(cfg_s, seed=1), init_model(cfg_u, seed=1)
    np.testing.assert_allclose(ms(tok), mu(tok), atol=2e-5)


def test_moe_config_errors_name_the_key():
    from rpeg_jax.config.base import ConfigError

    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _moe_cfg(num_experts_per_tok=5)
    with pytest.raises(ConfigError, match="scan_layers"):
        _moe_cfg(mlp_only_layers=(1,), scan_layers=True)
    with pytest.raises(ConfigError, match="num_experts"):
        _moe_cfg(arch="qwen3")


def test_forward_matches_transformers_qwen3_moe():
    """Logits <= 1e-4 vs transformers' Qwen3MoeForCausalLM in float32 (fixture written by
    tests/fixtures/make_qwen3_moe_forward.py: 4 experts, top-2, layer 1 dense). The weights are put
    into the model here, by the HF layouts (models/hf.py does not load qwen3_moe yet)."""
    import os

    from rpeg_jax.models.llama import init_model

    f = np.load(os.path.join(os.path.dirname(__file__), "fixtures", "hf", "qwen3_moe_tiny_forward.npz"))
    cfg = _moe_cfg(head_dim=8, max_position_embeddings=64, mlp_only_layers=(1,))
    m = init_model(cfg, seed=0)
    D, H, K, E, Fm = 32, 4, 2, 8, 16

    def w(name):
        return f[f"w/{name}"]

    def stack(fn, layers):
        return jnp.asarray(np.stack([fn(f"model.layers.{i}.") for i in layers]))

    L = m.layers
    every, sparse, dense = range(3), (0, 2), (1,)
    L.attn_norm[...] = stack(lambda p: w(p + "input_layernorm.weight"), every)
    L.mlp_norm[...] = stack(lambda p: w(p + "post_attention_layernorm.weight"), every)
    L.q_norm[...] = stack(lambda p: w(p + "self_attn.q_norm.weight"), every)
    L.k_norm[...] = stack(lambda p: w(p + "self_attn.k_norm.weight"), every)
    L.wq[...] = stack(lambda p: w(p + "self_attn.q_proj.weight").T.reshape(D, H, E), every)
    L.wk[...] = stack(lambda p: w(p + "self_attn.k_proj.weight").T.reshape(D, K, E), every)
    L.wv[...] = stack(lambda p: w(p + "self_attn.v_proj.weight").T.reshape(D, K, E), every)
    L.wo[...] = stack(lambda p: w(p + "self_attn.o_proj.weight").T.reshape(H, E, D), every)
    L.w_gate[...] = stack(lambda p: w(p + "mlp.gate_proj.weight").T, dense)
    L.w_up[...] = stack(lambda p: w(p + "mlp.up_proj.weight").T, dense)
    L.w_down[...] = stack(lambda p: w(p + "mlp.down_proj.weight").T, dense)
    L.w_router[...] = stack(lambda p: w(p + "mlp.gate.weight").T, sparse)
    L.we_gate[...] = stack(lambda p: w(p + "mlp.experts.gate_up_proj")[:, :Fm].transpose(0, 2, 1), sparse)
    L.we_up[...] = stack(lambda p: w(p + "mlp.experts.gate_up_proj")[:, Fm:].transpose(0, 2, 1), sparse)
    L.we_down[...] = stack(lambda p: w(p + "mlp.experts.down_proj").transpose(0, 2, 1), sparse)
    m.embed[...] = jnp.asarray(w("model.embed_tokens.weight"))
    m.final_norm[...] = jnp.asarray(w("model.norm.weight"))
    m.lm_head[...] = jnp.asarray(w("lm_head.weight").T)
    logits = np.asarray(m(jnp.asarray(f["tokens"])))
    print("max |logits - transformers|", np.abs(logits - f["logits"]).max())
    np.testing.assert_allclose(logits, f["logits"], atol=1e-4, rtol=0)
    assert np.abs(f["logits"]).max() > 0.05  # not a trivially small comparison


def test_load_hf_qwen3_moe_checkpoint_and_export(tmp_path):
    """models/hf.load_hf reads transformers' saved Qwen3-MoE (per-expert tensors): logits <= 1e-4
    vs transformers; save_hf writes the same tensors back (equal arrays, same names)."""
    import os

    from safetensors.numpy import load_file

    from rpeg_jax.models.hf import load_hf, save_hf

    ckpt = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "qwen3_moe_tiny")
    f = np.load(os.path.join(ckpt, "expected.npz"))
    m = load_hf(ckpt)
    assert m.cfg.arch == "qwen3_moe" and m.cfg.sparse_layers == (True, False, True)
    logits = np.asarray(m(jnp.asarray(f["tokens"])))
    np.testing.assert_allclose(logits, f["logits"], atol=1e-4, rtol=0)
    save_hf(m, str(tmp_path / "out"))
    a = load_file(os.path.join(ckpt, "model.safetensors"))
    b = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])
