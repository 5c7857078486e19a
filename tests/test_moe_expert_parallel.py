"""Expert parallelism with explicit collectives (models/moe.py `experts_mlp_parallel`) on 8 CPU
devices against one device.

Reference: the same model and batch on one device (the plain block: one ragged_dot per projection
over all experts). Tolerance: float32, loss rtol 1e-5, gradients rtol 1e-4 / atol 1e-6 (the sums
over tokens and experts are taken in a different order across devices; the dispatch drops nothing,
so anything beyond rounding is a bug). Each sharded case also checks the compiled program really
holds the collective of its path (an all-to-all for dispatch, none where tokens are replicated),
so a silent fallback to the plain GSPMD block cannot pass."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpeg_jax.config.model import ModelConfig
from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.models.moe import experts_mlp_parallel
from rpeg_jax.sharding import layout_for, register_rules
from rpeg_jax.sharding.axes import ExpertLayout

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
L_SPARSE = 2  # layers 0 and 2

# rule sets for the other token layouts (test-only names)
register_rules(
    "test_ep_local",  # tokens over data only, experts over fsdp: tokens replicated over the expert axis
    [("batch", "data"), ("expert", "fsdp")],
    origin=__name__,
)
register_rules(
    "test_ep_tensor",  # experts over fsdp and each expert's width over tensor (psum after the down projection)
    [
        ("batch", ("data", "fsdp")),
        ("expert", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor", "replicate"),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
    ],
    origin=__name__,
)


def loss_fn(params, graphdef, tokens, forced):
    model = nnx.merge(graphdef, params)
    h, _, route = model.hidden_routed(tokens[:, :-1], experts_BxTxSxK=forced)
    logp = jax.nn.log_softmax(model.logits(h), axis=-1)
    nll = -jnp.mean(jnp.sum(logp * jax.nn.one_hot(tokens[:, 1:], logp.shape[-1]), axis=-1))
    return nll + 0.01 * jnp.mean(route["logits"] ** 2)  # the router gets gradients from the routing too


@pytest.fixture(scope="module")
def model():
    from rpeg_jax.models import Transformer

    CFG.validate("model")
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (8, 13), 0, CFG.vocab_size)
    return graphdef, params, tokens


def one_device(model, forced=None):
    graphdef, params, tokens = model
    one = jax.devices()[0]
    return jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(
        *jax.device_put((params,), one), graphdef, jax.device_put(tokens, one), forced
    )


@pytest.fixture(scope="module")
def reference(model):
    return one_device(model)


def sharded(model, preset, shape, forced=None):
    graphdef, params, tokens = model
    n = int(np.prod(shape))
    layout = layout_for(dict(zip(("data", "fsdp", "tensor"), shape)), preset, ShardingConfig(), jax.devices()[:n])
    params_s = jax.device_put(params, layout.params(params))
    tokens_s = jax.device_put(tokens, layout.sharding(("batch", "seq"), tokens.shape))
    with layout.activations():
        compiled = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1).lower(params_s, graphdef, tokens_s, forced)
        compiled = compiled.compile()
    return compiled(params_s, tokens_s, forced), compiled.as_text(), params_s


def assert_equal(out, ref):
    (loss, grads), (ref_loss, ref_grads) = out, ref
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize(
    "preset, shape, collective",
    [
        # expert = 4 (two experts per device); slow: the expert 4 x data 2 case below runs the same dispatch
        pytest.param("fsdp_expert", (1, 4, 1), "all-to-all", marks=pytest.mark.slow),
        ("fsdp_expert", (2, 4, 1), "all-to-all"),  # expert 4 x data 2
        pytest.param("fsdp_expert", (1, 8, 1), "all-to-all", marks=pytest.mark.slow),  # one expert per device
        ("test_ep_local", (2, 4, 1), None),  # tokens replicated over the expert axis: psum, no dispatch
        ("test_ep_tensor", (1, 4, 2), "all-to-all"),  # experts over fsdp, their width over tensor
    ],
)
def test_loss_and_gradients_equal_one_device(model, reference, preset, shape, collective):
    out, hlo, params_s = sharded(model, preset, shape)
    assert params_s["layers"]["we_up"].sharding.spec[1] == "fsdp"  # the experts really are split
    if collective:
        assert "all-to-all" in hlo
    else:
        assert "all-to-all" not in hlo and "all-reduce" in hlo
    assert_equal(out, reference)


def test_all_pairs_to_one_device_drop_nothing(model):
    """Every token routed (replay) to experts 0 and 1, both on device 0 of the expert axis: the
    worst case for a fixed-size dispatch buffer. The expert-parallel result equals one device's."""
    graphdef, params, tokens = model
    B, T = tokens.shape[0], tokens.shape[1] - 1
    forced = jnp.broadcast_to(jnp.array([1, 0], jnp.int32), (B, T, L_SPARSE, 2))
    ref = one_device(model, forced)
    out, hlo, _ = sharded(model, "fsdp_expert", (2, 4, 1), forced)
    assert "all-to-all" in hlo
    assert_equal(out, ref)


