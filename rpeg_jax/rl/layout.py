"""Batch reordering and splitting that also works under JAX's explicit-sharding mode.

With `AxisType.Explicit` mesh axes a gather or a reshape of a sharded batch dimension needs its
output sharding spelled out; here it keeps the batch axis where it was (a permutation stays
sharded like its input; [B, ...] -> [n, B/n, ...] puts the sharding on the B/n axis). Without a
mesh, or with Auto axes, these are the plain jnp operations.

Called by: rl.update (minibatches, per-epoch shuffles, micro-batches).
"""

from __future__ import annotations

import jax


def explicit_spec(x):
    """x's PartitionSpec when some of its axes are explicitly sharded, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(s is None for s in spec):
        return None
    return tuple(spec) + (None,) * (x.ndim - len(spec))


def take_rows(x, index):
    """x[index] along axis 0, keeping x's sharding."""
    spec = explicit_spec(x)
    if spec is None:
        return x[index]
    return x.at[index].get(out_sharding=jax.P(*spec))


def split_rows(x, n: int):
    """[B, ...] -> [n, B/n, ...] (row-major: piece k = rows k·B/n ... (k+1)·B/n - 1)."""
    shape = (n, x.shape[0] // n) + tuple(x.shape[1:])
    spec = explicit_spec(x)
    if spec is None:
        return x.reshape(shape)
    return jax.lax.reshape(x, shape, out_sharding=jax.P(None, *spec))


def permute_tree(tree, index):
    return jax.tree.map(lambda x: take_rows(x, index), tree)


def split_tree(tree, n: int):
    return jax.tree.map(lambda x: split_rows(x, n), tree)


def replicated(x):
    """x with every axis unsharded (a reshard under explicit sharding, else x itself)."""
    if explicit_spec(x) is None:
        return x
    return jax.reshard(x, jax.P())
