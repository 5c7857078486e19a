"""Parameter layouts on 8 CPU devices: overrides and plugins (the extension point), sharded init,
activation constraints, `rpeg shardings`, and the model's loss and gradients under every preset
and several mesh shapes against the single-device values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.config.model import ModelConfig
from rpeg_jax.config.registry import load_plugins
from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.sharding import (
    PRESETS,
    ShardingError,
    abstract_mesh,
    constrain,
    layout_for,
    param_specs,
    shard_model,
    stage_layout,
)
from rpeg_jax.sharding.tactics import parse_partition

_ = None


def tree():
    """A plain pytree of nnx.Params with logical axes (no model needed)."""
    z = jnp.zeros
    return {
        "embed": nnx.Param(z((16, 8)), axes=("vocab", "embed")),
        "layers": {
            "wq": nnx.Param(z((2, 8, 4, 2)), axes=("layers", "embed", "heads", "head_dim")),
            "w_up": nnx.Param(z((2, 8, 12)), axes=("layers", "embed", "mlp")),
        },
        "bias": z((12,)),
    }  # no axes: replicated unless overridden


M = abstract_mesh({"data": 2, "fsdp": 2, "tensor": 2}, 8)


def test_param_specs_plain_tree():
    specs = param_specs(tree(), M, PRESETS["fsdp_tensor"])
    assert specs["embed"] == P("tensor", "fsdp")
    assert specs["layers"]["wq"] == P(_, "fsdp", "tensor", _)
    assert specs["layers"]["w_up"] == P(_, "fsdp", "tensor")
    assert specs["bias"] == P(_)


def test_overrides_first_match_wins_partition_and_tactic():
    ov = [
        [r"layers\.w.*", "P(None, tensor)"],
        [r"layers\.wq", "replicate"],
        ["embed", "fsdp_largest"],
        ["bias", "P(data+fsdp)"],
    ]
    with pytest.raises(ConfigError, match=r"overrides\[1\].*conflicts with earlier.*layers\\\\.w"):
        param_specs(tree(), M, PRESETS["fsdp"], ov)
    ov = [
        [r"layers\.wq", "replicate"],
        [r"layers\.w.*", "P(None, tensor)"],
        ["embed", "fsdp_largest"],
        ["bias", "P((data, fsdp))"],
    ]
    specs = param_specs(tree(), M, PRESETS["fsdp"], ov)
    assert specs["layers"]["wq"] == P(_, _, _, _)
    assert specs["layers"]["w_up"] == P(_, "tensor", _)  # padded to the rank
    assert specs["embed"] == P("fsdp", _)  # largest dim divisible by fsdp
    assert specs["bias"] == P(("data", "fsdp"))


def test_override_errors_name_the_entry_and_parameter():
    with pytest.raises(ConfigError, match=r"overrides\[0\].*matches no parameter"):
        param_specs(tree(), M, PRESETS["fsdp"], [["nothing.*", "replicate"]])
    with pytest.raises(ConfigError, match=r"overrides\[0\].*neither a known tactic.*did you mean 'replicate'"):
        param_specs(tree(), M, PRESETS["fsdp"], [["embed", "replicat"]])
    with pytest.raises(ShardingError, match=r"overrides\[0\].*'pipe'.*'embed'"):
        param_specs(tree(), M, PRESETS["fsdp"], [["embed", "P(pipe, None)"]])
    with pytest.raises(ShardingError, match=r"overrides\[0\].*dimension 0 of 'bias'.*size 12.*size 8"):
        param_specs(tree(), M, PRESETS["fsdp"], [["bias", "P(data+fsdp+tensor)"]])
    with pytest.raises(ShardingError, match="used twice"):
        param_specs(tree(), M, PRESETS["fsdp"], [["embed", "P(fsdp, fsdp)"]])
    with pytest.raises(ShardingError, match="3 entries"):
        param_specs(tree(), M, PRESETS["fsdp"], [["embed", "P(fsdp, None, None)"]])
    # a sub-tree (e.g. the actor without the value head) may leave patterns unmatched on request
    param_specs(tree(), M, PRESETS["fsdp"], [["value_w", "replicate"]], unmatched_ok=True)


def test_parse_partition():
    assert parse_partition("P(fsdp, None)") == P("fsdp", None)
    assert parse_partition("P()") == P()
    assert parse_partition("fsdp, _") == P("fsdp", None)
    assert parse_partition("P((data, fsdp), tensor)") == P(("data", "fsdp"), "tensor")
    assert parse_partition("data+fsdp, null") == P(("data", "fsdp"), None)
    with pytest.raises(ValueError):
        parse_partition("P((data, fsdp)")


def test_custom_rule_from_config_changes_layout():
    cfg = load_config(
        None,
        [
            "sharding.mesh={data: 2, fsdp: 2, tensor: 2}",
            "sharding.rules={mlp_over_data: [[mlp, data], [embed, fsdp]]}",
            "sharding.train_rules=mlp_over_data",
            "sharding.overrides=[[embed, 'P(None, tensor)']]",
        ],
    )
    layout = stage_layout(cfg.sharding, "train", num_devices=8)
    specs = layout.param_specs(tree())
    assert specs["layers"]["w_up"] == P(_, "fsdp", "data")
    assert specs["embed"] == P(_, "tensor")  # the override beats the rules
    with pytest.raises(ConfigError, match="sharding.rules.bad"):
        load_config(None, ["sharding.rules={bad: [[mlp, pipeline]]}"])


PLUGIN = """
from rpeg_jax.sharding import register_rules, tactic

