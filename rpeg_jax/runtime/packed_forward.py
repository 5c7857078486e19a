"""The training forward over packed rows (train.pack_sequences; the plan: rl/packing.py).

`packed_outputs(model, batch, plan)` runs the decoder over the plan's N packed rows of S columns
(each holding several sequences' real tokens, attention causal within each sequence's segment,
positions restarting per sequence) instead of the batch's b padded rows, puts only the K hidden
states that predict a response token through the LM head (and the value head), and returns
logp / entropy / values in the padded response window [b, R], like the plain pass
(`token_logprobs(..., start=P-1, length=R)`) at every real response token, to float32 rounding;
0 at cells without a real target token.

A mixture of experts runs packed too: routing is per token, so the packed rows route every real
token as its padded row does (to float32 rounding); the sampler's expert records are gathered into
the packed rows like the tokens (replay imposes them, -1 in empty slots), and the routing metrics
(aux loss, agreements: runtime/routing.router_stats) are taken over the packed rows' real tokens,
the same set of tokens as the padded rows' (tests/test_moe_rl.py holds them equal).

Called by: runtime/kernels.py (the update stages' forward when train.pack_sequences is on).
"""

from __future__ import annotations

import jax.numpy as jnp

from rpeg_jax.models.logprobs import chunked_logprobs
from rpeg_jax.rl import packing
from rpeg_jax.runtime.routing import EXPERTS, router_stats


def packed_outputs(
    model,
    tokens_BxS,
    positions_BxS,
    plan: dict,
    *,
    temperature: float = 1.0,
    logp: bool = True,
    entropy: bool = False,
    values: bool = False,
    experts_BxSxLxK=None,
    replay: bool = False,
    router: bool = False,
) -> dict:
    """{"logp", "entropy", "values"} [b, R] float32 (None where not asked) from the packed pass.
    A MoE model: `experts_BxSxLxK` (the sampler's records) are imposed with `replay`, and `router`
    adds {"router": router_stats(...)} over the packed rows."""
    tok, pos = packing.pack_rows(plan, jnp.asarray(tokens_BxS, jnp.int32), jnp.asarray(positions_BxS, jnp.int32))
    out = {"logp": None, "entropy": None, "values": None}
    if any(model.cfg.sparse_layers):
        rec = None if experts_BxSxLxK is None else pack_experts(plan, experts_BxSxLxK)
        h, _, route = model.hidden_routed(tok, pos, plan["seg_NxT"], experts_BxTxSxK=rec if replay else None)
        if router:
            c = {"segment_ids_BxS": plan["seg_NxT"]} | ({} if rec is None else {EXPERTS: rec})
            out["router"] = router_stats(route, c, model.cfg.num_experts_per_tok)
    else:
        h, _ = model.hidden(tok, pos, plan["seg_NxT"])
    h_K = packing.predicting(plan, h)  # [K, D]
    if logp:
        lp, ent = chunked_logprobs(
            h_K[None],
            model.output_matrix(),
            packing.next_tokens(plan, tok)[None],
            temperature=temperature,
            with_entropy=entropy,
        )
        out["logp"] = packing.unpack_response(plan, lp[0])
        if entropy:
            out["entropy"] = packing.unpack_response(plan, ent[0])
    if values:
        out["values"] = packing.unpack_response(plan, model.values(h_K))
    return out


def pack_experts(plan: dict, experts_BxSxLxK):
    """The expert records [b, S, L, k] gathered into the packed rows [N, S, L, k] (-1 in empty slots)."""
    b, s, n_layers, k = experts_BxSxLxK.shape
    src = plan["src_NxT"]
    flat = jnp.reshape(jnp.asarray(experts_BxSxLxK, jnp.int32), (b * s, n_layers, k))
    return jnp.where((src >= 0)[..., None, None], flat[jnp.maximum(src, 0)], -1)


def packed_forward_fn(
    graphdef, *, temperature: float, logp: bool, entropy: bool, values: bool, routing: str = "recompute", router=False
):
    """(params, micro-batch) -> packed_outputs over the micro-batch's plan (rl.packing.PLAN_KEY):
    the update's policy_fn under train.pack_sequences (runtime/kernels.py). A MoE model's
    `routing` ("replay" imposes the micro-batch's EXPERTS records) and `router` (the routing
    metrics) as in the plain pass (runtime/kernels.forward_fn)."""
    from flax import nnx  # noqa: PLC0415

    def fn(params, mb):
        if packing.PLAN_KEY not in mb:
            raise ValueError("train.pack_sequences: the update's micro-batch carries no packing plan")
        model = nnx.merge(graphdef, params)
        return packed_outputs(
            model,
            mb["tokens_BxS"],
            mb["positions_BxS"],
            mb[packing.PLAN_KEY],
            temperature=temperature,
            logp=logp,
            entropy=entropy,
            values=values,
            experts_BxSxLxK=mb.get(EXPERTS),
            replay=routing == "replay",
            router=router,
        )

    return fn
