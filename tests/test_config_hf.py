"""`model.path` defines the model (config/hf.py): the shape, ids and RoPE settings come from the
checkpoint's config.json at config time; fields given beside it override the numerics and ids (and
are reported) but not the shape the weights fix; generation_config.json's eos ids end sequences;
bad checkpoints are one line naming the file and the field, exit 2. References are the fixtures'
config.json values read here with json (tests/fixtures/README.md) and runs without the change."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from rpeg_jax.cli import main as rpeg
from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.config.hf import checkpoint_overrides, config_from_hf
from rpeg_jax.config.run import DEFAULT_CONFIG, from_dict, read_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "tests", "fixtures", "hf")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "tokenizer.json")
NAMES = ["llama_tiny", "qwen2_tiny", "llama3_sharded", "qwen3_tiny"]


def raw(name: str) -> dict:
    with open(os.path.join(HF, name, "config.json")) as f:
        return json.load(f)


def copy_of(tmp_path, name: str = "llama_tiny", **changes) -> str:
    """A copy of a fixture checkpoint with config.json fields changed (None deletes one)."""
    out = str(tmp_path / name)
    shutil.copytree(os.path.join(HF, name), out)
    hf = {**raw(name), **changes}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({k: v for k, v in hf.items() if v is not None}, f)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_path_alone_gives_the_checkpoints_config(name):
    path = os.path.join(HF, name)
    m = load_config(None, [f"model.path={path}"]).model  # configs/default.yaml names preset tiny
    assert m == dataclasses.replace(config_from_hf(raw(name)), path=path)
    hf = raw(name)  # and field by field against the file itself
    rope = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads) == (
        hf["vocab_size"],
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
    )
    assert (m.intermediate_size, m.max_position_embeddings, m.rms_norm_eps, m.rope_theta) == (
        hf["intermediate_size"],
        hf["max_position_embeddings"],
        hf["rms_norm_eps"],
        rope,
    )
    assert (m.tie_embeddings, m.qkv_bias, m.qk_norm, m.arch, m.preset) == (
        hf["tie_word_embeddings"],
        hf["model_type"] == "qwen2",
        hf["model_type"] == "qwen3",
        hf["model_type"],
        None,
    )
    assert (m.pad_id, m.bos_id, m.eos_id) == (0, 1, 2)
    assert m.head_size == hf.get("head_dim", 16) == (32 if name == "qwen3_tiny" else 16)
    assert (m.rope_scaling is not None) == (name == "llama3_sharded")
    if m.rope_scaling is not None:
        assert m.rope_scaling.original_max_position_embeddings == hf["rope_scaling"]["original_max_position_embeddings"]


def test_the_planner_prices_the_checkpoints_shape():
    from rpeg_jax.costmodel import planner as P
    from rpeg_jax.costmodel.hardware import load_hardware

    hw = load_hardware("cpu", calibrated=False)
    path = os.path.join(HF, "llama3_sharded")
    by_path = P.search(load_config(None, [f"model.path={path}"]), 1, hw).chosen
    typed = {**read_yaml(DEFAULT_CONFIG), "model": dataclasses.asdict(config_from_hf(raw("llama3_sharded")))}
    by_hand = P.search(from_dict(typed), 1, hw).chosen  # the same shape typed in by hand, no path
    tiny = P.search(load_config(None, []), 1, hw).chosen
    assert by_path.step_time_s == by_hand.step_time_s and by_path.memory_per_gpu_gb == by_hand.memory_per_gpu_gb
    assert by_path.step_time_s != tiny.step_time_s  # the preset's shape is not what is priced


def test_given_fields_override_and_are_reported(tmp_path):
    path = os.path.join(HF, "llama_tiny")
    preset = tmp_path / "run.yaml"
    preset.write_text(f"base: {DEFAULT_CONFIG}\nmodel:\n  path: {path}\n  max_position_embeddings: 64\n")
    cfg = load_config(str(preset), ["model.rope_theta=5e5", "model.num_layers=2"])  # 2 = the checkpoint's
    assert (cfg.model.rope_theta, cfg.model.max_position_embeddings, cfg.model.num_layers) == (5e5, 64, 2)
    assert checkpoint_overrides(cfg) == [
        f"model.rope_theta=500000.0: given, overrides config.json's rope_theta=10000.0 (model.path={path})",
        f"model.max_position_embeddings=64: given, overrides config.json's max_position_embeddings=128 "
        f"(model.path={path})",
    ]
    assert checkpoint_overrides(load_config(None, [f"model.path={path}"])) == []


def test_the_override_reaches_the_loaded_model():
    import jax.numpy as jnp

    from rpeg_jax.runtime.setup import _model

    class Unsharded:  # a layout that leaves the parameters where they are
        def params(self, params):
            return None

    path = os.path.join(HF, "llama_tiny")
    exp = np.load(os.path.join(path, "expected.npz"))
    real = exp["attention_mask"].astype(bool)

    def logits(*overrides):
        m = load_config(None, [f"model.path={path}", *overrides]).model
        model = _model(m, m.path, 0, Unsharded())
        assert model.cfg == m
        out = model(jnp.asarray(exp["input_ids"]), jnp.asarray(exp["position_ids"]), jnp.asarray(exp["attention_mask"]))
        return np.abs(np.asarray(out) - exp["logits"])[real].max()

    assert logits() <= 1e-4  # the checkpoint as transformers computes it
    assert logits("model.rope_theta=100.0") > 0.1  # the given theta is the one that runs


def test_a_shape_the_weights_fix_cannot_be_overridden():
    path = os.path.join(HF, "qwen2_tiny")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.path={path}", "model.num_kv_heads=4"])
    assert str(e.value) == (
        f"config error: model.num_kv_heads=4: contradicts model.path={path}: its config.json has "
        "num_key_value_heads=2 (the weights have that shape)"
    )
    assert load_config(None, [f"model.path={path}", "model.head_dim=16"]).model.head_size == 16  # = implied


def test_critic_path_defines_the_critics_shape():
    cfg = load_config(
        None,
        [f"model.path={HF}/llama_tiny", f"critic.path={HF}/qwen2_tiny", "rl.algorithm=ppo", "rl.kl_coef=0.0"],
    )
    assert cfg.critic == dataclasses.replace(config_from_hf(raw("qwen2_tiny")), path=f"{HF}/qwen2_tiny")
    assert cfg.critic_model.value_head and cfg.critic_model.qkv_bias and not cfg.model.qkv_bias


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary(tmp_path):
    from rpeg_jax.data.pipeline import build_pipeline

    path = copy_of(tmp_path, vocab_size=64)  # the fixture tokenizer has 100 tokens
    cfg = load_config(None, [f"model.path={path}", f"data.tokenizer={TOKENIZER}", "data.task=reverse"])
    with pytest.raises(ConfigError) as e:
        build_pipeline(cfg, shard_index=0, shard_count=1)
    assert str(e.value) == (
        f"config error: data.tokenizer={TOKENIZER!r}: has 100 tokens, more than model.path={path}'s vocab_size=64"
    )


def test_generation_configs_eos_list_stops_the_sampler(tmp_path):
    from rpeg_jax.runtime.setup import _model, sampler_config
    from rpeg_jax.sampling import Sampler, SamplingParams

    class Unsharded:
        def params(self, params):
            return None

    path = copy_of(tmp_path)
    over = ["data.prompts_per_step=1", "rl.group_size=2", "rollout.max_new_tokens=12", "data.max_prompt_len=8"]
    cfg = load_config(None, [f"model.path={path}", *over])
    assert cfg.model.end_ids == (2,)
    model = _model(cfg.model, path, 0, Unsharded())
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    free = Sampler(model, sampler_config(cfg)).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    run = [o.completions[0].tokens.tolist() for o in free]
    ends = [run[0][4], run[1][2]]  # two ids the greedy runs produce, as Llama 3's eos list
    (tmp_path / "llama_tiny" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *ends]}))
    cfg = load_config(None, [f"model.path={path}", *over])
    assert cfg.model.eos_id == 2 and cfg.model.eos_ids == tuple(dict.fromkeys(e for e in ends if e != 2))
    scfg = sampler_config(cfg)
    assert scfg.eos_token_ids == (2, *cfg.model.eos_ids)
    sampler = Sampler(_model(cfg.model, path, 0, Unsharded()), scfg)
    outs = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    stops = set(scfg.eos_token_ids)
    for o, r in zip(outs, run):  # independent reference: the free run cut at its first end id
        cut = next(i for i, t in enumerate(r) if t in stops)
        assert o.completions[0].tokens.tolist() == r[: cut + 1] and o.completions[0].finish_reason == "stop"


BAD = [
    ("no-config", lambda p: os.remove(os.path.join(p, "config.json")), "no config.json in it"),
    (
        "model-type",
        {"model_type": "gpt2"},
        "config.json: model_type='gpt2' is not supported (llama, qwen2, qwen3, qwen3_moe)",
    ),
    ("not-json", "{'vocab_size': 128,", "config.json is not valid JSON: Expecting property name"),
    ("missing", {"num_hidden_layers": None}, "config.json: has no num_hidden_layers (required)"),
    ("bad-value", {"num_key_value_heads": 3}, "config.json: num_key_value_heads=3: must divide num_heads=4"),
    ("gen-not-json", ("generation_config.json", "{"), "generation_config.json is not valid JSON"),
]


# qwen3 fields that would change what the model computes and that it does not implement
BAD_QWEN3 = [
    (
        "attention-bias",
        {"attention_bias": True},
        "attention_bias=true (q/k/v/o_proj biases) is not supported for qwen3",
    ),
    ("sliding-window", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    (
        "layer-types",
        {"layer_types": ["full_attention", "sliding_attention"]},
        "layer_types has 'sliding_attention': only full_attention layers are supported",
    ),
    ("bad-head-dim", {"head_dim": 31}, "config.json: head_dim=31: must be even for RoPE"),
]


@pytest.mark.parametrize("case,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoints_are_one_line_exit_2(tmp_path, capsys, case, change, message):
    path = copy_of(tmp_path)
    if callable(change):
        change(path)
    elif isinstance(change, dict):
        path = copy_of(tmp_path / "changed", **change)
    else:
        name, text = change if isinstance(change, tuple) else ("config.json", change)
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    assert rpeg(["config", f"model.path={path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: model.path={path!r}: ")
    assert message in err


@pytest.mark.parametrize("case,change,message", BAD_QWEN3, ids=[b[0] for b in BAD_QWEN3])
def test_bad_qwen3_checkpoints_are_one_line_exit_2(tmp_path, capsys, case, change, message):
    path = copy_of(tmp_path, "qwen3_tiny", **change)
    assert rpeg(["config", f"model.path={path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: model.path={path!r}: ")
    assert message in err


def test_qwen3_head_dim_and_the_fields_its_weights_fix():
    """A qwen3 config.json without head_dim means transformers' Qwen3Config default, 128 (not
    hidden / heads); q/k norm and head_dim cannot be overridden beside the path."""
    from rpeg_jax.config.hf import model_fields

    assert model_fields(raw("qwen3_tiny"))["head_dim"] == 32
    no_head_dim = {k: v for k, v in raw("qwen3_tiny").items() if k != "head_dim"}
    assert model_fields(no_head_dim)["head_dim"] == 128
    assert model_fields({**no_head_dim, "hidden_size": 512})["head_dim"] is None  # 128 = 512 / 4: implied
    assert model_fields({**raw("qwen2_tiny"), "head_dim": None})["head_dim"] is None  # qwen2: hidden / heads
    path = os.path.join(HF, "qwen3_tiny")
    for given, hf_value in (("model.qk_norm=false", "model_type='qwen3'"), ("model.head_dim=16", "head_dim=32")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"model.path={path}", given])
        assert f"contradicts model.path={path}: its config.json has {hf_value}" in str(e.value)


def test_eos_lists_in_config_json_and_generation_config():
    from rpeg_jax.config.hf import model_fields

    llama31 = {**raw("llama_tiny"), "eos_token_id": [2, 9, 11]}  # Llama 3.1 writes the list in config.json
    f = model_fields(llama31)
    assert (f["eos_id"], f["eos_ids"], f["pad_id"]) == (2, (9, 11), 0)
    f = model_fields(llama31, {"eos_token_id": 7})  # generation_config.json wins (transformers' generate)
    assert (f["eos_id"], f["eos_ids"]) == (2, (7,))
    f = model_fields({**raw("qwen2_tiny"), "pad_token_id": None}, {"eos_token_id": [2, 2, 5]})
    assert (f["eos_id"], f["eos_ids"], f["pad_id"]) == (2, (5,), 2)  # no pad: eos pads


def test_the_checkpoints_tokenizer_is_the_default_tokenizer(tmp_path):
    """data.tokenizer not given: model.path's tokenizer.json (its ids are the embeddings' rows);
    given: that one; a checkpoint without tokenizer.json keeps the built-in one (None)."""
    ckpt = copy_of(tmp_path)
    assert load_config(None, [f"model.path={ckpt}"]).data.tokenizer is None
    shutil.copy(TOKENIZER, os.path.join(ckpt, "tokenizer.json"))
    assert load_config(None, [f"model.path={ckpt}"]).data.tokenizer == os.path.join(ckpt, "tokenizer.json")
    assert load_config(None, [f"model.path={ckpt}", f"data.tokenizer={TOKENIZER}"]).data.tokenizer == TOKENIZER
    assert load_config(None, []).data.tokenizer is None


def test_a_jsonl_run_bounds_prompts_by_the_models_positions_unless_given():
    """data.max_prompt_len not given with task=jsonl: 512 (verl's default) or what the model's
    positions leave beside max_new_tokens; given: as given; built-in tasks keep the field's default."""
    base = ["data.task=jsonl", "data.path=x.jsonl"]
    cfg = load_config(None, base + [f"model.path={os.path.join(HF, 'llama_tiny')}", "rollout.max_new_tokens=8"])
    assert cfg.data.max_prompt_len == raw("llama_tiny")["max_position_embeddings"] - 8 == 120
    cfg = load_config(None, base + ["model.preset=tiny", "rollout.max_new_tokens=8"])
    assert cfg.data.max_prompt_len == min(512, cfg.model.max_position_embeddings - 8)
    assert load_config(None, base + ["data.max_prompt_len=40"]).data.max_prompt_len == 40
    assert load_config(None, []).data.max_prompt_len == 32


def test_the_finetune_preset_has_the_grpo_recipes_values_and_warns_otherwise(tmp_path):
    """configs/finetune.yaml (the README's real-checkpoint recipe) with the Qwen2-family fixture: the
    verl / TRL GRPO values for a pretrained model; the tiny-model default's lr on the same checkpoint
    is warned about in one line, the preset's is not."""
    from rpeg_jax.config.hf import PRETRAINED_LR_MAX, pretrained_warnings

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "solution": "#### 2"}) + "\n")
    given = [f"model.path={os.path.join(HF, 'qwen2_tiny')}", f"data.path={data}", "data.prompt_field=question"]
    preset = os.path.join(ROOT, "configs", "finetune.yaml")
    assert read_yaml(preset)["rollout"]["max_new_tokens"] == 256  # TRL's; the fixture holds 128 positions:
    cfg = load_config(
        preset, given + ["data.answer_field=solution", "rollout.max_new_tokens=64", "data.max_prompt_len=32"]
    )
    assert cfg.model.path and cfg.model.vocab_size == raw("qwen2_tiny")["vocab_size"]  # shape from the checkpoint
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip, cfg.optim.warmup_steps) == (1e-6, 0.01, 1.0, 0)
    assert (cfg.rl.algorithm, cfg.rl.group_size, cfg.rl.kl_coef, cfg.rl.kl_estimator) == ("grpo", 8, 0.001, "k3")
    assert cfg.rl.overlong == "mask"  # DAPO's overlong filtering (TRL's mask_truncated_completions)
    assert (cfg.rollout.temperature, cfg.data.prompts_per_step, cfg.data.task) == (1.0, 8, "jsonl")
    assert pretrained_warnings(cfg) == []
    tiny_lr = load_config(None, given + ["data.task=jsonl", "data.answer_field=solution", "data.max_prompt_len=32"])
    assert tiny_lr.optim.lr > PRETRAINED_LR_MAX
    (line,) = pretrained_warnings(tiny_lr)
    assert "optim.lr=0.0002" in line and "configs/finetune.yaml" in line and "\n" not in line
    assert pretrained_warnings(load_config(None, [])) == []  # the tiny random-init model: no warning