@pytest.mark.parametrize(
    "tokens, collective",
    [((("data", "fsdp"), None), "all-to-all"), (("data", None), "all-reduce"), ((None, "fsdp"), "all-to-all")],
)
def test_the_block_alone_equals_the_plain_block_with_gradients(tokens, collective):
    """`experts_mlp_parallel` against models/moe.experts_mlp on random routing in float32, with a
    random (unnormalised) weight per pair, experts over fsdp = 4, tokens split over data x fsdp
    (dispatch), over data only (replicated over the experts' axis: local experts + psum) and over
    the sequence (dispatch): the value of sum(y^2) and its gradients with respect to the tokens,
    the pair weights and the three expert weights (atol 1e-4 on values of order 1-50)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from rpeg_jax.models.moe import experts_mlp

    rng = np.random.default_rng(0)
    B, T, D, X, F, k = 8, 4, 12, 8, 6, 3
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    e = jnp.asarray(np.stack([rng.permutation(X)[:k] for _ in range(B * T)]).reshape(B, T, k), jnp.int32)
    w = jnp.asarray(rng.uniform(size=(B, T, k)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(X, D, F)) / 3, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(X, F, D)) / 3, jnp.float32)

    def plain(x, w, wg, wu, wd):
        return jnp.sum(experts_mlp(x.reshape(-1, D), e.reshape(-1, k), w.reshape(-1, k), wg, wu, wd) ** 2)

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    layout = ExpertLayout(("fsdp",), (), tokens, mesh)

    def parallel(x, w, wg, wu, wd):
        return jnp.sum(experts_mlp_parallel(x, e, w, wg, wu, wd, layout) ** 2)

    tok = P(*tokens)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (put(x, tok), put(w, tok), *(put(a, P("fsdp")) for a in (wg, wu, wd)))
    fn = jax.jit(jax.value_and_grad(parallel, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    hlo = fn.as_text()
    assert collective in hlo and (collective == "all-to-all") == ("all-to-all" in hlo)
    (v, grads), (rv, rgrads) = fn(*args), jax.value_and_grad(plain, argnums=(0, 1, 2, 3, 4))(x, w, wg, wu, wd)
    np.testing.assert_allclose(float(v), float(rv), rtol=1e-5)
    for name, g, r in zip(("x", "w", "w_gate", "w_up", "w_down"), grads, rgrads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("forward", ["model", pytest.param("split", marks=pytest.mark.slow)])
def test_sampler_with_experts_split_and_pool_sharded_equals_one_device(monkeypatch, forward):
    """The paged sampler on tests/fixtures/hf/qwen3_moe_tiny (4 experts, top-2) with its experts
    split over fsdp = 2 (the fsdp_expert preset) and the KV pool over data = 2: greedy tokens,
    logprobs and the recorded experts equal the single-device sampler's, for the model's own
    forward and (slow) the split forward; the expert-parallel block really ran (tokens replicated over
    the expert axis: each device runs its own experts' pairs, then a psum)."""
    from rpeg_jax.models import load_hf, moe
    from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

    model = load_hf(os.path.join(os.path.dirname(__file__), "fixtures", "hf", "qwen3_moe_tiny"))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (5, 1, 9, 4, 7)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    fixed = dict(max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16)
    base = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, **fixed)
    layout = layout_for({"data": 2, "fsdp": 2, "tensor": 1}, "fsdp_expert", ShardingConfig(), jax.devices()[:4])
    graphdef, state = nnx.split(model, nnx.Param)
    placed = nnx.merge(graphdef, jax.device_put(state, layout.params(state)))
    assert placed.layers.we_gate[...].sharding.spec[1] == "fsdp"
    ran = []
    plain = moe.experts_mlp_parallel

    def counting(*args):
        out = plain(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(moe, "experts_mlp_parallel", counting)
    cfg = dataclasses.replace(base, forward=forward, attention="chunk")
    ref = Sampler(model, cfg).generate(prompts, greedy)
    assert not ran  # one device: the plain block
    sampler = Sampler(placed, cfg)
    assert sampler.stats()["pool_shards"] == 2
    out = sampler.generate(prompts, greedy)
    assert ran and all(ran)
    for o, r in zip(out, ref, strict=True):
        for c, d in zip(o.completions, r.completions, strict=True):
            assert c.tokens.tolist() == d.tokens.tolist()
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(np.sort(c.experts, -1), np.sort(d.experts, -1))


MOE_KEYS = ["model.arch=qwen3_moe", "model.num_experts=6", "model.qk_norm=true"]


def test_an_expert_split_that_does_not_divide_the_experts_is_one_config_line():
    """fsdp_expert on fsdp = 4 with 6 experts: refused by the config, naming the mesh key; fsdp = 3
    (and fsdp_expert_tensor with tensor 2, which does not split the experts) is accepted; a mesh
    whose fsdp fills (-1) is checked when the stage's mesh is resolved (StageLayout.check_experts)."""
    from rpeg_jax.config import ConfigError, load_config

    bad = ["sharding.train_rules=fsdp_expert", "sharding.mesh.fsdp=4", "sharding.mesh.data=1"]
    with pytest.raises(ConfigError, match=r"^config error: sharding.mesh.fsdp=4: sharding.train_rules=fsdp_expert "):
        load_config(None, MOE_KEYS + bad)
    gen = ["sharding.generate_rules=fsdp_expert_tensor", "sharding.generate_mesh.fsdp=4"]
    gen += ["sharding.generate_mesh.data=1"]
    with pytest.raises(ConfigError, match=r"^config error: sharding.generate_mesh.fsdp=4: .*must divide 6$"):
        load_config(None, MOE_KEYS + gen)
    load_config(None, MOE_KEYS + ["sharding.train_rules=fsdp_expert_tensor", "sharding.mesh.fsdp=3"])
    load_config(None, ["sharding.train_rules=fsdp_expert", "sharding.mesh.fsdp=4"])  # a dense model: nothing to split
    cfg = load_config(None, MOE_KEYS + ["sharding.train_rules=fsdp_expert", "sharding.mesh.fsdp=-1"])
    layout = layout_for({"data": 1, "fsdp": 4, "tensor": 1}, "fsdp_expert", cfg.sharding, jax.devices()[:4])
    with pytest.raises(ConfigError, match=r"^config error: sharding.mesh=.*split the model.num_experts=6"):
        layout.check_experts(6, "sharding.mesh")
    layout.check_experts(8, "sharding.mesh")
