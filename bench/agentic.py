"""Benchmark A1 (bench/WORKLOADS.md): tool-using episodes, the engine decoding while tools run vs a
per-turn synchronous loop, in one run.

Model T, 16 prompts x 8 episodes, each episode 3 tool calls (4 turns of 16 sampled tokens, ignore_eos)
with a tool latency drawn uniformly from 50-300 ms (seeded) per call and 8 observation tokens per call.
  overlap: sampling/episodes.EpisodeDriver: a turn's tool runs on a thread pool while the engine
           decodes the others; the episode resumes when its tool returns.
  sync:    per turn, generate every live episode's turn, then run all the turn's tools at once and
           wait for the slowest, then the next turn.
  ceiling: the overlap loop cannot beat max(decode-only time (the same episodes, 0 ms tools), the
           longest episode's total tool time); the speedup ceiling is sync / that.
Prints seconds per step and decode occupancy of each, the ceiling, and the ratio.

    PYTHONPATH=$PWD .venv/bin/python bench/agentic.py [--reps 2]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rpeg_jax.config.model import model_preset
from rpeg_jax.env.base import EpisodeStats
from rpeg_jax.env.session import Outcome
from rpeg_jax.models import init_model
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sampling.episodes import EpisodeDriver

PROMPTS, G, CALLS, TURN, OBS, PLEN = 16, 8, 3, 16, 8, 16


class Session:
    def __init__(self, prompt, lat):
        self.prompt_ids, self.lat = list(prompt), lat  # lat: this episode's CALLS tool latencies (s)
        self.pieces, self.stats, self.total_reward, self.n = [], EpisodeStats(), 0.0, 0

    def response_ids(self):
        return [i for _, ids in self.pieces for i in ids]

    def response_mask(self):
        return [int(s) for s, ids in self.pieces for _ in ids]

    def end(self, ids):
        self.pieces.append((True, list(ids)))
        if self.n >= CALLS:
            return Outcome((), True, 1.0)
        time.sleep(self.lat[self.n])
        self.n += 1
        self.stats.tool_calls += 1
        obs = [3 + (self.n * 7 + k) % 100 for k in range(OBS)]
        self.pieces.append((False, obs))
        return Outcome(tuple(obs), False, 0.0)


class Runner:
    stop_strings, stop_token_ids = (), ()

    def __init__(self, lats):
        self.lats, self.k = lats, 0
        self.pool = ThreadPoolExecutor(PROMPTS * G)

    def start(self, record):
        s = Session(record["prompt"], self.lats[self.k])
        self.k += 1
        return s

    def submit(self, s, ids, end):
        return self.pool.submit(s.end, ids)


def params():
    return SamplingParams(temperature=1.0, max_new_tokens=TURN, ignore_eos=True, seed=0)


def overlap(sampler, prompts, lats):
    drv = EpisodeDriver(sampler, Runner(lats), params(), max_total_tokens=(CALLS + 1) * (TURN + OBS))
    t = time.perf_counter()
    res = drv.run([{"prompt": p} for p in prompts], group=G)
    dt = time.perf_counter() - t
    assert all(sum(r.mask) == (CALLS + 1) * TURN for r in res)
    return dt, drv.last_stats["occupancy"]


def sync(sampler, prompts, lats):
    pool = ThreadPoolExecutor(PROMPTS * G)
    s0 = sampler.stats()
    t = time.perf_counter()
    sessions = [Session(p, lats[i * G + j]) for i, p in enumerate(prompts) for j in range(G)]
    outs = sampler.generate(prompts, SamplingParams(**{**vars(params()), "n": G}))
    turn = [c.tokens.tolist() for o in outs for c in o.completions]
    for _ in range(CALLS + 1):
        done = list(pool.map(lambda a: a[0].end(a[1]), zip(sessions, turn)))  # waits for the slowest
        live = [s for s, o in zip(sessions, done) if not o.done]
        if not live:
            break
        outs = sampler.generate([s.prompt_ids + s.response_ids() for s in live], params())
        turn = [o.completions[0].tokens.tolist() for o in outs]
        sessions = live
    dt = time.perf_counter() - t
    s1 = sampler.stats()
    occ = (s1["busy_slot_steps"] - s0["busy_slot_steps"]) / max(s1["slot_steps"] - s0["slot_steps"], 1)
    return dt, occ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    model = init_model(model_preset("tiny"), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, PLEN).tolist() for _ in range(PROMPTS)]
    lats = rng.uniform(0.05, 0.3, (PROMPTS * G, CALLS))
    zero = np.zeros_like(lats)
    cfg = SamplerConfig(page_size=16, max_slots=PROMPTS * G, chunk_steps=8, max_seq_len=128, min_prefill_len=128)
    sampler = Sampler(model, cfg)
    overlap(sampler, prompts, zero)  # warm-up: every shape compiled
    sync(sampler, prompts, zero)
    rows = {"overlap": [], "sync": [], "decode_only": []}
    occs = {"overlap": [], "sync": []}
    for _ in range(a.reps):  # interleaved, so load on the machine hits both alike
        dt, occ = overlap(sampler, prompts, lats)
        rows["overlap"].append(dt), occs["overlap"].append(occ)
        dt, occ = sync(sampler, prompts, lats)
        rows["sync"].append(dt), occs["sync"].append(occ)
        rows["decode_only"].append(overlap(sampler, prompts, zero)[0])
    med = {k: float(np.median(v)) for k, v in rows.items()}
    tools_max = float(lats.sum(1).max())
    floor = max(med["decode_only"], tools_max)
    ceiling = med["sync"] / floor
    speedup = med["sync"] / med["overlap"]
    print(f"A1: {PROMPTS} prompts x {G}, {CALLS} tool calls of 50-300 ms per episode, {TURN} tokens per turn")
    print(f"  decode only (0 ms tools): {med['decode_only']:.3f} s; longest episode's tool time: {tools_max:.3f} s")
    print(f"  sync:    {med['sync']:.3f} s/step  occupancy {np.median(occs['sync']):.3f}")
    print(f"  overlap: {med['overlap']:.3f} s/step  occupancy {np.median(occs['overlap']):.3f}")
    print(f"  speedup {speedup:.2f}x; ceiling {ceiling:.2f}x (sync / max(decode only, longest tool chain)); "
          f"{100 * speedup / ceiling:.0f}% of the ceiling")  # fmt: skip


if __name__ == "__main__":
    main()
