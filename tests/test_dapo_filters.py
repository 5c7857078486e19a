"""DAPO's filters (Yu 2025): rl.overlong (soft overlong punishment, overlong filtering) and
rl.filter_groups (dynamic sampling), against independent references.

- soft penalty: a float64 numpy transcription of DAPO eq. 13 over every length 0..L_max;
- overlong mask: the actor loss of a batch whose truncated rows are masked equals the float64
  numpy loss over the other rows only (the loss-test reference of test_rl_losses);
- dynamic sampling: a reward under which exactly the prompts of a known set (by a hash of the
  prompt text) vary within their group; the batch that reaches the reward/update stages must be
  exactly the known varying prompts of the stream in order, full, and the filtered count exact
  (step admission), or every batch full of varying groups and the filtered count equal to the
  non-varying groups the engine completed (continuous admission);
- config errors name the field and the value.
"""

import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import KILLER, SKIP, TINY, run

from rpeg_jax import rl
from rpeg_jax.config import ConfigError, RLConfig, load_config
from rpeg_jax.data.rewards import Sample, overlong_penalty, register_reward, truncated
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train


# ---------------------------------------------------------------- the soft overlong penalty
def np_soft_penalty(length, l_max, l_cache, factor):
    """DAPO eq. 13, case by case, float64."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return (l_max - l_cache - length) / l_cache * factor
    return -factor


@pytest.mark.parametrize("l_max,l_cache,factor", [(16, 4, 1.0), (30, 7, 0.5), (8, 1, 2.0)])
def test_soft_penalty_matches_dapo_eq13(l_max, l_cache, factor):
    lengths = np.arange(0, l_max + 3)
    got = overlong_penalty(lengths, l_max, l_cache, factor)
    want = np.array([np_soft_penalty(n, l_max, l_cache, factor) for n in lengths])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[l_max] == pytest.approx(-factor) and got[l_max - l_cache] == 0.0  # the ramp's ends


def test_soft_penalty_changes_rewards_and_advantages_before_grpo():
    """The penalty is in the reward the advantage sees: a group with equal task rewards but different
    lengths gets non-zero GRPO advantages (shorter is better), equal to the numpy GRPO of the sum."""
    lengths = np.array([3, 14, 16, 16])  # L_max 16, L_cache 4: 0, -0.5, -1, -1
    task = np.ones(4)
    shaped = task + overlong_penalty(lengths, 16, 4, 1.0)
    adv = np.asarray(rl.grpo_advantages(jnp.asarray(shaped, jnp.float32), group_size=4))
    r = task + np.array([np_soft_penalty(n, 16, 4, 1.0) for n in lengths])
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert adv[0] > adv[1] > adv[2] == adv[3]


# ---------------------------------------------------------------- overlong filtering (mask)
EOS, B, R = 2, 6, 5


def make_batch(seed):
    rng = np.random.default_rng(seed)
    lens = np.array([5, 5, 3, 5, 0, 2])  # rows 0, 1, 3 reach the cap R
    tokens = rng.integers(3, 20, (B, R)).astype(np.int32)
    tokens[1, 4] = EOS  # row 1 ends in eos at the cap: not truncated
    tokens[5, 1] = EOS
    mask = (np.arange(R)[None] < lens[:, None]).astype(np.float32)
    old = (-rng.random((B, R)) * 2).astype(np.float32)
    logp = (old + rng.normal(size=(B, R)) * 0.4).astype(np.float32)
    adv = rng.normal(size=(B, R)).astype(np.float32)
    return tokens, mask, logp, old, adv


def np_ppo_loss(logp, old, adv, mask, eps, mode):
    """float64 clipped surrogate aggregated over the mask (test_rl_losses' reference)."""
    ratio = np.exp(logp.astype(np.float64) - old)
    loss = np.where(mask > 0, np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps, 1 + eps)), 0.0)
    if mode == "token-mean":
        return loss.sum() / mask.sum()
    lens = mask.sum(1)
    return np.mean([loss[i].sum() / lens[i] for i in range(len(lens)) if lens[i] > 0])


