"""Logical axis names and the activation-constraint hook that model code calls.

Model code names what a dimension *is* (`batch`, `seq`, `embed`, ...), never where it goes. A
rules context (`use_rules`) maps logical names to mesh axes; outside one, `constrain` is the
identity, so models run unchanged on one device. This module is the only part of `sharding`
that `models`, `rl` and `data` may import.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Sequence

# The logical axes used by rpeg_jax models (parameters and activations).
BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS, EXPERT = (
    "batch",
    "seq",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "layers",
    "expert",  # a mixture of experts' expert dimension (models/moe.py)
)
LOGICAL_AXES = (BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS, EXPERT)

Axes = tuple[str | None, ...]

# A resolver: (logical axes of an activation, its shape) -> a sharding (or None to leave it).
_ACTIVE: contextvars.ContextVar[Callable[[Axes, tuple[int, ...]], Any] | None] = contextvars.ContextVar(
    "rpeg_activation_resolver", default=None
)


@contextlib.contextmanager
def use_resolver(resolver: Callable[[Axes, tuple[int, ...]], Any] | None):
    """Within the context, `constrain(x, axes)` applies `resolver(axes, x.shape)` as a sharding
    constraint. The sharding package builds resolvers from a mesh and rules."""
    token = _ACTIVE.set(resolver)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, axes: Sequence[str | None]):
    """Annotate activation `x` with logical `axes` (one per dimension)."""
    resolver = _ACTIVE.get()
    if resolver is None:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} logical axes {tuple(axes)} for an array of shape {x.shape}")
    sharding = resolver(tuple(axes), tuple(x.shape))
    if sharding is None:
        return x
    import jax

    return jax.lax.with_sharding_constraint(x, sharding)


def explicit_spec(x) -> tuple | None:
    """x's PartitionSpec entries, one per dimension, when some dimension is sharded over an explicit
    mesh axis (sharding in types: the layout is part of the array's type); None otherwise (no mesh,
    Auto axes, or fully replicated)."""
    import jax

    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None or all(s is None for s in spec):
        return None
    return tuple(spec) + (None,) * (x.ndim - len(spec))
