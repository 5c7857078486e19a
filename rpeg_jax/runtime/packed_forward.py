"""The training forward over packed rows (train.pack_sequences; the plan: rl/packing.py).

`packed_outputs(model, batch, plan)` runs the decoder over the plan's N packed rows of S columns
(each holding several sequences' real tokens, attention causal within each sequence's segment,
positions restarting per sequence) instead of the batch's b padded rows, puts only the K hidden
states that predict a response token through the LM head (and the value head), and returns
logp / entropy / values in the padded response window [b, R], like the plain pass
(`token_logprobs(..., start=P-1, length=R)`) at every real response token, to float32 rounding;
0 at cells without a real target token.

Called by: runtime/kernels.py (the update stages' forward when train.pack_sequences is on).
"""

from __future__ import annotations

import jax.numpy as jnp

from rpeg_jax.models.logprobs import chunked_logprobs
from rpeg_jax.rl import packing


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
) -> dict:
    """{"logp", "entropy", "values"} [b, R] float32 (None where not asked) from the packed pass."""
    tok, pos = packing.pack_rows(plan, jnp.asarray(tokens_BxS, jnp.int32), jnp.asarray(positions_BxS, jnp.int32))
    h, _ = model.hidden(tok, pos, plan["seg_NxT"])
    h_K = packing.predicting(plan, h)  # [K, D]
    out = {"logp": None, "entropy": None, "values": None}
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


def packed_forward_fn(
    graphdef, *, temperature: float, logp: bool, entropy: bool, values: bool, routing: str = "recompute", router=False
):
    """(params, micro-batch) -> packed_outputs over the micro-batch's plan (rl.packing.PLAN_KEY):
    the update's policy_fn under train.pack_sequences (runtime/kernels.py). `routing` / `router`
    (a MoE model's) do not apply: the run config keeps MoE models off packing (config/run.py)."""
    del routing, router
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
        )

    return fn
