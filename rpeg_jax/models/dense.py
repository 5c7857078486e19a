"""Matrix products as plain 2-D GEMMs, and a small-vocabulary embedding lookup as a GEMM.

Why this file exists: XLA:CPU lowers `einsum("btd,df->btf")` fine in the forward pass, but the
weight gradient JAX derives from it contracts over two axes (b, t), which XLA:CPU lowers with a
transposed copy of an operand and a slower dot (about 2x slower backward on the tiny model T).
Flattening the leading axes first (`[B*T, D] @ [D, F]`) gives every product of forward and
backward one plain GEMM. When an operand carries explicit (sharding-in-types) mesh axes the
flattening could move shards, so the product is one dot_general there that states its layout
(`_dense_explicit`; `compute_layout` gathers FSDP-sharded weights before use).

Called by: models/llama.py (projections, embedding), models/logprobs.py (unembedding).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rpeg_jax.sharding.axes import explicit_spec

ONEHOT_MAX_VOCAB = 1024  # vocabularies up to this size embed by one-hot GEMM (its backward is a GEMM, not a scatter)


def explicitly_sharded(*xs) -> bool:
    """True when any of `xs` has an axis sharded over an explicit mesh axis (sharding in types)."""
    return any(explicit_spec(x) is not None for x in xs)


def _spec(x) -> tuple:
    """x's partition spec, one entry per dimension (all None when nothing is explicitly sharded)."""
    return explicit_spec(x) or (None,) * x.ndim


def _names(entry) -> tuple:
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _drop(spec, axes) -> tuple:
    """spec with the mesh axes `axes` removed from every entry."""
    out = []
    for entry in spec:
        kept = tuple(a for a in _names(entry) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)


def compute_layout(w, batch_like):
    """Sharding in types: `w` re-laid-out for use against activations laid out like `batch_like` —
    the mesh axes that shard the batch are gathered out of the weight (FSDP's all-gather before
    use). The identity without explicitly sharded operands."""
    if not explicitly_sharded(w, batch_like):
        return w
    used = set(_names(_spec(batch_like)[0]))
    spec = _spec(w)
    new = _drop(spec, used)
    return w if new == spec else jax.reshard(w, jax.P(*new))


def _dense_explicit(x, w, contract, preferred_element_type, precision):
    """`dense` with sharding in types: the weight is gathered off the batch's mesh axes, its
    contracted dimensions take x's layout, and a contraction sharded on both sides is summed across
    devices (the output states its layout: x's leading dimensions, then w's output dimensions)."""
    w = compute_layout(w, x)
    xs, ws = _spec(x), _spec(w)
    lead, inner = xs[: x.ndim - contract], xs[x.ndim - contract :]
    used_lead = {a for e in lead for a in _names(e)}
    if ws[:contract] != inner:  # put w's contracted dimensions on x's layout
        w = jax.reshard(w, jax.P(*inner, *_drop(ws[contract:], {a for e in inner for a in _names(e)})))
        ws = _spec(w)
    out_spec = lead + _drop(ws[contract:], used_lead)
    dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
    return jax.lax.dot_general(
        x, w, dims, precision=precision, preferred_element_type=preferred_element_type, out_sharding=jax.P(*out_spec)
    )


def dense(x, w, contract: int = 1, *, preferred_element_type=None, precision=None):
    """Σ over the last `contract` axes of x and the first `contract` axes of w.

    x [..., I1..Ic], w [I1..Ic, O...] -> [..., O...], computed as one [M, K] @ [K, N] product.
    """
    lead, inner, out = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :], w.shape[contract:]
    if inner != w.shape[:contract]:
        raise ValueError(f"dense: x {x.shape} and w {w.shape} disagree on the {contract} contracted axes")
    if explicitly_sharded(x, w):
        return _dense_explicit(x, w, contract, preferred_element_type, precision)
    k = math.prod(inner)
    y = jnp.matmul(
        x.reshape(-1, k), w.reshape(k, -1), precision=precision, preferred_element_type=preferred_element_type
    )
    return y.reshape(*lead, *out)


def embed_lookup(table_VxD, tokens, dtype):
    """table[tokens] in `dtype`. For a small vocabulary a one-hot GEMM (exact: each output is one
    table entry times 1.0, summed with zeros) so that the gradient is a GEMM instead of a
    serial scatter-add; a gather otherwise."""
    v = table_VxD.shape[0]
    if explicitly_sharded(table_VxD, tokens):
        # Sharding in types: the gather's output layout is ambiguous (the table may be sharded over
        # vocab or embed); rows follow the tokens' layout, the embedding dimension is gathered whole
        # (later `constrain` calls place it as the rules say).
        table_VxD = compute_layout(table_VxD, tokens)
        table_VxD = jax.reshard(table_VxD, jax.P(None, _spec(table_VxD)[1]))  # rows gathered whole
        return table_VxD.at[tokens].get(out_sharding=jax.P(*_spec(tokens), _spec(table_VxD)[1])).astype(dtype)
    if v > ONEHOT_MAX_VOCAB:
        return jnp.take(table_VxD, tokens, axis=0).astype(dtype)
    onehot = jax.nn.one_hot(tokens, v, dtype=table_VxD.dtype)
    # HIGHEST: a GPU may otherwise round float32 operands to TF32, and the lookup must be exact.
    return dense(onehot, table_VxD, precision=jax.lax.Precision.HIGHEST).astype(dtype)
