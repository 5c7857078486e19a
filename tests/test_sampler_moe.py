"""The paged sampler on a Qwen3-MoE model (tests/fixtures/hf/qwen3_moe_tiny: 4 experts top-2, layer 1
dense, logits equal to transformers' to 9e-8, tests/test_moe.py).

References: greedy decoding with the model's own plain forward recomputed over the whole sequence
each step (no cache, no pages) for every sampler forward; the experts the sampler records for each
token (Completion.experts) against the top-k sets of the model's own full forward
(`Transformer.hidden_routed`); and a KV pool split over `data` on 4 CPU devices against the
single-device sampler (GRPO groups forked inside a shard, and a pool small enough to preempt, where
the resumed sequences' records come from the recompute prefill)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from rpeg_jax.models import load_hf
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FIXED = dict(max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16)
BASE = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, **FIXED)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
LP_TOL = 2e-5  # float32 logprobs, sampler vs the plain forward (as tests/test_sampler.py)


@pytest.fixture(scope="module")
def moe():
    return load_hf(os.path.join(HF, "qwen3_moe_tiny"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(0, 64, size=n).tolist() for n in (5, 1, 9, 4, 7)]


def full_forward_greedy(model, prompts, max_new):
    """Argmax decoding with the plain forward over the whole sequence each step; also the logits and
    the experts (sorted top-k per sparse layer) of the final sequences."""
    width = max(map(len, prompts)) + max_new
    fwd = jax.jit(lambda t: model.hidden_routed(t))
    seqs = [list(p) for p in prompts]

    def run():
        toks = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            toks[i, : len(s)] = s
        h, _, route = fwd(jnp.asarray(toks))
        return np.asarray(model.logits(h)), np.sort(np.asarray(route["experts"]), axis=-1)

    for _ in range(max_new):
        logits, _ = run()
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    logits, experts = run()
    return [s[len(p) :] for s, p in zip(seqs, prompts)], logits, experts


@pytest.fixture(scope="module")
def reference(moe, prompts):
    return full_forward_greedy(moe, prompts, 16)


@pytest.mark.parametrize(
    "forward,attention", [("model", "gather"), ("split", "chunk"), ("split_t", "chunk"), ("model", "chunk")]
)
def test_greedy_equals_full_forward_and_records_experts(moe, prompts, reference, forward, attention):
    """Tokens equal the plain forward's argmax decoding, logprobs its log-softmax, and every run
    token's recorded experts (prompt and generated; all but the last token, which no step runs) are
    the plain forward's top-k set in each sparse layer."""
    ref_tokens, logits, experts = reference
    sampler = Sampler(moe, dataclasses.replace(BASE, forward=forward, attention=attention))
    outs = sampler.generate(prompts, GREEDY)
    s = sum(moe.cfg.sparse_layers)
    assert s == 2
    for i, (o, r, p) in enumerate(zip(outs, ref_tokens, prompts)):
        c = o.completions[0]
        assert c.tokens.tolist() == r and c.finish_reason == "length"
        ls = np.asarray(jax.nn.log_softmax(logits[i, len(p) - 1 : len(p) + 15], axis=-1))
        np.testing.assert_allclose(c.logprobs, np.take_along_axis(ls, np.asarray(r)[:, None], 1)[:, 0], atol=LP_TOL)
        n = len(p) + len(r)
        assert c.experts.shape == (n, s, 2) and c.experts.dtype == np.int16
        np.testing.assert_array_equal(np.sort(c.experts[: n - 1], axis=-1), experts[i, : n - 1])
        assert (c.experts[n - 1] == -1).all()  # the last token never ran
        assert len(np.unique(c.experts[: n - 1])) > 1  # the record is not constant


def test_dense_model_records_nothing():
    model = load_hf(os.path.join(HF, "qwen3_tiny"))
    outs = Sampler(model, BASE).generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert outs[0].completions[0].experts is None


SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=14, seed=5)


def _data_mesh(d):
    return jax.make_mesh((d,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:d])


def _assert_same(outs, ref):
    for o, r in zip(outs, ref, strict=True):
        for c, d in zip(o.completions, r.completions, strict=True):
            assert c.tokens.tolist() == d.tokens.tolist()
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(np.sort(c.experts, -1), np.sort(d.experts, -1))


@pytest.mark.parametrize("num_pages", [pytest.param(None, marks=pytest.mark.slow), 36])  # 36: the same pool, preempting
def test_sharded_pool_equals_single_device(moe, prompts, num_pages):
    """data=4 (pool split over data, groups of n=2 forked inside a shard) against one device, sampled
    and greedy; num_pages=36 (9 per shard: one maximal 8-page sequence fits, a group of two ~6-page
    ones does not) forces preemptions, whose recompute prefill re-records the experts."""
    cfg = dataclasses.replace(BASE, attention="chunk", **({"num_pages": num_pages} if num_pages else {}))
    grp = dataclasses.replace(GREEDY, n=2, max_new_tokens=14)
    ref = [Sampler(moe, dataclasses.replace(BASE, attention="chunk")).generate(prompts, p) for p in (SAMPLED, grp)]
    sampler = Sampler(moe, cfg, mesh=_data_mesh(4))
    assert sampler.stats()["pool_shards"] == 4
    outs = [sampler.generate(prompts, p) for p in (SAMPLED, grp)]
    for o, r in zip(outs, ref):
        _assert_same(o, r)
    if num_pages:
        assert sampler.stats()["preemptions"] > 0


def test_data2_tensor2_model_forward_equals_single_device(moe, prompts):
    """Parameters over `tensor` (heads, kv heads, the experts' and the dense MLP's width), the pool
    over `data` = 2, the model's own forward with "gather" attention (the GPU defaults)."""
    from helpers import shard

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    cfg = dataclasses.replace(BASE, attention="gather", forward="model")
    ref = [Sampler(moe, cfg).generate(prompts, p) for p in (SAMPLED, GREEDY)]
    sharded = shard(moe, mesh)
    assert len(sharded.layers.we_gate[...].sharding.device_set) == 4
    sampler = Sampler(sharded, cfg)
    assert sampler.stats()["pool_shards"] == 2
    for o, r in zip([sampler.generate(prompts, p) for p in (SAMPLED, GREEDY)], ref):
        _assert_same(o, r)
