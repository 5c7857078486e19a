"""Sampler outputs -> the rollout batch layout.

B = prompts x G sequences (a prompt's G rows adjacent; with processes sharing each group, a process
holds G / s of them and the global batch is still prompt-major: graph/processes.share_of), prompts
LEFT-padded to P, responses RIGHT-padded to R, S = P + R. `completions` holds global arrays sharded
over `data` (tokens_BxS, positions_BxS, segment_ids_BxS: 1 on real tokens, 0 on padding;
response_mask_BxR, versions_BxR: the policy version of each sampled token; group_ids_B; a MoE
model's experts_BxSxLxK: the experts the sampler routed each token to, rl.routing) plus host-only
`host_*` fields (tokens, mask, prompt, answer, record) for the reward; the behaviour logprobs are a
separate [B, R] array. P and R are bucketed (shapes/buckets.length_bucket: fewer padded tokens, few
distinct compiled shapes) unless the run streams micro-batches, where every piece must have the
configured shape so pieces concatenate; under continuous admission R is rollout.max_new_tokens (a
batch's longest response changes every step, and each new R would compile the training stages
again).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rpeg_jax.runtime.rollout.prompts import StepPrompts
from rpeg_jax.shapes.buckets import length_bucket

HOST_FIELDS = (("prompt", "prompts"), ("answer", "answers"), ("record", "records"))


def lay_out(ctx, rows, gids: np.ndarray, host: dict[str, list], experts=None) -> tuple[dict, Any, int]:
    """Rows (prompt tokens, response tokens, their logprobs, their policy versions) -> the rollout
    layout (module docstring) as this process's share of global arrays, plus host fields; returns
    (completions, behav_logp, new tokens). `experts` (a MoE model's sampler records, one [prompt +
    response, S, k] array per row, sampling.Completion.experts) -> experts_BxSxLxK in the token
    layout (-1 at padding and wherever the sampler ran no token)."""
    cfg, fixed = ctx.cfg, ctx.fixed_shapes
    toks = [np.asarray(t, np.int32) for _, t, _, _ in rows]
    lps = [np.asarray(lp, np.float32) for _, _, lp, _ in rows]
    vers = [np.asarray(v, np.int32) for _, _, _, v in rows]
    longest = np.array([max(len(r[0]) for r in rows), max(len(t) for t in toks)])
    if ctx.placement.gen_count > 1:  # every generating process must lay its rows out with the same P and R
        longest = ctx.placement.gen_allgather(longest).max(axis=0)
    P = length_bucket(int(longest[0]), cfg.data.max_prompt_len if fixed else None)
    # under continuous admission each batch's longest response varies from step to step (whichever
    # groups completed first), so R is the cap: one compiled shape for the training stages
    fixed_r = fixed or ctx.admission == "continuous"
    R = length_bucket(int(longest[1]), cfg.rollout.max_new_tokens if fixed_r else None)
    B = len(rows)
    tokens = np.full((B, P + R), cfg.model.pad_id, np.int32)
    positions = np.zeros((B, P + R), np.int32)
    segments = np.zeros((B, P + R), np.int32)
    mask = np.zeros((B, R), np.float32)
    behav = np.zeros((B, R), np.float32)
    versions = np.zeros((B, R), np.int32)
    for b, (p, *_) in enumerate(rows):
        lp, lr = len(p), len(toks[b])
        tokens[b, P - lp : P] = p
        tokens[b, P : P + lr] = toks[b]
        positions[b, P - lp : P + lr] = np.arange(lp + lr)
        segments[b, P - lp : P + lr] = 1
        mask[b, :lr] = 1.0
        behav[b, :lr] = lps[b]
        versions[b, :lr] = vers[b]
    comps = {
        "tokens_BxS": tokens,
        "positions_BxS": positions,
        "segment_ids_BxS": segments,
        "response_mask_BxR": mask,
        "versions_BxR": versions,
        "group_ids_B": gids,
    }
    if experts is not None:
        rec = np.full((B, P + R, *experts[0].shape[1:]), -1, experts[0].dtype)
        for b, (p, *_) in enumerate(rows):
            e = experts[b][: len(p) + len(toks[b])]
            rec[b, P - len(p) : P - len(p) + len(e)] = e
        comps["experts_BxSxLxK"] = rec
    comps = {k: ctx.placement.put_batch(v) for k, v in comps.items()}
    comps.update(_host_columns(host, tokens, mask))
    return comps, ctx.placement.put_batch(behav), int(mask.sum())


def _host_columns(host: dict[str, list], tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Host columns of rows that come as equal runs per prompt: rl.group_size each, or this process's
    part of each group when processes share the groups (graph/processes.share_of)."""
    n = len(host["prompt"])
    if len(tokens) % max(n, 1) or (len(tokens) and not n):
        raise ValueError(f"{len(tokens)} rollout rows for {n} prompts: not an equal number per prompt")
    pi = np.repeat(np.arange(n), len(tokens) // max(n, 1))
    return {"host_tokens": tokens, "host_mask": mask, **{f"host_{k}": _objects(v, pi) for k, v in host.items()}}


def host_fields(batch, lo: int, hi: int, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Host-side fields of prompts [lo, hi) of a PromptBatch, this process's rows of each (for the reward)."""
    host = {k: [getattr(batch, a)[i] for i in range(lo, hi)] for k, a in HOST_FIELDS}
    return _host_columns(host, tokens, mask)


def stream_host_fields(prompts: StepPrompts, sources, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Host-side fields of the prompts at `sources` ((data step, index) each) of the stream, this
    process's rows of each."""
    picked = [(prompts.get(d), i) for d, i in sources]
    host = {k: [getattr(b, a)[i] for b, i in picked] for k, a in HOST_FIELDS}
    return _host_columns(host, tokens, mask)


def _objects(values, index) -> np.ndarray:
    out = np.empty(len(index), dtype=object)
    for j, i in enumerate(index):
        out[j] = values[i]
    return out


def saved_host_fields(saved: dict, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Host-side fields of a batch from what a checkpoint saved of them (runtime/resume._host_of: per
    group prompt, answer and record; per row the scores dynamic sampling cached), this process's rows of each."""
    out = _host_columns({k: saved[k] for k, _ in HOST_FIELDS}, tokens, mask)
    for k in ("rewards", "reward_errors", "truncated"):
        if k in saved:
            values, dtype = saved[k]
            out[f"host_{k}"] = np.asarray(values, np.dtype(dtype))
    return out
