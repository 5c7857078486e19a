"""Sequence packing (train.pack_sequences; rl/packing.py, runtime/packed_forward.py).

The plan against a brute-force check of its invariants on random batches (every real token of
every sequence copied exactly once, rows within S, positions restarting, one segment id per
sequence in a row, every response token's predictor and target in place); the packed forward
against the padded plain pass (`token_logprobs`, itself tested against a float64 numpy decoder
in test_models.py); one update with packing against the same update without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpeg_jax.config import model_preset
from rpeg_jax.models import init_model, token_logprobs
from rpeg_jax.rl import packing
from rpeg_jax.runtime.packed_forward import packed_outputs

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, init_std=0.2)


def rollout_batch(rng, b, P, R, *, min_resp=0):
    """Rollout layout: prompts left-padded to P (1..P tokens), responses right-padded to R."""
    tok, pos, seg = (np.zeros((b, P + R), np.int32) for _ in range(3))
    for i in range(b):
        lp, lr = int(rng.integers(1, P + 1)), int(rng.integers(min_resp, R + 1))
        tok[i, P - lp : P + lr] = rng.integers(3, 128, lp + lr)
        pos[i, P - lp : P + lr] = np.arange(lp + lr)
        seg[i, P - lp : P + lr] = 1
    mask = (seg[:, P:] > 0).astype(np.float32)
    return tok, pos, seg, mask


@pytest.mark.parametrize("seed", range(20))
def test_plan_invariants(seed):
    rng = np.random.default_rng(seed)
    b, P, R = int(rng.integers(1, 24)), int(rng.integers(1, 9)), int(rng.integers(1, 17))
    tok, pos, seg, mask = rollout_batch(rng, b, P, R)
    S = P + R
    start, length = packing.sequence_spans(seg)
    need_rows, need_k = packing.piece_sizes(start, length, P, R)
    rows, k = need_rows + int(rng.integers(0, 3)), need_k + int(rng.integers(0, 5))
    plan = packing.piece_plan(start, length, P, R, rows=rows, tokens=k)
    src, sg, pred, out = plan["src_NxT"], plan["seg_NxT"], plan["pred_K"], plan["out_BxR"]
    assert src.shape == (rows, S) and sg.shape == (rows, S) and pred.shape == (k,) and out.shape == (b, R)
    # every real token exactly once, nothing else
    copied = np.sort(src[src >= 0])
    real = np.flatnonzero(seg.reshape(-1) != 0)
    np.testing.assert_array_equal(copied, real)
    assert np.all((src >= 0) == (sg > 0))
    ppos = np.where(src >= 0, pos.reshape(-1)[np.maximum(src, 0)], 0)
    for r in range(rows):
        ids = sg[r][sg[r] > 0]
        # segments are contiguous runs 1, 2, 3, ... with one sequence each, positions restart at 0
        assert np.all(np.diff(ids) >= 0) and (ids.size == 0 or ids[0] == 1) and np.all(np.diff(np.unique(ids)) == 1)
        assert np.all(sg[r][ids.size :] == 0)  # real slots first, then empty ones
        for j in np.unique(ids):
            cols = np.flatnonzero(sg[r] == j)
            seqs = np.unique(src[r, cols] // S)
            assert seqs.size == 1
            np.testing.assert_array_equal(ppos[r, cols], np.arange(cols.size))
            np.testing.assert_array_equal(src[r, cols], seqs[0] * S + start[seqs[0]] + np.arange(cols.size))
    # the response cells with a real target: predictor is the previous token of the same sequence
    have = out >= 0
    np.testing.assert_array_equal(have, (mask > 0) & (seg[:, P - 1 : P - 1 + R] > 0))
    assert len(np.unique(out[have])) == have.sum() == need_k
    for i, t in zip(*np.nonzero(have)):
        slot = pred[out[i, t]]
        assert src.reshape(-1)[slot] == i * S + P - 1 + t
        assert src.reshape(-1)[slot + 1] == i * S + P + t
    # first-fit-decreasing uses no more rows than the sequences' total length needs, twice over
    assert need_rows <= max(1, -(-2 * int(length.sum()) // S))


def test_first_fit_decreasing_brute_force():
    """FFD against its definition, stepwise, on random item lists."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        cap = int(rng.integers(1, 20))
        lengths = rng.integers(0, cap + 1, int(rng.integers(0, 15)))
        bins = packing.first_fit_decreasing(lengths, cap)
        ref: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            if lengths[i] == 0:
                continue
            for b in ref:
                if sum(lengths[j] for j in b) + lengths[i] <= cap:
                    b.append(i)
                    break
            else:
                ref.append([i])
        assert bins == ref
    with pytest.raises(ValueError, match="exceeds the row length"):
        packing.first_fit_decreasing([5], 4)


