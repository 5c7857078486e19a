"""Batch reordering and splitting that also works under JAX's explicit-sharding mode.

With `AxisType.Explicit` mesh axes a gather or a reshape of a sharded batch dimension needs its
output sharding spelled out; here it keeps the batch axis where it was (a permutation stays
sharded like its input; [B, ...] -> [n, B/n, ...] puts the sharding on the B/n axis, and the
pieces are strided so that each one is spread over all data devices). Without a mesh, or with
Auto axes, these are the plain jnp operations.

Group mode (`group_size` G > 1, unsharded batches only): the batch holds groups of G
consecutive rows (G responses to one prompt); permutations and splits move whole groups, so every
minibatch and micro-batch keeps its groups intact and a forward pass can run each group's prompt
once (models/prefix.py).

Called by: rl.update (minibatches, per-epoch shuffles, micro-batches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rpeg_jax.sharding.axes import explicit_spec


def take_rows(x, index):
    """x[index] along axis 0, keeping x's sharding."""
    spec = explicit_spec(x)
    if spec is None:
        return x[index]
    return x.at[index].get(out_sharding=jax.P(*spec))


def _axis_size(x, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    shape = jax.typeof(x).sharding.mesh.shape
    size = 1
    for n in names:
        size *= shape[n]
    return size


def split_rows(x, n: int):
    """[B, ...] -> [n, B/n, ...], strided: piece k = rows k, k+n, k+2n, ...

    Strided (not contiguous) so that, with the batch sharded in contiguous blocks over the data
    devices, every piece is spread evenly over all of them and no rows move between devices."""
    b = x.shape[0]
    rest = tuple(x.shape[1:])
    spec = explicit_spec(x)
    if spec is None:
        return x.reshape((b // n, n) + rest).swapaxes(0, 1)
    devices = _axis_size(x, spec[0])
    if (b // n) % devices:
        raise ValueError(
            f"cannot split a batch of {b} rows sharded over {devices} devices ({spec[0]!r}) into "
            f"{n} pieces: each piece of {b // n} rows must divide evenly over the devices "
            f"(lower rl.minibatches / rl.micro_batches or raise the batch size)"
        )
    y = jax.lax.reshape(x, (b // n, n) + rest, out_sharding=jax.P(spec[0], None, *spec[1:]))
    return y.swapaxes(0, 1)


def split_groups(x, n: int, group_size: int):
    """[B, ...] -> [n, B/n, ...] in whole groups of `group_size` consecutive rows, strided over
    groups: piece k = groups k, k+n, k+2n, ... (unsharded batches only)."""
    if explicit_spec(x) is not None:
        raise ValueError("split_groups: group mode needs an unsharded batch")
    b, rest = x.shape[0], tuple(x.shape[1:])
    y = x.reshape((b // (group_size * n), n, group_size) + rest).swapaxes(0, 1)
    return y.reshape((n, b // n) + rest)


def group_permutation(key, b: int, group_size: int):
    """A row index that permutes whole groups of `group_size` consecutive rows."""
    groups = jax.random.permutation(key, b // group_size)
    return (groups[:, None] * group_size + jnp.arange(group_size)).reshape(-1)


def permute_tree(tree, index):
    return jax.tree.map(lambda x: take_rows(x, index), tree)


def split_tree(tree, n: int, group_size: int = 1):
    if group_size > 1:
        return jax.tree.map(lambda x: split_groups(x, n, group_size), tree)
    return jax.tree.map(lambda x: split_rows(x, n), tree)


def merge_rows(y, group_size: int = 1):
    """The inverse of split_rows / split_groups: [n, B/n, ...] -> [B, ...] in the original order."""
    n, m, rest = y.shape[0], y.shape[1], tuple(y.shape[2:])
    if group_size > 1:
        return y.reshape((n, m // group_size, group_size) + rest).swapaxes(0, 1).reshape((n * m,) + rest)
    x = y.swapaxes(0, 1)
    spec = explicit_spec(x)
    if spec is None:
        return x.reshape((n * m,) + rest)
    return jax.lax.reshape(x, (n * m,) + rest, out_sharding=jax.P(spec[0], *spec[2:]))


def replicated(x):
    """x with every axis unsharded (a reshard under explicit sharding, else x itself)."""
    if explicit_spec(x) is None:
        return x
    return jax.reshard(x, jax.P())
