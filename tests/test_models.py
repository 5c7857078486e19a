"""The decoder against independent references: a float64 numpy attention/decoder, padding and
packing invariance, chunked logprobs vs a full log-softmax, remat, and the HF save/load round trip."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rpeg_jax.config import model_preset
from rpeg_jax.config.model import RopeScaling
from rpeg_jax.models import init_model, load_hf, save_hf, token_logprobs

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, init_std=0.2)


@pytest.fixture(scope="module")
def qwen():
    return init_model(model_preset("tiny", arch="qwen2", qkv_bias=True, tie_embeddings=True, **SMALL), seed=1)


def qwen3_model(seed: int, **kw):
    """A Qwen3-shaped model: head_dim 32 (!= hidden / heads = 16) and random q/k norm scales U(0.5, 1.5)
    (initialised to ones, a missing or misplaced norm would go unseen)."""
    m = init_model(model_preset("tiny", arch="qwen3", qk_norm=True, head_dim=32, **{**SMALL, **kw}), seed=seed)
    rng = np.random.default_rng(seed)
    for norm in (m.layers.q_norm, m.layers.k_norm):
        norm.set_value(jnp.asarray(rng.uniform(0.5, 1.5, norm[...].shape), norm[...].dtype))
    return m


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_model(seed=1)


def _np_params(model):
    return {k: np.asarray(v, np.float64) for k, v in model.layers.stacked().items()}


def numpy_decoder(model, tokens, positions, rnd=None, per_op_sigmoid=False):
    """A float64 re-implementation from the Llama/Qwen2/Qwen3 equations (one sequence, no padding).

    With `rnd` (round to bfloat16) it emulates the model's low-precision compute: every value the
    model stores in its compute dtype goes through `rnd` where the model rounds it (weights, the
    embedding, each product's output, biases, the residual stream after each add, norm outputs,
    rope outputs, attention probabilities and output, each SwiGLU op: the sigmoid's exp/add/divide
    each when `per_op_sigmoid`, XLA's expansion of the logistic), while what the model promises to
    keep in float32 stays unrounded: norm statistics, rope angles, attention scores and softmax,
    the logits' accumulation (models/llama.py, attention.py, rope.py)."""
    cfg = model.cfg
    r = rnd or (lambda a: a)
    p = _np_params(model)
    e, h, k = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, e, 2) / e)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):  # x [T, N, E], rotate-half convention
        x1, x2 = x[..., : e // 2], x[..., e // 2 :]
        return r(np.concatenate([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1))

    def norm(x, w):
        return r(r(w) * r(x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps)))

    def sigmoid(a):
        return r(1 / r(1 + r(np.exp(-a)))) if per_op_sigmoid else r(1 / (1 + np.exp(-a)))

    x = r(np.asarray(model.embed[...], np.float64)[tokens])
    t = len(tokens)
    for layer in range(cfg.num_layers):
        g = lambda n: r(p[n][layer])  # noqa: E731
        y = norm(x, p["attn_norm"][layer])
        q, kk, v = (r(np.einsum("td,dhe->the", y, g(w))) for w in ("wq", "wk", "wv"))
        if "bq" in p:
            q, kk, v = r(q + g("bq")), r(kk + g("bk")), r(v + g("bv"))
        if "q_norm" in p:  # Qwen3: RMSNorm of each head over head_dim, before RoPE
            q, kk = norm(q, p["q_norm"][layer]), norm(kk, p["k_norm"][layer])
        q, kk = rope(q), rope(kk)
        out = np.zeros((t, h, e))
        for head in range(h):
            kv = head // (h // k)
            s = q[:, head] @ kk[:, kv].T / np.sqrt(e)
            s = np.where(np.tril(np.ones((t, t))) > 0, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = r(w / w.sum(-1, keepdims=True)) @ v[:, kv]
        x = r(x + r(np.einsum("the,hed->td", r(out), g("wo"))))
        y = norm(x, p["mlp_norm"][layer])
        a, up = r(y @ g("w_gate")), r(y @ g("w_up"))
        x = r(x + r(r(r(a * sigmoid(a)) * up) @ g("w_down")))
    x = norm(x, np.asarray(model.final_norm[...], np.float64))
    return x @ r(np.asarray(model.output_matrix(), np.float64))


@pytest.mark.parametrize("name", ["qwen", "qwen3"])
def test_matches_float64_numpy_decoder(name, request):
    model = request.getfixturevalue(name)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 128, size=12)
    ref = numpy_decoder(model, tokens, np.arange(12))
    ours = np.asarray(model(jnp.asarray(tokens[None], jnp.int32)))[0]
    assert np.abs(ref).max() > 1.0  # logits far from uniform, so the comparison is sensitive
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen", "qwen3"])
def test_left_padding_and_packing_invariance(name, request):
    qwen = request.getfixturevalue(name)
    rng = np.random.default_rng(1)
    a, b = rng.integers(3, 128, size=7), rng.integers(3, 128, size=5)
    la = np.asarray(qwen(jnp.asarray(a[None], jnp.int32)))[0]
    lb = np.asarray(qwen(jnp.asarray(b[None], jnp.int32)))[0]
    # left padding: 4 pads, positions count real tokens only, pads are segment 0
    tok = np.concatenate([np.zeros(4, int), a])[None]
    seg = (np.arange(11) >= 4).astype(np.int32)[None]
    pos = np.maximum(np.cumsum(seg, -1) - 1, 0)
    lp = np.asarray(qwen(jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(seg)))[0]
    np.testing.assert_allclose(lp[4:], la, atol=2e-5, rtol=0)
    # packing: a and b in one row as segments 1 and 2 with restarting positions
    tok = np.concatenate([a, b])[None]
    seg = np.array([[1] * 7 + [2] * 5], np.int32)
    pos = np.array([list(range(7)) + list(range(5))], np.int32)
    lk = np.asarray(qwen(jnp.asarray(tok, jnp.int32), jnp.asarray(pos), jnp.asarray(seg)))[0]
    np.testing.assert_allclose(lk[:7], la, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lk[7:], lb, atol=2e-5, rtol=0)


def test_chunked_logprobs_equal_full_log_softmax_and_gradients(qwen):
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(3, 128, size=(3, 16)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    full = np.asarray(qwen(tokens), np.float64) / 0.7
    ref = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    ref_lp = np.take_along_axis(ref, np.asarray(targets)[..., None], -1)[..., 0][:, 4:13]
    ref_ent = -(np.exp(ref) * ref).sum(-1)[:, 4:13]
    lp, ent = token_logprobs(
        qwen, tokens, None, None, targets, start=4, length=9, chunk=4, temperature=0.7, with_entropy=True
    )
    np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=0)

    graphdef, params = nnx.split(qwen, nnx.Param)

    def loss(params, chunk):
        m = nnx.merge(graphdef, params)
        if chunk is None:  # naive: full logits
            logits = m(tokens)[:, 4:13]
            lps = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[:, 4:13, None], -1)[..., 0]
        else:
            lps, _ = token_logprobs(m, tokens, None, None, targets, start=4, length=9, chunk=chunk)
        return lps.sum()

    g_naive = jax.grad(loss)(params, None)
    g_chunk = jax.grad(loss)(params, 2)
    for x, y in zip(jax.tree.leaves(g_naive), jax.tree.leaves(g_chunk)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=1e-4)


