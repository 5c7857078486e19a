"""Shape buckets shared by the program and the cost model.

- Page-table widths (the sampler's decode program is compiled per width): the smallest width in
  the sequence lo, max(lo + 1, ceil(lo * growth)), ... that covers what the running sequences need,
  capped at one maximal sequence's pages. `TableWidths` answers it for a set of running sequences
  and cuts a decode chunk where the width would grow (`align`).
- The length bucket: the rollout batch pads its prompt and response windows to a multiple of
  LENGTH_BUCKET unless its shapes are fixed (one compile per bucket instead of per length).

Positions follow the sampler's convention (sampling/scheduler.Sequence): a sequence's `pos` is the
index of its last known token (prompt + generated - 1: the next decode step's input, its KV not yet
written) and it stops when it knows `end` tokens (prompt + its response budget). k decode steps
need the cache to hold positions up to min(pos + k, end - 1) - 1, i.e. pages for min(pos + k,
end - 1) tokens.
"""

from __future__ import annotations

import math

import numpy as np

MIN_TABLE_WIDTH = 1  # the smallest page-table width bucket, in pages (SamplerConfig.min_table_width)
LENGTH_BUCKET = 8  # prompt and response windows are padded to a multiple of this (unless fixed)


def pow2ceil(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def width_bucket(need: int, lo: int, growth: float) -> int:
    """The smallest page-table width >= need in the sequence lo, max(lo+1, ceil(lo*growth)), ..."""
    w = int(lo)
    while w < need:
        w = max(w + 1, math.ceil(w * growth))
    return w


def length_bucket(n: int, fixed: int | None = None) -> int:
    """A window of n tokens padded to a multiple of LENGTH_BUCKET (at least one bucket), or `fixed`
    when the shapes are fixed."""
    if fixed is not None:
        return int(fixed)
    return max(LENGTH_BUCKET, -(-int(n) // LENGTH_BUCKET) * LENGTH_BUCKET)


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple` (<= 1: n itself)."""
    b = max(int(multiple), 1)
    return -(-int(n) // b) * b


class TableWidths:
    """The decode program's page-table width over running sequences (module docstring).

    `max_pages` caps the last bucket (a maximal sequence's pages: the sampler's per-sequence page
    count). Used by the sampler (Sampler._width, _align_chunk) on its running sequences and by the
    cost model's admission simulation on simulated ones."""

    def __init__(self, page_size: int, max_pages: int, min_width: int = MIN_TABLE_WIDTH, growth: float = 2.0):
        self.page = max(int(page_size), 1)
        self.max_pages = int(max_pages)
        self.buckets = np.asarray(
            [min(width_bucket(need, min_width, growth), self.max_pages) for need in range(self.max_pages + 1)],
            np.int64,
        )
        self._big = (int(min_width), float(growth))

    def width(self, need_pages: int) -> int:
        """The bucket (pages) holding `need_pages` pages."""
        if need_pages <= self.max_pages:
            return int(self.buckets[max(int(need_pages), 0)])
        return min(width_bucket(need_pages, *self._big), self.max_pages)

    def pages(self, pos, end, k: int) -> int:
        """The width (pages) covering k more decode steps of every running sequence (arrays of their
        pos and end; none running: the smallest bucket)."""
        pos, end = np.asarray(pos), np.asarray(end)
        if not pos.size:
            return int(self.buckets[0])
        need = int(np.max(np.minimum(pos + k, end - 1)))
        return self.width(-(-need // self.page))

    def align(self, pos, end, k: int, min_steps: int) -> int:
        """The decode chunk cut where its width would grow: the largest k' in [min(k, min_steps), k]
        whose width is that of min(k, min_steps). In closed form: the width of w pages holds
        positions below cap = w * page, so only the sequences that would go past it (end - 1 > cap)
        bound k' (pos + k' <= cap). Equal to a search over `pages` (tests/test_shapes.py)."""
        lo = min(k, min_steps)
        if k <= lo:
            return k
        pos, end = np.asarray(pos), np.asarray(end)
        cap = self.pages(pos, end, lo) * self.page
        over = end - 1 > cap
        return max(lo, min(k, cap - int(pos[over].max()))) if over.any() else k
