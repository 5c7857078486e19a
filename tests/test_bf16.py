"""bf16 end to end on the CPU: model.dtype=bfloat16 with model.param_dtype=float32.

- What each piece holds: float32 master parameters, gradients and optimizer state; every matmul of
  the forward and the backward on bfloat16 operands (read off the jaxpr); float32 logits and
  logprobs; the sampler's KV pool in bfloat16 (SamplerConfig.kv_dtype None follows model.dtype).
- The rollout-vs-trainer logprob gap: the sampler's logprob of each token it generated against the
  trainer's forward (`token_logprobs`) of the same token. The two programs round their bfloat16
  activations differently (a different decomposition: paged KV cache, one token at a time, against
  one pass over the sequence), so the gap is a few roundings of the last hidden states carried into
  the logits. Tolerances from bf16's epsilon (eps = 2^-7): mean |gap| <= eps / 2 (the unit roundoff)
  and max |gap| <= 4 eps; the float32 control, the same two programs in float32, has mean <= 8 and
  max <= 64 float32 eps; and the bf16 gap must be real (mean >= 100 float32 eps), or the bf16 compute
  did not happen. Measured (bench/bf16_gap.py, bench/NOTES.md session 13): bf16 mean ~2-3e-3,
  max ~1e-2; float32 mean ~2e-7, max ~1e-6. The learner's decoupled / truncated IS correction
  (rl.behav_weight_cap, rl.tis_cap; rpeg_jax/rl/losses.py) bounds the resulting importance ratio."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import prompts_of, rollout_batch

from rpeg_jax.config import OptimConfig, model_preset
from rpeg_jax.models import init_model, token_logprobs
from rpeg_jax.rl.optimizer import make_optimizer
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

EPS16 = float(jnp.finfo(jnp.bfloat16).eps)
EPS32 = float(jnp.finfo(jnp.float32).eps)
CFG = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, max_seq_len=32, min_prefill_len=32, min_prefill_rows=8)


@pytest.fixture(scope="module")
def models():
    return {
        dt: init_model(model_preset("tiny", dtype=dt, param_dtype="float32"), seed=3) for dt in ("bfloat16", "float32")
    }


def batch(seed=0, b=4, P=5, R=7):
    rng = np.random.default_rng(seed)
    tok = jnp.asarray(rng.integers(3, 128, (b, P + R)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P + R, dtype=jnp.int32), tok.shape)
    seg = jnp.ones_like(tok)
    return tok, pos, seg, jnp.concatenate([tok[:, 1:], tok[:, :1]], 1), P, R


def eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations (scan, map, remat, jit)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from eqns(inner)


# 78 s; test_rollout_vs_trainer_logprob_gap runs bf16 compute by default (slow: session 24's trim of the default run)
@pytest.mark.slow
def test_fp32_master_state_bf16_compute(models):
    model = models["bfloat16"]
    graphdef, params = nnx.split(model, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    tok, pos, seg, tg, P, R = batch()
    h, _ = model.hidden(tok, pos, seg)
    assert h.dtype == jnp.bfloat16

    def loss(params):
        lp, _ = token_logprobs(nnx.merge(graphdef, params), tok, pos, seg, tg, start=P - 1, length=R)
        assert lp.dtype == jnp.float32
        return jnp.sum(lp)

    grads = jax.grad(loss)(params)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    tx = make_optimizer(OptimConfig())
    state = tx.init(params)
    floats = {x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim}
    assert floats == {jnp.dtype(jnp.float32)}
    new = optax.apply_updates(params, tx.update(grads, state, params)[0])
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.float32)}

    # Every forward matmul on bf16 operands, except the small-vocab embedding lookup (an exact one-hot
    # product in float32 at HIGHEST precision: a gather). In the backward, the matmuls whose forward
    # had a float32 output (the LM head, the xla attention's scores and probabilities·V) take the
    # float32 cotangent against a bf16 operand: 2 + 4 per layer, the known float32 GEMMs of the bf16
    # backward (bench/NOTES.md session 13); no other matmul has a float32 operand.
    def kinds(fn):
        dots = [e for e in eqns(jax.make_jaxpr(fn)(params).jaxpr) if e.primitive.name == "dot_general"]
        exact = [e for e in dots if e.params["precision"] is not None]
        assert all(v.aval.dtype == jnp.float32 for e in exact for v in e.invars)
        rest = [tuple(str(v.aval.dtype) for v in e.invars) for e in dots if e.params["precision"] is None]
        return {k: rest.count(k) for k in set(rest)}

    assert set(kinds(loss)) == {("bfloat16", "bfloat16")}
    assert kinds(jax.grad(loss)).get(("float32", "bfloat16"), 0) == 2 + 4 * model.cfg.num_layers
    assert set(kinds(jax.grad(loss))) <= {("bfloat16", "bfloat16"), ("float32", "bfloat16")}


def test_sampler_kv_pool_follows_model_dtype(models):
    for dt, model in models.items():
        k_pool, v_pool = Sampler(model, CFG).pools
        assert k_pool.dtype == v_pool.dtype == jnp.dtype(dt)


def signed_gap(model, temp):
    """Trainer - sampler logprob of every generated token: 3 prompts x 3 samples x 12 tokens."""
    outs = Sampler(model, CFG).generate(
        prompts_of([6, 3, 10]), SamplingParams(n=3, temperature=temp, max_new_tokens=12, seed=4)
    )
    tok, pos, seg, mask, behav, P, R = rollout_batch(outs)
    targets = np.concatenate([tok[:, 1:], np.zeros((len(tok), 1), np.int32)], axis=1)
    logp, _ = token_logprobs(
        model, *(jnp.asarray(x) for x in (tok, pos, seg, targets)), start=P - 1, length=R, temperature=temp
    )
    assert logp.dtype == jnp.float32
    return (np.asarray(logp, np.float64) - behav)[mask > 0]


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_rollout_vs_trainer_logprob_gap(models, temp):
    g16, g32 = signed_gap(models["bfloat16"], temp), signed_gap(models["float32"], temp)
    for name, g in (("bf16", g16), ("fp32", g32)):
        a = np.abs(g)
        print(
            f"{name} T={temp}: {g.size} tokens, mean |gap| {a.mean():.2e}, max {a.max():.2e}, "
            f"exp(gap) in [{np.exp(g.min()):.4f}, {np.exp(g.max()):.4f}]"
        )
    a16, a32 = np.abs(g16), np.abs(g32)
    assert a16.mean() <= EPS16 / 2 and a16.max() <= 4 * EPS16, (a16.mean(), a16.max())
    assert a32.mean() <= 8 * EPS32 and a32.max() <= 64 * EPS32, (a32.mean(), a32.max())
    assert a16.mean() >= 100 * EPS32, a16.mean()  # the bf16 path really rounds in bf16
