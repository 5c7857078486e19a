"""Training passes with each group's shared prompt computed once (GRPO-style groups).

In the rollout layout a batch of B = groups x G rows holds G responses to the same prompt, rows
of a group consecutive, prompts left-padded to P and responses right-padded to R. The plain pass
(`token_logprobs` over [B, P + R]) runs the decoder over every row's copy of the prompt. Here the
prompt runs once per group and the responses attend to it; one packed row per group:

    packed tokens [n, P + G·(R - 1)], n = B / G groups:  [prompt | resp_1 | ... | resp_G]

(the batch axis stays the groups, so a data-sharded batch stays sharded the same way).
Only R - 1 response columns are inputs: response token i is predicted from the hidden state of
the token before it (the prompt's last column for i = 0), and the last response token predicts
nothing. `GroupPrefixAttention` lets prompt tokens attend causally within their prompt and each
response token to its group's prompt plus its own earlier tokens: the same keys as the plain
pass's causal same-segment mask, so the results agree to float32 rounding, with every
model.attention implementation (through a mask for xla and cudnn, through the kernel's segment
ids for pallas: `GroupPrefixAttention`).

A row whose prompt columns (tokens, positions, segments) differ from its group's first row gets
NaN logprobs, so the update's NaN guard skips the step rather than training on a wrong prompt.

Called by: runtime/kernels.py (forward_fn) for scoring passes and updates when rows are grouped.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from rpeg_jax.models.attention import gqa_attention, pallas_segment_attention, sdpa_attention, segment_attention
from rpeg_jax.models.logprobs import chunked_logprobs


@dataclass(frozen=True)
class GroupPrefixAttention:
    """Attention over packed group rows [prompt | resp_1 | ... | resp_G] (see the module docstring).

    The prompt part is `segment_attention` over [n, P] (causal within the prompt's segments). The
    responses, by implementation (`impl`, a resolved model.attention):
    - xla, cudnn: a mask. Queries are each row's R response columns, keys its group's P prompt
      keys then its own R keys: mask [B, R, P + R] = (prompt key real) | (own key real, causal);
      xla runs `gqa_attention` over it, cudnn hands it to jax.nn.dot_product_attention (no
      is_causal: the diagonal sits P columns right of the kernel's top-left one).
    - pallas: the kernel's segment ids (it takes no mask and one id array for queries and keys of
      equal length): each response row becomes a [P + R] row (its group's prompt keys and values
      repeated, zero queries in the prompt columns, whose outputs are dropped) with id 1 at real
      tokens and 0 at padding, causal. A real response token then sees exactly the keys of the
      mask above; the price is the P dropped query columns per row.
    """

    prompt_seg_NxP: jax.Array  # segment ids of each group's prompt (0 = padding)
    resp_seg_BxR: jax.Array  # segment ids of each row's response input columns
    impl: str = "xla"
    interpret: bool = False

    def __call__(self, q, k, v, *, layer, cache):
        del layer
        n, p = self.prompt_seg_NxP.shape
        b, r = self.resp_seg_BxR.shape
        g = b // n
        split = lambda x: (x[:, :p], x[:, p:].reshape(b, r, *x.shape[2:]))  # noqa: E731
        (qp, qr), (kp, kr), (vp, vr) = split(q), split(k), split(v)
        out_p = segment_attention(qp, kp, vp, self.prompt_seg_NxP, impl=self.impl, interpret=self.interpret)
        # each response row sees its group's prompt keys, then its own keys causally
        keys = jnp.concatenate([jnp.repeat(kp, g, axis=0), kr], axis=1)
        vals = jnp.concatenate([jnp.repeat(vp, g, axis=0), vr], axis=1)
        if self.impl == "pallas":
            queries = jnp.concatenate([jnp.zeros((b, p, *qr.shape[2:]), qr.dtype), qr], axis=1)
            real = jnp.concatenate([jnp.repeat(self.prompt_seg_NxP, g, axis=0), self.resp_seg_BxR], axis=1) != 0
            out_r = pallas_segment_attention(queries, keys, vals, real.astype(jnp.int32), interpret=self.interpret)
            out_r = out_r[:, p:]
        else:
            prompt_ok = jnp.repeat(self.prompt_seg_NxP != 0, g, axis=0)[:, None, :]  # [B, 1, P]
            own = jnp.tril(jnp.ones((r, r), bool))[None] & (self.resp_seg_BxR != 0)[:, None, :]
            mask = jnp.concatenate([jnp.broadcast_to(prompt_ok, (b, r, p)), own], axis=2)
            if self.impl == "cudnn":
                out_r = sdpa_attention(qr, keys, vals, mask, causal=False)
            else:
                out_r = gqa_attention(qr, keys, vals, mask)
        out = jnp.concatenate([out_p, out_r.reshape(n, g * r, *out_r.shape[2:])], axis=1)
        return out, cache


jax.tree_util.register_dataclass(
    GroupPrefixAttention, data_fields=["prompt_seg_NxP", "resp_seg_BxR"], meta_fields=["impl", "interpret"]
)


def _prompt_mismatch(x_BxP, group_size: int):
    """[B] bool: the row's prompt columns differ from its group's first row."""
    b, p = x_BxP.shape
    x = x_BxP.reshape(b // group_size, group_size, p)
    return jnp.any(x != x[:, :1], axis=-1).reshape(b)


def group_hidden(model, tokens_BxS, positions_BxS, segment_ids_BxS, *, response_len: int, group_size: int):
    """(h_BxRxD, bad_B): the final hidden state that predicts each response token (column P-1+i of
    the plain pass), with every group's prompt run once; bad_B marks rows whose prompt differs
    from their group's first row (their hidden states are NaN). Needs B % group_size == 0 and response_len >= 2."""
    b, s = tokens_BxS.shape
    r, g = response_len, group_size
    p = s - r
    if b % g or r < 2 or p < 1:
        raise ValueError(
            f"group_hidden: batch {b} rows, group_size {g}, response_len {r}, prompt {p}: "
            f"needs B % group_size == 0, response_len >= 2 and a prompt column"
        )
    cols = lambda x, lo, hi: jax.lax.slice_in_dim(jnp.asarray(x, jnp.int32), lo, hi, axis=1)  # noqa: E731
    prompt = [cols(x, 0, p) for x in (tokens_BxS, positions_BxS, segment_ids_BxS)]
    resp = [cols(x, p, s - 1) for x in (tokens_BxS, positions_BxS, segment_ids_BxS)]
    bad = _prompt_mismatch(prompt[0], g) | _prompt_mismatch(prompt[1], g) | _prompt_mismatch(prompt[2], g)
    firsts = [x[::g] for x in prompt]  # [n, P] each
    n = b // g
    packed = [jnp.concatenate([f, x.reshape(n, g * (r - 1))], axis=1) for f, x in zip(firsts, resp)]
    attention = GroupPrefixAttention(
        firsts[2], resp[2], impl=model.attention_impl(packed[0]), interpret=model.cfg.attention_interpret
    )
    h, _ = model.hidden(packed[0], packed[1], packed[2], attention=attention)
    h_prompt_last = h[:, p - 1]  # [n, D]: the prompt's last column of each group
    h_resp = h[:, p:].reshape(b, r - 1, -1)
    h_pred = jnp.concatenate([jnp.repeat(h_prompt_last, g, axis=0)[:, None], h_resp], axis=1)
    return jnp.where(bad[:, None, None], jnp.nan, h_pred), bad


def group_token_logprobs(
    model,
    tokens_BxS,
    positions_BxS,
    segment_ids_BxS,
    *,
    response_len: int,
    group_size: int,
    chunk: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_hidden: bool = False,
):
    """`token_logprobs(..., targets=tokens shifted, start=P-1, length=R)` with the prompt computed
    once per group: log p(response token i | prompt, response[:i]) float32 [B, R] (NaN on rows
    whose prompt differs from their group's), optionally entropies and the predicting hidden states."""
    h, _ = group_hidden(
        model, tokens_BxS, positions_BxS, segment_ids_BxS, response_len=response_len, group_size=group_size
    )
    s = tokens_BxS.shape[1]
    targets = jax.lax.slice_in_dim(jnp.asarray(tokens_BxS, jnp.int32), s - response_len, s, axis=1)
    logp, ent = chunked_logprobs(
        h, model.output_matrix(), targets, chunk=chunk, temperature=temperature, with_entropy=with_entropy
    )
    return (logp, ent, h) if return_hidden else (logp, ent)
