"""A mixture of experts under the sharding rules on 8 CPU devices: the logical `expert` axis (the
`fsdp_expert` preset: whole experts per fsdp shard, expert x data) and the plain presets give the
single-device loss and gradients; explicit axis types are refused in one line naming the key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.config.model import ModelConfig
from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.sharding import PRESETS, abstract_mesh, layout_for, param_specs

CFG = ModelConfig(
    arch="qwen3_moe",
    qk_norm=True,
    vocab_size=64,
    hidden_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    mlp_only_layers=(1,),
)


def loss_fn(params, graphdef, tokens):
    model = nnx.merge(graphdef, params)
    logp = jax.nn.log_softmax(model(tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(tokens[:, 1:], logp.shape[-1]), axis=-1))


@pytest.fixture(scope="module")
def reference():
    from rpeg_jax.models import Transformer

    CFG.validate("model")
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)
    one = jax.devices()[0]
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(
        *jax.device_put((params,), one), graphdef, jax.device_put(tokens, one)
    )
    return graphdef, params, tokens, loss, grads


def test_the_expert_axis_places_whole_experts_on_each_fsdp_shard(reference):
    _, params, *_ = reference
    specs = param_specs(params, abstract_mesh({"data": 2, "fsdp": 4, "tensor": 1}, 8), PRESETS["fsdp_expert"])
    layers = specs["layers"]
    for name in ("we_gate", "we_up", "we_down"):
        assert tuple(layers[name]) == (None, "fsdp", None, None), name  # [Ls, X, ., .]: X over fsdp
    assert tuple(layers["wq"])[1] == "fsdp"  # the dense weights stay FSDP on embed
    plain = param_specs(params, abstract_mesh({"data": 2, "fsdp": 4, "tensor": 1}, 8), PRESETS["fsdp"])
    assert tuple(plain["layers"]["we_gate"]) == (None, None, "fsdp", None)  # fsdp alone slices every expert


@pytest.mark.parametrize(
    "preset, shape",
    [
        ("fsdp_expert", (2, 4, 1)),
        ("tensor", (2, 2, 2)),
        pytest.param("fsdp_expert", (1, 8, 1), marks=pytest.mark.slow),
        pytest.param("fsdp", (2, 4, 1), marks=pytest.mark.slow),
    ],
)
def test_loss_and_gradients_equal_one_device(reference, preset, shape):
    graphdef, params, tokens, ref_loss, ref_grads = reference
    layout = layout_for(dict(zip(("data", "fsdp", "tensor"), shape)), preset, ShardingConfig())
    params_s = jax.device_put(params, layout.params(params))
    tokens_s = jax.device_put(tokens, layout.sharding(("batch", "seq"), tokens.shape))
    with jax.set_mesh(layout.mesh), layout.activations():
        loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params_s, graphdef, tokens_s)
    if preset == "fsdp_expert":
        assert params_s["layers"]["we_up"].sharding.spec[1] == "fsdp"  # the experts really are split
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


def test_explicit_axis_types_are_refused_for_a_mixture():
    with pytest.raises(ConfigError, match=r"^config error: sharding.axis_types='explicit': a mixture of experts"):
        load_config(
            None, ["model.arch=qwen3_moe", "model.num_experts=4", "model.qk_norm=true", "sharding.axis_types=explicit"]
        )
