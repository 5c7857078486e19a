"""Helpers shared by several test files (test files never import each other).

- runtime runs on a tiny model: `run`, `assert_same_run`, and `program` / `assert_rewritten`,
  the positive control of every "rewritten run == plain run" test: the rewrite must first have
  changed the stages the executor ran, or an ignored knob would pass the equality trivially;
- the toy policy of the update tests: `policy_fn`, `value_fn`, `make_case`;
- paged attention cases: `E`, `ref_attention`, `build_case`;
- group-shared prompts for the prefix pass: `group_rollout`;
- sampler cases: `HF`, `prompts_of`, `rollout_batch`, `sampler_trainer_gap`, `perturbed`,
  `model_with`, `shard`.

Heavy imports (the trainer, the sampler) happen inside the functions that need them.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")

# ---- runtime runs ---------------------------------------------------------------------------------
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=128",
    "data.prompts_per_step=4",
    "rl.group_size=4",
    "rollout.max_new_tokens=6",
    "data.max_prompt_len=12",
    "train.checkpoint_every=0",
    "train.tensorboard=false",
    "train.progress=false",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
    "pipeline.plan=manual",
]
PPO = TINY + ["rl.algorithm=ppo", "rl.kl_coef=0.04"]
# Not results: times, rates, the model's predictions, and how full the engine's decode batch was
# (rollout/occupancy depends on how generation is split into pieces and processes).
SKIP = ("timing_s/", "perf/", "predicted_s/", "pred_error/", "rollout/occupancy")
ATOL = 2e-5  # float32: the same math in a different program/shape


class Run(NamedTuple):
    """One training run: its metrics records, final states, the executor's record of the tasks it
    ran ((stage, step, piece) -> {port: version | (step, piece)}) and its run directory."""

    metrics: list[dict[str, Any]]
    state: dict[str, Any]
    consumed: dict[tuple[str, int, int], dict[str, Any]]
    run_dir: str


def run(tmp_path, name, overrides, steps=3, **kw) -> Run:
    from rpeg_jax.config import load_config
    from rpeg_jax.runtime.metrics import read_metrics
    from rpeg_jax.runtime.trainer import train

    cfg = load_config(
        None, overrides + [f"train.steps={steps}", f"train.run_dir={tmp_path / name}", "train.resume=never"]
    )
    out = train(cfg, keep_state=True, **kw)
    return Run(
        read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")), out["state"], out["consumed"], out["run_dir"]
    )


def records(run_dir) -> dict[int, dict]:
    """metrics.jsonl of a run (one written by launch/multihost.py's processes too), by step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, filter(str.strip, f))}


def checkpoint_actor(run_dir, step) -> dict[str, np.ndarray]:
    """The actor's parameters in checkpoint `step` of a run, as numpy arrays by path."""
    import orbax.checkpoint as ocp

    path = os.path.join(run_dir, "checkpoints", str(step), "train")
    reader = ocp.PyTreeCheckpointer()
    try:
        meta = reader.metadata(path).item_metadata
        actor = {"actor": getattr(meta, "tree", meta)["actor"]}
        leaf = lambda x: hasattr(x, "shape") or x is None  # noqa: E731
        item = jax.tree.map(lambda m: np.zeros(()), actor, is_leaf=leaf)
        args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), actor, is_leaf=leaf)
        got = reader.restore(path, args=ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True))
    finally:
        reader.close()
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(got["actor"])[0]}


def assert_same_run(a: Run, b: Run, *, atol=ATOL):
    ma, sa, mb, sb = a.metrics, a.state, b.metrics, b.state
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        keys = sorted(k for k in ra if not k.startswith(SKIP) and k in rb)
        assert len(keys) > 10
        for k in keys:
            if isinstance(ra[k], float):
                assert rb[k] == pytest.approx(ra[k], abs=atol, rel=1e-4 if atol else 0), f"step {ra['step']} {k}"
    assert set(sa) == set(sb)
    for name in sa:
        for x, y in zip(jax.tree.leaves(sa[name]), jax.tree.leaves(sb[name]), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-4 if atol else 0, err_msg=name)


_GRAPH_LINE = re.compile(r"  (\S+)(?: x(\d+))? \[")


