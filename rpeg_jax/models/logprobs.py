"""Per-token log-probabilities (and entropies) without holding full float32 logits at once.

The first out-of-memory users of RL trainers hit is materialising [B, T, V] float32 logits
(V = 152k for Qwen). Here the unembedding, log-softmax and gather run over chunks of the
sequence under `jax.checkpoint`, so the forward keeps one chunk of logits alive and the
backward recomputes each chunk instead of storing it. Only the response window
[start, start + length) is unembedded: prompt logits are never computed.

Called by: rl policy functions (actor/critic stages), the sampler parity tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rpeg_jax.models.dense import dense
from rpeg_jax.shapes.logits import logits_chunk


def _chunk_logprobs(h_BxCxD, w_DxV, targets_BxC, temperature: float, with_entropy: bool):
    """(log p[target], entropy or None) of one chunk, float32 [B, C]."""
    logits = dense(h_BxCxD, w_DxV, preferred_element_type=jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit by a one-hot select (its gradient is a select too; a gather's is a scatter).
    hit = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets_BxC[..., None]
    logp = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1) - logz
    if not with_entropy:
        return logp, None
    probs = jnp.exp(logits - logz[..., None])
    return logp, logz - jnp.sum(probs * logits, axis=-1)


def chunked_logprobs(
    h_BxNxD, w_DxV, targets_BxN, *, chunk: int | None = None, temperature: float = 1.0, with_entropy: bool = False
):
    """log softmax(h·W / temperature)[target] per position, optionally the entropy, float32 [B, N].

    Always a `lax.map` over chunks, even when one chunk covers all N positions: the map body is
    compiled as its own computation, so a scoring pass (π_old, π_ref) and the update's forward get
    bitwise-identical logprobs (the on-policy ratio is exactly 1). Inlined, the rounding depended on
    the program around it (seen on a 4-device mesh), and in a zero-advantage step that noise is the
    whole gradient, which Adam's first step scales up to ±lr.
    """
    b, n, _ = h_BxNxD.shape
    v = w_DxV.shape[1]
    w = w_DxV.astype(h_BxNxD.dtype)
    targets_BxN = targets_BxN.astype(jnp.int32)
    if chunk is None:
        chunk = logits_chunk(b, n, v)
    num = -(-n // chunk)
    pad = num * chunk - n
    h = jnp.pad(h_BxNxD, ((0, 0), (0, pad), (0, 0)))
    tg = jnp.pad(targets_BxN, ((0, 0), (0, pad)))
    h = h.reshape(b, num, chunk, -1).swapaxes(0, 1)  # [num, B, C, D]
    tg = tg.reshape(b, num, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        logp, ent = _chunk_logprobs(hc, w, tc, temperature, with_entropy)
        return logp, (ent if with_entropy else jnp.zeros_like(logp))

    logp, ent = jax.lax.map(one, (h, tg))
    logp = logp.swapaxes(0, 1).reshape(b, num * chunk)[:, :n]
    ent = ent.swapaxes(0, 1).reshape(b, num * chunk)[:, :n]
    return logp, (ent if with_entropy else None)


def token_logprobs(
    model,
    tokens_BxT,
    positions_BxT,
    segment_ids_BxT,
    targets_BxT,
    *,
    start: int = 0,
    length: int | None = None,
    chunk: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_hidden: bool = False,
):
    """log p(targets[:, start+i] | tokens[:, :start+i+1]) for i < length, float32 [B, length].

    `targets_BxT` is usually the tokens shifted left by one. With `return_hidden` the final
    hidden states of the window are returned too (for a value head on a shared backbone).
    """
    t = tokens_BxT.shape[1]
    length = t - start if length is None else length
    if not (0 <= start and start + length <= t):
        raise ValueError(f"token_logprobs: window [{start}, {start + length}) outside sequence length {t}")
    h, _ = model.hidden(tokens_BxT, positions_BxT, segment_ids_BxT)
    h = jax.lax.slice_in_dim(h, start, start + length, axis=1)
    tg = jax.lax.slice_in_dim(jnp.asarray(targets_BxT), start, start + length, axis=1)
    logp, ent = chunked_logprobs(
        h, model.output_matrix(), tg, chunk=chunk, temperature=temperature, with_entropy=with_entropy
    )
    return (logp, ent, h) if return_hidden else (logp, ent)
