"""`rpeg export` (rpeg_jax/cli/export.py): a tiny run started from a Hugging Face checkpoint
(tests/fixtures/hf/llama_tiny plus a tokenizer, its config, a chat template and a
generation_config.json) trains 2 steps with a checkpoint after each; the export of its newest
checkpoint, loaded back with load_hf, has the trained policy's parameters and logits, and a
float64 numpy forward read straight from the exported config.json + safetensors
(tests/fixtures/numpy_reference.py, no model code of ours) gives the same logits, which is what
transformers would compute. The tokenizer files are copied byte for byte; bad inputs are one line,
exit 2. A run from tests/fixtures/hf/qwen3_tiny with model.path alone trains its q/k norms and
exports as Qwen3 (transformers' own reload of such exports: make_hf_fixtures.py --only export)."""

import filecmp
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from helpers import HF, TINY, load_file, run

from rpeg_jax.cli import main
from rpeg_jax.models import load_hf
from rpeg_jax.runtime.checkpoint import Checkpointer

FIXTURES = os.path.dirname(HF)
TOL_FP32 = 1e-5  # the same float32 forward on the same weights: only the XLA program may differ
TOL_NUMPY = 1e-4  # float64 numpy vs our float32 (tests/fixtures/README.md: float noise ~1.4e-5)
SIDE_FILES = {  # written next to the source checkpoint; the export must carry them
    "tokenizer_config.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}),
    "special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>"}),
    "chat_template.jinja": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": [2], "max_new_tokens": 8}),
}


