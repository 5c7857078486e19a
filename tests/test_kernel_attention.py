"""The "kernel" decode attention (sampling/kernel_attention.py: JAX's Pallas paged-attention kernel
reading the pools in place), run through the Pallas interpreter on CPU.

Against a float64 numpy dense reference over the gathered pages (independent of the kernel's
layout trick and of the sampler's gather path): ragged lengths 0 (inactive), 1, every length of a
short table, exactly at page boundaries, up to the table's last column, page sizes 16/32/64, GQA
ratios 1/2/4 and MQA, the pools' random values everywhere else (stale pages, the tails of partial
pages and the table's unused columns) so masking is tested; the per-head-shard shard_map on a
tensor mesh. End to end on the Hugging Face fixtures: `attention="kernel"` with kernel_interpret
gives the gather path's greedy tokens and logprobs within 1e-5, on one device and with the pool
split over data=2 and kv heads over tensor=2. And the backend checks: "kernel" on CPU without the
interpreter is a one-line ConfigError naming the key (sampler.* or rollout.*), before anything is
compiled."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import shard
from jax.sharding import AxisType

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.rollout import RolloutConfig, resolve_attention
from rpeg_jax.models import load_hf
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sampling.kernel_attention import attend_kernel, kernel_blocks

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
ATOL = 2e-6  # float32 kernel vs float64 reference, O(1) inputs, up to 256 key columns
LP_ATOL, LP_RTOL = 1e-5, 1e-5  # float32 logprobs, kernel vs gather sampler (a log-sum-exp of ~2 rounds by ~1e-5)
TF32_ATOL, TF32_LP_ATOL = 5e-3, 1e-2  # on a GPU: the compiled kernel's float32 products are TF32


def reference(q_BxHxE, k_pool, v_pool, layer, table_BxW, kv_len_B):
    """float64 dense attention of each slot's query over its first kv_len key columns."""
    b, h, e = q_BxHxE.shape
    kh = k_pool.shape[1]
    g = h // kh
    out = np.zeros((b, h, e))
    for i in range(b):
        n = int(kv_len_B[i])
        if n == 0:
            continue
        k = np.asarray(k_pool[layer][:, table_BxW[i]], np.float64).reshape(kh, -1, e)[:, :n]  # [K, n, E]
        v = np.asarray(v_pool[layer][:, table_BxW[i]], np.float64).reshape(kh, -1, e)[:, :n]
        for j in range(h):
            sc = k[j // g] @ np.asarray(q_BxHxE[i, j], np.float64) / np.sqrt(e)
            p = np.exp(sc - sc.max())
            out[i, j] = (p / p.sum()) @ v[j // g]
    return out


def case(page_size, kv_heads, q_heads, width, lengths, layers=3, head_dim=16, seed=0):
    """Random pools (values everywhere, so anything unmasked shows), tables of distinct random
    pages (no null pages either: unused columns hold stale ids), one query per slot."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    pages = b * width + 1
    shape = (layers, kv_heads, pages, page_size, head_dim)
    k_pool, v_pool = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    table = rng.permutation(np.arange(1, pages))[: b * width].reshape(b, width).astype(np.int32)
    q = rng.normal(size=(b, q_heads, head_dim)).astype(np.float32)
    return q, k_pool, v_pool, table, np.asarray(lengths, np.int32)


@jax.jit
def _kernel(q, k_pool, v_pool, layer, table, lengths):  # a traced layer, as under the model's scan
    return attend_kernel(q[:, None], k_pool, v_pool, layer, table, lengths, interpret=True)[:, 0]


def check(q, k_pool, v_pool, table, lengths, layer=1, fn=_kernel):
    got = np.asarray(fn(q, k_pool, v_pool, jnp.int32(layer), table, lengths))
    want = reference(q, k_pool, v_pool, layer, table, lengths)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def boundary_lengths(s, w):
    """0 (inactive), 1, page boundaries and their neighbours, and the table's last column."""
    return [0, 1, 2, s - 1, s, s + 1, 2 * s, 2 * s + 3, w * s - 1, w * s]


@pytest.mark.parametrize(
    "page_size,kv_heads,q_heads",
    [(16, 2, 2), (32, 2, 4), (64, 1, 4), (16, 2, 8)],  # GQA ratios 1, 2, 4 (MQA), 4
)
def test_kernel_equals_float64_reference(page_size, kv_heads, q_heads):
    width = 4
    check(*case(page_size, kv_heads, q_heads, width, boundary_lengths(page_size, width)))


def test_every_length_of_a_table():
    """Every length 1..W*S (and 0) in one batch; the last layer (largest page-id offset)."""
    s, w = 16, 3
    check(*case(s, 2, 4, w, list(range(w * s + 1))), layer=2)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("kv_heads,q_heads", [(4, 4), (2, 4), (2, 8), (1, 4), (1, 1)])
@pytest.mark.parametrize("width", [1, 5, 16])
def test_kernel_matrix(page_size, kv_heads, q_heads, width):
    """Page sizes x GQA ratios x table widths (1, an odd width the kernel's blocks pad, 16 pages
    split into partitions), ragged random lengths plus the boundary ones."""
    rng = np.random.default_rng(page_size * 100 + width)
    lengths = [n for n in boundary_lengths(page_size, width) if n <= width * page_size]
    lengths += rng.integers(1, width * page_size + 1, size=6).tolist()
    check(*case(page_size, kv_heads, q_heads, width, lengths, seed=width), layer=int(rng.integers(0, 3)))


def test_kernel_blocks_fit_the_kernel():
    """The kernel's divisibility rules and power-of-two blocks, for every table width."""
    for s in (1, 3, 4, 16, 32, 64, 128):
        for w in range(1, 300):
            ppcb, splits, width = kernel_blocks(w, s)
            assert width >= w and width % splits == 0 and (width // splits) % ppcb == 0
            assert ppcb & (ppcb - 1) == 0 and ppcb <= max(1, w)
            assert width - w < splits * ppcb  # at most one block of padding per partition


def test_heads_sharded_over_tensor_mesh():
    """kv heads (and their query heads) split over tensor=2: the kernel per head shard."""
    mesh = jax.make_mesh((2,), ("tensor",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    fn = jax.jit(
        lambda q, kp, vp, layer, t, n: attend_kernel(q[:, None], kp, vp, layer, t, n, interpret=True, heads_mesh=mesh)[
            :, 0
        ]
    )
    q, k_pool, v_pool, table, lengths = case(32, 2, 4, 4, boundary_lengths(32, 4))
    check(q, k_pool, v_pool, table, lengths, fn=fn)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_compiled_kernel_on_gpu(page_size):
    """The Triton-compiled kernel (no interpreter) against the same reference, GQA 2 and MQA. Its
    float32 products are TF32 (the kernel's `dot` at default precision; docs/kernels.md)."""
    compiled = jax.jit(lambda q, kp, vp, layer, t, n: attend_kernel(q[:, None], kp, vp, layer, t, n, interpret=False))
    for kv_heads in (2, 1):
        q, k_pool, v_pool, table, lengths = case(page_size, kv_heads, 4, 4, boundary_lengths(page_size, 4))
        got = np.asarray(compiled(q, k_pool, v_pool, jnp.int32(1), table, lengths))[:, 0]
        np.testing.assert_allclose(got, reference(q, k_pool, v_pool, 1, table, lengths), atol=TF32_ATOL, rtol=0)


# ---- end to end on the Hugging Face fixtures ----------------------------------------------------
FIXED = dict(max_seq_len=48, min_prefill_len=32, min_prefill_rows=8, min_table_width=4)
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=30, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=30, seed=5)


def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 128, size=n).tolist() for n in (7, 2, 10, 5, 16, 3)]  # 16 + 1: a page boundary


def assert_same(outs, ref):
    for o, r in zip(outs, ref, strict=True):
        for c, d in zip(o.completions, r.completions, strict=True):
            assert c.tokens.tolist() == d.tokens.tolist()
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=LP_ATOL, rtol=LP_RTOL)


@pytest.mark.parametrize("name,forward", [("llama_tiny", "split"), ("qwen2_tiny", "model"), ("qwen3_tiny", "split")])
def test_sampler_kernel_equals_gather_on_hf_fixtures(name, forward):
    """Greedy (and sampled) tokens equal and logprobs within 1e-5: sequences cross page
    boundaries (page 16, prompts + 30 tokens up to 46 positions: the table's third page)."""
    model = load_hf(os.path.join(HF, name))
    base = dict(page_size=16, max_slots=8, chunk_steps=8, forward=forward, **FIXED)
    ref = Sampler(model, SamplerConfig(attention="gather", **base))
    kern = Sampler(model, SamplerConfig(attention="kernel", kernel_interpret=True, **base))
    assert kern._attention == "kernel"
    for params in (GREEDY, SAMPLED):
        assert_same(kern.generate(prompts(), params), ref.generate(prompts(), params))


def test_sampler_kernel_sharded_pool_and_heads():
    """The pool split over data=2 (the engine's shard_map) and kv heads over tensor=2 (the kernel's
    own shard_map inside it), tensor-sharded parameters, against the single-device gather run."""
    model = load_hf(os.path.join(HF, "llama_tiny"))
    base = dict(page_size=16, max_slots=8, chunk_steps=8, forward="model", **FIXED)
    ref = Sampler(model, SamplerConfig(attention="gather", **base))
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    kern = Sampler(shard(model, mesh), SamplerConfig(attention="kernel", kernel_interpret=True, **base))
    assert kern.stats()["pool_shards"] == 2 and kern.sharding.heads_sharded and kern._heads_mesh is not None
    for params in (GREEDY, SAMPLED):
        assert_same(kern.generate(prompts(), params), ref.generate(prompts(), params))


@pytest.mark.gpu
def test_sampler_auto_on_gpu_is_the_kernel_and_equals_gather():
    model = load_hf(os.path.join(HF, "llama_tiny"))
    base = dict(page_size=16, max_slots=8, chunk_steps=8, **FIXED)
    kern, ref = Sampler(model, SamplerConfig(**base)), Sampler(model, SamplerConfig(attention="gather", **base))
    assert kern._attention == "kernel"
    matched = total = 0  # TF32 products: compare each greedy run up to its first differing token
    for o, r in zip(kern.generate(prompts(), GREEDY), ref.generate(prompts(), GREEDY), strict=True):
        for c, d in zip(o.completions, r.completions, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(c.tokens, d.tokens)) if x != y), len(c.tokens))
            np.testing.assert_allclose(c.logprobs[:n], d.logprobs[:n], atol=TF32_LP_ATOL, rtol=0)
            matched, total = matched + n, total + len(c.tokens)
    assert matched >= 0.9 * total, f"greedy tokens agree on {matched} of {total}"


