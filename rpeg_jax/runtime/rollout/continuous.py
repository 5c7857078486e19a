"""Continuous admission (rollout.admission=continuous): one generation engine that outlives the step.

With the default `rollout.admission: step`, every RL step samples its own prompts to completion, so
the decode batch drains while the longest responses finish (the tail). Here the sampler keeps up to
`max_slots` sequences in flight across RL steps instead:

- Whole GRPO groups (the prompt prefilled once, its pages shared) are admitted from the data stream
  whenever slots free; the stream is the data pipeline's prompts in order, step after step.
- The batch of step t is the first `data.prompts_per_step` groups to complete, in the order of the
  decode chunk they completed in and then of admission. Groups that complete beyond that wait for
  the next step.
- A new actor version is installed between decode chunks without draining the engine
  (rollout.on_weight_update: `continue` keeps the sequences' KV, `recompute` rebuilds it with the
  new weights); every token keeps the version that produced it, and the learner's decoupled-PPO
  correction uses the per-token behaviour logprobs.
- The bound, per token: a group enters the update of step t (trainer version t) only if every one
  of its tokens was produced by a version >= t - k (k = the graph's staleness). A group that can no
  longer meet it, in flight or completed, is re-queued (its prompt generated again, with a fresh
  random stream) or dropped (the next prompt of the stream takes its place), as
  rollout.stale_groups says, and counted.
- Dynamic sampling (rl.filter_groups=zero_variance, DAPO): a group is scored as it completes; one
  whose rewards are all equal (zero advantage) is not counted toward the batch and is dropped
  (counted as rollout/filtered_groups), so the engine admits the next prompt of the stream in its
  place. The rewards ride along with the batch (the reward stage does not score it again).

Generation does not run ahead of training here (the graph's generate stage reads the newest
weights, graph/passes.bounded_async(k, ahead=0)): what the asynchrony buys is that sequences run
on across weight updates, so the engine stays full instead of draining every step. Under split
placement it decodes ahead by default (rollout.decode_ahead, graph/passes.decode_ahead): step t's
batch is made by `next_batch(t, t - 1)` while training runs step t-1's update on its own devices
(the runtime calls it one slot early), so every token is one version older and the bound is tested
against the step that consumes it, as always; the ahead phase ends when that batch is complete, not
when the update ends, so nothing depends on timing.

- Episodes (env.name other than single_turn, `runner`: env/runner.EnvRunner): a group is G episodes of
  one record. A turn that ends pauses its sequence (slot and KV held: Sampler.submit(keep=True)) and goes
  to the runner's pool; its outcome is applied before the NEXT decode chunk (waiting for it there if the
  tools are still running): the observation appended to the paused KV (Sampler.resume) or the episode
  ended (slot released). Tools thus run while the engine decodes one chunk of the other sequences, at
  a point that depends on the chunk count, not on timing. A group completes when its G episodes are done;
  its rows are the episodes (observation tokens masked out, the environment's rewards ride along).

Everything is a function of the seeds, the data order and the decode-chunk count, never of timing:
runs are reproducible. A checkpoint holds the engine's whole state (`snapshot`: groups, sequences,
scheduler, page allocator and the KV of the pages in use), so a resume continues bit-exactly from
any step. An episode in flight is saved as its turns (ids and how each ended), logprobs and versions:
a restore replays its turns through a fresh episode of the environment (the tools run again), checks the
replay gives the tokens saved, and an outcome not yet applied is applied at the same chunk as in the
uninterrupted run (environments and tools must be deterministic functions of the turns). With several
processes every process runs its own engine on its data shard (its share of the batch, group ids
gid * P + process); the rollout counts logged are summed over processes.
The policy's decisions are shapes/admission.py's, which the cost model's
simulation of this engine (costmodel/lengths.admission) makes too. Called by: runtime/kernels.py
(the generate stage), runtime/setup.py.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rpeg_jax.sampling import SamplingParams
from rpeg_jax.sampling.episodes import turn_end
from rpeg_jax.sampling.scheduler import Sequence
from rpeg_jax.shapes import admission as policy


class FilterExhausted(RuntimeError):
    """Dynamic sampling (rl.filter_groups) could not fill a step's batch within rl.filter_max_rounds."""


