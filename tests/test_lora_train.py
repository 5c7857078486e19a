"""model.lora wired into training (issue 33 item 5): the activation-side LoRA forward equals the
PEFT-layout merge (models/lora.merge, PEFT parity in tests/test_lora.py); only the adapters train and
have optimizer state; the reference is the base (adapters off, the same buffers); the sampler's
weights are base + adapters merged; a resumed run equals an uninterrupted one; bad keys are one line."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY, run

from rpeg_jax.config import load_config
from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.model import LoraConfig, model_preset
from rpeg_jax.models import adapters
from rpeg_jax.models.llama import Transformer
from rpeg_jax.models.lora import from_peft, merge, to_peft

LORA = TINY + ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]


def _lora_model(targets=None, seed=0, qkv_bias=False):
    kw = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, qkv_bias=qkv_bias)
    lora = LoraConfig(rank=3, alpha=5.0, **({"targets": tuple(targets)} if targets else {}))
    cfg = model_preset("tiny", lora=lora, **kw)
    model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    rng = np.random.default_rng(seed + 1)
    for name in adapters.adapter_names(model.layers):  # B = 0 at init: give every adapter a value
        var = getattr(model.layers, name)
        var[...] = jnp.asarray(rng.normal(0, 0.2, var.shape), jnp.float32)
    return cfg, model


@pytest.mark.parametrize("targets", [None, ["q_proj", "o_proj", "down_proj"]])
def test_activation_side_lora_equals_the_peft_merge(targets):
    cfg, model = _lora_model(targets, qkv_bias=targets is None)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    got = model(tokens)
    _, state = nnx.split(model, nnx.Param)
    base, ad = adapters.split(state)
    plain_cfg = dataclasses.replace(cfg, lora=LoraConfig())
    plain = Transformer(plain_cfg, rngs=nnx.Rngs(params=0))
    nnx.update(plain, base)
    assert float(jnp.max(jnp.abs(plain(tokens) - got))) > 1e-2  # the adapters matter
    peft = to_peft(cfg, ad)
    assert sorted(peft) == sorted(cfg.lora.targets)
    merge(plain, peft, rank=cfg.lora.rank, alpha=cfg.lora.alpha)  # the PEFT-layout merge (PEFT parity)
    want = plain(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    # the runtime's merge (sampler sync, export) gives the same weights
    merged = adapters.merged_weights(cfg, base, ad)
    for (p1, x), (p2, y) in zip(
        jax.tree_util.tree_leaves_with_path(merged), jax.tree_util.tree_leaves_with_path(nnx.state(plain, nnx.Param))
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, err_msg=str(p1))
    # round trip of the layouts
    back = from_peft(cfg, peft)["layers"]
    for name, v in ad["layers"].items():
        np.testing.assert_array_equal(back[name], np.asarray(v[...]))


def test_activation_side_gradients_equal_those_of_the_merged_weights():
    """d loss / d (A, B) of y = x W + s (x A) B (what training differentiates) equals that of the
    forward on W + s A B (adapters.merged_weights, checked against the PEFT merge above)."""
    cfg, model = _lora_model()
    graphdef, state = nnx.split(model, nnx.Param)
    base, ad = adapters.split(state)
    plain = dataclasses.replace(cfg, lora=LoraConfig())
    plain_gd = nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))), nnx.Param)[0]
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    # each gradient compiled whole (run eagerly, each op of the forward and backward compiled alone)
    act = jax.jit(jax.grad(lambda a: jnp.sum(jnp.sin(nnx.merge(graphdef, adapters.join(base, a))(tokens)))))(ad)
    mrg = jax.jit(
        jax.grad(lambda a: jnp.sum(jnp.sin(nnx.merge(plain_gd, adapters.merged_weights(cfg, base, a))(tokens))))
    )(ad)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(act), jax.tree.leaves(mrg), strict=True):
        scale = float(jnp.max(jnp.abs(y)))
        assert float(jnp.max(jnp.abs(x))) > 1e-2, path
        # float32 sums in another order: an element of a sum with cancellation is off by a fraction of
        # the leaf's largest entries, not of itself (one of 384 was 9.4e-5 off at 0.34 on an AMD CPU);
        # a wrong scale or transposition is off by O(1) of it
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=3e-4 * scale, rtol=1e-4, err_msg=str(path))


def test_the_base_of_a_lora_model_is_the_plain_model_of_the_same_seed():
    cfg, _ = _lora_model()
    a = nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=7)), nnx.Param)
    b = nnx.state(Transformer(dataclasses.replace(cfg, lora=LoraConfig()), rngs=nnx.Rngs(params=7)), nnx.Param)
    base, ad = adapters.split(a)
    assert jax.tree.structure(base) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(np.all(np.asarray(v[...]) == 0) for k, v in ad["layers"].items() if k.startswith("lora_b_"))


@pytest.mark.parametrize(
    "over, key",
    [
        (["model.lora.rank=4", "model.lora.targets=[q_proj,qproj]"], "model.lora.targets"),
        (["model.lora.rank=-1"], "model.lora.rank"),
        (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha"),
        (["model.lora.rank=4", "model.lora.targets=[]"], "model.lora.targets"),
        (["model.lora.rank=4", "rl.algorithm=ppo", "pipeline.share_actor_critic=true"], "model.lora.rank"),
        (["model.lora.rank=4", "rl.kl_coef=0.1", "train.offload=optimizer+reference"], "train.offload"),
    ],
)
def test_bad_lora_keys_are_one_line_naming_the_key(over, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, TINY + over)
    assert e.value.key == key, str(e.value)
    assert "\n" not in str(e.value)


def test_lora_run_trains_only_the_adapters_and_the_reference_is_the_base(tmp_path):
    """GRPO with a KL term: the actor state and its AdamW moments are the adapters only; the
    reference is the base (its buffers are the base's), so the KL to it is 0 while the adapters are
    0 (step 1: B = 0) and grows once they train; the sampler's weights are the merged model: with
    pipeline.elide_old_forward π_old is the sampler's logprob, and ppo_kl (π_old vs the trainer's
    LoRA forward at the same weights) stays ~0 while the KL to the base grows."""
    from rpeg_jax.graph.plan import graph_for_plan
    from rpeg_jax.runtime.setup import build
    from rpeg_jax.runtime.trainer import choose_plan

    # the entropy bonus gives the adapters a gradient whether or not a completion earns a reward
    over = LORA + ["rl.kl_coef=0.1", "rl.entropy_coef=0.01", "pipeline.elide_old_forward=true"]
    r = run(tmp_path, "lora", over, steps=3)
    actor = r.state["actor"]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(actor)]
    assert paths and all("lora_" in p for p in paths), paths
    assert len(paths) == 2 * 7
    n_adapter = sum(x.size for x in jax.tree.leaves(actor))
    mu = [x for p, x in jax.tree_util.tree_leaves_with_path(r.state["actor_opt"]) if "mu" in jax.tree_util.keystr(p)]
    assert sum(x.size for x in mu) == n_adapter  # AdamW's first moment: one entry per adapter parameter
    assert any(float(jnp.max(jnp.abs(v))) > 0 for k, v in actor["layers"].items() if k.startswith("lora_b_"))
    kl = [m["actor/kl"] for m in r.metrics]
    assert abs(kl[0]) < 1e-6 and max(kl[1:]) > 1e-3, kl  # 0 at B = 0, then away from the base
    sampler_vs_trainer = [abs(m["actor/ppo_kl"]) for m in r.metrics]
    assert max(sampler_vs_trainer) < 1e-5, sampler_vs_trainer

    cfg = load_config(None, over + [f"train.run_dir={tmp_path / 'b'}"])
    cfg, plan = choose_plan(cfg)
    ctx, store = build(cfg, graph_for_plan(cfg, plan), plan)
    ref = store.frozen["reference"]
    assert all(x is y for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(ctx.lora_base), strict=True))
    # the sync: the sampler's weights are base + s·A·B (the trained adapters of the run above)
    trained = jax.device_put(actor, jax.tree.map(lambda x: x.sharding, store.latest("actor")[1]))
    synced = ctx.placement.to_rollout(ctx.policy_params(trained))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.model.vocab_size, (2, 10)), jnp.int32)
    lora_logits = nnx.merge(ctx.graphdefs["actor"], adapters.join(ctx.lora_base, trained))(tokens)
    plain_logits = nnx.merge(ctx.graphdefs["policy"], synced)(tokens)
    base_logits = nnx.merge(ctx.graphdefs["policy"], ctx.lora_base)(tokens)
    assert float(jnp.max(jnp.abs(lora_logits - base_logits))) > 1e-4  # the adapters matter
    np.testing.assert_allclose(np.asarray(plain_logits), np.asarray(lora_logits), atol=2e-5)


def test_split_placement_syncs_only_the_adapters(tmp_path):
    """Generation on other devices than training: the generation group keeps its own copy of the
    base, moved once, and each weight sync moves the adapters only and merges them there. The
    sampler's weights equal the colocated path's (merge in the training layout, then move the whole
    model), and no whole-model move happens after the first sync."""
    from rpeg_jax.graph.plan import graph_for_plan
    from rpeg_jax.runtime.setup import build, merge_adapters
    from rpeg_jax.runtime.trainer import choose_plan

    over = LORA + ["pipeline.placement=split", "pipeline.split_sizes=[4,4]", f"train.run_dir={tmp_path / 'a'}"]
    cfg, plan = choose_plan(load_config(None, over))
    ctx, store = build(cfg, graph_for_plan(cfg, plan), plan)
    assert ctx.placement.disjoint and ctx.adapter_sync is not None
    actor = store.latest("actor")[1]
    rng = np.random.default_rng(0)  # trained-looking adapters (B = 0 at init would hide a wrong merge)
    trained = jax.tree.map(
        lambda x: jax.device_put(jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype), x.sharding), actor
    )
    keys_before = set(k for _, k in ctx.placement._shardings)
    synced = ctx.rollout_params(trained)
    assert set(k for _, k in ctx.placement._shardings) == keys_before  # only the cached adapter/base moves
    assert "rollout" not in keys_before and {"rollout_base", "rollout_adapters"} <= keys_before
    gen_devices = set(ctx.placement.generate.mesh.devices.flat)
    assert all(set(x.sharding.device_set) <= gen_devices for x in jax.tree.leaves(synced))
    want = ctx.placement.to_rollout(merge_adapters(cfg, ctx.placement, ctx.lora_base, trained))  # the old path
    for x, y in zip(jax.tree.leaves(synced), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    base = jax.tree.leaves(ctx.lora_base)
    assert any(
        float(jnp.max(jnp.abs(np.asarray(x) - np.asarray(b)))) > 1e-4 for x, b in zip(jax.tree.leaves(synced), base)
    )
    r = run(tmp_path, "split", over[:-1], steps=2)  # and a run trains with it
    assert len(r.metrics) == 2 and all(np.isfinite(m["actor/loss"]) for m in r.metrics)


@pytest.mark.slow  # ~25 s on the loaded 2-core machine
def test_resume_of_a_lora_run_is_exact(tmp_path):
    from rpeg_jax.runtime.trainer import train

    straight = run(tmp_path, "straight", LORA, steps=3)

    def go(steps):
        cfg = load_config(None, LORA + [f"train.steps={steps}", f"train.run_dir={tmp_path / 'resumed'}"])
        return train(cfg, keep_state=True)

    go(2)
    out = go(3)
    assert out["steps"] == 3
    for name in ("actor", "actor_opt"):
        for x, y in zip(jax.tree.leaves(straight.state[name]), jax.tree.leaves(out["state"][name]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.slow  # ~30 s on the loaded 2-core machine
def test_export_writes_the_merged_model_and_a_peft_adapter(tmp_path, capsys):
    """A LoRA run from tests/fixtures/hf/llama_tiny, 2 steps: `rpeg export` writes base + adapters
    merged, whose logits equal the run's LoRA model; `rpeg export --adapter` writes a PEFT adapter
    directory that models/lora.read_peft_adapter (PEFT-parity tested on PEFT's own files) reads back to
    the checkpoint's adapters, and whose PEFT-layout merge onto the base gives the same logits.
    (PEFT itself loading such an export: tests/fixtures/make_lora_fixtures.py --only train-export.)"""
    import json
    import os

    from helpers import HF

    from rpeg_jax.cli import main
    from rpeg_jax.models import load_hf
    from rpeg_jax.models.lora import read_peft_adapter

    src = os.path.join(HF, "llama_tiny")
    over = LORA + [
        f"model.path={src}",
        "model.intermediate_size=160",
        "model.max_position_embeddings=128",
        "train.checkpoint_every=1",
        "rl.entropy_coef=0.1",
        "optim.lr=1e-2",
    ]
    r = run(tmp_path, "run", over, steps=2)
    merged_dir, adapter_dir = str(tmp_path / "merged"), str(tmp_path / "adapter")
    assert main(["export", "--run-dir", r.run_dir, "--out", merged_dir]) == 0
    assert main(["export", "--run-dir", r.run_dir, "--adapter", adapter_dir]) == 0
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, src)

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 12)), jnp.int32)
    base = load_hf(src)
    cfg = base.cfg
    base_logits = np.asarray(base(tokens))
    trained = jax.device_put(r.state["actor"], jax.devices()[0])
    lora_cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=4, alpha=8.0))
    lora_model = Transformer(lora_cfg, rngs=nnx.Rngs(0))
    nnx.update(lora_model, adapters.join(nnx.state(base, nnx.Param), trained))
    want = np.asarray(lora_model(tokens))
    assert np.abs(want - base_logits).max() > 1e-3, "the adapters did not train: the test could not fail"

    np.testing.assert_allclose(np.asarray(load_hf(merged_dir)(tokens)), want, atol=2e-5)
    read, rank, alpha = read_peft_adapter(adapter_dir, cfg)
    for target, (a, b) in to_peft(lora_cfg, trained).items():
        np.testing.assert_array_equal(read[target][0], a)
        np.testing.assert_array_equal(read[target][1], b)
    merge(base, read, rank=rank, alpha=alpha)
    np.testing.assert_allclose(np.asarray(base(tokens)), want, atol=2e-5)

    plain = tmp_path / "plainrun"  # --adapter of a run without adapters: one line, exit 2
    plain.mkdir()
    text = open(os.path.join(r.run_dir, "config.yaml")).read()
    (plain / "config.yaml").write_text(text.replace("rank: 4", "rank: 0"))
    os.symlink(os.path.join(r.run_dir, "checkpoints"), plain / "checkpoints")
    capsys.readouterr()
    assert main(["export", "--run-dir", str(plain), "--adapter", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.lora.rank=0" in err, err
