"""Logical axis names and the activation-constraint hook that model code calls.

Model code names what a dimension *is* (`batch`, `seq`, `embed`, ...), never where it goes. A
rules context (`use_rules`) maps logical names to mesh axes; outside one, `constrain` is the
identity, so models run unchanged on one device. This module is the only part of `sharding`
that `models`, `rl` and `data` may import.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
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


def _names(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, 'a' or ('a', 'b')) as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclass(frozen=True)
class ExpertLayout:
    """Where a mixture's experts and tokens live, for models/moe.py's expert-parallel dispatch.

    `expert`: the mesh axes the experts' dimension is split over (each device holds X / prod of
    them whole experts); `mlp`: the mesh axes each expert's width F is split over (partial sums,
    reduced after the down projection); `tokens`: the PartitionSpec entries of the [B, T] token
    dimensions. `mesh`: a concrete mesh, or None for the context's (inside an enclosing shard_map,
    e.g. the sampler's over `data`)."""

    expert: tuple[str, ...]
    mlp: tuple[str, ...] = ()
    tokens: tuple[Any, Any] = (None, None)
    mesh: Any = None

    @property
    def token_axes(self) -> tuple[str, ...]:
        return _names(self.tokens[0]) + _names(self.tokens[1])


_EXPERTS: contextvars.ContextVar[ExpertLayout | None] = contextvars.ContextVar("rpeg_expert_layout", default=None)


@contextlib.contextmanager
def use_experts(layout: ExpertLayout | None):
    """Within the context, a mixture's experts are dispatched by `layout` (the sampler sets one
    from its parameters' placement; under `use_resolver` the rules give it: `expert_layout`)."""
    token = _EXPERTS.set(layout)
    try:
        yield
    finally:
        _EXPERTS.reset(token)


def expert_layout(experts_shape_XxDxF: tuple[int, ...], tokens_shape_BxTxD: tuple[int, ...]) -> ExpertLayout | None:
    """The layout of a sparse MLP's experts [X, D, F] and tokens [B, T, D]: the one set by
    `use_experts`, else the one the active rules give the logical axes (EXPERT, EMBED, MLP) and
    (BATCH, SEQ, EMBED); None when no mesh axis splits the experts (or no rules are active)."""
    given = _EXPERTS.get()
    if given is not None:
        return given if given.expert else None
    resolver = _ACTIVE.get()
    if resolver is None:
        return None
    w = resolver((EXPERT, EMBED, MLP), tuple(experts_shape_XxDxF))
    t = resolver((BATCH, SEQ, EMBED), tuple(tokens_shape_BxTxD))
    if w is None or t is None or not hasattr(w, "spec"):
        return None
    spec = tuple(w.spec) + (None,) * (3 - len(w.spec))
    tspec = tuple(t.spec) + (None,) * (3 - len(t.spec))
    if not _names(spec[0]):
        return None
    return ExpertLayout(_names(spec[0]), _names(spec[2]), (tspec[0], tspec[1]), w.mesh)