def filter_exhausted_why(max_filtered: int) -> str:
    """Why continuous admission's dynamic sampling gave up: the line every process ends with."""
    return (
        f"rl.filter_groups: more than {max_filtered} groups (rl.filter_max_rounds x this process's share of "
        f"data.prompts_per_step) had equal rewards in one step; raise rl.filter_max_rounds (0 = unbounded)"
    )


@dataclass(eq=False)
class Group:
    """One prompt's G sequences in the engine, and where the prompt came from in the data stream."""

    gid: int  # admission order over the whole run (stable across requeues: the group's identity)
    data_step: int  # the data pipeline step the prompt was drawn from
    index: int  # its index in that step's PromptBatch (this process's share)
    attempt: int  # 0, then 1, 2, ... each time it is re-queued
    prompt: list[int]
    host: dict[str, Any]  # prompt text, answer, record (for the reward)
    seqs: list[Sequence] = field(default_factory=list)
    scores: Any = None  # dynamic sampling: (rewards [G], errors, truncated [G]) once complete
    eps: list["Ep"] | None = None  # episodes (with a runner): the G episodes, seqs unused

    @property
    def complete(self) -> bool:
        if self.eps is not None:
            return all(e.done for e in self.eps)
        return all(s.finish_reason is not None for s in self.seqs)

    @property
    def oldest_version(self) -> int | None:
        """The oldest version among the group's tokens (None: no token yet)."""
        if self.eps is not None:
            vs = [e.first_version() for e in self.eps if e.first_version() is not None]
        else:
            vs = [s.versions[0] for s in self.seqs if s.versions]
        return min(vs) if vs else None


@dataclass(eq=False)
class Ep:
    """One episode of a group in the engine: its session, the sequence of its current turn (running,
    queued, or paused while the turn end is out) and what its finished turns produced."""

    session: Any
    seq: Sequence | None = None
    turns: list = field(default_factory=list)  # [(turn ids, end)]: what a restore replays
    logprobs: list = field(default_factory=list)  # per response token (0 on observation tokens)
    versions: list = field(default_factory=list)  # per response token (the version at the append on observations)
    pending: Any = None  # Future[Outcome] of the last turn end, applied before the next chunk
    paused: bool = False  # seq finished its turn (slot and KV held)
    done: bool = False
    truncated: bool = False

    def first_version(self) -> int | None:
        """The version of its first sampled token (None: none yet)."""
        if self.versions:
            return self.versions[0]
        return self.seq.versions[0] if self.seq is not None and self.seq.versions else None


@dataclass
class StepStats:
    """What one `next_batch` call did (logged as rollout/* metrics)."""

    requeued: int = 0
    dropped: int = 0
    filtered: int = 0  # dynamic sampling: completed groups with equal rewards, not counted toward the batch
    decode_steps: int = 0
    occupancy: float = 0.0


def occupancy(before: dict, after: dict) -> float:
    """Mean fraction of busy slots over the decode steps between two Sampler.stats()."""
    slots = after["slot_steps"] - before["slot_steps"]
    return (after["busy_slot_steps"] - before["busy_slot_steps"]) / slots if slots else 0.0