@tactic("vocab_over_data_{n}")
def vocab_over_data(ctx):
    return ctx.spec({{"vocab": "data"}})

register_rules("plugin_rules_{n}", [["mlp", "tensor"], ["embed", "data"]])
"""


def test_plugin_module_registers_tactic_and_rules(tmp_path, monkeypatch):
    (tmp_path / "my_rules_a.py").write_text(PLUGIN.format(n="a"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        None,
        [
            "sharding.mesh={data: 2, fsdp: 2, tensor: 2}",
            "plugins=[my_rules_a]",
            "sharding.train_rules=plugin_rules_a",
            "sharding.overrides=[[embed, vocab_over_data_a]]",
        ],
    )
    specs = stage_layout(cfg.sharding, "train", num_devices=8).param_specs(tree())
    assert specs["embed"] == P("data", _)  # the plugin's tactic
    assert specs["layers"]["w_up"] == P(_, "data", "tensor")  # the plugin's rules
    # a second module registering the same tactic name is a conflict, reported with both names
    (tmp_path / "my_rules_b.py").write_text(PLUGIN.format(n="a"))
    with pytest.raises(ConfigError, match="plugins=.*tactic 'vocab_over_data_a'.*my_rules_a.*my_rules_b"):
        load_plugins(["my_rules_b"])
    with pytest.raises(ConfigError, match=r"plugins\[0\].*cannot import"):
        load_config(None, ["plugins=[no_such_rules_module]"])


# ---- the model on 8 CPU devices ----

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def loss_fn(params, graphdef, tokens):
    """Mean next-token cross entropy."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    # the target's logprob by a one-hot select (a gather over a vocab-sharded axis has no
    # unambiguous layout under sharding in types)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(tokens[:, 1:], logp.shape[-1]), axis=-1))


@pytest.fixture(scope="module")
def reference():
    from rpeg_jax.models import Transformer

    model = Transformer(TINY, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, TINY.vocab_size)
    one = jax.devices()[0]
    params1, tokens1 = jax.device_put((params, tokens), one)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params1, graphdef, tokens1)
    return model, graphdef, params, tokens, loss, grads


