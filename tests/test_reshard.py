"""Resharding within one process (8 CPU devices): training -> generation -> training round trips
are exact, plans are cached, and the bytes reported match a count done by hand. (Across two
processes: tests/test_multihost.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.sharding import Resharder, layout_for, make_mesh, reshard_bytes, sub_meshes


class Net(nnx.Module):
    def __init__(self, rngs):
        n = nnx.initializers.normal(1.0)
        self.embed = nnx.Param(n(rngs.params(), (16, 8)), axes=("vocab", "embed"))
        self.wq = nnx.Param(n(rngs.params(), (2, 8, 4, 2)), axes=("layers", "embed", "heads", "head_dim"))
        self.norm = nnx.Param(jnp.array([-0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]), axes=("embed",))
        self.scale = nnx.Param(jnp.float32(0.5), axes=())
        self.count = nnx.Param(jnp.arange(6, dtype=jnp.int32), axes=(None,))


@pytest.fixture(scope="module")
def setup():
    state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    subs = sub_meshes({"gen": (4, {"data": 2, "tensor": 2}), "train": (-1, {"fsdp": -1})})
    cfg = ShardingConfig()
    train = layout_for({"fsdp": 4}, "fsdp", cfg, list(subs["train"].devices.flat))  # devices 4-7
    gen = layout_for({"data": 2, "tensor": 2}, "tensor", cfg, list(subs["gen"].devices.flat))  # devices 0-3
    return state, train, gen


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("method", ["auto", "collective"])
def test_round_trip_train_generate_train_is_exact(setup, method):
    state, train, gen = setup
    train_sh, gen_sh = train.params(state), gen.params(state)
    x = jax.device_put(state, train_sh)
    rs = Resharder(method)
    y = rs(x, gen_sh)
    assert y["wq"][...].sharding == gen_sh["wq"] and y["wq"][...].sharding.spec == P(None, None, "tensor", None)
    assert set(y["wq"][...].sharding.device_set) == set(gen.mesh.devices.flat)
    z = rs(y, train_sh)
    assert _bits(y) == _bits(state) and _bits(z) == _bits(state)  # bit-exact, -0.0 included
    assert z["embed"][...].sharding == train_sh["embed"]
    rs(rs(z, gen_sh), train_sh)
    assert rs.plans_built == 2  # planned once per direction, then cached
    plan = rs.plan(x, gen_sh)
    want = {"collective": 5} if method == "collective" else {"device_put": 5}
    assert plan.methods == want


def test_overlapping_device_sets_by_collective(setup):
    """All 8 devices -> 4 of them (and back): the union mesh handles shared devices too."""
    state, _, gen = setup
    train = layout_for({"fsdp": 8}, "fsdp", ShardingConfig())
    x = jax.device_put(state, train.params(state))
    rs = Resharder("collective")
    y = rs(x, gen.params(state))
    z = rs(y, train.params(state))
    assert _bits(y) == _bits(state) == _bits(z)
    assert z["wq"][...].sharding.spec == P(None, "fsdp", None, None)


def test_bytes_moved_match_hand_count():
    devs = jax.devices()
    a, b = make_mesh({"x": 4}, devs[:4]), make_mesh({"x": 4}, devs[4:])
    full = make_mesh({"x": 8}, devs)
    arr = jax.ShapeDtypeStruct((64, 8), jnp.float32)  # 2048 bytes
    n = 64 * 8 * 4
    # replicated on 4 devices -> sharded on 4 other devices: each receives a quarter.
    assert reshard_bytes(arr, NamedSharding(a, P()), NamedSharding(b, P("x"))) == n
    # replicated on 4 -> replicated on 4 others: each receives everything.
    assert reshard_bytes(arr, NamedSharding(a, P()), NamedSharding(b, P())) == 4 * n
    # sharded over 8 -> replicated over the same 8: each receives the 7/8 it lacks.
    assert reshard_bytes(arr, NamedSharding(full, P("x")), NamedSharding(full, P())) == 7 * n
    # replicated -> sharded on the same devices: nothing moves.
    assert reshard_bytes(arr, NamedSharding(full, P()), NamedSharding(full, P("x"))) == 0
    # sharded on rows -> on columns, same 8 devices: each keeps 1/64 of the array, receives 7/64.
    assert reshard_bytes(arr, NamedSharding(full, P("x", None)), NamedSharding(full, P(None, "x"))) == 8 * 7 * n // 64


def test_plan_reports_bytes_for_cost_model(setup):
    state, train, gen = setup
    x = jax.device_put(state, train.params(state))
    plan = Resharder().plan(x, gen.params(state))
    assert plan.bytes_total == sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(state))
    # disjoint devices: every destination block is received in full (replicated ones 4 times)
    per_device = {"embed": 16 * 8 // 2, "wq": 2 * 8 * 4 * 2 // 2, "norm": 8, "scale": 1, "count": 6}
    assert plan.bytes_moved == 4 * 4 * sum(per_device.values())
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    assert plan.bytes_moved == reshard_bytes(abstract, train.params(state), gen.params(state)) > 0
    assert "moved" in plan.summary()


@pytest.mark.parametrize(
    "src_spec,dst_spec", [(P("x", None), P(None, "x")), (P(("x", "y")), P("y", "x")), (P(), P("y")), (P("y", "x"), P())]
)
def test_abstract_bytes_agree_with_device_count(src_spec, dst_spec):
    """The device-free count (for the cost model) equals the one from JAX's own index maps."""
    from rpeg_jax.sharding.reshard import reshard_bytes_abstract

    devs = jax.devices()
    shape = (16, 8)
    arr = jax.ShapeDtypeStruct(shape, jnp.float32)
    m = make_mesh({"x": 2, "y": 4}, devs)
    other_a, other_b = make_mesh({"x": 2, "y": 2}, devs[:4]), make_mesh({"x": 2, "y": 2}, devs[4:])
    sizes, small = {"x": 2, "y": 4}, {"x": 2, "y": 2}
    assert reshard_bytes_abstract(shape, 4, src_spec, sizes, dst_spec, sizes, True) == reshard_bytes(
        arr, NamedSharding(m, src_spec), NamedSharding(m, dst_spec)
    )
    assert reshard_bytes_abstract(shape, 4, src_spec, small, dst_spec, small, False) == reshard_bytes(
        arr, NamedSharding(other_a, src_spec), NamedSharding(other_b, dst_spec)
    )