def test_remat_gives_same_gradients():
    cfg = model_preset("tiny", **SMALL)
    tokens = jnp.asarray(np.random.default_rng(3).integers(3, 128, size=(2, 8)), jnp.int32)
    grads = []
    for remat in ("none", "full", "dots"):
        m = init_model(model_preset("tiny", remat=remat, **SMALL), seed=4)
        gd, params = nnx.split(m, nnx.Param)
        grads.append(jax.grad(lambda p: nnx.merge(gd, p)(tokens).sum())(params))
    assert cfg.remat == "none"
    for other in grads[1:]:
        for x, y in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(other)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5)


def test_unrolled_layers_equal_scanned():
    """model.scan_layers: the unrolled loop (default for <= 4 layers) computes what the scan does."""
    tokens = jnp.asarray(np.random.default_rng(8).integers(3, 128, size=(2, 8)), jnp.int32)
    outs = []
    for scan in (True, False):
        m = init_model(model_preset("tiny", scan_layers=scan, **SMALL), seed=4)
        assert m.cfg.scanned == scan
        gd, params = nnx.split(m, nnx.Param)
        loss = lambda p: jnp.sum(jax.nn.log_softmax(nnx.merge(gd, p)(tokens))[..., 5])  # noqa: E731
        outs.append(jax.value_and_grad(loss)(params))
    assert not model_preset("tiny", **SMALL).scanned and model_preset("tiny", num_layers=5).scanned
    for x, y in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=1e-4)