def program(r: Run) -> dict[str, int]:
    """stage -> pieces per step of the tasks the executor ran (its `consumed` record: what the
    compiled program executed), checked against the stages and `xN` micro-batch counts that the
    run directory's graph.txt lists."""
    pieces: dict[str, dict[int, set[int]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for stage, step, piece in r.consumed:
        pieces[stage][step].add(piece)
    ran = {}
    for stage, by_step in pieces.items():
        counts = {len(p) for p in by_step.values()}
        assert len(counts) == 1, f"{stage} ran a different number of pieces in different steps: {dict(by_step)}"
        ran[stage] = counts.pop()
    with open(os.path.join(r.run_dir, "graph.txt")) as f:
        listed = {m[1]: int(m[2] or 1) for m in map(_GRAPH_LINE.match, f.read().splitlines()[1:]) if m}
    assert ran == listed, f"the executor ran {ran}, graph.txt lists {listed}"
    return ran


def assert_rewritten(rewritten: Run, plain: Run, *, present=(), absent=(), pieces=None, unread=None):
    """The rewrite reached the program that ran: relative to `plain`, `rewritten` ran exactly the
    stages of `plain` minus `absent` plus `present` (each in `present` new, each in `absent` run
    by `plain`), the stages in `pieces` (stage -> n) ran n pieces per step and every other shared
    stage as many as in `plain`, and no task of a stage in `unread` (stage -> ports) read those
    ports while `plain`'s did."""
    new, old = program(rewritten), program(plain)
    assert new != old, f"the rewrite left the executed program unchanged: {new}"
    present, absent, pieces = set(present), set(absent), dict(pieces or {})
    assert not present & set(old), f"{present & set(old)} already ran in the plain run"
    assert absent <= set(old), f"{absent - set(old)} did not run in the plain run either"
    assert set(new) == (set(old) - absent) | present, f"ran {sorted(new)}, want {sorted((set(old) - absent) | present)}"
    assert {s: new[s] for s in pieces} == pieces, f"pieces per step {new}"
    for s in (set(new) & set(old)) - set(pieces):
        assert new[s] == old[s], f"{s}: {new[s]} pieces, {old[s]} in the plain run"
    for stage, ports in (unread or {}).items():
        for r, reads in ((rewritten, False), (plain, True)):
            read = {p for key, rec in r.consumed.items() if key[0] == stage for p in rec}
            assert bool(set(ports) & read) == reads, f"{stage} read {sorted(read)}"


# ---- the toy policy of the update tests (a logits table per row) ----------------------------------
B, R, V = 8, 5, 6


def rows(table, idx):
    """table[idx]; under explicit sharding the gathered rows follow the (sharded) index."""
    spec = jax.typeof(idx).sharding.spec
    if all(x is None for x in spec):
        return table[idx]
    return table.at[idx].get(out_sharding=jax.P(spec[0]))


def policy_fn(params, b):
    lp = jax.nn.log_softmax(rows(params["table"], b["row_B"]))
    logp = jnp.take_along_axis(lp, b["targets_BxR"][..., None], -1)[..., 0]
    out = {"logp": logp, "entropy": -jnp.sum(jnp.exp(lp) * lp, -1)}
    if "v" in params:
        out["values"] = rows(params["v"], b["row_B"])
    return out


def value_fn(params, b):
    return {"values": rows(params["v"], b["row_B"])}


def make_case(seed=0, *, critic=False, behav_noise=0.0):
    rng = np.random.default_rng(seed)
    params = {"table": jnp.asarray(rng.normal(size=(B, R, V)), jnp.float32)}
    if critic:
        params["v"] = jnp.asarray(rng.normal(size=(B, R)), jnp.float32)
    lens = rng.integers(1, R + 1, B)
    lens[2] = 0  # an empty response
    mask = (np.arange(R)[None] < lens[:, None]).astype(np.float32)
    batch = {
        "row_B": jnp.arange(B, dtype=jnp.int32),
        "targets_BxR": jnp.asarray(rng.integers(0, V, (B, R)), jnp.int32),
        "response_mask_BxR": jnp.asarray(mask),
    }
    logp = policy_fn(params, batch)["logp"]
    batch["old_logp_BxR"] = logp + jnp.asarray(rng.normal(size=(B, R)) * 0.1, jnp.float32)
    batch["behav_logp_BxR"] = batch["old_logp_BxR"] + jnp.asarray(rng.normal(size=(B, R)) * behav_noise, jnp.float32)
    batch["ref_logp_BxR"] = logp + jnp.asarray(rng.normal(size=(B, R)) * 0.2, jnp.float32)
    batch["advantages_BxR"] = jnp.asarray(rng.normal(size=(B, R)) * mask, jnp.float32)
    if critic:
        batch["values_BxR"] = params["v"] + jnp.asarray(rng.normal(size=(B, R)) * 0.3, jnp.float32)
        batch["returns_BxR"] = jnp.asarray(rng.normal(size=(B, R)), jnp.float32)
    return params, batch


# ---- paged attention cases -----------------------------------------------------------------------
E = 16


def ref_attention(q_TxHxE, k_CxKxE, v_CxKxE, q_pos_T):
    """float64 causal GQA attention; head h reads kv head h // (H // K)."""
    t, h, e = q_TxHxE.shape
    g = h // k_CxKxE.shape[1]
    out = np.zeros((t, h, e))
    for i in range(t):
        n = q_pos_T[i] + 1
        for hh in range(h):
            kk = k_CxKxE[:n, hh // g].astype(np.float64)
            s = kk @ q_TxHxE[i, hh].astype(np.float64) / np.sqrt(e)
            p = np.exp(s - s.max())
            out[i, hh] = (p / p.sum()) @ v_CxKxE[:n, hh // g].astype(np.float64)
    return out


def build_case(page_size, kv_heads, lengths, shared, seed=0, num_layers=2, layer=1):
    """Random contiguous K/V per sequence; sequence 1 shares sequence 0's first `shared` tokens (a page
    multiple) through the same pages. Pages are a random permutation; everything unused is NaN."""
    rng = np.random.default_rng(seed)
    b, lmax = len(lengths), max(lengths)
    k = rng.standard_normal((b, lmax, kv_heads, E)).astype(np.float32)
    v = rng.standard_normal((b, lmax, kv_heads, E)).astype(np.float32)
    k[1, :shared], v[1, :shared] = k[0, :shared], v[0, :shared]
    npages = [-(-n // page_size) for n in lengths]
    total = sum(npages) + 5
    perm = rng.permutation(np.arange(1, total + 1))  # page 0 stays the null page
    w = 1 << max(0, max(npages) + 1).bit_length()  # wider than needed: trailing null entries
    table = np.zeros((b, w), np.int32)
    pool_k = np.full((num_layers, kv_heads, total + 1, page_size, E), np.nan, np.float32)  # [L, K, P, S, E]
    pool_v = pool_k.copy()
    nxt = 0
    for i, n in enumerate(lengths):
        for j in range(npages[i]):
            if i == 1 and (j + 1) * page_size <= shared:
                table[i, j] = table[0, j]  # shared prefix page
                continue
            table[i, j] = perm[nxt]
            nxt += 1
            lo, hi = j * page_size, min(n, (j + 1) * page_size)
            pool_k[layer, :, table[i, j], : hi - lo] = k[i, lo:hi].transpose(1, 0, 2)
            pool_v[layer, :, table[i, j], : hi - lo] = v[i, lo:hi].transpose(1, 0, 2)
    return k, v, table, pool_k, pool_v


# ---- group-shared prompts (models/prefix.py) ---------------------------------------------------
def group_rollout(rng, n_groups, G, P, R):
    """Rollout layout of n_groups groups of G rows sharing one prompt (left-padded to P; prompt
    lengths P, 3, 1, ...), responses right-padded to R (each group's first row full length):
    numpy (tokens, positions, segment ids), each [n_groups·G, P + R]."""
    tok, pos, seg = (np.zeros((n_groups * G, P + R), np.int32) for _ in range(3))
    for grp, lp in enumerate((P, 3, 1)[:n_groups]):
        prompt = rng.integers(3, 128, lp)
        for j in range(G):
            row, lr = grp * G + j, int(rng.integers(1, R + 1)) if j else R
            tok[row, P - lp : P], tok[row, P : P + lr] = prompt, rng.integers(3, 128, lr)
            pos[row, P - lp : P + lr] = np.arange(lp + lr)
            seg[row, P - lp : P + lr] = 1
    return tok, pos, seg


# ---- sampler cases -------------------------------------------------------------------------------
def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, size=n).tolist() for n in lengths]


def rollout_batch(outs):
    """The runtime's layout: prompts left-padded to P, responses right-padded to R."""
    rows = [(o.prompt_tokens, c) for o in outs for c in o.completions]
    P = max(len(p) for p, _ in rows)
    R = max(len(c.tokens) for _, c in rows)
    tok = np.zeros((len(rows), P + R), np.int32)
    pos, seg = np.zeros_like(tok), np.zeros_like(tok)
    mask, behav = np.zeros((len(rows), R), np.float32), np.zeros((len(rows), R), np.float32)
    for i, (p, c) in enumerate(rows):
        n = len(c.tokens)
        tok[i, P - len(p) : P], tok[i, P : P + n] = p, c.tokens
        pos[i, P - len(p) : P + n] = np.arange(len(p) + n)
        seg[i, P - len(p) : P + n] = 1
        mask[i, :n], behav[i, :n] = 1, c.logprobs
    return tok, pos, seg, mask, behav, P, R


def sampler_trainer_gap(model, cfg, temp):
    """(|sampler logprob - trainer logprob| masked [B, R], mask [B, R]) for 3 prompts x 3 samples of
    12 tokens at temperature `temp`: the trainer's `token_logprobs` (float32) of the sampled tokens."""
    from rpeg_jax.models import token_logprobs
    from rpeg_jax.sampling import Sampler, SamplingParams

    prompts = prompts_of([6, 3, 10])
    outs = Sampler(model, cfg).generate(prompts, SamplingParams(n=3, temperature=temp, max_new_tokens=12, seed=4))
    tok, pos, seg, mask, behav, P, R = rollout_batch(outs)
    targets = np.concatenate([tok[:, 1:], np.zeros((len(tok), 1), np.int32)], axis=1)
    logp, _ = token_logprobs(
        model,
        jnp.asarray(tok),
        jnp.asarray(pos),
        jnp.asarray(seg),
        jnp.asarray(targets),
        start=P - 1,
        length=R,
        temperature=temp,
    )
    assert logp.dtype == jnp.float32
    return np.abs(np.asarray(logp) - behav) * mask, mask


def perturbed(model, scale=0.05, seed=9):
    """Weights B: the same tree/shapes/dtypes/shardings with different values."""
    from flax import nnx

    _, params = nnx.split(model, nnx.Param)

    @jax.jit  # one compile instead of one per eager op
    def shift(params):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
        return jax.tree.unflatten(
            treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
        )

    return shift(params)


def model_with(model, params):
    from flax import nnx

    graphdef, _ = nnx.split(model, nnx.Param)
    return nnx.merge(graphdef, params)


TENSOR = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"}


def shard(model, mesh):
    """The model's parameters placed on `mesh` with heads / kv heads / MLP over `tensor`."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    graphdef, state = nnx.split(model, nnx.Param)

    def place(v):
        spec = P(*[TENSOR.get(a) for a in v.get_metadata()["axes"]])
        return v.replace(jax.device_put(v.get_value(), NamedSharding(mesh, spec)))

    return nnx.merge(graphdef, jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


# A training process that dies as a crashed host does (SIGKILL, no cleanup) after step argv[1]:
# `python -c KILLER N key=value ...`.
KILLER = """
import os, signal, sys
from rpeg_jax.config import load_config
from rpeg_jax.runtime.trainer import train
stop = int(sys.argv[1])
def on_step(step, metrics):
    if step == stop:
        os.kill(os.getpid(), signal.SIGKILL)
train(load_config(None, sys.argv[2:]), on_step=on_step)
"""


def load_file(name: str, path: str, register: bool = False):
    """The module at `path` (a bench/ or launch/ script, a fixture), imported as `name`; `register`:
    also in sys.modules (a module whose dataclasses look their module up)."""
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
