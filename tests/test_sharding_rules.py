"""The resolver, the presets and mesh construction, on abstract meshes and fake devices (no
devices are used): the documented semantics, the error cases, and the presets against a table
written out by hand from the model's parameter list."""

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from rpeg_jax.config.base import ConfigError
from rpeg_jax.sharding import PRESETS, Rules, ShardingError, abstract_mesh, get_rules, register_rules, resolve
from rpeg_jax.sharding.mesh import MeshError, canonical_spec, device_grid, fill_spec, split_devices


def mesh(**sizes):
    return abstract_mesh(sizes, math.prod(sizes.values()))


# ---- semantics ----


def test_first_rule_that_fits_wins():
    rules = Rules.from_data([["batch", "data"], ["embed", "data"], ["embed", "fsdp"], ["embed", "tensor"]])
    m = mesh(data=2, fsdp=2, tensor=2)
    # batch takes data, so embed's first rule does not fit; the second does.
    assert resolve(("batch", "embed"), (4, 8), m, rules) == P("data", "fsdp")
    assert resolve(("embed", "batch"), (8, 4), m, rules) == P("data", None)  # left to right


def test_mesh_axis_used_at_most_once_per_array():
    rules = Rules.from_data([["heads", "tensor"], ["kv_heads", "tensor"], ["batch", ["data", "tensor"]]])
    m = mesh(data=2, tensor=4)
    assert resolve(("heads", "kv_heads"), (8, 8), m, rules) == P("tensor", None)
    assert resolve(("heads", "batch"), (8, 8), m, rules) == P("tensor", None)  # (data, tensor) does not fit
    assert resolve(("batch", "heads"), (8, 8), m, rules) == P(("data", "tensor"), None)


def test_absent_and_size_one_axes_are_dropped_unknown_logical_replicated():
    rules = Rules.from_data([["batch", ["data", "fsdp"]], ["embed", "pipeline"]])
    assert resolve(("batch", "embed"), (4, 4), mesh(data=4, fsdp=1), rules) == P("data", None)
    assert resolve(("batch", None, "vocab"), (4, 3, 5), mesh(data=4), rules) == P("data", None, None)
    assert resolve((), (), mesh(data=4), rules) == P()


def test_indivisible_error_names_parameter_logical_and_mesh_axis():
    rules = Rules.from_data([["embed", "fsdp"]], "mine")
    with pytest.raises(ShardingError) as e:
        resolve(("layers", "embed", "heads"), (2, 100, 4), mesh(fsdp=8), rules, "layers.wq")
    msg = str(e.value)
    for part in ("layers.wq", "dimension 1", "'embed'", "size 100", "fsdp", "size 8", "'mine'"):
        assert part in msg, (part, msg)
    assert isinstance(e.value, ConfigError)  # the CLI prints it as one line


def test_indivisible_policies():
    m = mesh(data=2, tensor=4)
    rep = Rules.from_data([["kv_heads", "tensor", "replicate"]])
    assert resolve(("kv_heads",), (2,), m, rep) == P(None)
    nxt = Rules.from_data([["kv_heads", "tensor", "next"], ["kv_heads", "data"]])
    assert resolve(("kv_heads",), (2,), m, nxt) == P("data")
    strict = Rules.from_data([["kv_heads", "tensor"]])
    assert resolve(("kv_heads",), (2,), m, strict, strict=False) == P(None)  # activations
    with pytest.raises(ShardingError):
        resolve(("kv_heads",), (2,), m, strict)


def test_rank_mismatch_and_bad_rule_data():
    with pytest.raises(ShardingError, match="2 logical axes"):
        resolve(("a", "b"), (3,), mesh(data=2), Rules(()), "x")
    with pytest.raises(ShardingError, match="expected"):
        Rules.from_data([["embed"]])
    with pytest.raises(ShardingError, match="indivisible"):
        Rules.from_data([["embed", "fsdp", "sometimes"]])
    r = Rules.from_data([{"logical": "mlp", "mesh": "data+tensor"}, ["embed", None], ["heads", []]])
    assert [x.mesh for x in r.rules] == [("data", "tensor"), (), ()]


# ---- presets against the models' parameter layout (written out by hand) ----

