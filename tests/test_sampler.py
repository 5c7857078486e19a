"""End-to-end tests of the paged sampler against independent references: argmax decoding with the model's
plain forward (no cache) on the Hugging Face fixtures, the trainer's `token_logprobs` (float32, 1e-5),
runs with other page sizes / chunk sizes / slot counts / prompt orders / a pool small enough to
preempt, an unshared run of a GRPO group, stop conditions, and in-place weight updates (zero
recompiles). Most tests share the llama_tiny fixture and one engine shape, so compiled code is reused."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import prompts_of, sampler_trainer_gap

from rpeg_jax.models import load_hf
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sampling import forward as sampling_forward

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
# One bucket of each kind per engine shape (prefill rows/length, page-table width): one compile each.
FIXED = dict(max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16)
BASE = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, **FIXED)
OTHER = SamplerConfig(page_size=3, max_slots=1, chunk_steps=5, **FIXED)  # another page size, chunk and slot count
# float32 logprob agreement between sampler runs of other engine shapes (batch rows, page size,
# key columns: other GEMM kernels and reduction lengths). Max 2e-5 per token (was 1e-5: after the
# Gumbel source changed, other draws measured 1.14e-5 at one token of 84, the same floor as the
# trainer comparison below) and mean 2e-6 over a run, so a systematic shift still fails.
LP_TOL, LP_MEAN_TOL = 2e-5, 2e-6
# Sampler vs the trainer's teacher-forced forward (float32, "~1e-5"): paged decode attention and the
# trainer's dense attention round differently (other reduction orders and padding); the measured
# floor on these fixtures is max |d| ~1.0e-5 .. 1.4e-5 and mean ~1.5e-6 over all response tokens.
TRAINER_MAX, TRAINER_MEAN = 2e-5, 2e-6


@pytest.fixture(scope="module")
def llama():
    return load_hf(os.path.join(HF, "llama_tiny"))


def greedy_reference(model, prompts, max_new):
    """Argmax decoding with the plain forward pass over the whole sequence each step (no cache)."""
    width = max(map(len, prompts)) + max_new
    fwd = jax.jit(lambda t: model(t))
    seqs = [list(p) for p in prompts]
    for _ in range(max_new):
        toks = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            toks[i, : len(s)] = s
        logits = np.asarray(fwd(jnp.asarray(toks)))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts)], fwd


def flat(outs):
    return [
        (o.prompt_index, c.sample_index, c.tokens.tolist(), c.logprobs, c.finish_reason)
        for o in outs
        for c in o.completions
    ]


def assert_same(a, b, tol=LP_TOL):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:3] == y[:3], f"tokens differ for prompt {x[0]} sample {x[1]}"
        np.testing.assert_allclose(x[3], y[3], atol=tol)
        assert x[4] == y[4]
    d = np.concatenate([np.abs(np.asarray(x[3], np.float64) - y[3]) for x, y in zip(a, b)] or [np.zeros(1)])
    assert d.mean() <= LP_MEAN_TOL, f"mean |logprob difference| {d.mean():.2e} > {LP_MEAN_TOL}"


@pytest.mark.parametrize(
    "name,forward,attention",
    [
        ("llama_tiny", "split", "chunk"),
        ("qwen2_tiny", "split", "chunk"),
        ("qwen2_tiny", "model", "gather"),
        ("llama_tiny", "split_t", "chunk"),
        ("qwen2_tiny", "split_t", "gather"),
        ("llama_tiny", "model", "chunk"),
        ("qwen3_tiny", "split_t", "chunk"),  # q/k norm in the per-layer forward's own layer
        ("qwen3_tiny", "model", "gather"),
        ("qwen2_tiny", "split_unfused", "chunk"),  # separate q/k/v (with biases) and gate/up products
        ("llama_tiny", "split_t_unfused", "chunk"),
    ],
)
def test_greedy_equals_plain_forward_argmax_on_hf_fixtures(name, forward, attention, llama, monkeypatch):
    """Every sampler forward (the model's own; per-layer weights, products fused or not; transposed
    per-layer weights) and decode attention (pages gathered per step or per chunk) against the plain
    forward."""
    if forward.endswith("_unfused"):  # the fixtures' layers are small enough to be fused by default
        monkeypatch.setattr(sampling_forward, "FUSE_MAX_LAYER_BYTES", -1)
        forward = forward.removesuffix("_unfused")
    model = llama if name == "llama_tiny" else load_hf(os.path.join(HF, name))
    prompts = prompts_of([5, 1, 9, 4, 7])
    sampler = Sampler(model, dataclasses.replace(BASE, forward=forward, attention=attention))
    if forward.startswith("split"):  # the products are laid out as the size rule says
        fused = sampling_forward.layer_bytes(model.cfg) <= sampling_forward.FUSE_MAX_LAYER_BYTES
        assert sampler._fwd.fused == fused and ("wqkv" in sampler._weights["layers"][0]) == fused
    outs = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    ref, fwd = greedy_reference(model, prompts, 16)
    for o, r, p in zip(outs, ref, prompts):
        c = o.completions[0]
        assert c.tokens.tolist() == r and c.finish_reason == "length"
        # greedy logprob = log_softmax(logits)[token] of the plain forward
        seq = np.asarray([p + r], np.int32)
        logits = np.asarray(fwd(jnp.asarray(np.pad(seq, ((0, 0), (0, 32 - seq.shape[1]))))))[0]
        ls = jax.nn.log_softmax(logits[len(p) - 1 : len(p) + 15], axis=-1)
        np.testing.assert_allclose(
            c.logprobs, np.take_along_axis(np.asarray(ls), np.asarray(r)[:, None], 1)[:, 0], atol=LP_TOL
        )


def test_logprobs_equal_trainer_forward(llama):
    for temp in (1.0, 0.7):
        err, mask = sampler_trainer_gap(llama, BASE, temp)
        assert err.max() < TRAINER_MAX, f"max |sampler - trainer| = {err.max():.2e} at T={temp}"
        assert err.sum() / mask.sum() < TRAINER_MEAN, f"mean |sampler - trainer| = {err.sum() / mask.sum():.2e}"


SAMPLED = SamplingParams(n=2, temperature=1.0, top_k=40, max_new_tokens=14, seed=11)


@pytest.fixture(scope="module")
def baseline(llama):
    prompts = prompts_of([7, 2, 10, 5, 9, 3], seed=1)
    return prompts, flat(Sampler(llama, BASE).generate(prompts, SAMPLED))


def test_invariant_to_page_size_chunk_size_slots_and_order(llama, baseline):
    prompts, ref = baseline
    order = [5, 2, 0, 4, 1, 3]
    outs = Sampler(llama, OTHER).generate([prompts[i] for i in order], SAMPLED, prompt_ids=order)
    got = sorted(flat(outs), key=lambda x: (order[x[0]], x[1]))
    assert_same([(order[g[0]],) + g[1:] for g in got], ref)


def test_invariant_under_preemption(llama, baseline):
    prompts, ref = baseline
    tiny = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, num_pages=12, watermark=0.0, **FIXED)
    sampler = Sampler(llama, tiny)
    outs = sampler.generate(prompts, SAMPLED)
    assert_same(flat(outs), ref)
    assert sampler.stats()["preemptions"] > 0
    assert sum(c.num_preemptions for o in outs for c in o.completions) == sampler.stats()["preemptions"]
    assert sampler.stats()["pages_used"] == 0  # every page came back


def test_grpo_group_prefills_once_shares_pages_and_equals_unshared_run(llama):
    prompt = prompts_of([10], seed=2)  # 9 prefilled tokens: 2 full pages + 1 partial page of 4
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=3)
    probe = Sampler(llama, BASE)  # host bookkeeping only: admit, inspect, never run
    probe.submit(prompt, params)
    plan = probe.sched.admit(k=1)
    assert len(plan.rows) == 1 and len(plan.rows[0][1]) == 9, "one prefill for the group"
    assert len(plan.copies) == 7 and probe.alloc.num_used == 2 + 8  # full pages + G x partial page
    table = probe.alloc.table(range(8), 4)
    assert (table[:, :2] == table[0, :2]).all() and len(set(table[:, 2].tolist())) == 8

    shared = Sampler(llama, BASE)
    outs = shared.generate(prompt, params)
    assert shared.stats()["prefill_tokens"] == 9 and shared.stats()["page_copies"] == 7
    unshared = Sampler(llama, OTHER)
    ref = unshared.generate(prompt, params)  # max_slots=1: each sample is prefilled on its own
    assert unshared.stats()["page_copies"] == 0 and unshared.stats()["prefill_tokens"] == 8 * 9
    assert_same(flat(outs), flat(ref))


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        dict(page_size=1),
        dict(page_size=16),
        dict(page_size=64, max_seq_len=64),
        dict(chunk_steps=1),
        dict(max_slots=3),
        dict(max_slots=5, num_pages=13, page_size=3, watermark=0.0),
        dict(min_chunk_steps=1),
        dict(min_table_width=1),
        dict(attention="blocked", block_pages=2),
        dict(attention="gather"),
        dict(attention="chunk"),
        dict(forward="model"),
        dict(forward="split_t"),
        dict(table_width_growth=1.5),
        dict(chunk_steps=24),
    ],
)  # chunk_steps > chunk_attention.FLUSH_BLOCK: a multi-block flush
def test_invariance_matrix(llama, baseline, variant):
    """Each factor on its own (the default run covers them combined)."""
    prompts, ref = baseline
    cfg = dict(page_size=4, max_slots=8, chunk_steps=8, **FIXED)
    cfg.update(variant)
    order = list(range(len(prompts)))[::-1] if variant.get("max_slots") == 3 else list(range(len(prompts)))
    sampler = Sampler(llama, SamplerConfig(**cfg))
    outs = sampler.generate([prompts[i] for i in order], SAMPLED, prompt_ids=order)
    got = sorted(flat(outs), key=lambda x: (order[x[0]], x[1]))
    assert_same([(order[g[0]],) + g[1:] for g in got], ref)
    if "num_pages" in variant:
        assert sampler.stats()["preemptions"] > 0
