"""Response-length distributions and the decode schedule they imply (batch shrinking over time).

Generation time is set by the length distribution, not the mean: the
active batch b(τ) shrinks as sequences finish and the longest sequence sets the stage's end. A
`LengthDist` is a shifted lognormal clipped to [min_len, max_len] (a long tail), or an empirical
sample (the previous iteration's realised lengths). `decode_profile` runs continuous batching
with `slots` concurrent sequences (refill on finish) and compresses the step axis into bins:

    T_gen = Σ_bins steps_i · t_step(b_i, c_i)      (b_i active sequences, c_i their mean context)

That is one step-admission generate call. `admission` simulates the engine across RL steps
(rollout.admission=continuous, runtime/rollout/continuous.py: groups admitted at decode-chunk ends, the
batch the first groups to complete, the staleness bound) and returns its steady state per step
(`Admission`: decode steps, occupancy, tokens, staleness, re-queues).

Callers: costmodel/stages.py, planner.py, fit.py, calibrate.py, tests. Pure numpy.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from rpeg_jax.shapes import admission as policy
from rpeg_jax.shapes.buckets import TableWidths

NBINS = 32  # bins of the decode step axis (the cost model sums a roofline per bin)


@dataclass(frozen=True)
class LengthDist:
    """Response lengths in tokens: min_len + LogNormal(ln(median - min_len), sigma), ≤ max_len."""

    max_len: int
    min_len: int = 1
    median: float | None = None  # None -> halfway between min_len and max_len
    sigma: float = 0.6  # lognormal shape (0 -> every response has the median length)
    samples: tuple[int, ...] = ()  # empirical lengths; when given they win over the parameters

    def __post_init__(self):
        if self.max_len < 1 or not (1 <= self.min_len <= self.max_len):
            raise ValueError(f"LengthDist: need 1 <= min_len={self.min_len} <= max_len={self.max_len}")
        if self.sigma < 0:
            raise ValueError(f"LengthDist: sigma={self.sigma} must be >= 0")
        if self.median is not None and not (self.min_len <= self.median <= self.max_len):
            raise ValueError(f"LengthDist: median={self.median} outside [{self.min_len}, {self.max_len}]")

    @staticmethod
    def fixed(n: int) -> LengthDist:
        return LengthDist(max_len=n, min_len=n, sigma=0.0)

    def lengths(self, n: int) -> np.ndarray:
        """n lengths at the quantiles (i + 0.5)/n (deterministic), in a fixed shuffled order so
        long ones are not all admitted last."""
        q = (np.arange(n) + 0.5) / n
        if self.samples:
            out = np.quantile(np.asarray(self.samples, np.float64), q, method="inverted_cdf")
        else:
            med = self.median if self.median is not None else (self.min_len + self.max_len) / 2
            base = max(med - self.min_len, 0.0)
            z = np.array([NormalDist().inv_cdf(x) for x in q]) if self.sigma > 0 else np.zeros(n)
            out = self.min_len + base * np.exp(self.sigma * z)
        out = np.clip(np.round(out), self.min_len, self.max_len).astype(np.int64)
        return out[np.random.default_rng(0).permutation(n)]

    def mean(self, n: int = 1024) -> float:
        return float(self.lengths(n).mean())


@dataclass(frozen=True)
class DecodeProfile:
    """Binned schedule of one generation replica. Arrays have one entry per bin."""

    steps: np.ndarray  # decode steps in the bin
    batch: np.ndarray  # mean active sequences per step
    ctx: np.ndarray  # mean context (prompt + generated so far) of an active sequence
    bin_edges: np.ndarray  # step index where each bin starts (len nbins + 1)
    total_steps: int


@dataclass(frozen=True)
class GenSchedule:
    """Synchronous generation of one batch over `reps` replicas with `slots` slots each."""

    critical: tuple[DecodeProfile, ...]  # replicas that can finish last (longest tail, most tokens)
    finish_step: np.ndarray  # sorted finish step of every sequence of the batch
    mean_len: float
    mean_sq_len: float


def _schedule(lengths: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and end step of every sequence under continuous batching with `slots` slots."""
    if slots >= len(lengths):
        return np.zeros(len(lengths), np.int64), lengths.copy()
    free = [0] * slots
    heapq.heapify(free)
    start = np.empty(len(lengths), np.int64)
    for i, ln in enumerate(lengths):
        s = heapq.heappop(free)
        start[i] = s
        heapq.heappush(free, s + int(ln))
    return start, start + lengths