def test_truncated_rows_are_the_capped_rows_without_eos():
    tokens, mask, *_ = make_batch(0)
    lengths = mask.sum(1).astype(int)
    last = tokens[np.arange(B), np.maximum(lengths - 1, 0)]
    np.testing.assert_array_equal(truncated(last, lengths, R, (EOS,)), [True, False, False, True, False, False])
    masked, cut = rl.overlong_mask(jnp.asarray(tokens), jnp.asarray(mask), R, (EOS,))
    np.testing.assert_array_equal(np.asarray(cut), [1, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(masked)[[1, 2, 4, 5]], mask[[1, 2, 4, 5]])
    assert not np.asarray(masked)[[0, 3]].any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_masked_loss_equals_the_loss_over_the_other_rows(mode):
    tokens, mask, logp, old, adv = make_batch(1)
    cfg = RLConfig(loss_agg=mode, clip_eps=0.2)
    masked, _ = rl.overlong_mask(jnp.asarray(tokens), jnp.asarray(mask), R, (EOS,))
    loss_w, tok_w = rl.agg_weights(masked, mode)
    mb = {"response_mask_BxR": masked, "old_logp_BxR": jnp.asarray(old), "advantages_BxR": jnp.asarray(adv)}
    loss, _ = rl.actor_objective({"logp": jnp.asarray(logp)}, mb, cfg, loss_w, tok_w)
    keep = [1, 2, 4, 5]  # the rows that are not truncated
    want = np_ppo_loss(logp[keep], old[keep], adv[keep], mask[keep], 0.2, mode)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    full = np_ppo_loss(logp, old, adv, mask, 0.2, mode)
    assert abs(full - want) > 1e-3  # the truncated rows did weigh in without the mask


# ---------------------------------------------------------------- dynamic sampling
def varies(prompt: str) -> bool:
    """The known set: prompts whose rewards differ within their group (a hash of the text)."""
    return zlib.crc32(prompt.encode()) % 3 == 0


@register_reward("dapo_test_reward", overwrite=True)
def dapo_test_reward(sample: Sample) -> float:
    """1.0 for every completion of a non-varying prompt; for a varying one a function of the
    completion's tokens (its G sampled completions differ, so their rewards do)."""
    if not varies(sample.prompt):
        return 1.0
    return float(sum((j + 1) * t for j, t in enumerate(sample.completion_ids)) % 997) + 0.5 * len(sample.completion_ids)


FILTER = TINY + [
    "data.reward=dapo_test_reward",
    f"plugins=[{__name__}]",
    "rl.filter_groups=zero_variance",
    "rl.filter_max_rounds=0",
]


def stream_prompts(cfg, n):
    """The first n prompts of the run's data stream, in order (an independent pipeline)."""
    from rpeg_jax.data.pipeline import build_pipeline

    pipe = build_pipeline(cfg, shard_index=0, shard_count=1)
    out = []
    while len(out) < n:
        out += list(next(pipe).prompts)
    return out[:n]


def recording_registry(seen: dict, ctxs: list):
    """The default kernels, the reward stage recording the prompts of each batch it scores (the
    batch the forwards and the update then consume) and the rewards it returns."""
    from rpeg_jax.graph.compile import Kernel
    from rpeg_jax.graph.ir import StageKind
    from rpeg_jax.runtime import kernels

    reg = kernels.default_registry()

    def reward(env):
        inner = kernels.reward(env).fn
        ctxs.append(env.context)

        def fn(i):
            out = inner(i)
            c = i["completions"]
            seen[int(i["_step"])] = (list(c["host_prompt"]), np.asarray(out["rewards"]), np.asarray(c["group_ids_B"]))
            return out

        return Kernel(fn, jittable=False)

    reg.register(StageKind.REWARD, reward, overwrite=True)
    return reg


def test_step_admission_trains_on_exactly_the_varying_groups(tmp_path):
    steps, G, P = 3, 4, 4
    seen, ctxs = {}, []
    got = run(tmp_path, "step", FILTER, steps=steps, registry=recording_registry(seen, ctxs))
    cfg = load_config(None, FILTER)
    stream = stream_prompts(cfg, 400)
    pos = 0
    for t in range(steps):  # reference: the next P varying prompts of the stream; the others filtered
        want, filtered = [], 0
        while len(want) < P:
            if varies(stream[pos]):
                want.append(stream[pos])
            else:
                filtered += 1
            pos += 1
        prompts, rewards, gids = seen[t]
        assert prompts[::G] == want and all(p == prompts[g * G] for g in range(P) for p in prompts[g * G : g * G + G])
        assert len(prompts) == P * G  # refilled to a full batch
        assert all(np.ptp(rewards[g * G : (g + 1) * G]) > 0 for g in range(P))  # every group varies
        assert len(set(gids.tolist())) == P
        assert got.metrics[t]["rollout/filtered_groups"] == filtered, t
    assert sum(r["rollout/filtered_groups"] for r in got.metrics) > 0  # the filter did drop groups


CONTINUOUS = [
    "rollout.max_new_tokens=12",
    "rollout.forced_lengths=[3,1.0,1,12]",
    "rollout.admission=continuous",
    "rollout.on_weight_update=continue",
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
    "pipeline.staleness=1",
]


def test_continuous_admission_counts_only_varying_groups(tmp_path):
    steps, G, P = 4, 4, 4
    seen, ctxs = {}, []
    got = run(tmp_path, "cont", FILTER + CONTINUOUS, steps=steps, registry=recording_registry(seen, ctxs))
    engine = ctxs[0].engine
    for t in range(steps):
        prompts, rewards, _ = seen[t]
        assert len(prompts) == P * G and all(varies(p) for p in prompts)
        assert all(np.ptp(rewards[g * G : (g + 1) * G]) > 0 for g in range(P))
    drawn = stream_prompts(load_config(None, FILTER + CONTINUOUS), engine.next_gid)  # every prompt admitted
    waiting = [g.host["prompt"] for g in engine.in_flight + engine.done + engine.retry]
    consumed = [p for t in range(steps) for p in seen[t][0][::G]]
    # every admitted prompt is consumed, still waiting, or was filtered: the count is exact
    filtered = sum(r["rollout/filtered_groups"] for r in got.metrics)
    assert filtered == sum(not varies(p) for p in drawn) - sum(not varies(p) for p in waiting) > 0
    assert sorted(consumed + [p for p in waiting if varies(p)]) == sorted(p for p in drawn if varies(p))


def test_filter_off_logs_nothing_new(tmp_path):
    got = run(tmp_path, "off", TINY, steps=1)
    assert not any(k.startswith(("rollout/filtered", "rollout/overlong")) for k in got.metrics[0])


def test_exhausted_rounds_fail_clearly(tmp_path):
    from rpeg_jax.runtime.rollout.continuous import FilterExhausted

    with pytest.raises(FilterExhausted, match="rl.filter_max_rounds=1"):
        run(tmp_path, "few", FILTER + ["rl.filter_max_rounds=1"], steps=1)


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "overrides,match",
    [
        (["rl.overlong=soft_penalty"], r"rl\.overlong_buffer=0: must be > 0"),
        (["rl.overlong=soft_penalty", "rl.overlong_buffer=6"], r"rl\.overlong_buffer=6: must be < rollout\.max_new"),
        (["rl.overlong=soft_penalty", "rl.overlong_buffer=2", "rl.overlong_penalty=-1"], r"rl\.overlong_penalty=-1"),
        (["rl.overlong=clip"], r"rl\.overlong"),
        (["rl.filter_groups=all_equal"], r"rl\.filter_groups"),
        (["rl.filter_groups=zero_variance", "rl.filter_max_rounds=-1"], r"rl\.filter_max_rounds=-1"),
    ],
)
def test_bad_filter_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, TINY + overrides)


