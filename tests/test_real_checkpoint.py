"""Train a checkpoint you have (README): a Qwen2-family instruct checkpoint of ~53M parameters, and a
Qwen3 one of ~66M (head_dim 128 != hidden / heads, q/k norms, untied)
(tests/fixtures/checkpoint.py: config.json, safetensors, generation_config.json with an eos list,
a byte-level BPE tokenizer.json and the Qwen2.5 chat template) and a GSM8K-style JSONL whose
prompts are chat messages train through the README's command with only model.path, data.task,
data.path, data.prompt_field and data.answer_field given (pipeline.plan: auto from default.yaml),
for 3 steps, with held-out evaluation before and after, then `rpeg export`. Checked: the shape and
the tokenizer come from the checkpoint, the prompts are the chat template's rendering, evaluation
wrote its files and metrics, and the export's logits equal the trained actor's (<= 1e-5, float32)
and a float64 numpy forward of the exported files (tests/fixtures/numpy_reference.py)."""

import json
import os
import random
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from fixtures.checkpoint import write_qwen2_checkpoint, write_qwen3_checkpoint, write_qwen3_moe_checkpoint
from flax import nnx
from helpers import load_file

from rpeg_jax.cli import main
from rpeg_jax.models import load_hf
from rpeg_jax.runtime.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def write_data(path, n: int, seed: int) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = r.randint(2, 30), r.randint(2, 30)
            q = f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
            f.write(json.dumps({"question": [{"role": "user", "content": q}], "solution": f"#### {a + b}"}) + "\n")


def numpy_reference():
    return load_file("numpy_reference", os.path.join(FIXTURES, "numpy_reference.py"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_train_evaluate_export_a_checkpoint_with_model_path_alone(tmp_path, arch):
    write = {"qwen2": write_qwen2_checkpoint, "qwen3": write_qwen3_checkpoint}.get(arch)
    ckpt = write(tmp_path / "qwen") if write else write_qwen3_moe_checkpoint(tmp_path / "qwen", layers=4)
    write_data(tmp_path / "train.jsonl", 48, 0)
    write_data(tmp_path / "test.jsonl", 8, 1)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "multihost.py"),
        "--config",
        os.path.join(ROOT, "configs", "default.yaml"),
        f"model.path={ckpt}",
        "data.task=jsonl",
        f"data.path={tmp_path / 'train.jsonl'}",
        "data.prompt_field=question",
        "data.answer_field=solution",
        # the run itself: length, where, evaluation
        "train.steps=3",
        f"train.run_dir={run_dir}",
        "train.checkpoint_every=3",
        f"eval.path={tmp_path / 'test.jsonl'}",
        "eval.before_train=true",
        "eval.every=3",
        # the parameters move every step whatever the rewards (the random-weight checkpoint may earn none
        # in 3 steps: zero advantages, no gradient), so the export check below can tell trained from not
        "rl.entropy_coef=0.01",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    with open(run_dir / "config.yaml") as f:
        ran = yaml.safe_load(f)
    hf = json.load(open(os.path.join(ckpt, "config.json")))
    assert ran["model"]["hidden_size"] == hf["hidden_size"] and ran["model"]["num_layers"] == hf["num_hidden_layers"]
    assert ran["model"]["vocab_size"] == hf["vocab_size"] and ran["model"]["arch"] == arch
    assert (ran["model"]["qkv_bias"], ran["model"]["qk_norm"]) == (arch == "qwen2", arch != "qwen2")
    if arch == "qwen3_moe":  # the mixture's fields from config.json too
        assert (ran["model"]["num_experts"], ran["model"]["num_experts_per_tok"]) == (4, 2)
        assert ran["model"]["mlp_only_layers"] == [1] and ran["model"]["moe_intermediate_size"] == 448
    assert ran["model"]["head_dim"] == hf.get("head_dim")  # qwen2: implied (None); qwen3: 128 (!= 640 / 10)
    assert ran["data"]["tokenizer"] == os.path.join(ckpt, "tokenizer.json")
    assert ran["pipeline"]["plan"] == "auto"

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps_with_eval = [m["step"] for m in metrics if "val-core/test/reward/mean@1" in m]
    assert steps_with_eval == [0, 3]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2, 3]
    for step in (0, 3):
        lines = [json.loads(line) for line in open(run_dir / "eval" / f"step_{step}.jsonl")]
        assert len(lines) == 8
        first = lines[0]["prompt_text"]
        assert first.startswith("<|im_start|>system\n") and first.endswith("<|im_start|>assistant\n")
        assert "Tom has" in first and lines[0]["answer"].startswith("#### ")

    out = str(tmp_path / "export")
    assert main(["export", "--run-dir", str(run_dir), "--out", out]) == 0
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= set(os.listdir(out))
    exported = load_hf(out)
    graphdef, params = nnx.split(exported, nnx.Param)
    ckpts = Checkpointer(str(run_dir / "checkpoints"))
    try:
        actor = ckpts.restore_state(3, "actor", params)
    finally:
        ckpts.close()
    policy = nnx.merge(graphdef, actor)
    source = load_hf(ckpt)
    tokens = np.random.default_rng(0).integers(3, 400, (2, 24)).astype(np.int32)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def logits(m):
        return np.asarray(m(jnp.asarray(tokens), pos, jnp.ones_like(tokens)))

    want = logits(policy)
    assert np.abs(logits(exported) - want).max() <= 1e-5
    assert np.abs(logits(source) - want).max() > 1e-4  # training moved the policy: the check can tell
    if arch == "qwen3_moe":  # the float64 numpy reference has no mixture (transformers reloads it: NOTES)
        return
    ref = numpy_reference()
    cfg, w = ref.load_checkpoint(out)
    got = ref.forward(cfg, w, tokens, np.ones_like(tokens), np.asarray(pos))
    assert np.abs(got - want).max() <= 1e-4