def _profile(start: np.ndarray, end: np.ndarray, prompt_len: int, nbins: int) -> DecodeProfile:
    total = int(end.max())
    # Difference arrays: active count and Σ start over active sequences, per step.
    active = np.zeros(total + 1)
    np.add.at(active, start, 1.0)
    np.add.at(active, end, -1.0)
    active = np.cumsum(active)[:total]
    s_start = np.zeros(total + 1)
    np.add.at(s_start, start, start.astype(np.float64))
    np.add.at(s_start, end, -start.astype(np.float64))
    s_start = np.cumsum(s_start)[:total]
    gen_sum = active * np.arange(total, dtype=np.float64) - s_start  # Σ (τ - start_i) over active
    edges = np.unique(np.linspace(0, total, min(nbins, total) + 1).round().astype(np.int64))
    steps = np.diff(edges).astype(np.float64)
    b_sum = np.add.reduceat(active, edges[:-1])
    g_sum = np.add.reduceat(gen_sum, edges[:-1])
    ctx = prompt_len + 1 + np.where(b_sum > 0, g_sum / np.maximum(b_sum, 1e-9), 0.0)
    return DecodeProfile(steps=steps, batch=b_sum / steps, ctx=ctx, bin_edges=edges, total_steps=total)


@functools.lru_cache(maxsize=4096)
def gen_schedule(
    dist: LengthDist, batch: int, reps: int, slots: int, prompt_len: int, nbins: int = NBINS
) -> GenSchedule:
    """The batch's sequences dealt round-robin to `reps` replicas (whole batch in one step).

    The stage ends when the slowest replica does: the one holding the longest response
    (memory-bound decode) or the most tokens (compute-bound); both are profiled."""
    if batch < 1 or reps < 1 or slots < 1:
        raise ValueError(f"gen_schedule: batch={batch}, reps={reps}, slots={slots} must be >= 1")
    lengths = dist.lengths(batch)
    per = [lengths[r::reps] for r in range(min(reps, batch))]
    ends = []
    for ln in per:
        ends.append(_schedule(ln, min(slots, len(ln)))[1])
    longest = int(np.argmax([e.max() for e in ends]))
    busiest = int(np.argmax([ln.sum() for ln in per]))
    crit = []
    for r in dict.fromkeys((longest, busiest)):
        st, en = _schedule(per[r], min(slots, len(per[r])))
        crit.append(_profile(st, en, prompt_len, nbins))
    lf = lengths.astype(np.float64)
    return GenSchedule(
        critical=tuple(crit),
        finish_step=np.sort(np.concatenate(ends)),
        mean_len=float(lf.mean()),
        mean_sq_len=float((lf**2).mean()),
    )


# ---- the engine's admission, decode step by decode step ----------------------------------------
@dataclass(frozen=True)
class Admission:
    """Steady-state behaviour of one sampler engine per RL step (means over the measured steps).

    Defined as the runtime logs them (runtime/rollout/continuous.py, Sampler.stats()): `occupancy` =
    busy slot-steps / (decode steps x slots), where a busy slot-step is one decoded token."""

    decode_steps: float  # decode steps per RL step
    occupancy: float  # mean busy fraction of the slots over those steps (rollout/occupancy)
    tokens: float  # tokens decoded per RL step (busy slot-steps; requeued groups' work included)
    batch_tokens: float  # response tokens of the consumed batch per step
    batch_longest: float  # mean longest response of a consumed batch (the padded R of its update)
    ctx: float  # mean tokens generated so far by a busy slot (its context beyond the prompt)
    # mean over decode steps of the page-table width a chunk needs, in tokens beyond the prompt: the
    # longest running sequence's tokens + the chunk's steps (Sampler._width covers the whole chunk),
    # rounded up to the sampler's width bucket when admission() is given the `table`. A decode step
    # of static rows reads every slot's table to this width.
    ctx_width: float
    staleness_mean: float  # mean over consumed groups of t - (version of their oldest token)
    staleness_max: int
    requeued: float  # groups per step that broke the bound k (re-queued or dropped)
    admitted: float  # groups admitted per step (prefills), re-admissions included
    chunks: float  # decode chunks (device calls) per step
    # response lengths of the consumed batches' sequences over the measured steps (sorted): biased
    # short against `dist` at small k (a long sequence outlives the bound and is re-queued), which is
    # what a packed update computes on (candidates.consumed_setting)
    consumed: tuple[int, ...] = ()
    trace: tuple | None = None  # admission(trace=True): per step (consumed (stream index, attempt)s,
    #   re-queued, dropped, decode steps)


