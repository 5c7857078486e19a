"""Matrix products as plain 2-D GEMMs, and a small-vocabulary embedding lookup as a GEMM.

Why this file exists: XLA:CPU lowers `einsum("btd,df->btf")` fine in the forward pass, but the
weight gradient JAX derives from it contracts over two axes (b, t), which XLA:CPU lowers with a
transposed copy of an operand and a slower dot (about 2x slower backward on the tiny model T).
Flattening the leading axes first (`[B*T, D] @ [D, F]`) gives every product of forward and
backward one plain GEMM. When an operand carries explicit (sharding-in-types) mesh axes the
flattening could move shards, so the einsum form is kept there.

Called by: models/llama.py (projections, embedding), models/logprobs.py (unembedding).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ONEHOT_MAX_VOCAB = 1024  # vocabularies up to this size embed by one-hot GEMM (its backward is a GEMM, not a scatter)


def explicitly_sharded(*xs) -> bool:
    """True when any of `xs` has an axis sharded over an explicit mesh axis (sharding in types)."""
    for x in xs:
        spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
        if spec is not None and any(s is not None for s in spec):
            return True
    return False


def dense(x, w, contract: int = 1, *, preferred_element_type=None, precision=None):
    """Σ over the last `contract` axes of x and the first `contract` axes of w.

    x [..., I1..Ic], w [I1..Ic, O...] -> [..., O...], computed as one [M, K] @ [K, N] product.
    """
    lead, inner, out = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:], w.shape[contract:]
    if inner != w.shape[:contract]:
        raise ValueError(f"dense: x {x.shape} and w {w.shape} disagree on the {contract} contracted axes")
    if explicitly_sharded(x, w):
        dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
        return jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=preferred_element_type)
    k = math.prod(inner)
    y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), precision=precision,
                   preferred_element_type=preferred_element_type)
    return y.reshape(*lead, *out)


def embed_lookup(table_VxD, tokens, dtype):
    """table[tokens] in `dtype`. For a small vocabulary a one-hot GEMM (exact: each output is one
    table entry times 1.0, summed with zeros) so that the gradient is a GEMM instead of a
    serial scatter-add; a gather otherwise."""
    v = table_VxD.shape[0]
    if v > ONEHOT_MAX_VOCAB or explicitly_sharded(table_VxD, tokens):
        return jnp.take(table_VxD, tokens, axis=0).astype(dtype)
    onehot = jax.nn.one_hot(tokens, v, dtype=table_VxD.dtype)
    # HIGHEST: a GPU may otherwise round float32 operands to TF32, and the lookup must be exact.
    return dense(onehot, table_VxD, precision=jax.lax.Precision.HIGHEST).astype(dtype)
