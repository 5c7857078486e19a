"""GPU checks in bfloat16 against independent references (run by bench/gpu_check.sh on an H200).

Every test is marked `gpu` and skipped unless `jax.default_backend() == "gpu"`; `make test`
deselects them. `RPEG_GPU_TESTS_ON_CPU=1` (with `pytest --noconftest`, which otherwise adds the
skip) runs them on a CPU: gpu_check.sh --dry-run uses it to test the plumbing, never as evidence.
`RPEG_GPU_TEST_REPORT=path.jsonl` appends each test's measured errors (for bench/NOTES.md).

References and tolerances (bfloat16 has an 8-bit significand: one rounding is <= 2^-9 ~ 2e-3
relative; results computed from bf16 operands with float32 accumulation typically land between
1e-3 and 1e-2 in ||out - ref|| / ||ref||):
- paged attention (gather, blocked) in bf16 vs float64 causal GQA attention on the same
  bf16-rounded q/k/v, NaN in every unused page: scores and softmax are float32, the
  probabilities and the output are rounded to bf16 (two roundings of <= 2^-9 on values |v| <= ~4),
  so max |err| <= 2e-2 and relative norm <= 1e-2; a masking or position bug gives O(0.1-1) or NaN.
- sampler greedy (bf16 random model) vs argmax of the plain forward teacher-forced on the
  sampler's own tokens (no cache): two bf16 programs round differently, so near-ties may flip;
  every chosen token must be within GAP_TOL = 0.03 nats of the forward's max logit (the random
  model's logits have std ~0.33 and a median top-2 gap ~0.1, so a wrong token is usually > 0.03
  below) and >= 90% exactly the argmax; its logprob within LP_MAX of the forward's log-softmax.
- sampler logprobs vs trainer `token_logprobs` (bf16, temperature 1 and 0.7): max LP_MAX = 0.05,
  mean LP_MEAN = 0.01 (the float32 CPU test asks 2e-5; bf16 hidden states differ by ~1 ulp per
  layer; PPO's ratio is then off by ~1%, the known bf16 sampler/trainer mismatch).
- one GRPO update (SGD, so the step is -lr * grad) with bf16 compute / float32 params against
  the same step in float32 with matmul precision "highest" (no TF32) on the same device: finite
  loss, |loss diff| <= 1e-2 (loss ~0.2), relative norm of the parameter deltas <= 5e-2 (gradients through 4
  bf16 layers forward and backward), cosine >= 0.99; a wrong gradient is off by O(1).
- update_weights: zero recompiles, versions 1, and the same tokens / logprobs (1e-6, as on CPU:
  the same compiled programs on the same inputs) as a fresh sampler built with the new weights.
Measured in bf16 on the CPU (dry run, XLA CPU; not GPU evidence): attention max 7e-3 / rel 2.5e-3,
greedy gap 2e-3 with 95% exact, sampler-trainer max 9e-3 / mean 2.8e-3, update rel 9.5e-3.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import E, build_case, model_with, perturbed, prompts_of, ref_attention, sampler_trainer_gap

from rpeg_jax.config import RLConfig
from rpeg_jax.config.model import model_preset
from rpeg_jax.models import init_model, token_logprobs
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sampling.paged_attention import attend_blocked, attend_pages, dense_attention
from rpeg_jax.sampling.sampler import _COMPILES

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (ON_GPU or os.environ.get("RPEG_GPU_TESTS_ON_CPU") == "1"),
        reason=f"needs a GPU (default backend {jax.default_backend()})",
    ),
]

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
ATTN_MAX, ATTN_REL = 2e-2, 1e-2
GAP_TOL, EXACT_FRAC = 0.03, 0.9
LP_MAX, LP_MEAN = 0.05, 0.01
LOSS_TOL, DELTA_REL, DELTA_COS = 1e-2, 5e-2, 0.99
CFG = SamplerConfig(
    page_size=4, max_slots=8, chunk_steps=8, max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16
)


def report(name, **vals):
    path = os.environ.get("RPEG_GPU_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(
                json.dumps({"test": name, "backend": jax.default_backend(), **{k: float(v) for k, v in vals.items()}})
                + "\n"
            )


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model16():
    return init_model(model_preset("tiny", **BF16), seed=3)


@pytest.mark.parametrize("page_size,kv_heads", [(1, 2), (3, 1), (16, 2), (64, 4)])
def test_paged_attention_bf16_equals_dense_reference(page_size, kv_heads):
    heads, t = 4, 3
    lengths = [2 * page_size + 1, 2 * page_size + 5, page_size, 1, 3 * page_size - 1]
    k, v, table, pk, pv = build_case(page_size, kv_heads, lengths, shared=2 * page_size)
    q = np.random.default_rng(1).standard_normal((len(lengths), t, heads, E)).astype(np.float32)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    q16, k16, v16 = (np.asarray(bf(x), np.float32) for x in (q, k, v))  # what the kernels see
    qpos = np.stack([np.maximum(np.arange(n - t, n), 0) for n in lengths]).astype(np.int32)
    args = (bf(q), bf(pk), bf(pv), 1, jnp.asarray(table), jnp.asarray(qpos), jnp.asarray(lengths, jnp.int32))
    c = table.shape[1] * page_size
    kc = np.zeros((kv_heads, len(lengths), c, E), np.float32)
    vc = kc.copy()
    for i, n in enumerate(lengths):
        kc[:, i, :n], vc[:, i, :n] = k[i, :n].transpose(1, 0, 2), v[i, :n].transpose(1, 0, 2)
    outs = {
        "gather": attend_pages(*args),
        "blocked": attend_blocked(*args, block_pages=2),
        "dense": dense_attention(bf(q), bf(kc), bf(vc), jnp.asarray(qpos), jnp.asarray(lengths, jnp.int32)),
    }
    for name, out in outs.items():
        assert out.dtype == jnp.bfloat16, name
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all(), f"{name}: NaN from unused pages leaked into the output"
        errs, rels = [], []
        for i, n in enumerate(lengths):
            ref = ref_attention(q16[i], k16[i, :n], v16[i, :n], qpos[i])
            errs.append(np.abs(out[i] - ref).max())
            rels.append(rel(out[i], ref))
        report(f"paged_attention[{name},{page_size},{kv_heads}]", max_abs=max(errs), max_rel=max(rels))
        assert max(errs) <= ATTN_MAX and max(rels) <= ATTN_REL, (name, max(errs), max(rels))


def forward_logits(model, seqs, width=32):
    toks = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(toks)), np.float64)


@pytest.mark.parametrize("forward,attention", [("auto", "auto"), ("split", "chunk")])
def test_greedy_bf16_matches_plain_forward_argmax(model16, forward, attention):
    prompts, new = prompts_of([5, 1, 9, 4, 7]), 16
    sampler = Sampler(model16, dataclasses.replace(CFG, forward=forward, attention=attention))
    outs = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
    gen = [o.completions[0] for o in outs]
    logits = forward_logits(model16, [p + c.tokens.tolist() for p, c in zip(prompts, gen)])
    gaps, exact, lp_err = [], 0, []
    for i, (p, c) in enumerate(zip(prompts, gen)):
        assert len(c.tokens) == new and c.finish_reason == "length"
        rows = logits[i, len(p) - 1 : len(p) - 1 + new]
        tok = c.tokens.astype(np.int64)
        chosen = rows[np.arange(new), tok]
        gaps += (rows.max(-1) - chosen).tolist()
        exact += int((rows.argmax(-1) == tok).sum())
        ls = (
            rows
            - np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - rows.max(-1, keepdims=True)
        )
        lp_err += np.abs(ls[np.arange(new), tok] - np.asarray(c.logprobs)).tolist()
    frac = exact / (new * len(prompts))
    report(f"greedy[{forward},{attention}]", max_gap=max(gaps), exact_frac=frac, lp_max=max(lp_err))
    assert max(gaps) <= GAP_TOL, f"a greedy token is {max(gaps):.3f} nats below the forward's argmax"
    assert frac >= EXACT_FRAC, f"only {frac:.0%} of greedy tokens are the forward's exact argmax"
    assert max(lp_err) <= LP_MAX, f"greedy logprob off by {max(lp_err):.3f}"


def test_sampler_logprobs_bf16_match_trainer(model16):
    for temp in (1.0, 0.7):
        err, mask = sampler_trainer_gap(model16, CFG, temp)
        mean = err.sum() / mask.sum()
        report(f"sampler_vs_trainer[T={temp}]", max_abs=err.max(), mean_abs=mean)
        assert err.max() <= LP_MAX and mean <= LP_MEAN, (temp, err.max(), mean)


def grpo_step(model, batch, lr=0.5):
    """One GRPO update with SGD; returns (loss, parameter deltas as float64 leaves)."""
    from rpeg_jax.rl import make_actor_update

    graphdef, params = nnx.split(model, nnx.Param)
    P, R = batch["P"], batch["R"]

    def policy_fn(p, b):
        lp = token_logprobs(
            nnx.merge(graphdef, p), b["tokens"], b["positions"], b["seg"], b["targets"], start=P - 1, length=R
        )[0]
        return {"logp": lp, "entropy": None, "values": None}

    tx = optax.sgd(lr)
    update = jax.jit(make_actor_update(policy_fn, tx, RLConfig(algorithm="grpo", group_size=2)))
    data = {k: v for k, v in batch.items() if k not in ("P", "R")}
    new, _, metrics = update(params, tx.init(params), data)
    deltas = [
        np.asarray(a, np.float64) - np.asarray(b, np.float64)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))
    ]
    return float(metrics["actor/pg_loss"]), deltas, metrics


def test_grpo_update_bf16_matches_float32_reference():
    B, P, R = 8, 8, 8
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(3, 128, (B, P + R)), jnp.int32)
    mask = (np.arange(R)[None] < rng.integers(2, R + 1, B)[:, None]).astype(np.float32)
    batch = {
        "tokens": tokens,
        "positions": jnp.broadcast_to(jnp.arange(P + R, dtype=jnp.int32), (B, P + R)),
        "seg": jnp.ones((B, P + R), jnp.int32),
        "targets": jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1),
        "response_mask_BxR": jnp.asarray(mask),
        "advantages_BxR": jnp.asarray(np.repeat(rng.normal(size=(B, 1)), R, 1), jnp.float32),
        "P": P,
        "R": R,
    }
    m32 = init_model(model_preset("tiny"), seed=5)
    m16 = init_model(model_preset("tiny", dtype="bfloat16"), seed=5)  # same float32 params, bf16 compute
    with jax.default_matmul_precision("highest"):
        old = token_logprobs(
            m32, batch["tokens"], batch["positions"], batch["seg"], batch["targets"], start=P - 1, length=R
        )[0]
        batch["old_logp_BxR"] = old  # ratio 1 in float32: nothing clipped
        loss32, d32, _ = grpo_step(m32, batch)
    loss16, d16, metrics = grpo_step(m16, batch)
    assert np.isfinite(loss16) and float(metrics["actor/updates"]) == 1
    flat32, flat16 = np.concatenate([d.ravel() for d in d32]), np.concatenate([d.ravel() for d in d16])
    cos = float(flat16 @ flat32 / np.linalg.norm(flat16) / np.linalg.norm(flat32))
    r = rel(flat16, flat32)
    report("grpo_update", loss32=loss32, loss16=loss16, delta_rel=r, delta_cos=cos, delta_norm32=np.linalg.norm(flat32))
    assert np.linalg.norm(flat32) > 0
    assert abs(loss16 - loss32) <= LOSS_TOL, (loss16, loss32)
    assert r <= DELTA_REL and cos >= DELTA_COS, (r, cos)


def test_update_weights_bf16_zero_recompiles(model16):
    prompts = prompts_of([5, 8, 3])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=2)
    sampler = Sampler(model16, CFG)
    sampler.generate(prompts, params)  # warm-up: every bucket this workload uses is compiled
    new = perturbed(model16)
    before = _COMPILES.count
    sampler.update_weights(new)
    outs = sampler.generate(prompts, params)
    report("update_weights", recompiles=_COMPILES.count - before)
    assert _COMPILES.count == before, "update_weights + generate recompiled"
    assert all((c.policy_versions == 1).all() for o in outs for c in o.completions)
    fresh = Sampler(model_with(model16, new), CFG).generate(prompts, params)
    for o, f in zip(outs, fresh):
        for c, d in zip(o.completions, f.completions):
            assert c.tokens.tolist() == d.tokens.tolist()
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=1e-6)