# Every preset on a mesh (data, fsdp, tensor) that uses its axes, in the default run; more in `slow`.
CASES = [
    ("replicated", (8, 1, 1)),
    ("data", (2, 4, 1)),
    ("fsdp", (1, 8, 1)),
    ("tensor", (2, 2, 2)),
    ("fsdp_tensor", (1, 4, 2)),
]
SLOW_CASES = [
    ("data", (8, 1, 1)),
    ("fsdp", (2, 4, 1)),
    ("tensor", (4, 1, 2)),
    ("fsdp_tensor", (2, 2, 2)),
    ("fsdp_tensor", (2, 1, 4)),
]


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
@pytest.mark.parametrize("preset,shape", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_model_loss_and_grads_match_single_device(reference, preset, shape, axis_types):
    """Auto axes (XLA propagates layouts) and explicit ones (sharding in types: the model gathers
    FSDP-sharded weights before use and states the layout of sharded contractions, models/dense.py)."""
    _model, graphdef, params, tokens, ref_loss, ref_grads = reference
    layout = layout_for(dict(zip(("data", "fsdp", "tensor"), shape)), preset, ShardingConfig(axis_types=axis_types))
    shardings = layout.params(params)
    params_s = jax.device_put(params, shardings)
    tokens_s = jax.device_put(tokens, layout.sharding(("batch", "seq"), tokens.shape))
    with jax.set_mesh(layout.mesh), layout.activations():
        loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params_s, graphdef, tokens_s)
    wq = params_s["layers"]["wq"]
    assert wq.sharding.spec == layout.param_specs(params)["layers"]["wq"]
    # float32: the sharded program sums in a different order; 1e-5 relative covers that.
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6, err_msg=f"{preset} {shape} {jax.tree_util.keystr(path)}"
        )


class Small(nnx.Module):
    def __init__(self, rngs):
        normal = nnx.initializers.normal(0.02)
        self.w = nnx.Param(normal(rngs.params(), (16, 8)), axes=("embed", "mlp"))
        self.e = nnx.Param(normal(rngs.params(), (32, 16)), axes=("vocab", "embed"))


def test_shard_model_initialises_in_place():
    make = lambda: Small(nnx.Rngs(0))  # noqa: E731
    layout = layout_for({"fsdp": 4, "tensor": 2}, "fsdp_tensor", ShardingConfig())
    sharded = shard_model(make, layout.mesh, layout.rules)
    got = nnx.state(sharded, nnx.Param)
    assert got["w"][...].sharding.spec == P("fsdp", "tensor")
    assert got["e"][...].sharding.spec == P("tensor", "fsdp")
    with jax.default_device(jax.devices()[0]):  # the same init, compiled for one device
        want = jax.jit(lambda: nnx.state(make(), nnx.Param))()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_activation_constraint_applies_rules():
    layout = layout_for({"data": 2, "fsdp": 2, "tensor": 2}, "tensor", ShardingConfig())
    x = jnp.ones((8, 4, 6))
    with layout.activations():
        y = jax.jit(lambda a: constrain(a * 2, ("batch", "seq", "mlp")))(x)
    assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")
    z = jax.jit(lambda a: constrain(a * 2, ("batch", "seq", "mlp")))(x)  # outside: identity
    assert len(z.sharding.device_set) == 1


def test_rpeg_shardings_cli(capsys):
    from rpeg_jax.cli import main

    rc = main(
        [
            "shardings",
            "--devices",
            "8",
            "sharding.mesh={fsdp: 4, tensor: 2}",
            "sharding.train_rules=fsdp_tensor",
            "sharding.generate_rules=tensor",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  layers.wq")}
    assert "P(None, 'fsdp', 'tensor', None)" in out and "P(None, None, 'tensor', None)" in out
    assert "stage train" in out and "stage generate" in out and "[act] logits" in out
    assert lines and "KiB" in lines["layers.wq"]
    rc = main(["shardings", "--devices", "8", "sharding.mesh={fsdp: 3}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("config error: sharding.mesh=") and "\n" not in err
