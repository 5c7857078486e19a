"""Multi-turn episodes on the streaming sampler (sampling/episodes.py, issue 32 item 4): the sampler's
logprobs of every sampled token of a 3-turn episode (observation tokens appended to the paused sequence's
KV between turns) equal the trainer's token_logprobs over the whole sequence; only the first prompt and
each turn's last token + observation are prefilled (never the sequence again); observation tokens are
masked 0 and never sampled; with too few pages a resumed turn falls back to a full prefill and the
logprobs still equal the trainer's; the token budget truncates; every slot and page is released. The
environment is a stand-in whose turn ends return fixed observation ids after a host delay (the engine
keeps stepping the other episodes meanwhile)."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import prompts_of

from rpeg_jax.env.base import EpisodeStats
from rpeg_jax.env.session import Outcome
from rpeg_jax.models import load_hf, token_logprobs
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sampling.episodes import EpisodeDriver

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
CFG = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, max_seq_len=64, min_prefill_len=32, min_table_width=16)


class FakeSession:
    def __init__(self, prompt, turns, obs):
        self.prompt_ids, self.turns, self.obs = list(prompt), turns, obs
        self.pieces, self.stats, self.total_reward, self.n = [], EpisodeStats(), 0.0, 0

    def response_ids(self):
        return [i for _, ids in self.pieces for i in ids]

    def response_mask(self):
        return [int(s) for s, ids in self.pieces for _ in ids]


class FakeRunner:
    stop_strings, stop_token_ids = (), ()

    def __init__(self, turns=3, obs=(5, 6, 7, 8, 9), delay=0.02):
        self.turns, self.obs, self.delay = turns, list(obs), delay
        self.pool = ThreadPoolExecutor(4)
        self.prompts = iter(prompts_of([6, 9, 4], seed=3))

    def start(self, record):
        return FakeSession(record["prompt"], self.turns, self.obs)

    def _end(self, s, ids, end):
        time.sleep(self.delay)
        s.pieces.append((True, list(ids)))
        s.n += 1
        if s.n >= s.turns:
            s.total_reward = 1.0
            return Outcome((), True, 1.0)
        obs = [o + s.n for o in self.obs]
        s.pieces.append((False, obs))
        return Outcome(tuple(obs), False, 0.0)

    def submit(self, s, ids, end):
        return self.pool.submit(self._end, s, ids, end)


@pytest.fixture(scope="module")
def llama():
    return load_hf(os.path.join(HF, "llama_tiny"))


def trainer_logprobs(model, prompt, response, temp):
    tok = np.asarray([prompt + response], np.int32)
    pos = np.arange(tok.shape[1], dtype=np.int32)[None]
    seg = np.ones_like(tok)
    targets = np.concatenate([tok[:, 1:], np.zeros((1, 1), np.int32)], axis=1)
    logp, _ = token_logprobs(
        model,
        jnp.asarray(tok),
        jnp.asarray(pos),
        jnp.asarray(seg),
        jnp.asarray(targets),
        start=len(prompt) - 1,
        length=len(response),
        temperature=temp,
    )
    return np.asarray(logp)[0]


def test_multi_turn_logprobs_equal_the_trainers_and_observations_are_masked(llama):
    prompts = prompts_of([6, 9], seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=2)
    drv = EpisodeDriver(Sampler(llama, CFG), FakeRunner(), params, max_total_tokens=40)
    res = drv.run([{"prompt": p} for p in prompts], group=3)
    assert len(res) == 6
    for r in res:
        m = np.asarray(r.mask)
        assert len(r.response_ids) == len(m) == len(r.logprobs)
        # 3 turns of 6 sampled tokens, 2 observations of 5 tokens between them
        assert m.tolist() == [1] * 6 + [0] * 5 + [1] * 6 + [0] * 5 + [1] * 6
        obs = np.asarray(r.response_ids)[m == 0].tolist()
        assert obs == [6, 7, 8, 9, 10, 7, 8, 9, 10, 11]
        ref = trainer_logprobs(llama, r.prompt_ids, r.response_ids, 1.0)
        np.testing.assert_allclose(r.logprobs[m == 1], ref[m == 1], atol=2e-5)
        assert np.all(r.logprobs[m == 0] == 0)
        assert r.reward == 1.0 and not r.truncated
    # the group's samples differ (fresh random streams per turn)
    assert len({tuple(r.response_ids) for r in res}) > 1
    assert 0.0 < drv.last_stats["occupancy"] <= 1.0
    # prefilled: each record's prompt but its last token once (the group shares it), then per resume the
    # turn's last token and the observation but its last token (5): the observation went into the KV
    assert drv.last_stats["prefill_tokens"] == (6 - 1) + (9 - 1) + 6 * 2 * 5
    sampler = drv.sampler
    assert not sampler.sched.paused and sampler.sched.idle() and sampler.alloc.num_used == 0


def test_resumed_turns_without_pages_fall_back_to_a_full_prefill(llama):
    """A pool of 24 pages (one 64-token sequence takes 16): resumed turns whose pages do not fit are
    prefilled again from their start (and groups are preempted); the logprobs still equal the trainer's."""
    cfg = SamplerConfig(
        page_size=4, max_slots=8, chunk_steps=8, max_seq_len=64, min_prefill_len=32, min_table_width=16, num_pages=24
    )
    prompts = prompts_of([6, 9], seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=2)
    drv = EpisodeDriver(Sampler(llama, cfg), FakeRunner(), params, max_total_tokens=40)
    res = drv.run([{"prompt": p} for p in prompts], group=3)
    full = drv.sampler.stats()
    assert drv.last_stats["prefill_tokens"] > (6 - 1) + (9 - 1) + 6 * 2 * 5, "some turn was prefilled again"
    for r in res:
        m = np.asarray(r.mask)
        assert m.tolist() == [1] * 6 + [0] * 5 + [1] * 6 + [0] * 5 + [1] * 6
        ref = trainer_logprobs(llama, r.prompt_ids, r.response_ids, 1.0)
        np.testing.assert_allclose(r.logprobs[m == 1], ref[m == 1], atol=2e-5)
    assert full["pages_peak"] <= 23 and drv.sampler.alloc.num_used == 0 and not drv.sampler.sched.paused


def test_token_budget_truncates_the_episode(llama):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=2)
    drv = EpisodeDriver(Sampler(llama, CFG), FakeRunner(turns=5), params, max_total_tokens=17)
    (r,) = drv.run([{"prompt": prompts_of([5])[0]}], group=1)
    # 6 sampled + 5 obs = 11; the next turn gets 6 (17 - 11) tokens, then 17 used + 5 obs > budget
    assert r.truncated and r.session.stats.truncated
    assert sum(r.mask) == 12
