"""model.attention (models/attention.py): every implementation that runs on a CPU against a float64
numpy attention and against today's path (xla), forward and gradients, in the attention alone and
through the model (the plain pass, the shared-prompt pass of models/prefix.py, the packed forward
of runtime/packed_forward.py); the config errors.

What runs here: `xla` (the einsum path), `pallas` in Pallas interpret mode (model.attention_interpret,
the same kernel code, run by the interpreter), and the cudnn code path with cuDNN replaced by JAX's
xla implementation of the same jax.nn.dot_product_attention call (`cudnn_as_xla`: the mask, is_causal
and padding the model hands cuDNN, checked; the cuDNN kernel itself needs an NVIDIA GPU and is not
run here). Comparisons are at real queries (segment != 0): outputs at padding queries are defined by
each implementation (module docstring of models/attention.py) and must only be finite.
Tolerances: float32 throughout, one attention 2e-6 against float64 (|out| <= ~3), the model 2e-5
absolute on logprobs and 2e-5 + 1e-4 relative on parameter gradients (as test_model_prefix.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import group_rollout

from rpeg_jax.config import model_preset
from rpeg_jax.config.base import ConfigError
from rpeg_jax.models import attention as attn
from rpeg_jax.models import init_model, token_logprobs
from rpeg_jax.models.prefix import group_token_logprobs
from rpeg_jax.rl import packing
from rpeg_jax.runtime.packed_forward import packed_outputs

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, init_std=0.2)
ATOL_ATTN, ATOL_LP, RTOL_GRAD = 2e-6, 2e-5, 1e-4


# ---- references -----------------------------------------------------------------------------------
def mask_of(seg_BxT):
    t = seg_BxT.shape[1]
    same = (seg_BxT[:, :, None] == seg_BxT[:, None, :]) & (seg_BxT[:, None, :] != 0)
    return same & np.tril(np.ones((t, t), bool))[None]


def ref_attention(q, k, v, mask):
    """float64 softmax(q·kᵀ/√E)·v over the masked keys, K/V heads shared by H/K query heads, and the
    pieces the backward needs. Rows with no key are zero (never compared)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthe,bshe->bhts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshe->bthe", p, v), p


def ref_grads(q, k, v, mask, w):
    """Gradients of sum(w · out) wrt q, k, v (float64, by hand): dP = w·vᵀ, dS = P(dP - rowsum(P dP))."""
    out, p = ref_attention(q, k, v, mask)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k64, g, axis=2), np.repeat(v64, g, axis=2)
    w = np.asarray(w, np.float64)
    dp = np.einsum("bthe,bshe->bhts", w, vr)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("bhts,bshe->bthe", ds, kr)
    dk = np.einsum("bhts,bthe->bshe", ds, q64)
    dv = np.einsum("bhts,bthe->bshe", p, w)
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


# ---- the implementations --------------------------------------------------------------------------
def kernel(name):
    """(q, k, v, seg) -> out for one implementation as the model calls it."""
    if name == "cudnn_as_xla":
        mask = attn.causal_segment_mask
        return lambda q, k, v, seg: attn.sdpa_attention(q, k, v, mask(seg), causal=True, implementation="xla")
    impl = "pallas" if name == "pallas" else "xla"
    return lambda q, k, v, seg: attn.segment_attention(q, k, v, seg, impl=impl, interpret=True)


CASES = {  # segment ids [B, T]: 0 = padding
    "causal": np.ones((2, 16), np.int32),
    "padded": np.array([[0] * 4 + [1] * 6 + [0] * 3, [1] * 11 + [0] * 2], np.int32),  # T = 13: odd
    "segments": np.array([[1] * 5 + [2] * 7 + [3] * 6 + [0] * 2, [0] * 3 + [1] * 9 + [2] * 8], np.int32),
    "long": np.array([[0] * 9 + [1] * 121, [1] * 70 + [2] * 50 + [0] * 10], np.int32),  # T = 130 > one block
}
HEADS = [(4, 4), (4, 2), (4, 1), (6, 3)]


def qkv(seg, h, kh, e=16, seed=0):
    b, t = seg.shape
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, e), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, kh, e), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, kh, e), jnp.float32)
    w = jax.random.normal(ks[3], (b, t, h, e), jnp.float32) * jnp.asarray(seg != 0)[:, :, None, None]
    return q, k, v, w


# Interpret mode is slow: the Pallas kernel and the two-block length run two GQA ratios, not all.
REFERENCE_CASES = [
    (name, case, h, kh)
    for h, kh in HEADS
    for case in CASES
    for name in ("xla", "pallas", "cudnn_as_xla")
    if not ((case == "long" or name == "pallas") and (h, kh) not in ((4, 2), (6, 3)))
]


