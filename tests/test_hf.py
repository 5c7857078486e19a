"""Hugging Face parity: our loader + forward against logits saved by transformers itself
(tests/fixtures/make_hf_fixtures.py), the float64 numpy spec of the format (tests/fixtures/
numpy_reference.py) against the same logits, and an exact save_hf/load_hf round trip of those
checkpoints."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import load_file

from rpeg_jax.models import load_hf, save_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
NAMES = ["llama_tiny", "llama3_sharded", "qwen2_tiny", "qwen3_tiny"]
ARCH = {"llama_tiny": "llama", "llama3_sharded": "llama", "qwen2_tiny": "qwen2", "qwen3_tiny": "qwen3"}
TOL = 1e-4  # float32 logits, max |difference| at real (mask == 1) positions


def _check(model, ids, mask, pos, expected):
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    real = mask.astype(bool)
    diff = np.abs(ours - expected)[real].max()
    assert diff <= TOL, f"max |logits - HF| = {diff:.2e} > {TOL}"


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    path = os.path.join(FIXTURES, name)
    exp = np.load(os.path.join(path, "expected.npz"))
    model = load_hf(path)
    assert model.cfg.arch == ARCH[name]
    _check(model, exp["input_ids"], exp["attention_mask"], exp["position_ids"], exp["logits"])
    if "logits_offset" in exp:  # large absolute positions exercise the (llama3-scaled) RoPE tables
        _check(model, exp["input_ids"], exp["attention_mask"], exp["position_ids_offset"], exp["logits_offset"])


@pytest.mark.parametrize("name", NAMES)
def test_numpy_reference_matches_transformers(name):
    """The float64 spec (no model code of ours) reproduces transformers' logits: the format as written
    in tests/fixtures/README.md is the one transformers computes (worst measured 1.4e-5)."""
    ref = load_file("numpy_reference", os.path.join(os.path.dirname(FIXTURES), "numpy_reference.py"))
    path = os.path.join(FIXTURES, name)
    exp = np.load(os.path.join(path, "expected.npz"))
    cfg, w = ref.load_checkpoint(path)
    got = ref.forward(cfg, w, exp["input_ids"], exp["attention_mask"], exp["position_ids"])
    diff = np.abs(got - exp["logits"])[exp["attention_mask"].astype(bool)].max()
    assert diff <= TOL, f"max |numpy64 - HF| = {diff:.2e} > {TOL}"


def test_fixture_features_are_what_the_parity_test_relies_on():
    assert load_hf(os.path.join(FIXTURES, "llama3_sharded")).cfg.rope_scaling is not None
    assert load_hf(os.path.join(FIXTURES, "qwen2_tiny")).cfg.qkv_bias
    assert os.path.exists(os.path.join(FIXTURES, "llama3_sharded", "model.safetensors.index.json"))
    qwen3 = load_hf(os.path.join(FIXTURES, "qwen3_tiny"))
    c = qwen3.cfg
    assert c.qk_norm and not c.qkv_bias and not c.tie_embeddings
    assert c.head_size == 32 != c.hidden_size // c.num_heads  # head_dim is read, not implied
    for norm in (qwen3.layers.q_norm[...], qwen3.layers.k_norm[...]):  # random scales, not ones
        assert norm.shape == (2, 32) and float(np.ptp(np.asarray(norm))) > 0.5
    exp = np.load(os.path.join(FIXTURES, "qwen3_tiny", "expected.npz"))
    for bug in ("no_qk_norm", "qk_norm_after_rope", "qk_norm_over_all_heads", "rope_convention"):
        assert float(exp[f"{bug}_sensitivity"]) > 1.0, bug  # each would miss TOL by four orders of magnitude


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip_of_hf_checkpoint(tmp_path, name):
    model = load_hf(os.path.join(FIXTURES, name))
    out = str(tmp_path / name)
    save_hf(model, out)
    again = load_hf(out)
    assert again.cfg == model.cfg
    a = nnx.to_flat_state(nnx.state(model, nnx.Param))
    b = nnx.to_flat_state(nnx.state(again, nnx.Param))
    assert [k for k, _ in a] == [k for k, _ in b]
    for (_, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(str(tmp_path))