# ---- backend checks --------------------------------------------------------------------------
def test_kernel_on_cpu_without_interpreter_is_one_config_error():
    model = load_hf(os.path.join(HF, "llama_tiny"))
    with pytest.raises(ConfigError, match=r"^config error: sampler\.attention='kernel': .*needs a GPU") as err:
        Sampler(model, SamplerConfig(attention="kernel"))
    assert "\n" not in str(err.value)
    r = RolloutConfig(attention="kernel")
    with pytest.raises(ConfigError, match=r"rollout\.attention='kernel'.*rollout\.kernel_interpret=true"):
        Sampler(model, SamplerConfig.from_rollout(r, max_slots=4, max_seq_len=32))
    Sampler(model, SamplerConfig.from_rollout(RolloutConfig(attention="kernel", kernel_interpret=True), max_slots=4))


def test_attention_resolution_and_gpu_block_rules():
    fit = dict(page_size=16, head_dim=64)
    assert [resolve_attention("auto", b, **fit) for b in ("cpu", "gpu", "tpu")] == ["chunk", "kernel", "gather"]
    assert resolve_attention("gather", "gpu", **fit) == "gather"
    # auto on a GPU takes the kernel only where its Triton blocks fit, else the gather attention
    assert resolve_attention("auto", "gpu", page_size=4, head_dim=64) == "gather"
    assert resolve_attention("auto", "gpu", page_size=16, head_dim=48) == "gather"
    assert resolve_attention("kernel", "gpu", page_size=4, head_dim=64) == "kernel"  # explicit: kept, refused below
    SamplerConfig(attention="auto").check_backend("cpu", head_dim=8)  # auto on CPU: chunk, no rules
    SamplerConfig(attention="auto", page_size=16).check_backend("gpu", head_dim=64)
    SamplerConfig(attention="auto", page_size=4).check_backend("gpu", head_dim=64)  # auto = gather there
    with pytest.raises(ConfigError, match=r"sampler\.page_size=4"):
        SamplerConfig(attention="kernel", page_size=4).check_backend("gpu", head_dim=64)
    with pytest.raises(ConfigError, match=r"model\.head_dim=48"):
        SamplerConfig(attention="kernel", page_size=32).check_backend("gpu", head_dim=48)
    with pytest.raises(ConfigError, match=r"sampler\.attention='kernel'"):
        SamplerConfig(attention="kernel").check_backend("tpu", head_dim=64)
    SamplerConfig(attention="kernel", kernel_interpret=True, page_size=4).check_backend("tpu", head_dim=8)
    with pytest.raises(ConfigError, match=r"rollout\.attention"):
        RolloutConfig(attention="fused").validate("rollout")