@pytest.mark.parametrize("name,case,h,kh", REFERENCE_CASES)
def test_attention_equals_float64_reference(name, case, h, kh):
    """Forward at real queries and gradients wrt q, k, v of sum(w · out), w zero at padding queries."""
    seg = CASES[case]
    q, k, v, w = qkv(seg, h, kh)
    fn = jax.jit(kernel(name))
    out = np.asarray(fn(q, k, v, jnp.asarray(seg)))
    ref, _ = ref_attention(q, k, v, mask_of(seg))
    real = seg != 0
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[real], ref[real], atol=ATOL_ATTN, rtol=0)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * fn(q, k, v, jnp.asarray(seg))), argnums=(0, 1, 2)))(q, k, v)
    for got, want, what in zip(grads, ref_grads(q, k, v, mask_of(seg), w), "qkv"):
        np.testing.assert_allclose(np.asarray(got), want, atol=5 * ATOL_ATTN, rtol=0, err_msg=f"d{what}")


def test_xla_is_todays_einsum_path():
    """model.attention=xla (and auto on a CPU) computes bitwise what gqa_attention over the causal
    segment mask computed before the key existed."""
    seg = CASES["segments"]
    q, k, v, _ = qkv(seg, 4, 2)
    today = attn.gqa_attention(q, k, v, attn.causal_segment_mask(jnp.asarray(seg)))
    np.testing.assert_array_equal(np.asarray(kernel("xla")(q, k, v, jnp.asarray(seg))), np.asarray(today))
    cfg = model_preset("tiny", **SMALL)
    assert cfg.attention == "auto" and attn.resolve_attention(cfg) == "xla"


# ---- through the model ----------------------------------------------------------------------------
@pytest.fixture
def cudnn_as_xla(monkeypatch):
    """cuDNN's availability checks pass and jax.nn.dot_product_attention runs its xla implementation;
    the calls the model made are recorded (they must have asked for cudnn)."""
    calls = []
    real = jax.nn.dot_product_attention

    def fake(*args, implementation=None, **kw):
        calls.append(dict(implementation=implementation, is_causal=kw.get("is_causal"), mask=kw["mask"].shape))
        return real(*args, implementation="xla", **kw)

    monkeypatch.setattr(attn, "_cudnn_unfit", lambda cfg: None)
    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return calls


def models_for(name, arch="llama"):
    """(today's model, the same weights under implementation `name`)."""
    kw = dict(arch="qwen2", qkv_bias=True, tie_embeddings=True) if arch == "qwen" else {}
    cfg = model_preset("tiny", value_head=True, **kw, **SMALL)
    if name == "pallas":
        other = dataclasses.replace(cfg, attention="pallas", attention_interpret=True)
    else:  # cudnn in float32: past ModelConfig.validate (which asks bf16/fp16), with cuDNN emulated
        other = dataclasses.replace(cfg, attention="cudnn")
    return init_model(dataclasses.replace(cfg, attention="xla"), seed=3), init_model(other, seed=3)


def rollout_batch(rng, b, P, R):
    """Rollout layout: prompts left-padded to P (1..P tokens), responses right-padded to R (0..R)."""
    tok, pos, seg = (np.zeros((b, P + R), np.int32) for _ in range(3))
    for i in range(b):
        lp, lr = int(rng.integers(1, P + 1)), int(rng.integers(0, R + 1))
        tok[i, P - lp : P + lr] = rng.integers(3, 128, lp + lr)
        pos[i, P - lp : P + lr] = np.arange(lp + lr)
        seg[i, P - lp : P + lr] = 1
    return tok, pos, seg, seg[:, P:] > 0


def plain(model, tok, pos, seg, P, R, **kw):
    targets = jnp.concatenate([tok[:, 1:], jnp.zeros_like(tok[:, :1])], 1)
    return token_logprobs(model, tok, pos, seg, targets, start=P - 1, length=R, **kw)


def assert_same(model0, model1, forward, mask, rng):
    """forward(model) -> (logp, entropy) [B, R]: equal at `mask`, and the gradients of a weighted
    masked sum of logp + 0.3·entropy wrt every parameter."""
    lp0, ent0 = forward(model0)
    lp1, ent1 = forward(model1)
    np.testing.assert_allclose(np.asarray(lp1)[mask], np.asarray(lp0)[mask], atol=ATOL_LP, rtol=0)
    np.testing.assert_allclose(np.asarray(ent1)[mask], np.asarray(ent0)[mask], atol=ATOL_LP, rtol=0)
    w = jnp.asarray(rng.normal(size=mask.shape) * mask, jnp.float32)

    def grads(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params):
            lp, ent = forward(nnx.merge(graphdef, params))
            return jnp.sum(jnp.where(jnp.asarray(mask), lp + 0.3 * ent, 0.0) * w)

        return jax.jit(jax.grad(loss))(params)

    g0, g1 = grads(model0), grads(model1)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=ATOL_LP, rtol=RTOL_GRAD, err_msg=str(path))


