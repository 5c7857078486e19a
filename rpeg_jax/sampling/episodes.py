"""Episodes on the streaming sampler (issue 32 item 4): a sequence that ends its turn (eos, a stop id, the
tool parser's call close, or its token budget) is paused (its slot and KV held: Sampler.submit(keep=True))
and hands the turn to the EnvRunner's bounded pool while the engine keeps stepping the other sequences;
when the turn's Outcome arrives, the observation ids are appended to the paused sequence's KV
(Sampler.resume: only the turn's last token and the observation are prefilled, never sampled) and it
samples on with the episode's remaining token budget. A finished episode's slot and pages are released.

    drv = EpisodeDriver(sampler, runner, params, max_total_tokens=256)
    results = drv.run(records, group=G)        # one EpisodeResult per (record, sample), record-major

Limits: the environment's own (env.max_turns, env.max_tool_calls, the tool timeout) and
`max_total_tokens` (sampled + observation tokens after the prompt); an episode that hits the token
budget is marked truncated (EpisodeStats.truncated) and ends.

The group's first turn shares its prompt's pages (params.n = G); a resumed turn continues in its own slot
(a paused sequence holds its slot, so at most max_slots episodes are in flight). Where the pages for an
observation do not fit when it is resumed, the scheduler frees the slot and the turn waits as a new
request prefilled from its start (same tokens and logprobs; tests/test_episodes.py checks them against the
trainer's and counts the prefilled tokens). `occupancy` (busy slot steps / slot steps while turns were
out) and `prefill_tokens` are in `last_stats`.

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


def turn_end(seq, runner, tokenizer) -> str:
    """How a sequence's turn ended: "length" (its budget), "call" (the runner's call close, a stop id or
    a stop string), else "stop" (eos or a stop id)."""
    if seq.finish_reason == "length":
        return "length"
    if seq.tokens and seq.tokens[-1] in set(runner.stop_token_ids):
        return "call"
    if runner.stop_strings and tokenizer is not None and seq.tokens:
        tail = tokenizer.decode(seq.tokens[-16:])
        if any(tail.endswith(x) for x in runner.stop_strings):
            return "call"
    return "stop"


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
    seq: Any = None  # its paused sequence (slot and KV held) while a turn end is out
    index: int = 0  # its place in the run (record-major)
    turns: int = 0  # turns sampled so far


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
        return turn_end(seq, self.runner, self.sampler.tokenizer)

    def _next_id(self) -> int:
        self._ids += 1
        return 1_000_000 + self._ids

    @staticmethod
    def _turn_id(e: _Ep) -> int:
        """The random stream of an episode's next turn: a function of the episode and the turn, not of
        the order in which tool results came back (which is timing)."""
        return (1 << 30) + (e.index * 256 + e.turns) % (1 << 30)

    def run(self, records: Sequence[dict], group: int = 1) -> list[EpisodeResult]:
        try:
            return self._run(records, group)
        finally:  # an exception (a RewardError) leaves no slot held
            for seq in list(self.sampler.sched.paused):
                self.sampler.release(seq)

    def _end(self, e: _Ep, truncated: bool = False) -> None:
        e.done = True
        e.truncated = e.truncated or truncated
        if e.seq is not None:
            self.sampler.release(e.seq)
            e.seq = None

    def _run(self, records: Sequence[dict], group: int) -> list[EpisodeResult]:
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
                keep=True,
            )
            for s, seq in zip(sessions, seqs):
                e = _Ep(s, index=len(eps))
                eps.append(e)
                owner[id(seq)] = e
        t_tools = 0.0
        sched = self.sampler.sched
        while any(not e.done for e in eps):
            finished = self.sampler.step() if sched.running or sched.waiting or sched.resuming else []
            if not finished and not sched.running and not sched.resuming and pending:
                # nothing to decode (what waits needs the slots that paused episodes hold): wait for a turn end
                t = time.perf_counter()
                wait(list(pending), return_when=FIRST_COMPLETED)
                t_tools += time.perf_counter() - t
            for seq in finished:
                e = owner.pop(id(seq))
                e.seq = seq  # paused: its slot and KV wait for the observation
                e.turns += 1
                e.logprobs += list(seq.logprobs)
                pending[self.runner.submit(e.session, list(seq.tokens), self._end_of(seq))] = e
            for fut in [f for f in pending if f.done()]:
                e = pending.pop(fut)
                out = fut.result()
                if out.done:
                    self._end(e)
                    continue
                e.logprobs += [0.0] * len(out.observation_ids)
                used = len(e.session.response_ids())
                left = min(self.params.max_new_tokens, self.max_total - used)
                full = list(e.session.prompt_ids) + e.session.response_ids()
                room = self.sampler.max_seq_len - len(full)
                left = min(left, room)
                if left < 1:
                    e.session.stats.truncated = True
                    self._end(e, truncated=True)
                    continue
                assert e.seq.known() + list(out.observation_ids) == full, "the session's tokens are the sequence's"
                seq = self.sampler.resume(
                    e.seq,
                    out.observation_ids,
                    dataclasses.replace(self.params, n=1, max_new_tokens=left),
                    prompt_id=self._turn_id(e),
                )
                e.seq = None
                owner[id(seq)] = e
        s1 = self.sampler.stats()
        slot_steps = s1["slot_steps"] - s0["slot_steps"]
        self.last_stats = {
            "occupancy": (s1["busy_slot_steps"] - s0["busy_slot_steps"]) / slot_steps if slot_steps else 0.0,
            "tools_wait_s": t_tools,
            "prefill_tokens": s1["prefill_tokens"] - s0["prefill_tokens"],
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
