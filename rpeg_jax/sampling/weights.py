"""Weights handling for the sampler: split a model into (graphdef, params), the compiled-parameter
signature that `Sampler.update_weights` checks new weights against, and a compile counter.

Params are jit *arguments* of every device function, so swapping in weights with the same tree,
shapes, dtypes (weak types included) and shardings reuses the compiled executables. Anything else
would silently recompile (or fail on device), so `ParamSignature.check` raises a ValueError naming
the first mismatching parameter before anything runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def as_params(obj: Any) -> tuple[Any, Any]:
    """(graphdef or None, params) from an nnx Module, or (None, obj) for a params pytree/State."""
    if isinstance(obj, nnx.Module):
        graphdef, params, rest = nnx.split(obj, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(
                "sampler: the model has non-Param state "
                f"({[jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0]]});"
                " only nnx.Param variables are supported"
            )
        return graphdef, params
    return None, obj


def _describe(x) -> tuple:
    if not isinstance(x, jax.Array):
        return ("not a jax.Array", type(x).__name__)
    return (tuple(x.shape), jnp.dtype(x.dtype).name, bool(getattr(x, "weak_type", False)), x.sharding)


class ParamSignature:
    """Tree structure plus (shape, dtype, weak_type, sharding) of every parameter."""

    def __init__(self, treedef, leaves: list[tuple[str, tuple]]):
        self.treedef, self.leaves = treedef, leaves

    @classmethod
    def of(cls, params) -> "ParamSignature":
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        return cls(treedef, [(jax.tree_util.keystr(p), _describe(x)) for p, x in flat])

    def check(self, params) -> None:
        other = ParamSignature.of(params)
        if other.treedef != self.treedef:
            mine = {p for p, _ in self.leaves}
            theirs = {p for p, _ in other.leaves}
            raise ValueError(
                f"update_weights: parameter tree differs from the compiled one "
                f"(missing {sorted(mine - theirs)[:5]}, unexpected {sorted(theirs - mine)[:5]})"
            )
        names = ("shape", "dtype", "weak_type", "sharding")
        for (path, want), (_, got) in zip(self.leaves, other.leaves):
            if got[0] == "not a jax.Array":
                raise ValueError(f"update_weights: {path} is a {got[1]}, not a jax.Array with sharding {want[3]}")
            for name, w, g in zip(names, want, got):
                same = w == g or (name == "sharding" and g.is_equivalent_to(w, len(want[0])))
                if not same:
                    raise ValueError(
                        f"update_weights: {path}: {name} {g} differs from the compiled {w} "
                        "(new weights must match the sampler's to avoid recompiling)"
                    )


class CompileCounter:
    """Counts, in this process, jit cache misses (`count`: every miss traces the function, whether or
    not a persistent compilation cache then spares the XLA compile) and XLA backend compilations
    (`backend`), from jax.monitoring events."""

    def __init__(self):
        self.count = 0
        self.backend = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == TRACE_EVENT:
            self.count += 1
        elif event == BACKEND_COMPILE_EVENT:
            self.backend += 1
