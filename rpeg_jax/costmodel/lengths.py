"""Response-length distributions and the decode schedule they imply (batch shrinking over time).

Generation time is set by the length distribution, not the mean: the
active batch b(τ) shrinks as sequences finish and the longest sequence sets the stage's end. A
`LengthDist` is a shifted lognormal clipped to [min_len, max_len] (a long tail), or an empirical
sample (the previous iteration's realised lengths). `decode_profile` runs continuous batching
with `slots` concurrent sequences (refill on finish) and compresses the step axis into bins:

    T_gen = Σ_bins steps_i · t_step(b_i, c_i)      (b_i active sequences, c_i their mean context)

Callers: costmodel/stages.py, planner.py, fit.py, calibrate.py, tests. Pure numpy.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

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
