"""models/lora.py: merging PEFT-layout adapters equals PEFT's formula W + (alpha/r) B @ A (float64 numpy,
on the HF tensors save_hf writes), and a PEFT adapter directory round-trips with PEFT's key names."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from rpeg_jax.config.model import model_preset
from rpeg_jax.models import load_hf
from rpeg_jax.models.hf import hf_state
from rpeg_jax.models.llama import Transformer
from rpeg_jax.models.lora import TARGETS, merge, read_peft_adapter, target_shapes, write_peft_adapter


def _cfg():
    return model_preset(
        "tiny", hidden_size=64, intermediate_size=96, num_layers=2, param_dtype="float32", dtype="float32"
    )


def _random_adapters(cfg, targets, rank, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for t in targets:
        a_shape, b_shape = target_shapes(cfg, t, rank)
        out[t] = (rng.normal(0, 0.1, a_shape).astype(np.float32), rng.normal(0, 0.1, b_shape).astype(np.float32))
    return out


def test_merge_matches_peft_formula(tmp_path):
    cfg = _cfg()
    rank, alpha = 4, 8.0
    targets = ["q_proj", "k_proj", "o_proj", "down_proj"]
    adapters = _random_adapters(cfg, targets, rank)
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
    before = {k: np.asarray(v, np.float64) for k, v in hf_state(model).items()}
    merge(model, adapters, rank=rank, alpha=alpha)
    after = {k: np.asarray(v, np.float64) for k, v in hf_state(model).items()}
    changed = set()
    for t, (a, b) in adapters.items():
        for i in range(cfg.num_layers):
            name = f"model.layers.{i}.{TARGETS[t][1]}.weight"
            expect = before[name] + (alpha / rank) * b[i].astype(np.float64) @ a[i].astype(np.float64)
            np.testing.assert_allclose(after[name], expect, atol=1e-6, rtol=0)
            assert np.abs(expect - before[name]).max() > 1e-3  # the delta is not negligible
            changed.add(name)
    for name in set(before) - changed:
        np.testing.assert_array_equal(after[name], before[name])


def test_peft_adapter_dir_roundtrip(tmp_path):
    cfg = _cfg()
    targets = list(TARGETS)
    adapters = _random_adapters(cfg, targets, 3, seed=1)
    write_peft_adapter(str(tmp_path), cfg, adapters, rank=3, alpha=6.0)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 3 and config["lora_alpha"] == 6.0 and config["peft_type"] == "LORA"
    keys = set(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in keys
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in keys
    assert len(keys) == 2 * len(targets) * cfg.num_layers
    back, rank, alpha = read_peft_adapter(str(tmp_path), cfg)
    assert (rank, alpha) == (3, 6.0) and set(back) == set(targets)
    for t in targets:
        np.testing.assert_array_equal(back[t][0], adapters[t][0])
        np.testing.assert_array_equal(back[t][1], adapters[t][1])


def test_unknown_target_is_one_line():
    with pytest.raises(ValueError, match="lora target 'qkv_proj': unknown"):
        target_shapes(_cfg(), "qkv_proj", 4)


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_base_plus_peft_adapter_matches_peft_logits(name):
    """tests/fixtures/lora/<name>/ was written by PEFT (make_lora_fixtures.py) with random nonzero A, B:
    our base + merged adapter reproduces PeftModel's logits."""
    exp = np.load(os.path.join(FIXTURES, "lora", name, "expected.npz"))
    inputs = np.load(os.path.join(FIXTURES, "hf", name, "expected.npz"))
    model = load_hf(os.path.join(FIXTURES, "hf", name))
    adapters, rank, alpha = read_peft_adapter(os.path.join(FIXTURES, "lora", name), model.cfg)
    assert set(adapters) == set(TARGETS) and (rank, alpha) == (4, 8.0)
    merge(model, adapters, rank=rank, alpha=alpha)
    ours = np.asarray(
        model(
            jnp.asarray(inputs["input_ids"]), jnp.asarray(inputs["position_ids"]), jnp.asarray(inputs["attention_mask"])
        )
    )
    real = inputs["attention_mask"].astype(bool)
    assert float(exp["adapter_effect"]) > 0.1  # the adapter moves the logits far more than the tolerance
    diff = np.abs(ours - exp["logits"])[real].max()
    assert diff <= 1e-4, f"max |logits - PEFT| = {diff:.2e}"


def test_adapter_gradient_is_the_chain_rule_of_the_full_gradient():
    """At B = 0 (PEFT's init, init_adapters) the merged model is the base, and the gradient w.r.t. B of
    the adapted model is (alpha/r) dW_hf @ A^T, dW_hf the full weight gradient in HF orientation; the
    base is an input that is not differentiated."""
    import jax

    from rpeg_jax.models.hf import _layer_mapping
    from rpeg_jax.models.lora import init_adapters

    cfg = _cfg()
    rank, alpha = 4, 8.0
    graphdef, base = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)

    def loss(params, adapters):
        model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
        if adapters is not None:
            merge(model, adapters, rank=rank, alpha=alpha)
        return jnp.mean(model(tokens).astype(jnp.float32) ** 2)

    adapters = init_adapters(cfg, ["q_proj", "down_proj"], rank, nnx.Rngs(params=3))
    assert abs(float(loss(base, adapters)) - float(loss(base, None))) == 0.0
    g_full = jax.grad(loss)(base, None)
    g_lora = jax.grad(lambda a: loss(base, a))(adapters)
    layouts = {ours: layout for ours, _, layout in _layer_mapping(cfg)}
    for target in adapters:
        ours = TARGETS[target][0]
        dw = np.asarray(g_full["layers"][ours][...], np.float64)
        a = np.asarray(adapters[target][0], np.float64)
        for i in range(cfg.num_layers):
            expect = (alpha / rank) * layouts[ours].to_hf(dw[i]) @ a[i].T
            got = np.asarray(g_lora[target][1][i], np.float64)
            np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-7)
            assert np.abs(expect).max() > 1e-6
        np.testing.assert_array_equal(np.asarray(g_lora[target][0]), 0.0)  # dA = 0 while B = 0