class ContinuousRollouts:
    """The engine's host state across steps: the data stream's position, the groups in flight and
    the completed groups not yet consumed."""

    def __init__(
        self,
        sampler,
        *,
        groups_per_step: int,
        group_size: int,
        staleness: int,
        stale_groups: str,
        sampling: SamplingParams,
        seed: int,
        prompt_offset: int,
        lengths=None,
        max_filtered: int = 0,
        runner=None,
        max_total_tokens: int | None = None,
    ):
        self.sampler = sampler
        self.groups_per_step, self.group_size, self.staleness = groups_per_step, group_size, staleness
        self.stale_groups, self.sampling, self.seed, self.prompt_offset = stale_groups, sampling, seed, prompt_offset
        self.lengths = lengths  # (data step, index, attempt) -> per-sequence max new tokens (forced), or None
        # dynamic sampling (rl.filter_groups): Group -> (rewards, errors, truncated), set by runtime/setup.py;
        # a completed group whose rewards are all equal is dropped (another is admitted in its place),
        # at most max_filtered per step (0: unbounded)
        self.scorer = None
        self.max_filtered = max_filtered
        self.in_flight: list[Group] = []
        self.done: list[Group] = []
        self.next_gid = 0
        self.data_step, self.data_index = 0, 0  # the next prompt of the stream
        self.retry: list[Group] = []  # re-queued groups, admitted before new prompts
        # episodes (env.name other than single_turn): the EnvRunner, the episode's token budget, and
        # the sampling of a turn with the runner's stops (the call close) added
        self.runner = runner
        self.max_total = int(max_total_tokens or sampling.max_new_tokens)
        if runner is not None:
            stop_ids = tuple(dict.fromkeys((*sampling.stop_token_ids, *runner.stop_token_ids)))
            stops = tuple(sampling.stop) + tuple(x for x in runner.stop_strings if x not in sampling.stop)
            self.sampling = dataclasses.replace(sampling, stop_token_ids=stop_ids, stop=stops)

    # ---- the step's batch ---------------------------------------------------------------------
    def next_batch(self, step: int, version: int, params, prompts) -> tuple[list[Group], StepStats]:
        """The first groups_per_step groups to complete that step `step` may consume, with the
        engine on weights `version` (installed between chunks, without draining)."""
        stats = StepStats()
        if self.sampler.version != version:
            self.sampler.update_weights(params, version)
        self.done = [g for g in self.done if self._keep(g, step, stats)]
        for g in [g for g in self.in_flight if not self._fresh_enough(g, step)]:
            self._abort(g)
            self.in_flight.remove(g)
            self._stale(g, stats)
        before = self.sampler.stats()
        while len(self.done) < self.groups_per_step:
            self._top_up(prompts)
            if self.runner is not None:
                self._apply_outcomes()  # the turn ends of the last chunk: resume or end those episodes
            finished = self.sampler.step()
            if self.runner is not None:
                self._turn_ends(finished)
                self._collect(step, stats)
            elif finished:
                self._collect(step, stats)
        after = self.sampler.stats()
        stats.decode_steps = after["decode_steps"] - before["decode_steps"]
        stats.occupancy = occupancy(before, after)
        batch, self.done = policy.take_batch(self.done, self.groups_per_step)
        return batch, stats

    # ---- checkpoints ----------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict, dict]:
        """The engine's whole state at a step boundary, taken without disturbing it (the run goes on
        as if no checkpoint were written): (JSON, device arrays). The JSON holds the stream's
        position, the retry queue, every group in flight or completed but not consumed (with its
        sequences' tokens, logprobs, versions and, under dynamic sampling, its scores) and the
        sampler's scheduler and page allocator; the arrays are the KV of its pages in use. `restore`
        continues decoding from it bit-exactly (re-prefilling is not: bench/NOTES.md)."""
        keep = ("gid", "data_step", "index", "attempt", "prompt", "host")
        groups = self.in_flight + self.done
        seqs = [s for g in groups for s in g.seqs]
        eps = [e for g in groups for e in g.eps or ()]
        for e in eps:  # a turn end still out: its session settles (the outcome is applied later, as it would be)
            if e.pending is not None:
                e.pending.result()
        seqs += [e.seq for e in eps if e.seq is not None]
        where = {id(s): i for i, s in enumerate(seqs)}
        sampler, arrays = self.sampler.snapshot(seqs)
        out, n = {"in_flight": [], "done": []}, 0
        for name in out:
            for g in getattr(self, name):
                d = {**{k: getattr(g, k) for k in keep}, "seqs": list(range(n, n + len(g.seqs))), "scores": _scores(g)}
                if g.eps is not None:
                    d["eps"] = [_ep_state(e, where) for e in g.eps]
                out[name].append(d)
                n += len(g.seqs)
        state = {
            "data_step": self.data_step,
            "data_index": self.data_index,
            "next_gid": self.next_gid,
            "retry": [{k: getattr(g, k) for k in keep} for g in self.retry],
            **out,
            "sampler": sampler,
        }
        return state, arrays

    def restore(self, state: dict, arrays: dict) -> None:
        seqs = self.sampler.restore(state["sampler"], arrays)
        self.data_step, self.data_index = int(state["data_step"]), int(state["data_index"])
        self.next_gid = int(state["next_gid"])

        def group(d: dict) -> Group:
            g = Group(**{k: v for k, v in d.items() if k not in ("seqs", "scores", "eps")})
            g.prompt = [int(t) for t in g.prompt]
            g.seqs = [seqs[int(i)] for i in d.get("seqs", [])]
            g.scores = _scores_from(d.get("scores"))
            if d.get("eps") is not None:
                if self.runner is None:
                    raise ValueError("ContinuousRollouts.restore: the snapshot holds episodes; this engine has none")
                g.eps = [self._ep_from(g, e, seqs) for e in d["eps"]]
            return g

        self.retry = [group(d) for d in state["retry"]]
        self.in_flight = [group(d) for d in state["in_flight"]]
        self.done = [group(d) for d in state["done"]]

    def in_flight_sequences(self) -> int:
        """Sequences holding or waiting for a slot: with episodes, every episode not done (a paused one
        keeps its slot while its tools run)."""
        n = sum(1 for g in self.in_flight for s in g.seqs if s.finish_reason is None)
        return n + sum(1 for g in self.in_flight for e in g.eps or () if not e.done)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _fresh_enough(self, g: Group, step: int) -> bool:
        return policy.fresh_enough(g.oldest_version, step, self.staleness)

    def _keep(self, g: Group, step: int, stats: StepStats) -> bool:
        if self._fresh_enough(g, step):
            return True
        self._stale(g, stats)
        return False

    def _stale(self, g: Group, stats: StepStats) -> None:
        """A group that can no longer meet the bound: generate its prompt again, or drop it."""
        if self.stale_groups == "requeue":
            stats.requeued += 1
            self.retry.append(dataclasses.replace(g, attempt=g.attempt + 1, seqs=[], scores=None, eps=None))
        else:
            stats.dropped += 1

    def _collect(self, step: int, stats: StepStats) -> None:
        """Move complete groups from in flight to done (in admission order within this chunk)."""
        for g in [g for g in self.in_flight if g.complete]:
            self.in_flight.remove(g)
            if self._keep(g, step, stats) and not self._filtered(g, stats):
                self.done.append(g)

    def _filtered(self, g: Group, stats: StepStats) -> bool:
        """Dynamic sampling: score a completed group; True (dropped, counted) when its rewards are all equal."""
        if self.scorer is None:
            return False
        g.scores = self.scorer(g)
        if not np.all(g.scores[0] == g.scores[0][0]):
            return False
        stats.filtered += 1
        if self.max_filtered and stats.filtered > self.max_filtered:
            raise FilterExhausted(filter_exhausted_why(self.max_filtered))
        return True

    def _top_up(self, prompts) -> None:
        """Queue whole groups until every slot is taken and one group waits for the next to free."""
        while policy.wants_group(self.in_flight_sequences(), self.sampler.cfg.max_slots):
            g = self.retry.pop(0) if self.retry else self._draw(prompts)
            self._submit(g)

    def _draw(self, prompts) -> Group:
        batch = prompts.get(self.data_step)
        i = self.data_index
        g = Group(
            gid=self.next_gid,
            data_step=self.data_step,
            index=i,
            attempt=0,
            prompt=[int(t) for t in batch.prompt_tokens[i]],
            host={"prompt": batch.prompts[i], "answer": batch.answers[i], "record": batch.records[i]},
        )
        self.next_gid += 1
        self.data_index += 1
        if self.data_index == len(batch.prompt_tokens):
            self.data_step, self.data_index = self.data_step + 1, 0
        return g

    def _submit(self, g: Group) -> None:
        seed = rollout_seed(self.seed + 7919 * g.attempt, g.data_step)
        sp = dataclasses.replace(self.sampling, n=self.group_size, seed=seed)
        # (forced lengths drawn by the prompt's index in the step's whole batch, as its stream: the
        # lengths of a prompt do not depend on how many processes share the batch)
        ids = [self.prompt_offset + g.index]
        lengths = None if self.lengths is None else [self.lengths(g.data_step, ids[0], g.attempt)]
        if self.runner is not None:
            sessions = [self.runner.start(episode_record(g)) for _ in range(self.group_size)]
            sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, self.max_total))
            seqs = self.sampler.submit([sessions[0].prompt_ids], sp, prompt_ids=ids, lengths=lengths, keep=True)
            g.eps = [Ep(session, seq) for session, seq in zip(sessions, seqs)]
            self.in_flight.append(g)
            return
        g.seqs = self.sampler.submit([g.prompt], sp, prompt_ids=ids, lengths=lengths)
        self.in_flight.append(g)

    # ---- episodes ---------------------------------------------------------------------------------
    def _abort(self, g: Group) -> None:
        """Take a group's sequences out of the engine (an episode's paused one: its slot released)."""
        if g.eps is None:
            self.sampler.abort(g.seqs)
            return
        for e in g.eps:
            if e.seq is not None and e.paused:
                self.sampler.release(e.seq)
            elif e.seq is not None:
                self.sampler.abort([e.seq])
            e.seq, e.pending, e.done = None, None, True

    def _episodes(self):
        """(group, member, episode) of every group in flight, in admission order: the order outcomes are
        applied in (a function of the data order, never of timing)."""
        return [(g, j, e) for g in self.in_flight for j, e in enumerate(g.eps or ())]

    def _turn_ends(self, finished) -> None:
        """Sequences that just finished their turn: paused (slot and KV held); the turn goes to the runner."""
        owner = {id(e.seq): e for _, _, e in self._episodes() if e.seq is not None and not e.paused}
        for seq in finished:
            e = owner.get(id(seq))
            if e is None:
                continue
            end = turn_end(seq, self.runner, self.sampler.tokenizer)
            e.paused = True
            e.turns.append((list(seq.tokens), end))
            e.logprobs += list(seq.logprobs)
            e.versions += list(seq.versions)
            e.pending = self.runner.submit(e.session, list(seq.tokens), end)

    def _apply_outcomes(self) -> None:
        """Every turn end out since the last chunk, in admission order (waiting for its tools if they
        still run): the observation appended to its paused KV, or the episode ended."""
        for g, j, e in self._episodes():
            if e.pending is None:
                continue
            out = e.pending.result()
            e.pending = None
            if out.done:
                self._end(e)
                continue
            e.logprobs += [0.0] * len(out.observation_ids)
            e.versions += [self.sampler.version] * len(out.observation_ids)
            used = len(e.session.response_ids())
            full = len(e.session.prompt_ids) + used
            left = min(self.sampling.max_new_tokens, self.max_total - used, self.sampler.max_seq_len - full)
            if left < 1:
                e.session.stats.truncated = True
                self._end(e, truncated=True)
                continue
            sp = dataclasses.replace(
                self.sampling, n=1, max_new_tokens=left, seed=rollout_seed(self.seed + 7919 * g.attempt, g.data_step)
            )
            pid = (1 << 30) + ((g.gid * self.group_size + j) * 64 + len(e.turns)) % (1 << 30)
            e.seq = self.sampler.resume(e.seq, out.observation_ids, sp, prompt_id=pid)
            e.paused = False

    def _end(self, e: Ep, truncated: bool = False) -> None:
        e.done = True
        e.truncated = e.truncated or truncated
        if e.seq is not None and e.paused:
            self.sampler.release(e.seq)
        e.seq, e.paused = None, False

    def _ep_from(self, g: Group, d: dict, seqs: list) -> Ep:
        """An episode of a snapshot: its turns replayed through a fresh episode (module doc)."""
        e = Ep(self.runner.start(episode_record(g)))
        e.logprobs = [float(x) for x in d["logprobs"]]
        e.versions = [int(x) for x in d["versions"]]
        e.done, e.truncated, e.paused = bool(d["done"]), bool(d["truncated"]), bool(d["paused"])
        e.seq = seqs[int(d["seq"])] if d.get("seq") is not None else None
        out = None
        for ids, end in d["turns"]:
            e.turns.append(([int(t) for t in ids], end))
            out = self.runner.end_turn(e.session, e.turns[-1][0], end)
        if e.session.response_ids() != [int(t) for t in d["response_ids"]]:
            raise ValueError(
                f"ContinuousRollouts.restore: an episode of group {g.gid} replayed to other tokens than it had "
                "(its environment or tools are not a deterministic function of the turns)"
            )
        if e.truncated:  # (ended by the token budget, which the replay does not see)
            e.session.stats.truncated = True
        if d["pending"]:
            e.pending = Future()
            e.pending.set_result(out)
        return e