@pytest.mark.parametrize("k", [0, pytest.param(1, marks=pytest.mark.slow)])  # 17 s at k = 1 (session 24's trim)
def test_resume_with_dynamic_sampling_is_exact(tmp_path, k):
    """Train 2N steps straight vs N, kill -9, resume to 2N: the same metrics and parameters. The
    checkpoint holds the stream cursor past the extra groups drawn, and (k = 1) where in the stream
    the buffered step's groups came from."""
    n = 2
    common = FILTER + [f"pipeline.staleness={k}", f"train.steps={2 * n}", f"train.checkpoint_every={n}"]
    want = run(tmp_path, "straight", common, steps=2 * n)
    crash = tmp_path / "crashed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(n), *common, f"train.steps={2 * n}", f"train.run_dir={crash}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    got = train(load_config(None, common + [f"train.run_dir={crash}"]), keep_state=True)
    a = {r["step"]: r for r in want.metrics}
    b = {r["step"]: r for r in read_metrics(str(crash / "metrics.jsonl"))}
    assert sum(a[s]["rollout/filtered_groups"] for s in range(n + 1, 2 * n + 1)) > 0  # extra groups after the cut
    for s in range(1, 2 * n + 1):
        keys = [key for key in a[s] if not key.startswith(SKIP)]
        assert {key: a[s][key] for key in keys} == {key: b[s].get(key) for key in keys}, s
    for name, tree in want.state.items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
