"""The engine and the cost model decide continuous admission alike: runtime/rollout/
continuous.ContinuousRollouts over a real Sampler (a tiny model, response lengths forced) and the cost model's
event simulation (costmodel/lengths.admission) are driven on the same seeded lengths, and every
step they consume the same groups (prompt and attempt, in the same order), re-queue or drop as
many, and decode as many steps. Both decide through shapes/admission.py and shapes/buckets.py;
this test is what keeps a rule added to one side from going unpriced (or unrun) on the other."""

from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel.lengths import LengthDist, admission
from rpeg_jax.models.llama import init_model
from rpeg_jax.runtime.rollout.continuous import ContinuousRollouts, forced_lengths
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

PROMPT = 5  # every prompt's length (the simulation prices one prompt length)
PER_STEP = 4  # prompts per data step (groups per RL step)


class Prompts:
    """A data stream of PER_STEP prompts per step, all PROMPT tokens long."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def get(self, step: int):
        rng = np.random.default_rng(1000 + step)
        toks = rng.integers(3, self.vocab, size=(PER_STEP, PROMPT)).tolist()
        n = len(toks)
        return SimpleNamespace(prompt_tokens=toks, prompts=[""] * n, answers=[""] * n, records=[{}] * n)


def engine_trace(*, slots, group, k, stale, spec, chunk, min_chunk, page, growth, steps, seed, lag=0):
    model = init_model(model_preset("tiny"), seed=0)
    cfg = SamplerConfig(
        page_size=page,
        max_slots=slots,
        max_seq_len=PROMPT + spec[3],
        chunk_steps=chunk,
        min_chunk_steps=min_chunk,
        table_width_growth=growth,
        release_slots=True,
        on_weight_update="continue",
        seed=seed,
    )
    sampler = Sampler(model, cfg)
    roll = ContinuousRollouts(
        sampler,
        groups_per_step=PER_STEP,
        group_size=group,
        staleness=k,
        stale_groups=stale,
        sampling=SamplingParams(n=group, temperature=1.0, max_new_tokens=spec[3], ignore_eos=True),
        seed=seed,
        prompt_offset=0,
        lengths=forced_lengths(spec, seed, group),
    )
    prompts, params = Prompts(model.cfg.vocab_size), nnx.state(model, nnx.Param)  # the same weights, new versions
    out = []
    for t in range(steps):
        batch, st = roll.next_batch(t, max(0, t - lag), params, prompts)  # lag 1: decoding ahead
        ids = tuple((g.data_step * PER_STEP + g.index, g.attempt) for g in batch)
        out.append((ids, st.requeued, st.dropped, st.decode_steps))
    return out


def model_trace(*, slots, group, k, stale, spec, chunk, min_chunk, page, growth, steps, seed, lag=0):
    draw = forced_lengths(spec, seed, group)
    sim = admission(
        LengthDist(max_len=spec[3], min_len=spec[2]),
        slots,
        PER_STEP,
        group,
        k,
        "continuous",
        chunk,
        min_chunk,
        steps=steps,
        warmup=0,
        table=(page, PROMPT, 1, growth),
        source=lambda n, attempt: draw(n // PER_STEP, n % PER_STEP, attempt),
        requeue=stale == "requeue",
        trace=True,
        lag=lag,
    )
    return list(sim.trace[:steps])


CASES = [  # slots, group, k, stale_groups, (median, sigma, lo, hi), chunk, min chunk, page, growth
    (8, 2, 1, "requeue", (3, 1.2, 1, 24), 4, 2, 4, 2.0),
    (12, 3, 2, "requeue", (4, 1.0, 1, 24), 6, 3, 2, 1.25),  # slow: 23 s (session 24's trim of the default run)
    (8, 4, 1, "drop", (3, 1.2, 1, 24), 4, 4, 4, 2.0),
]


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.slow] if c[0] == 12 else []) for c in CASES],
    ids=lambda c: f"slots{c[0]}-G{c[1]}-k{c[2]}-{c[3]}",
)
def test_engine_and_cost_model_make_the_same_decisions(case):
    slots, group, k, stale, spec, chunk, min_chunk, page, growth = case
    kw = dict(
        slots=slots,
        group=group,
        k=k,
        stale=stale,
        spec=spec,
        chunk=chunk,
        min_chunk=min_chunk,
        page=page,
        growth=growth,
        steps=8,
        seed=3,
    )
    engine, model = engine_trace(**kw), model_trace(**kw)
    assert sum(r[1] + r[2] for r in engine) > 0  # the bound did act (stale groups were re-queued / dropped)
    assert any(a > 0 for _, _, a, _ in engine) == (stale == "drop")
    assert any(ident[1] > 0 for r in engine for ident in r[0]) == (stale == "requeue")  # retries consumed
    for t, (e, m) in enumerate(zip(engine, model, strict=True)):
        assert e == m, f"step {t}: engine {e} vs cost model {m}"


@pytest.mark.parametrize("k", [1, 2])
def test_decoding_ahead_engine_and_cost_model_agree(k):
    """rollout.decode_ahead: the engine makes step t's batch with the weights of version t - 1 (the
    trainer calls next_batch(t, t - 1) one slot early); the simulation with lag=1 makes the same
    decisions step by step."""
    kw = dict(
        slots=8,
        group=2,
        stale="requeue",
        spec=(3, 1.2, 1, 24),
        chunk=4,
        min_chunk=2,
        page=4,
        growth=2.0,
        steps=8,
        seed=3,
    )
    engine, model = engine_trace(k=k, lag=1, **kw), model_trace(k=k, lag=1, **kw)
    assert sum(r[1] for r in engine) > 0  # the bound did act
    for t, (e, m) in enumerate(zip(engine, model, strict=True)):
        assert e == m, f"step {t}: engine {e} vs cost model {m}"


@pytest.mark.parametrize("k", [1, 2, 3])
def test_decoding_ahead_prices_as_the_engine_one_k_below(k):
    """The planner's tables price decoding ahead at k by the engine at k - 1 without lag
    (scoring.engine_staleness): the same test of every group shifted by one version, so in the steady
    state the same decode steps and re-queues (the two runs part at step 0, where lag has no older
    weights), with every token one version staler."""
    dist = LengthDist(max_len=24, min_len=1)
    run = lambda kk, lag: admission(dist, 16, 4, 2, kk, "continuous", 4, 2, steps=64, lag=lag, table=(4, 5, 1, 2.0))  # noqa: E731
    ahead, below = run(k, 1), run(k - 1, 0)
    assert ahead.decode_steps == pytest.approx(below.decode_steps, rel=0.03)
    assert ahead.requeued == pytest.approx(below.requeued, rel=0.1, abs=0.1)
    assert ahead.staleness_max == below.staleness_max + 1 == k
