"""Hugging Face parity: our loader + forward against logits saved by transformers itself
(tests/fixtures/make_hf_fixtures.py), and an exact save_hf/load_hf round trip of those checkpoints."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpeg_jax.models import load_hf, save_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
NAMES = ["llama_tiny", "llama3_sharded", "qwen2_tiny"]
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
    assert model.cfg.arch == ("qwen2" if name.startswith("qwen2") else "llama")
    _check(model, exp["input_ids"], exp["attention_mask"], exp["position_ids"], exp["logits"])
    if "logits_offset" in exp:  # large absolute positions exercise the (llama3-scaled) RoPE tables
        _check(model, exp["input_ids"], exp["attention_mask"], exp["position_ids_offset"], exp["logits_offset"])


def test_fixture_features_are_what_the_parity_test_relies_on():
    assert load_hf(os.path.join(FIXTURES, "llama3_sharded")).cfg.rope_scaling is not None
    assert load_hf(os.path.join(FIXTURES, "qwen2_tiny")).cfg.qkv_bias
    assert os.path.exists(os.path.join(FIXTURES, "llama3_sharded", "model.safetensors.index.json"))


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