L, V, D, H, K, E, F = 2, 64, 32, 8, 2, 4, 48
PARAMS = {  # name: (shape, logical axes) — as models/llama.py declares them (nnx.Param `axes`)
    "embed": ((V, D), ("vocab", "embed")),
    "layers.attn_norm": ((L, D), ("layers", "embed")),
    "layers.wq": ((L, D, H, E), ("layers", "embed", "heads", "head_dim")),
    "layers.wk": ((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim")),
    "layers.wo": ((L, H, E, D), ("layers", "heads", "head_dim", "embed")),
    "layers.w_up": ((L, D, F), ("layers", "embed", "mlp")),
    "layers.w_down": ((L, F, D), ("layers", "mlp", "embed")),
    "final_norm": ((D,), ("embed",)),
    "lm_head": ((D, V), ("embed", "vocab")),
    "value_b": ((), ()),
}
_ = None
EXPECTED = {  # preset -> name -> spec on mesh data=2, fsdp=2, tensor=4 (K=2 kv heads < tensor=4)
    "replicated": {n: P(*([_] * len(s))) for n, (s, _a) in PARAMS.items()},
    "data": {n: P(*([_] * len(s))) for n, (s, _a) in PARAMS.items()},
    "fsdp": {
        "embed": P(_, "fsdp"),
        "layers.attn_norm": P(_, "fsdp"),
        "layers.wq": P(_, "fsdp", _, _),
        "layers.wk": P(_, "fsdp", _, _),
        "layers.wo": P(_, _, _, "fsdp"),
        "layers.w_up": P(_, "fsdp", _),
        "layers.w_down": P(_, _, "fsdp"),
        "final_norm": P("fsdp"),
        "lm_head": P("fsdp", _),
        "value_b": P(),
    },
    "tensor": {
        "embed": P("tensor", _),
        "layers.attn_norm": P(_, _),
        "layers.wq": P(_, _, "tensor", _),
        "layers.wk": P(_, _, _, _),
        "layers.wo": P(_, "tensor", _, _),
        "layers.w_up": P(_, _, "tensor"),
        "layers.w_down": P(_, "tensor", _),
        "final_norm": P(_),
        "lm_head": P(_, "tensor"),
        "value_b": P(),
    },
    "fsdp_tensor": {
        "embed": P("tensor", "fsdp"),
        "layers.attn_norm": P(_, "fsdp"),
        "layers.wq": P(_, "fsdp", "tensor", _),
        "layers.wk": P(_, "fsdp", _, _),
        "layers.wo": P(_, "tensor", _, "fsdp"),
        "layers.w_up": P(_, "fsdp", "tensor"),
        "layers.w_down": P(_, "tensor", "fsdp"),
        "final_norm": P("fsdp"),
        "lm_head": P("fsdp", "tensor"),
        "value_b": P(),
    },
}
ACTS = {  # training and generation activations: (shape, axes) -> expected per preset family
    "hidden": ((8, 6, D), ("batch", "seq", "embed")),
    "q": ((8, 6, H, E), ("batch", "seq", "heads", "head_dim")),
    "kv_cache": ((L, 8, 6, K, E), ("layers", "batch", "seq", "kv_heads", "head_dim")),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_presets_match_table(preset):
    m = mesh(data=2, fsdp=2, tensor=4)
    for name, (shape, axes) in PARAMS.items():
        assert resolve(axes, shape, m, PRESETS[preset], name) == EXPECTED[preset][name], (preset, name)
    b = None if preset == "replicated" else ("data", "fsdp")
    t = "tensor" if "tensor" in preset else None
    assert resolve(*ACTS["hidden"][::-1], m, PRESETS[preset]) == P(b, _, _)
    assert resolve(*ACTS["q"][::-1], m, PRESETS[preset]) == P(b, _, t, _)
    assert resolve(*ACTS["kv_cache"][::-1], m, PRESETS[preset], strict=False) == P(_, b, _, _, _)


def test_presets_on_one_device_are_replicated():
    m = mesh(data=1, fsdp=1, tensor=1)
    for rules in PRESETS.values():
        for name, (shape, axes) in PARAMS.items():
            assert resolve(axes, shape, m, rules, name) == P(*([None] * len(shape)))


def test_register_rules_conflict_names_both_modules():
    register_rules("test_only_rules", [["mlp", "tensor"]], origin="pkg_a.rules")
    register_rules("test_only_rules", [["mlp", "tensor"]], origin="pkg_a.rules")  # same module: fine
    with pytest.raises(
        ConfigError, match="rule preset 'test_only_rules' is registered twice: by pkg_a.rules.*pkg_b.rules"
    ):
        register_rules("test_only_rules", [["mlp", "data"]], origin="pkg_b.rules")
    with pytest.raises(ConfigError, match="unknown rule preset"):
        get_rules("fsdp_tensr", "sharding.train_rules")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_resolver_invariants(data):
    """For random rules, shapes and meshes: each mesh axis shards at most one dimension, every
    sharded dimension divides, and is sharded exactly as the first fitting rule for its name."""
    names = ["a", "b", "c"]
    sizes = {ax: data.draw(st.sampled_from([1, 2, 4])) for ax in ("data", "fsdp", "tensor")}
    m = abstract_mesh(sizes, math.prod(sizes.values()))
    rule_list = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(names),
                st.lists(st.sampled_from(list(sizes)), max_size=2, unique=True),
                st.sampled_from(["replicate", "next"]),
            ),
            max_size=6,
        )
    )
    rules = Rules.from_data([list(r) for r in rule_list])
    axes = tuple(data.draw(st.lists(st.sampled_from(names + [None]), max_size=4)))
    shape = tuple(data.draw(st.sampled_from([1, 2, 3, 4, 8, 12])) for _ in axes)
    spec = resolve(axes, shape, m, rules)
    used = []
    for dim, entry in enumerate(tuple(spec)):
        mesh_axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        used += mesh_axes
        ways = math.prod(sizes[a] for a in mesh_axes)
        assert shape[dim] % ways == 0
        if mesh_axes:
            assert any(r[0] == axes[dim] and tuple(a for a in r[1] if sizes[a] > 1) == mesh_axes for r in rule_list)
    assert len(used) == len(set(used))