def test_sequence_spans_refuses_non_contiguous():
    seg = np.array([[0, 1, 1, 0], [1, 0, 1, 0]])
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        packing.sequence_spans(seg)


@pytest.fixture(scope="module")
def models():
    return {
        "llama": init_model(model_preset("tiny", value_head=True, **SMALL), seed=3),
        "qwen": init_model(model_preset("tiny", arch="qwen2", qkv_bias=True, tie_embeddings=True, **SMALL), seed=1),
    }


def plain(model, tok, pos, seg, P, R, **kw):
    targets = jnp.concatenate([tok[:, 1:], jnp.zeros_like(tok[:, :1])], 1)
    return token_logprobs(model, tok, pos, seg, targets, start=P - 1, length=R, **kw)


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_packed_forward_equals_padded(models, name):
    model = models[name]
    rng = np.random.default_rng(5)
    b, P, R = 10, 6, 12
    tok, pos, seg, mask = rollout_batch(rng, b, P, R)
    start, length = packing.sequence_spans(seg)
    rows, k = packing.piece_sizes(start, length, P, R)
    assert rows < b  # the rewrite happened: fewer rows than the padded batch
    plan = {x: jnp.asarray(v) for x, v in packing.piece_plan(start, length, P, R, rows=rows + 1, tokens=k + 3).items()}
    lp0, ent0, h0 = plain(model, tok, pos, seg, P, R, temperature=0.8, with_entropy=True, return_hidden=True)
    out = packed_outputs(model, tok, pos, plan, temperature=0.8, entropy=True, values=model.value_w is not None)
    m = mask > 0
    np.testing.assert_allclose(np.asarray(out["logp"])[m], np.asarray(lp0)[m], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out["entropy"])[m], np.asarray(ent0)[m], atol=1e-5, rtol=0)
    if model.value_w is not None:
        np.testing.assert_allclose(np.asarray(out["values"])[m], np.asarray(model.values(h0))[m], atol=1e-5)
    assert np.all(np.asarray(out["logp"])[~m] == 0)

    graphdef, params = nnx.split(model, nnx.Param)
    w = jnp.asarray(rng.normal(size=mask.shape) * mask, jnp.float32)

    def loss(params, packed):
        mdl = nnx.merge(graphdef, params)
        if packed:
            o = packed_outputs(mdl, tok, pos, plan, entropy=True)
            lp, ent = o["logp"], o["entropy"]
        else:
            lp, ent = plain(mdl, tok, pos, seg, P, R, with_entropy=True)
        return jnp.sum(jnp.where(mask > 0, lp + 0.3 * ent, 0.0) * w)

    g0, g1 = jax.grad(loss)(params, False), jax.grad(loss)(params, True)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-4, err_msg=str(path))


# ---- one update with and without packing ---------------------------------------------------------
B_UPD, G_UPD, P_UPD, R_UPD = 16, 4, 6, 12


