"""Episodes on the streaming sampler (issue 32 item 4, first cut): a sequence that ends its turn (eos, a
stop id, the tool parser's call close, or its token budget) hands the turn to the EnvRunner's bounded
pool and the engine keeps stepping the other sequences; when the turn's Outcome arrives, the episode
resumes as a new request whose prompt is everything so far plus the observation ids (prefilled, never
sampled), with the episode's remaining token budget.

    drv = EpisodeDriver(sampler, runner, params, max_total_tokens=256)
    results = drv.run(records, group=G)        # one EpisodeResult per (record, sample), record-major

Limits: the environment's own (env.max_turns, env.max_tool_calls, the tool timeout) and
`max_total_tokens` (sampled + observation tokens after the prompt); an episode that hits the token
budget is marked truncated (EpisodeStats.truncated) and ends.

What this cut does NOT do yet (kept out of sampling/engine.py and the scheduler on purpose, another
change is rewriting them): the resumed request is prefilled again from its start rather than appending
the observation to the paused sequence's KV; only the group's first turn shares its prompt's pages
(params.n = G). The logprobs are the same either way (tests/test_episodes.py checks them against the
trainer's). `occupancy` (busy slot steps / slot steps while turns were out) is in `stats()`.

Duck-typed runner: start(record) -> session (prompt_ids, response_ids(), response_mask(), stats,
total_reward), submit(session, turn_ids, end) -> Future[Outcome], stop_strings, stop_token_ids.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from rpeg_jax.sampling.types import SamplingParams


@dataclass
class EpisodeResult:
    prompt_ids: list[int]
    response_ids: list[int]  # every token after the prompt: sampled turns and observations, in order
    mask: list[int]  # 1 = sampled (trained on, has a behaviour logprob), 0 = observation
    logprobs: np.ndarray  # float32 [len(response_ids)]: the sampler's logprob of sampled tokens, 0 elsewhere
    reward: float
    truncated: bool
    session: Any


@dataclass
class _Ep:
    session: Any
    logprobs: list[float] = dataclasses.field(default_factory=list)
    done: bool = False
    truncated: bool = False


class EpisodeDriver:
    def __init__(self, sampler, runner, params: SamplingParams, *, max_total_tokens: int | None = None):
        self.sampler, self.runner = sampler, runner
        stop_ids = tuple(dict.fromkeys((*params.stop_token_ids, *runner.stop_token_ids)))
        stops = tuple(params.stop) + tuple(s for s in runner.stop_strings if s not in params.stop)
        self.params = dataclasses.replace(params, stop_token_ids=stop_ids, stop=stops)
        self.max_total = int(max_total_tokens or params.max_new_tokens)
        self._ids = 0
        self._tools_wait_s = 0.0

    def _end_of(self, seq) -> str:
        if seq.finish_reason == "length":
            return "length"
        call_ids = set(self.runner.stop_token_ids)
        if seq.tokens and seq.tokens[-1] in call_ids:
            return "call"
        tok = self.sampler.tokenizer
        strings = self.runner.stop_strings
        if strings and tok is not None and seq.tokens:
            tail = tok.decode(seq.tokens[-16:])
            if any(tail.endswith(s) for s in strings):
                return "call"
        return "stop"

    def _next_id(self) -> int:
        self._ids += 1
        return 1_000_000 + self._ids

    def run(self, records: Sequence[dict], group: int = 1) -> list[EpisodeResult]:
        eps: list[_Ep] = []
        owner: dict[int, _Ep] = {}  # id(Sequence) -> episode
        pending: dict[Future, _Ep] = {}
        s0 = self.sampler.stats()
        for r in records:
            sessions = [self.runner.start(r) for _ in range(group)]
            prompt = sessions[0].prompt_ids
            first = min(self.params.max_new_tokens, self.max_total)
            seqs = self.sampler.submit(
                [prompt],
                dataclasses.replace(self.params, n=group, max_new_tokens=first),
                prompt_ids=[self._next_id()],
            )
            for s, seq in zip(sessions, seqs):
                e = _Ep(s)
                eps.append(e)
                owner[id(seq)] = e
        t_tools = 0.0
        while any(not e.done for e in eps):
            if self.sampler.sched.running or self.sampler.sched.waiting:
                finished = self.sampler.step()
            else:  # nothing to decode: wait for a turn end
                t = time.perf_counter()
                wait(list(pending), return_when=FIRST_COMPLETED)
                t_tools += time.perf_counter() - t
                finished = []
            for seq in finished:
                e = owner.pop(id(seq))
                e.logprobs += list(seq.logprobs)
                pending[self.runner.submit(e.session, list(seq.tokens), self._end_of(seq))] = e
            for fut in [f for f in pending if f.done()]:
                e = pending.pop(fut)
                out = fut.result()
                if out.done:
                    e.done = True
                    continue
                e.logprobs += [0.0] * len(out.observation_ids)
                used = len(e.session.response_ids())
                left = min(self.params.max_new_tokens, self.max_total - used)
                full = list(e.session.prompt_ids) + e.session.response_ids()
                room = self.sampler.max_seq_len - len(full)
                left = min(left, room)
                if left < 1:
                    e.done = e.truncated = True
                    e.session.stats.truncated = True
                    continue
                (seq,) = self.sampler.submit(
                    [full],
                    dataclasses.replace(self.params, n=1, max_new_tokens=left),
                    prompt_ids=[self._next_id()],
                )
                owner[id(seq)] = e
        s1 = self.sampler.stats()
        slot_steps = s1["slot_steps"] - s0["slot_steps"]
        self.last_stats = {
            "occupancy": (s1["busy_slot_steps"] - s0["busy_slot_steps"]) / slot_steps if slot_steps else 0.0,
            "tools_wait_s": t_tools,
        }
        return [
            EpisodeResult(
                list(e.session.prompt_ids),
                e.session.response_ids(),
                e.session.response_mask(),
                np.asarray(e.logprobs, np.float32),
                float(e.session.total_reward),
                e.truncated or bool(e.session.stats.truncated),
                e.session,
            )
            for e in eps
        ]