def test_onehot_embedding_and_dense_match_gather_and_einsum(cpu_devices):
    """The small-vocabulary one-hot lookup is exact, its gradient equals a numpy scatter-add, and
    `dense` equals einsum, also on an explicitly sharded mesh (where it keeps the einsum form)."""
    from rpeg_jax.models.dense import dense, embed_lookup

    rng = np.random.default_rng(9)
    table = jnp.asarray(rng.standard_normal((128, 16)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 128, size=(4, 6)), jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(embed_lookup(table, tokens, jnp.float32)), np.asarray(table)[np.asarray(tokens)]
    )
    cot = rng.standard_normal((4, 6, 16))
    grad = jax.grad(lambda t: jnp.sum(embed_lookup(t, tokens, jnp.float32) * cot))(table)
    ref = np.zeros((128, 16))
    np.add.at(ref, np.asarray(tokens).reshape(-1), cot.reshape(-1, 16))
    np.testing.assert_allclose(np.asarray(grad), ref, atol=1e-5, rtol=0)
    x = jnp.asarray(rng.standard_normal((4, 6, 2, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 8, 5)), jnp.float32)
    ref = np.einsum("bthe,hed->btd", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(dense(x, w, contract=2)), ref, atol=1e-4, rtol=0)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=cpu_devices[:2])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))
        out = jax.jit(lambda a: dense(a, w, contract=2))(xs)
        assert jax.typeof(out).sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_frequencies():
    """inv_freq against Meta's reference formula, written out here per frequency."""
    from rpeg_jax.models.rope import inv_frequencies

    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    cfg = model_preset("tiny", rope_scaling=s, rope_theta=500000.0, **SMALL)
    base = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    expect = []
    for f in base:
        wavelen = 2 * np.pi / f
        if wavelen < 64 / 4.0:
            expect.append(f)
        elif wavelen > 64 / 1.0:
            expect.append(f / 8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            expect.append((1 - smooth) * f / 8.0 + smooth * f)
    got = inv_frequencies(cfg)
    np.testing.assert_allclose(got, np.array(expect), rtol=1e-6)
    assert np.any(got != base.astype(np.float32))  # the scaling changed something


def _to_bf16(a):
    return np.asarray(np.asarray(a, np.float64).astype(ml_dtypes.bfloat16), np.float64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_compute_follows_its_rounding_policy(arch):
    """The bf16 forward against numpy_decoder emulating it in float64 (same weights, rounded to bf16
    where the model rounds, kept where it promises float32).

    XLA may keep excess precision (skip a bf16 rounding inside a fusion), which makes the rounding
    points the compiler's choice, so the program is compiled with xla_allow_excess_precision=false:
    each bf16 value is then rounded where the program says. The emulation differs only by
    float32-vs-float64 arithmetic (~1e-7 relative) and the rare bf16 rounding flips it causes (a
    value within ~1e-7 of a rounding midpoint: ~3e-5 of the roundings), each a 1-ulp (2u) change
    that propagates to later positions. With u = 2^-8 (bf16's unit roundoff), most positions
    therefore match to float32 noise: the median per-position relative error is <= u/8, and the
    flips keep the overall relative error <= u. A missing, extra or misplaced rounding moves every
    position instead. Measured (median/u): correct 1e-5 (overall 0.23); bf16 norm statistics 4.6,
    bf16 scores 3.2, bf16 scores+softmax 3.3, bf16 rope tables 3.5, bf16 logits 0.42, model.dtype
    ignored (float32 compute) 4.2. The old check (max|d| < 0.05 max|logits| against a float32
    model) passed every one of these. The unrounded emulation is >= 2u away (measured 4.7-4.8u)."""
    u = 2.0**-8
    if arch == "qwen3":
        m = qwen3_model(seed=5, dtype="bfloat16")
    else:
        kw = dict(arch="qwen2", qkv_bias=True, tie_embeddings=True) if arch == "qwen2" else {}
        m = init_model(model_preset("tiny", dtype="bfloat16", **kw, **SMALL), seed=5)
    tokens = np.random.default_rng(5).integers(3, 128, size=(4, 32))
    fwd = jax.jit(lambda t: m(t)).lower(jnp.asarray(tokens, jnp.int32))
    got = np.asarray(fwd.compile({"xla_allow_excess_precision": False})(jnp.asarray(tokens, jnp.int32)))
    assert got.dtype == np.float32  # logits stay float32

    def errors(**kw):
        ref = np.stack([numpy_decoder(m, t, np.arange(len(t)), **kw) for t in tokens])
        rel = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)  # per position
        return np.median(rel) / u, np.linalg.norm(got - ref) / np.linalg.norm(ref) / u

    # the logistic rounds once or after each of exp/add/divide, as XLA lowers it: the closer one
    median, overall = min(errors(rnd=_to_bf16, per_op_sigmoid=p) for p in (True, False))
    assert median <= 1 / 8 and overall <= 1, (median, overall)
    assert errors()[1] >= 2  # float64 without rounding: computing in float32 would fail here


def test_value_head_and_missing_head_error(qwen):
    critic = init_model(model_preset("tiny", value_head=True, **SMALL), seed=6)
    tokens = jnp.ones((2, 5), jnp.int32)
    logits, values = critic.forward(tokens)
    assert logits.shape == (2, 5, 128) and values.shape == (2, 5)
    with pytest.raises(ValueError, match="no value head"):
        qwen.values(jnp.zeros((1, 2, 64)))


@pytest.mark.parametrize("arch,tie,vh", [("llama", False, False), ("qwen2", True, True), ("qwen3", True, False)])
def test_save_load_round_trip_is_exact(tmp_path, arch, tie, vh):
    """qwen3 here has head_dim implied (hidden / heads = 16): its config.json must still say 16, as a
    qwen3 config.json without head_dim means 128 (Qwen3Config's default)."""
    qwen = dict(qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    m = init_model(model_preset("tiny", arch=arch, tie_embeddings=tie, value_head=vh, **qwen, **SMALL), seed=7)
    if vh:  # a non-zero value head, so the round trip is meaningful
        m.value_w.set_value(jnp.linspace(-1, 1, 64))
        m.value_b.set_value(jnp.asarray(0.25))
    out = str(tmp_path / "ckpt")
    save_hf(m, out, max_shard_bytes=40_000)  # several shards + index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    m2 = load_hf(out, value_head=vh)
    assert m2.cfg.tie_embeddings == tie and m2.cfg.arch == arch
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f).get("head_dim") == (16 if arch == "qwen3" else None)
    for (pa, a), (pb, b) in zip(
        nnx.to_flat_state(nnx.state(m, nnx.Param)), nnx.to_flat_state(nnx.state(m2, nnx.Param))
    ):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    with pytest.raises(FileExistsError):
        save_hf(m, out)