def update_batch(model, seed=0):
    """A GRPO-shaped batch (groups of G rows share a prompt) with random advantages, old/ref
    logprobs a little off the model's own, values and returns."""
    rng = np.random.default_rng(seed)
    P, R = P_UPD, R_UPD
    tok, pos, seg = (np.zeros((B_UPD, P + R), np.int32) for _ in range(3))
    for grp in range(B_UPD // G_UPD):
        lp = int(rng.integers(1, P + 1))
        prompt = rng.integers(3, 128, lp)
        for j in range(G_UPD):
            i, lr = grp * G_UPD + j, int(rng.integers(1, R + 1))
            tok[i, P - lp : P], tok[i, P : P + lr] = prompt, rng.integers(3, 128, lr)
            pos[i, P - lp : P + lr] = np.arange(lp + lr)
            seg[i, P - lp : P + lr] = 1
    mask = (seg[:, P:] > 0).astype(np.float32)
    lp0, _ = plain(model, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg), P, R)
    noise = lambda s: rng.normal(scale=s, size=mask.shape).astype(np.float32)  # noqa: E731
    return {
        "tokens_BxS": jnp.asarray(tok),
        "positions_BxS": jnp.asarray(pos),
        "segment_ids_BxS": jnp.asarray(seg),
        "response_mask_BxR": jnp.asarray(mask),
        "group_ids_B": jnp.asarray(np.repeat(np.arange(B_UPD // G_UPD), G_UPD).astype(np.int32)),
        "old_logp_BxR": jnp.asarray(np.asarray(lp0) + noise(0.05) * mask),
        "behav_logp_BxR": jnp.asarray(np.asarray(lp0) + noise(0.05) * mask),
        "ref_logp_BxR": jnp.asarray(np.asarray(lp0) + noise(0.1) * mask),
        "advantages_BxR": jnp.asarray(np.repeat(rng.normal(size=(B_UPD, 1)), R, 1).astype(np.float32) * mask),
        "values_BxR": jnp.asarray(noise(0.5) * mask),
        "returns_BxR": jnp.asarray(noise(1.0) * mask),
    }


def make_fns(graphdef, *, entropy, values):
    """(padded policy_fn, packed policy_fn) as the runtime builds them (runtime/kernels.py)."""

    def padded(params, b):
        mdl = nnx.merge(graphdef, params)
        lp, ent, h = plain(
            mdl, b["tokens_BxS"], b["positions_BxS"], b["segment_ids_BxS"], P_UPD, R_UPD,
            with_entropy=entropy, return_hidden=True,
        )  # fmt: skip
        return {"logp": lp, "entropy": ent, "values": mdl.values(h) if values else None}

    def packed(params, b):
        mdl = nnx.merge(graphdef, params)
        return packed_outputs(
            mdl, b["tokens_BxS"], b["positions_BxS"], b[packing.PLAN_KEY], entropy=entropy, values=values
        )

    return padded, packed


UPDATE_CASES = {
    "token-mean": {},
    "seq-mean-token-mean": dict(loss_agg="seq-mean-token-mean"),
    "seq-mean-token-sum-norm": dict(loss_agg="seq-mean-token-sum-norm"),
    "gspo-seq-mean": dict(policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    "kl-entropy-tis": dict(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0),
    "epochs-minibatches-micro": dict(ppo_epochs=2, minibatches=2, micro_batches=2, loss_agg="seq-mean-token-mean"),
}


# `slow` (session 24's trim of the default run, ~9 s each): seq-mean-token-sum-norm (its normaliser is
# the loss module's, tests/test_rl_losses.py), and the cases the other group size already runs
SLOW_UPDATES = {("seq-mean-token-sum-norm", 1), ("epochs-minibatches-micro", 1), ("token-mean", G_UPD)}


@pytest.mark.parametrize(
    ("case", "group_size"),
    [
        pytest.param(c, g, marks=[pytest.mark.slow] if (c, g) in SLOW_UPDATES else [])
        for c, g in [(c, 1) for c in UPDATE_CASES] + [("token-mean", G_UPD), ("epochs-minibatches-micro", G_UPD)]
    ],
)
def test_update_with_packing_equals_without(models, case, group_size):
    """Same loss, metrics and parameters (rtol 1e-5 / atol 1e-6) after make_actor_update's steps,
    shuffled (rng) and split into minibatches and micro-batches, with whole-group splits
    (group_size=G, as when the unpacked update shares prompts) or row splits."""
    import optax

    from rpeg_jax import rl
    from rpeg_jax.config import RLConfig

    cfg = RLConfig(**UPDATE_CASES[case])
    model = models["llama"]
    graphdef, params = nnx.split(model, nnx.Param)
    batch = update_batch(model)
    padded, packed = make_fns(graphdef, entropy=cfg.entropy_coef > 0, values=False)
    # Adam over one step; over several, SGD: Adam's later steps turn a float32-rounding
    # difference of a near-zero gradient entry into a step difference of up to ~lr (seen: 4e-6
    # on one of 4096 entries after 4 steps), which is Adam, not packing
    one = cfg.ppo_epochs * cfg.minibatches == 1
    tx = optax.adam(1e-3) if one else optax.sgd(0.1)
    rng = jax.random.key(7)
    kw = dict(group_size=group_size)
    p0, s0, m0 = jax.jit(rl.make_actor_update(padded, tx, cfg, **kw))(params, tx.init(params), batch, rng)
    plan = packing.update_plan(
        batch["segment_ids_BxS"], R_UPD, epochs=cfg.ppo_epochs, minibatches=cfg.minibatches,
        micro_batches=cfg.micro_batches, group_size=group_size, rng=rng,
    )  # fmt: skip
    b_piece = B_UPD // (cfg.minibatches * cfg.micro_batches)
    rows = plan["src_NxT"].shape[3]
    assert rows < b_piece if b_piece == B_UPD else rows <= b_piece  # the rewrite packs sequences together
    p1, s1, m1 = jax.jit(rl.make_actor_update(packed, tx, cfg, **kw))(params, tx.init(params), batch, rng, plan)
    assert float(m0["actor/updates"]) == cfg.ppo_epochs * cfg.minibatches
    assert set(m0) == set(m1)
    for k in m0:
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=str(path))
    # the parameters moved (the comparison is not of two unchanged copies)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(params))) > 1e-4


def test_packing_plan_follows_the_shuffle(models):
    """A plan made for another shuffle than the update's gives other parameters (the plan's own
    order is what the packed update trains on, so it must be the update's draw)."""
    import optax

    from rpeg_jax import rl
    from rpeg_jax.config import RLConfig

    cfg = RLConfig(minibatches=2)
    graphdef, params = nnx.split(models["llama"], nnx.Param)
    batch = update_batch(models["llama"])
    padded, packed = make_fns(graphdef, entropy=False, values=False)
    tx = optax.adam(1e-3)
    rng = jax.random.key(7)
    p0, _, _ = jax.jit(rl.make_actor_update(padded, tx, cfg))(params, tx.init(params), batch, rng)
    kw = dict(epochs=1, minibatches=2, micro_batches=1)
    other = packing.update_plan(batch["segment_ids_BxS"], R_UPD, rng=jax.random.key(8), **kw)
    p1, _, _ = jax.jit(rl.make_actor_update(packed, tx, cfg))(params, tx.init(params), batch, rng, other)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1))) > 1e-4