def numpy_reference():
    return load_file("numpy_reference", os.path.join(FIXTURES, "numpy_reference.py"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run, source checkpoint dir): 2 steps from llama_tiny with a checkpoint after each."""
    tmp = tmp_path_factory.mktemp("export")
    src = tmp / "source"
    shutil.copytree(os.path.join(HF, "llama_tiny"), src, ignore=shutil.ignore_patterns("expected.npz"))
    shutil.copy(os.path.join(FIXTURES, "tokenizer", "tokenizer.json"), src / "tokenizer.json")
    for name, text in SIDE_FILES.items():
        (src / name).write_text(text)
    overrides = TINY + [
        f"model.path={src}",
        f"data.tokenizer={src / 'tokenizer.json'}",
        "model.intermediate_size=160",  # llama_tiny's shape, so that the config agrees with config.json
        "model.max_position_embeddings=128",
        "train.checkpoint_every=1",
        "rl.entropy_coef=0.1",  # a gradient even when every reward of a group is the same
    ]
    return run(tmp, "run", overrides, steps=2), str(src)


def logits(model, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(jnp.asarray(tokens), pos, jnp.ones_like(tokens)))


TOKENS = np.random.default_rng(0).integers(3, 100, (2, 16)).astype(np.int32)


def test_export_has_the_trained_policy(trained, tmp_path):
    r, src = trained
    out = str(tmp_path / "hf")
    assert main(["export", "--run-dir", r.run_dir, "--out", out]) == 0
    exported = load_hf(out)
    source = load_hf(src)
    graphdef, source_params = nnx.split(source, nnx.Param)
    actor = jax.device_put(r.state["actor"], jax.devices()[0])  # the run's final actor (step 2), off its mesh
    policy = nnx.merge(graphdef, actor)
    trained_leaves = [np.asarray(x) for x in jax.tree.leaves(actor)]
    moved = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(trained_leaves, jax.tree.leaves(source_params)))
    assert moved > 1e-4, "training did not change the weights: the test would pass on the source checkpoint"
    for a, b in zip(jax.tree.leaves(nnx.state(exported, nnx.Param)), trained_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    want = logits(policy, TOKENS)
    assert np.abs(logits(exported, TOKENS) - want).max() <= TOL_FP32
    ref = numpy_reference()
    cfg, w = ref.load_checkpoint(out)
    ones = np.ones_like(TOKENS)
    pos = np.broadcast_to(np.arange(TOKENS.shape[1]), TOKENS.shape)
    assert np.abs(ref.forward(cfg, w, TOKENS, ones, pos) - want).max() <= TOL_NUMPY
    assert np.abs(logits(source, TOKENS) - want).max() > 100 * TOL_NUMPY  # the numpy check can tell them apart


def test_export_copies_tokenizer_and_generation_config(trained, tmp_path):
    r, src = trained
    out = str(tmp_path / "hf")
    assert main(["export", "--run-dir", r.run_dir, "--out", out]) == 0
    expected = {"config.json", "model.safetensors", "tokenizer.json", *SIDE_FILES}
    assert set(os.listdir(out)) == expected
    for name in expected - {"config.json", "model.safetensors"}:
        assert filecmp.cmp(os.path.join(src, name), os.path.join(out, name), shallow=False), name
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["intermediate_size"] == 160
    # data.chat_template=PATH: the template the run rendered with is the export's chat_template.jinja
    other = tmp_path / "other_template"
    other.mkdir()
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    with open(os.path.join(r.run_dir, "config.yaml")) as f:
        run_cfg = yaml.safe_load(f)
    run_cfg["data"]["chat_template"] = str(template)
    (other / "config.yaml").write_text(yaml.safe_dump(run_cfg))
    os.symlink(os.path.join(r.run_dir, "checkpoints"), other / "checkpoints")
    out2 = str(tmp_path / "hf2")
    assert main(["export", "--run-dir", str(other), "--out", out2]) == 0
    assert filecmp.cmp(template, os.path.join(out2, "chat_template.jinja"), shallow=False)
    assert filecmp.cmp(os.path.join(src, "tokenizer_config.json"), os.path.join(out2, "tokenizer_config.json"))


def test_export_of_a_given_step(trained, tmp_path):
    """--step 1 gives step 1's actor: the one the resume path (a full restore of the train item)
    reads from that checkpoint, not the latest one."""
    r, _ = trained
    out = str(tmp_path / "hf1")
    assert main(["export", "--run-dir", r.run_dir, "--step", "1", "--out", out]) == 0
    ckpt = Checkpointer(os.path.join(r.run_dir, "checkpoints"), async_save=False)
    try:
        full, meta, _ = ckpt.restore(1, r.state)
    finally:
        ckpt.close()
    assert meta["step"] == 1
    got = jax.tree.leaves(nnx.state(load_hf(out), nnx.Param))
    for a, b in zip(got, jax.tree.leaves(full["actor"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, jax.tree.leaves(r.state["actor"])))


# 16 s; test_export_has_the_trained_policy runs by default, Qwen3's save_hf round trip in test_hf (slow: session 24's
# trim of the default run)
@pytest.mark.slow
def test_a_qwen3_checkpoint_trains_and_exports_as_qwen3(tmp_path):
    """model.path=qwen3_tiny and nothing about the model beside it: the run has the checkpoint's shape
    (head_dim 32 != hidden / heads, q/k norm), training moves the q/k norm scales, and `rpeg export`
    writes a Qwen3 config.json + tensors whose float64 numpy forward is the trained policy's."""
    src = os.path.join(HF, "qwen3_tiny")
    overrides = [o for o in TINY if not o.startswith("model.")]
    overrides += [f"model.path={src}", "train.checkpoint_every=2", "rl.entropy_coef=0.1"]
    r = run(tmp_path, "run", overrides, steps=2)
    with open(os.path.join(r.run_dir, "config.yaml")) as f:
        ran = yaml.safe_load(f)["model"]
    assert (ran["arch"], ran["qk_norm"], ran["qkv_bias"], ran["head_dim"], ran["tie_embeddings"]) == (
        "qwen3",
        True,
        False,
        32,
        False,
    )
    out = str(tmp_path / "hf")
    assert main(["export", "--run-dir", r.run_dir, "--out", out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["architectures"], cfg["model_type"], cfg["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 32)
    source = load_hf(src)
    graphdef, _ = nnx.split(source, nnx.Param)
    policy = nnx.merge(graphdef, jax.device_put(r.state["actor"], jax.devices()[0]))
    exported = load_hf(out)
    for name in ("q_norm", "k_norm"):  # the norms are trained parameters, and exported as such
        trained = np.asarray(getattr(policy.layers, name)[...])
        assert np.abs(trained - np.asarray(getattr(source.layers, name)[...])).max() > 1e-4, name
        np.testing.assert_array_equal(np.asarray(getattr(exported.layers, name)[...]), trained)
    want = logits(policy, TOKENS)
    assert np.abs(logits(exported, TOKENS) - want).max() <= TOL_FP32
    ref = numpy_reference()
    ncfg, w = ref.load_checkpoint(out)
    assert "model.layers.1.self_attn.k_norm.weight" in w
    pos = np.broadcast_to(np.arange(TOKENS.shape[1]), TOKENS.shape)
    assert np.abs(ref.forward(ncfg, w, TOKENS, np.ones_like(TOKENS), pos) - want).max() <= TOL_NUMPY
    assert np.abs(logits(source, TOKENS) - want).max() > 100 * TOL_NUMPY  # the numpy check can tell them apart


def test_bad_inputs_are_one_line_exit_2(trained, tmp_path, capsys):
    r, _ = trained
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    empty_run = tmp_path / "norun"
    empty_run.mkdir()
    shutil.copy(os.path.join(r.run_dir, "config.yaml"), empty_run / "config.yaml")
    other = tmp_path / "othershape"  # the same checkpoints under a config.yaml of another model shape
    other.mkdir()
    with open(os.path.join(r.run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["model"].update(path=None, intermediate_size=128)
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    os.symlink(os.path.join(r.run_dir, "checkpoints"), other / "checkpoints")
    damaged = tmp_path / "damaged"  # its newest checkpoint's files no longer match their checksums
    shutil.copytree(r.run_dir, damaged)
    newest = max(int(n) for n in os.listdir(damaged / "checkpoints") if n.isdigit())
    with open(damaged / "checkpoints" / str(newest) / "meta" / "metadata", "a") as f:
        f.write(" ")
    cases = [
        (["--run-dir", str(damaged), "--out", str(tmp_path / "e")], f"checkpoint {newest} in "),
        (["--run-dir", r.run_dir, "--out", str(full)], "exists and is not empty (pass --overwrite"),
        (["--run-dir", str(other), "--out", str(tmp_path / "d")], "holds actor.layers.w_down as ((2, 160, 64)"),
        (["--run-dir", r.run_dir, "--step", "7", "--out", str(tmp_path / "a")], "step 7 is not in"),
        (["--run-dir", str(empty_run), "--out", str(tmp_path / "b")], "no checkpoint in"),
        (["--run-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c")], "config.yaml not found"),
    ]
    for args, message in cases:
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not any(os.path.exists(tmp_path / n) for n in "abcde")
    assert main(["export", "--run-dir", r.run_dir, "--out", str(full), "--overwrite"]) == 0
    assert "model.safetensors" in os.listdir(full) and "x" not in os.listdir(full)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