def draw_lengths(dist: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    """n random lengths of `dist` (its empirical samples, or its clipped shifted lognormal)."""
    if dist.samples:
        return rng.choice(np.asarray(dist.samples, np.int64), n)
    med = dist.median if dist.median is not None else (dist.min_len + dist.max_len) / 2
    base = max(med - dist.min_len, 0.0)
    out = dist.min_len + base * np.exp(dist.sigma * rng.standard_normal(n))
    return np.clip(np.round(out), dist.min_len, dist.max_len).astype(np.int64)


def window(hist: list, warmup: int, steps: int) -> tuple[int, int]:
    """The measured steps [a, b) of a simulation's per-step records (decode steps first): at least
    `steps` whole cycles' worth after `warmup`, from a step that decodes to just before one that
    does. With more slots than a batch an engine may decode in one step the groups of the next
    few (no decoding in those), so a window must not cut such a cycle."""
    dec = [i for i in range(warmup, len(hist)) if hist[i][0] > 0]
    if not dec:
        return warmup, len(hist)
    a = dec[0]
    ends = [i for i in dec if i >= a + steps]
    return a, ends[0] if ends else len(hist)


def measured(hist: list, warmup: int, steps: int, cap: int = 8) -> bool:
    """Whether a simulation has run long enough for window() (or `cap` x steps past warmup)."""
    n = len(hist)
    if n >= warmup + cap * steps:
        return True
    a, b = window(hist, warmup, steps)
    return n > warmup and b < n


class LengthStream:
    """The lengths of the groups a simulated engine admits, group after group: blocks of BLOCK
    groups drawn at once from one seeded generator (lengths.admission; its tests read it too)."""

    BLOCK = 256

    def __init__(self, dist: LengthDist, group: int, seed: int = 0):
        self.dist, self.group, self.rng = dist, group, np.random.default_rng(seed)
        self.block, self.i = np.zeros((0, group), np.int64), 0

    def next(self) -> np.ndarray:
        if self.i == len(self.block):
            self.block = draw_lengths(self.dist, self.rng, self.BLOCK * self.group).reshape(self.BLOCK, self.group)
            self.i = 0
        self.i += 1
        return self.block[self.i - 1]


@functools.lru_cache(maxsize=4096)
def admission(
    dist: LengthDist,
    slots: int,
    groups: int,
    group: int,
    staleness: int = 1,
    mode: str = "continuous",
    chunk_steps: int = 64,
    min_chunk_steps: int = 8,
    steps: int = 8,
    warmup: int | None = None,
    seed: int = 0,
    table: tuple[int, int, int, float] | None = None,
    source=None,
    requeue: bool = True,
    trace: bool = False,
    lag: int = 0,
) -> Admission:
    """Event simulation of the sampler's slots over RL steps (runtime/rollout/continuous.ContinuousRollouts
    over sampling/sampler.Sampler.step), one decode chunk per event, deciding with the engine's own
    rules (shapes/admission.py):

    - `mode="continuous"`: at the start of step t the groups that broke the bound k are re-queued
      (`requeue`: generated again before any new prompt) or dropped, the completed ones first; whole
      groups of `group` sequences are queued while the unfinished sequences fit in the slots
      (`wants_group`); at each chunk start the waiting groups are admitted FIFO while one fits
      (`admits`); a chunk runs min(chunk_steps, longest remaining) decode steps, cut where the
      page-table width would grow (`table`), and ends early once the first waiting group's slots
      have freed after min_chunk_steps (`release_rule` / `chunk_length`); a step's batch is the
      first `groups` groups to complete, in submission order within a chunk (`take_batch`).
    - `mode="step"`: each step queues its `groups` groups and decodes them to the end (no early
      release); what runtime/rollout/sources.generate_piece does with one piece.

    Lengths: `source(n, attempt)` gives the lengths of the stream's n-th prompt at its attempt-th
    generation when given (tests drive the engine and this simulation on the same lengths); else
    LengthStream(dist, group, seed), one group per submission (then a re-queued group and a new one
    cost the same). A group's oldest token has the version of the step that admitted it (weights
    are installed between steps, tokens are produced from the first chunk after admission). Not
    modelled: the KV page budget (slots are the limit). `table` = (page_size, prompt tokens,
    min_table_width, table_width_growth): the sampler's page-table width buckets (shapes/buckets.
    TableWidths over the running sequences' positions), and `ctx_width` is the bucket's width
    (tokens beyond the prompt) that every slot's table is read to; None: the unbucketed width.
    `warmup` steps (default k + 2: a group lives at most k + 1 steps in the engine) run before the
    `steps` measured (P1's decode steps move < 2% from 8 to 16 measured steps). `trace`: the result
    carries, per step, (the consumed groups as (stream index, attempt), re-queued, dropped, decode
    steps). `lag`: the engine decodes step t's batch with the weights of version max(0, t - lag) (1:
    decoding ahead, rollout.decode_ahead; 0: the newest)."""
    if slots < group or groups < 1 or group < 1:
        raise ValueError(f"admission: slots={slots} must hold a group of {group}; groups={groups} >= 1")
    stream = LengthStream(dist, group, seed)
    if table is not None:
        page, prompt, min_w, growth = table
        widths = TableWidths(page, -(-(prompt + dist.max_len) // max(page, 1)), min_w, growth)
    warmup = staleness + 2 if warmup is None else warmup
    cont = mode == "continuous"
    rem = np.zeros(slots, np.int64)  # tokens left per slot (0: free)
    pos = np.zeros(slots, np.int64)  # tokens generated so far per slot
    owner = np.full(slots, -1, np.int64)  # submission id per slot
    left: dict[int, int] = {}  # submission -> members still decoding (admitted, not complete)
    lengths: dict[int, np.ndarray] = {}  # submission -> its members' lengths (submitted, not consumed)
    ident: dict[int, tuple[int, int]] = {}  # submission -> (stream index, attempt)
    oldest: dict[int, int] = {}  # submission -> version of its oldest token (admitted, not consumed)
    waiting: list[int] = []  # submitted, not admitted (FIFO)
    done: list[int] = []  # complete, not consumed (in completion order)
    retry: list[tuple[int, int]] = []  # re-queued (stream index, attempt), before new prompts
    nfree = slots  # slots with no sequence
    unfinished = 0  # members of submitted groups still to finish (ContinuousRollouts.in_flight_sequences)
    gid, drawn = 0, 0
    batches = []  # per step: the consumed batch's response lengths
    traced = []
    hist = []  # per step: decode steps, busy, batch tokens, longest, Σ ctx, Σ staleness, requeued, admitted,
    #            chunks, staleness max, Σ width

    def submit() -> None:
        nonlocal gid, drawn, unfinished
        if retry:
            who = retry.pop(0)
        else:
            who, drawn = (drawn, 0), drawn + 1
        ident[gid] = who
        lengths[gid] = stream.next() if source is None else np.asarray(source(*who), np.int64)
        waiting.append(gid)
        unfinished += group
        gid += 1

    t = -1
    while not measured(hist, warmup, steps):
        t += 1
        st = np.zeros(11)
        requeued = dropped = 0
        if cont:  # the bound at the start of step t: completed groups first, then those in flight
            stale = [g for g in done if not policy.fresh_enough(oldest[g], t, staleness)]
            stale += [g for g in sorted(left) if not policy.fresh_enough(oldest[g], t, staleness)]
            for g in stale:
                if g in left:  # in flight: abort, free its slots
                    busy = owner == g
                    rem[busy], pos[busy], owner[busy] = 0, 0, -1
                    nfree += int(busy.sum())
                    unfinished -= left.pop(g)
                else:
                    done.remove(g)
                if requeue:
                    retry.append((ident[g][0], ident[g][1] + 1))
                    requeued += 1
                else:
                    dropped += 1
                del oldest[g], lengths[g]
            st[6] = len(stale)
        else:
            for _ in range(groups):
                submit()
        while len(done) < groups:
            while cont and policy.wants_group(unfinished, slots):  # top up
                submit()
            free = np.flatnonzero(owner < 0)
            while waiting and policy.admits(group, len(free)):  # FIFO while a whole group fits
                g = waiting.pop(0)
                idx, free = free[:group], free[group:]
                rem[idx], pos[idx], owner[idx] = lengths[g], 0, g
                left[g], oldest[g] = group, max(0, t - lag)
                nfree -= group
                st[7] += 1
            busy = rem > 0
            k = min(chunk_steps, int(rem.max()))  # free slots hold rem = 0 and decode nothing
            if table is not None:  # the host's chunk: cut where the width bucket would grow
                abs_pos, abs_end = prompt - 1 + pos[busy], prompt + pos[busy] + rem[busy]  # Sequence.pos / .end
                k = widths.align(abs_pos, abs_end, k, min_chunk_steps)
                width = widths.pages(abs_pos, abs_end, k) * widths.page - prompt
            rule = policy.release_rule(cont, [group] if waiting else [], min_chunk_steps, slots)
            k = policy.chunk_length(rem[busy], k, rule)
            n = np.minimum(rem, k)
            if table is None:  # the chunk's table width, k steps
                width = int(pos[busy].max(initial=0)) + k
            st[10] += k * width
            st[0] += k
            st[1] += n.sum()
            st[4] += float(np.dot(n, pos) + np.dot(n, n - 1) / 2)  # Σ generated-so-far over busy steps
            st[8] += 1
            rem -= n
            pos += n
            fin = np.flatnonzero((n > 0) & (rem == 0))
            nfree += len(fin)
            complete = []
            for g in owner[fin].tolist():
                left[g] -= 1
                unfinished -= 1
                if not left[g]:
                    complete.append(g)
                    del left[g]
            owner[fin] = -1
            done += sorted(complete)  # in submission order within the chunk (ContinuousRollouts._collect)
        batch, done = policy.take_batch(done, groups)
        batches.append(np.concatenate([lengths[g] for g in batch]))
        if trace:
            traced.append((tuple(ident[g] for g in batch), requeued, dropped, int(st[0])))
        for g in batch:
            st[2] += lengths[g].sum()
            st[3] = max(st[3], lengths[g].max())
            st[5] += t - oldest[g]
            st[9] = max(st[9], t - oldest[g])
            del lengths[g], oldest[g]
        hist.append(st)
    a, b = window(hist, warmup, steps)
    m = np.mean(hist[a:b], axis=0)
    return Admission(
        decode_steps=float(m[0]),
        occupancy=float(m[1] / (m[0] * slots)) if m[0] else 0.0,
        tokens=float(m[1]),
        batch_tokens=float(m[2]),
        batch_longest=float(m[3]),
        ctx=float(m[4] / m[1]) if m[1] else 0.0,
        ctx_width=float(m[10] / m[0]) if m[0] else 0.0,
        staleness_mean=float(m[5] / groups),
        staleness_max=int(max(h[9] for h in hist[a:b])),
        requeued=float(m[6]),
        admitted=float(m[7]),
        chunks=float(m[8]),
        consumed=tuple(sorted(np.concatenate(batches[a:b]).tolist())),
        trace=tuple(traced) if trace else None,
    )