def episode_record(g: Group) -> dict:
    """The data record an episode of group g starts from (PromptBatch.record's fields)."""
    return {**g.host["record"], "prompt": g.host["prompt"], "answer": g.host["answer"], "prompt_tokens": list(g.prompt)}


def _ep_state(e: Ep, where: dict) -> dict:
    """JSON of an episode in flight (its session is rebuilt by replaying `turns`)."""
    return {
        "turns": [[list(ids), end] for ids, end in e.turns],
        "response_ids": e.session.response_ids(),
        "logprobs": list(e.logprobs),
        "versions": list(e.versions),
        "seq": where[id(e.seq)] if e.seq is not None else None,
        "pending": e.pending is not None,
        "paused": e.paused,
        "done": e.done,
        "truncated": e.truncated,
    }


def _scores(g: Group) -> dict | None:
    """JSON of a group's dynamic-sampling scores (rewards [G], errors, truncated [G]), exact."""
    if g.scores is None:
        return None
    rewards, errors, truncated = g.scores
    rewards, truncated = np.asarray(rewards), np.asarray(truncated)
    return {
        "rewards": rewards.tolist(),
        "rewards_dtype": str(rewards.dtype),
        "errors": int(errors),
        "truncated": truncated.tolist(),
        "truncated_dtype": str(truncated.dtype),
    }


def _scores_from(d: dict | None):
    if d is None:
        return None
    return (
        np.asarray(d["rewards"], np.dtype(d["rewards_dtype"])),
        int(d["errors"]),
        np.asarray(d["truncated"], np.dtype(d["truncated_dtype"])),
    )


def rollout_seed(base: int, step: int) -> int:
    """The sampler seed of a data step's prompts (each prompt's stream is (seed, prompt id))."""
    return (base * 1_000_003 + step * 7919 + 17) % (2**31 - 1)


def forced_lengths(spec: tuple[float, float, int, int], seed: int, group_size: int):
    """Per-sequence response lengths from a lognormal (median, sigma) clipped to [lo, hi], drawn from
    a stream of (seed, data step, index, attempt, sample): the benchmark workloads' long tail (R2)."""
    median, sigma, lo, hi = spec

    def lengths(data_step: int, index: int, attempt: int) -> list[int]:
        rng = np.random.default_rng([seed, data_step, index, attempt])
        draw = np.exp(np.log(median) + sigma * rng.standard_normal(group_size))
        return [int(x) for x in np.clip(np.round(draw), lo, hi)]

    return lengths