# ---- meshes (fake devices: nothing touches JAX devices) ----


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def test_fill_spec_and_errors():
    assert fill_spec({"data": -1, "fsdp": 4, "tensor": 1}, 16) == {"data": 4, "fsdp": 4, "tensor": 1}
    with pytest.raises(MeshError, match="does not divide"):
        fill_spec({"data": -1, "fsdp": 3}, 8)
    with pytest.raises(MeshError, match="uses 4 devices but 8"):
        fill_spec({"data": 2, "fsdp": 2}, 8)
    with pytest.raises(MeshError, match="at most one"):
        fill_spec({"data": -1, "fsdp": -1}, 8)
    assert list(canonical_spec({"tensor": 2, "data": -1})) == ["data", "fsdp", "tensor"]


def test_tensor_axis_stays_inside_a_node():
    # 4 hosts x 4 devices, listed out of order: the grid follows (process, id) order.
    devs = [FakeDevice(p * 100 + i, p) for p in (3, 1, 0, 2) for i in (3, 2, 1, 0)]
    grid = device_grid(canonical_spec({"data": -1, "fsdp": 2, "tensor": 2}), devs, devices_per_node=4)
    assert grid.shape == (4, 2, 2)
    for d in range(4):
        for f in range(2):
            group = grid[d, f, :]
            assert len({x.process_index for x in group}) == 1  # a tensor group is on one node
    assert [x.id for x in grid.flat][:4] == [0, 1, 2, 3]
    with pytest.raises(MeshError, match="spans nodes"):
        device_grid({"data": -1, "tensor": 8}, devs, devices_per_node=4)
    # one process per GPU (GH200: 4 per node): nodes come from the order, not the process index
    single = [FakeDevice(i, i) for i in range(8)]
    device_grid({"data": -1, "tensor": 4}, single, devices_per_node=4)
    ten = [FakeDevice(i, i) for i in range(10)]
    with pytest.raises(MeshError, match="spans nodes"):  # a sub-mesh that starts mid-node
        device_grid({"data": 2, "tensor": 4}, ten[2:], devices_per_node=4, all_devices=ten)


def test_split_devices_contiguous():
    devs = [FakeDevice(i, i // 4) for i in range(8)]
    parts = split_devices([("gen", 2), ("train", -1)], devs)
    assert [d.id for d in parts["gen"]] == [0, 1] and [d.id for d in parts["train"]] == list(range(2, 8))
    with pytest.raises(MeshError):
        split_devices([("a", 6), ("b", 4)], devs)
    with pytest.raises(MeshError):
        split_devices([("a", -1), ("b", -1)], devs)
