"""The schedule simulator on real RPEGs: overlap on disjoint groups, serialisation when
colocated, steady-state period under staleness, streamed pieces."""

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.costmodel.schedule import simulate, stage_spans, unroll
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.passes import apply_pipeline

CFG = load_config(None, ["rl.algorithm=grpo", "data.prompts_per_step=8"])


def graph(**pipe):
    return apply_pipeline(build_graph(CFG), PipelineConfig(**pipe))


def durs(g, gen=4.0, train=1.0, other=0.0):
    d = {n: np.array([other]) for n in g.stage_names()}
    d["generate"] = np.array([gen])
    d["actor_update"] = np.array([train])
    return d


def test_colocated_serialises():
    g = graph(placement="colocated")
    d = {n: np.array([float(i + 1)]) for i, n in enumerate(g.stage_names())}
    period, latency, _, _ = simulate(unroll(g), d)
    # Device stages run one after another; the host-side reward (2 s) overlaps old_forward (3 s).
    assert d["reward"][0] < d["old_forward"][0]
    total = sum(float(v[0]) for k, v in d.items() if k != "reward")
    assert period[0] == pytest.approx(total) and latency[0] == pytest.approx(total)


def test_split_synchronous_is_a_sum_async_is_a_max():
    sync = graph(placement="split", split_sizes=(4, 4))
    p0, _, _, _ = simulate(unroll(sync), durs(sync, gen=4.0, train=1.0))
    assert p0[0] == pytest.approx(5.0)  # on-policy: generate waits for the new weights
    k1 = graph(placement="split", split_sizes=(4, 4), staleness=1)
    p1, lat1, _, _ = simulate(unroll(k1), durs(k1, gen=4.0, train=1.0))
    assert p1[0] == pytest.approx(4.0)  # period = the slowest group (generation)
    assert lat1[0] == pytest.approx(5.0)  # one step still takes generate + update
    p1b, _, _, _ = simulate(unroll(k1), durs(k1, gen=1.0, train=3.0))
    assert p1b[0] == pytest.approx(3.0)  # now training is the slowest group


def test_staleness_on_one_group_or_shared_host_gives_nothing():
    k1 = graph(placement="colocated", staleness=1)
    p, _, _, _ = simulate(unroll(k1), durs(k1, gen=4.0, train=1.0))
    assert p[0] == pytest.approx(5.0)
    split = graph(placement="split", split_sizes=(4, 4), staleness=1)
    p, _, _, _ = simulate(unroll(split, shared_resource=True), durs(split, gen=4.0, train=1.0))
    assert p[0] == pytest.approx(5.0)  # the CPU devices share one host: no real overlap


def test_staleness_two_allows_a_longer_pipeline():
    g = graph(placement="split", split_sizes=(4, 4), staleness=2)
    d = durs(g, gen=2.0, train=2.0)
    d["weight_sync"] = np.array([1.0])  # train group busy 3, gen 2
    p, _, _, _ = simulate(unroll(g), d)
    assert p[0] == pytest.approx(3.0)


def test_streamed_pieces_overlap_forwards_with_generation():
    plain = graph(placement="split", split_sizes=(4, 4))
    pieces = graph(placement="split", split_sizes=(4, 4), pieces=4)
    for g, want in ((plain, 4.0 + 2.0 + 1.0), (pieces, 4.0 + 0.5 + 1.0)):
        d = durs(g, gen=4.0, train=1.0)
        d["old_forward"] = np.array([2.0])
        p, _, s, e = simulate(unroll(g), d, record=True)
        assert p[0] == pytest.approx(want)
        spans = stage_spans(unroll(g), s, e)
        assert spans["old_forward"][0] < spans["generate"][1] or g is plain


def test_vectorised_over_candidates_matches_scalar():
    g = graph(placement="split", split_sizes=(4, 4), staleness=1, pieces=2)
    rng = np.random.default_rng(0)
    d = {n: rng.uniform(0.1, 3.0, size=50) for n in g.stage_names()}
    prog = unroll(g)
    vec, _, _, _ = simulate(prog, d)
    for i in (0, 17, 49):
        one, _, _, _ = simulate(prog, {k: v[i : i + 1] for k, v in d.items()})
        assert vec[i] == pytest.approx(one[0])
    # Steady state: the period never beats either group's busy time per step.
    gen = d["generate"]
    train = sum(v for k, v in d.items() if k not in ("generate", "reward"))
    assert np.all(vec >= np.maximum(gen, train) - 1e-9)


def test_decoding_ahead_overlaps_continuous_generation_with_the_update():
    """Continuous admission on a split placement: taking turns, a step costs generation + update + sync;
    decoding ahead (rollout.decode_ahead) generate(t+1) runs beside update(t), so about max(the
    generation group's work, the training group's) per step; on a shared host (one resource) nothing."""
    pipe = PipelineConfig(placement="split", split_sizes=(4, 4), staleness=1)
    turns = apply_pipeline(build_graph(CFG), pipe, "continuous", False)
    ahead = apply_pipeline(build_graph(CFG), pipe, "continuous", True)
    for gen, train in ((4.0, 1.0), (1.0, 3.0), (2.0, 2.0)):
        d = durs(turns, gen=gen, train=train)
        d["weight_sync"] = np.array([0.5])
        p_turns, _, _, _ = simulate(unroll(turns), d)
        p_ahead, _, _, _ = simulate(unroll(ahead), d)
        assert p_turns[0] == pytest.approx(gen + train + 0.5)
        assert p_ahead[0] == pytest.approx(max(gen, train + 0.5))  # the sync runs on the training group
        shared, _, _, _ = simulate(unroll(ahead, shared_resource=True), d)
        assert shared[0] == pytest.approx(gen + train + 0.5)