IMPLS = ["pallas", "cudnn"]


@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("name", IMPLS)
def test_model_plain_pass_equals_xla(name, arch, request):
    calls = request.getfixturevalue("cudnn_as_xla") if name == "cudnn" else None
    model0, model1 = models_for(name, arch)
    rng = np.random.default_rng(5)
    P, R = 6, 9  # T = 15: odd, padded for both kernels
    tok, pos, seg, mask = rollout_batch(rng, 6, P, R)
    fwd = lambda m: plain(m, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg), P, R, with_entropy=True)  # noqa: E731
    assert_same(model0, model1, fwd, mask, rng)
    if calls is not None:
        assert calls and all(c["implementation"] == "cudnn" and c["is_causal"] for c in calls), calls[:1]
        assert calls[0]["mask"] == (6, 1, 16, 16)  # one [T, S] mask per row, T padded to even


@pytest.mark.parametrize("name", IMPLS)
def test_shared_prompt_pass_equals_plain_xla(name, request):
    """group_token_logprobs under `name` (prompt once per group; responses through a mask or the
    kernel's segment ids) against today's plain pass over every row's copy of the prompt."""
    calls = request.getfixturevalue("cudnn_as_xla") if name == "cudnn" else None
    model0, model1 = models_for(name)
    rng = np.random.default_rng(2)
    n, G, P, R = 3, 4, 6, 7
    tok, pos, seg = group_rollout(rng, n, G, P, R)  # left-padded prompts of different lengths per group
    mask = seg[:, P:] > 0
    tok, pos, seg = jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg)

    def forward(m):
        if m is model0:
            return plain(m, tok, pos, seg, P, R, with_entropy=True)
        return group_token_logprobs(m, tok, pos, seg, response_len=R, group_size=G, with_entropy=True)

    assert_same(model0, model1, forward, mask, rng)
    if calls is not None:  # the prompts [n, 1, P, P] (causal), the responses' R - 1 input columns [P + R - 1]
        shapes = {(c["mask"], c["is_causal"]) for c in calls}
        assert shapes == {((n, 1, P, P), True), ((n * G, 1, R - 1, P + R - 1), False)}, shapes


@pytest.mark.parametrize("name", IMPLS)
def test_packed_forward_equals_padded_xla(name, request):
    """runtime/packed_forward.py under `name` (several sequences per row: the segment ids) against
    today's padded plain pass."""
    if name == "cudnn":
        request.getfixturevalue("cudnn_as_xla")
    model0, model1 = models_for(name)
    rng = np.random.default_rng(5)
    b, P, R = 10, 6, 12
    tok, pos, seg, mask = rollout_batch(rng, b, P, R)
    start, length = packing.sequence_spans(seg)
    rows, k = packing.piece_sizes(start, length, P, R)
    assert rows < b
    plan = {x: jnp.asarray(v) for x, v in packing.piece_plan(start, length, P, R, rows=rows + 1, tokens=k + 3).items()}
    assert int(jnp.max(plan["seg_NxT"])) > 1  # rows hold several segments
    tok, pos, seg = jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg)

    def forward(m):
        if m is model0:
            return plain(m, tok, pos, seg, P, R, with_entropy=True)
        out = packed_outputs(m, tok, pos, plan, entropy=True)
        return out["logp"], out["entropy"]

    assert_same(model0, model1, forward, mask, rng)


# ---- config errors --------------------------------------------------------------------------------
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU backend's refusals")
@pytest.mark.parametrize("choice", ["pallas", "cudnn"])
def test_gpu_kernels_refused_on_cpu(choice):
    """One line naming model.attention and the value, from the config check and from the model's
    forward while it traces (before XLA compiles anything)."""
    cfg = model_preset("tiny", attention=choice, dtype="bfloat16", **SMALL)
    with pytest.raises(ConfigError, match=f"^config error: model.attention='{choice}': .*needs") as err:
        attn.resolve_attention(cfg)
    assert "\n" not in str(err.value)
    model = init_model(cfg, seed=0)
    tok = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ConfigError, match=f"model.attention='{choice}'"):
        jax.jit(lambda t: model(t)).lower(tok)


def test_config_errors():
    with pytest.raises(ConfigError, match="model.attention='cudnn': .*bfloat16 or float16, not float32"):
        model_preset("tiny", attention="cudnn")
    with pytest.raises(ConfigError, match="model.attention_interpret=True: .*pallas, not xla"):
        model_preset("tiny", attention="xla", attention_interpret=True)
    with pytest.raises(ConfigError, match="model.attention='flash'"):
        model_preset("tiny", attention="flash")
    assert attn.resolve_attention(model_preset("tiny", attention="pallas", attention_interpret=True)) == "pallas"