# ---- the scoring forwards (ref / old / critic) ------------------------------------------------------
def scoring_models():
    """Actor, reference and critic of the kernel tests: three different weight sets, the critic's
    value head non-zero (it starts at zero: values would be 0 == 0)."""
    out = {}
    for role, seed in (("actor", 3), ("reference", 4), ("critic", 5)):
        mdl = init_model(model_preset("tiny", value_head=True, **SMALL), seed=seed)
        rng = np.random.default_rng(seed)
        mdl.value_w.set_value(jnp.asarray(rng.normal(size=mdl.value_w.get_value().shape), jnp.float32))
        mdl.value_b.set_value(jnp.float32(0.3))
        out[role] = nnx.split(mdl, nnx.Param)
    return out


@pytest.fixture(scope="module")
def scorers():
    return scoring_models()


def assert_scored_equal(packed, padded, mask, keys):
    """Every real response token's output at rtol 1e-5 / atol 1e-6 x the output's scale (a value
    near 0 is a sum of terms of that scale: seen 2.6e-6 off at |v| = 0.03, max |v| = 10); the packed
    pass's other cells 0."""
    m = np.asarray(mask) > 0
    assert m.sum() > m.shape[0]
    for k in keys:
        a, b = np.asarray(packed[k]), np.asarray(padded[k])
        assert a.shape == b.shape == m.shape and np.abs(b[m]).max() > 0.5, k
        np.testing.assert_allclose(a[m], b[m], rtol=1e-5, atol=1e-6 * max(1.0, np.abs(b[m]).max()), err_msg=k)
        assert np.all(a[~m] == 0), k


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("group_size", [G_UPD, 1])  # the padded pass shares each group's prompt / plain
def test_scoring_forward_with_packing_equals_without(scorers, micro, group_size):
    """runtime/kernels.scoring_fn over rl/packing.forward_plan (rl.forward_micro_batches pieces,
    merged back in batch order) against the padded pass (group-shared prompt or plain)."""
    from rpeg_jax.runtime.kernels import scoring_fn, shared_prompt_groups

    graphdef, params = scorers["critic"]
    c = {k: v for k, v in update_batch(nnx.merge(graphdef, params)).items() if not k.endswith("_BxR") or "mask" in k}
    assert shared_prompt_groups(c, group_size, micro) == group_size  # the padded reference shares when asked
    kw = dict(temperature=0.8, logp=True, entropy=False, values=True)
    padded = jax.jit(scoring_fn(graphdef, group_size, 1, micro, **kw))(params, c)
    plan = packing.forward_plan(c, micro)
    assert plan["src_NxT"].shape[0] == micro and plan["src_NxT"].shape[1] < B_UPD // micro  # packed: fewer rows
    packed = jax.jit(scoring_fn(graphdef, group_size, 1, micro, **kw))(params, c, plan)
    assert_scored_equal(packed, padded, c["response_mask_BxR"], ("logp", "values"))


def test_forward_plan_packs_the_strided_pieces_in_batch_order():
    """forward_plan's piece u packs rows u, u+n, u+2n, ... (rl/layout.split_rows, the pieces the
    scoring pass runs) in that order, with the update's rounding of N (devices) and K."""
    seg = np.asarray(update_batch(init_model(model_preset("tiny", **SMALL), seed=0))["segment_ids_BxS"])
    c = {"segment_ids_BxS": seg, "response_mask_BxR": np.zeros((B_UPD, R_UPD), np.float32)}
    n, devices = 4, 2
    plan = packing.forward_plan(c, n, devices=devices)
    start, length = packing.sequence_spans(seg)
    sizes = [packing.piece_sizes(start[u::n], length[u::n], P_UPD, R_UPD) for u in range(n)]
    b = B_UPD // n
    rows = packing.round_to_quantum(max(r for r, _ in sizes), packing.row_quantum(b, devices))
    tokens = packing.round_to_quantum(max(k for _, k in sizes), -(-b * R_UPD // packing.TOKEN_BUCKETS))
    assert rows % devices == 0 and set(plan) == {"src_NxT", "seg_NxT", "pred_K", "out_BxR"}
    for u in range(n):
        want = packing.piece_plan(start[u::n], length[u::n], P_UPD, R_UPD, rows=rows, tokens=tokens)
        for k, v in want.items():
            np.testing.assert_array_equal(plan[k][u], v, err_msg=f"piece {u} {k}")


class ScoringRuntime:
    """The part of runtime/setup.RuntimeContext that the kernels read, on one device, inputs left
    where they are (graph/compile.PlainRuntime)."""

    compiler_options: dict = {}

    def __init__(self, cfg, models):
        import optax

        from rpeg_jax.runtime.offload import Offload

        self.cfg, self.temperature = cfg, 0.8
        self.graphdefs = {role: gd for role, (gd, _) in models.items()}
        self.optimizers = {"actor": optax.sgd(0.1), "critic": optax.sgd(0.1)}
        self.update_key, self.offload = jax.random.key(0), Offload((), None)

    def place_inputs(self, stage, inputs):
        return inputs

    def stage_scope(self, stage):
        import contextlib

        return contextlib.nullcontext()


SCORING_KINDS = {"ref_forward", "old_forward", "critic_forward"}
SCORING_CASES = {
    "grpo": ["rl.kl_coef=0.04", "pipeline.elide_old_forward=false"],
    "grpo-micro2": ["rl.kl_coef=0.04", "pipeline.elide_old_forward=false", "rl.forward_micro_batches=2"],
    "ppo": ["rl.algorithm=ppo", "rl.kl_coef=0.04"],
    "ppo-micro2": ["rl.algorithm=ppo", "rl.kl_coef=0.04", "rl.forward_micro_batches=2"],
    "ppo-fused": ["rl.algorithm=ppo", "rl.kl_coef=0.04", "pipeline.fuse=[forwards]", "rl.forward_micro_batches=2"],
    "grpo-fused": ["rl.kl_coef=0.04", "pipeline.fuse=[forwards,advantage]"],
}


def scoring_stages(overrides, models):
    """The compiled scoring stages (single or fused) of a run of that config, on one device."""
    from helpers import TINY

    from rpeg_jax.config import load_config
    from rpeg_jax.graph.compile import compile_graph
    from rpeg_jax.graph.plan import graph_for_plan, plan_from_config
    from rpeg_jax.runtime.kernels import default_registry

    cfg = load_config(None, TINY + [f"data.max_prompt_len={P_UPD}", f"rollout.max_new_tokens={R_UPD}"] + overrides)
    graph = graph_for_plan(cfg)
    program = compile_graph(graph, plan_from_config(cfg, 1, graph), default_registry(), ScoringRuntime(cfg, models))
    kinds = lambda cs: {p.kind.value for p in cs.stage.parts} or {cs.stage.kind.value}  # noqa: E731
    return [cs for cs in program.stages if kinds(cs) & SCORING_KINDS]


@pytest.mark.parametrize("case", list(SCORING_CASES))
def test_scoring_stages_with_packing_equal_without(scorers, case):
    """The runtime's ref / old / critic forward stages (and a fused forwards stage) with
    train.pack_sequences=true against the same stages padded: every output at every real response
    token, GRPO-shaped groups (the padded pass shares their prompts), rl.forward_micro_batches 1/2."""
    overrides = SCORING_CASES[case]
    padded, packed = (scoring_stages(overrides + [f"train.pack_sequences={p}"], scorers) for p in ("false", "true"))
    batch = update_batch(nnx.merge(*scorers["actor"]))
    c = {k: batch[k] for k in ("tokens_BxS", "positions_BxS", "segment_ids_BxS", "response_mask_BxR", "group_ids_B")}
    inputs = {"completions": c, **{role: params for role, (_, params) in scorers.items()}}
    if "fused" in case:
        assert [len(cs.stage.parts) for cs in packed] == [3 if case.startswith("ppo") else 2]
    names = set()
    for a, b in zip(padded, packed, strict=True):
        assert b.kernel.prepare is not None and a.kernel.prepare is None
        sub = lambda cs: {p.name: inputs[p.name] for p in cs.reads if p.name in inputs}  # noqa: E731
        out0, out1 = a(sub(a)), b(sub(b))
        keys = [p.name for p in a.writes if p.name in ("ref_logp", "old_logp", "values")]
        names |= set(keys)
        assert_scored_equal(out1, out0, c["response_mask_BxR"], keys)
        parts = [p.name for p in b.stage.parts] or [b.name]
        fill = {k: float(v) for k, v in out1["metrics"].items() if k.endswith("_pack_fill")}
        assert set(fill) == {f"perf/{p}_pack_fill" for p in parts} and all(0 < f <= 1 for f in fill.values())
        assert all(float(out1["metrics"][f"perf/{p}_pack_rows"]) < 1 for p in parts)  # fewer rows than padded
        assert not (out0.get("metrics") or {})
    assert names == ({"ref_logp", "old_logp", "values"} if case.startswith("ppo") else {"ref_logp", "old_logp"})


# ---- the runtime --------------------------------------------------------------------------------
@pytest.mark.slow  # ~23 s: two 3-step runs
def test_runtime_packed_run_equals_padded(tmp_path):
    """Three GRPO steps (KL to a reference, an entropy bonus, 2 minibatches, π_old from an
    old_forward, the scoring forwards in 2 micro-batches, on the tests' 8 CPU devices) with
    train.pack_sequences=true: the same metrics and final states as padded; the update and the
    ref / old forwards ran packed."""
    from helpers import TINY, assert_same_run, run

    lengths = ["rollout.max_new_tokens=16", "rollout.forced_lengths=[4,1.0,1,16]"]  # a long tail, as R2
    # 64 sequences, 32 per minibatch: the 8 test devices' row quantum (8) leaves room to pack
    grpo = TINY + lengths + ["data.prompts_per_step=16", "rl.kl_coef=0.04", "rl.entropy_coef=0.01", "rl.minibatches=2"]
    grpo += ["pipeline.elide_old_forward=false", "rl.forward_micro_batches=2"]
    padded = run(tmp_path, "padded", grpo)
    packed = run(tmp_path, "packed", grpo + ["train.pack_sequences=true"])
    for stage in ("actor", "ref_forward", "old_forward"):
        fill = [r[f"perf/{stage}_pack_fill"] for r in packed.metrics]
        assert all(0 < f <= 1 for f in fill) and all(f"perf/{stage}_pack_fill" not in r for r in padded.metrics)
        rows = [r[f"perf/{stage}_pack_rows"] for r in packed.metrics]
        assert all(r < 1 for r in rows), (stage, rows)  # the pass ran on fewer rows
    assert_same_run(padded, packed)


@pytest.mark.parametrize(  # actor-critic-values packs both updates and the values pass by default
    "which",
    [pytest.param(w, marks=pytest.mark.slow) for w in ("critic", "actor-critic")] + ["actor-critic-values"],
)
def test_ppo_updates_with_packing_equal_without(models, which):
    """The critic's update and the shared actor-critic update (values from the value head on the
    packed hidden states; with values_from_update, V_old and GAE inside the loss) packed vs padded."""
    import optax

    from rpeg_jax import rl
    from rpeg_jax.config import RLConfig

    cfg = RLConfig(algorithm="ppo", micro_batches=2, loss_agg="seq-mean-token-mean")
    graphdef, params = nnx.split(models["llama"], nnx.Param)
    batch = update_batch(models["llama"])
    batch["rewards_B"] = jnp.asarray(np.random.default_rng(3).normal(size=B_UPD).astype(np.float32))
    padded, packed = make_fns(graphdef, entropy=False, values=True)
    tx = optax.adam(1e-3)
    rows = which == "actor-critic-values"
    rng = None if rows else jax.random.key(3)
    if which == "critic":
        make = lambda f: rl.make_critic_update(f, tx, cfg)  # noqa: E731
    else:
        make = lambda f: rl.make_actor_critic_update(f, tx, cfg, values_from_update=rows)  # noqa: E731
    plan = packing.update_plan(batch["segment_ids_BxS"], R_UPD, epochs=1, minibatches=1, micro_batches=2, rng=rng)
    out0 = jax.jit(make(padded))(params, tx.init(params), batch, rng)
    out1 = jax.jit(make(packed))(params, tx.init(params), batch, rng, plan)
    m0, m1 = out0[2], out1[2]
    assert set(m0) == set(m1) and any(k.startswith("critic/") for k in m0)
    for k in m0:
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(out0[0]), jax.tree.leaves(out1[0])):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=str(path))
    if rows:  # V_old per row, in batch order, at the response tokens
        m = np.asarray(batch["response_mask_BxR"]) > 0
        np.testing.assert_allclose(
            np.asarray(out1[3]["values_BxR"])[m], np.asarray(out0[3]["values_BxR"])[m], atol=1e-5
        )


def test_config_refuses_packing_with_explicit_axes():
    from rpeg_jax.config import load_config
    from rpeg_jax.config.base import ConfigError

    load_config(None, ["train.pack_sequences=true"])  # the default sharding is fine
    with pytest.raises(ConfigError, match="train.pack_sequences"):
        load_config(None, ["train.pack_sequences=true", "sharding.axis_types=explicit"])
