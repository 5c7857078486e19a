"""The logits budget: the LM head runs over a pass's positions in chunks, each materialising at most
LOGITS_BUDGET float32 logits (models/logprobs.chunked_logprobs), so a long response never holds a
[rows, positions, vocab] array. The cost model prices the same chunk's working set
(costmodel/shape.ModelShape.logits_bytes)."""

from __future__ import annotations

import numpy as np

LOGITS_BUDGET = 1 << 24  # float32 logits elements per chunk (64 MiB)


def logits_chunk(rows: int, positions: int, vocab: int) -> int:
    """Positions per chunk of a [rows, positions] pass over a `vocab`-column head: as many as the
    budget holds, at least 1 (rows x vocab alone above the budget runs one position at a time)."""
    return max(1, min(positions, LOGITS_BUDGET // max(1, int(rows) * int(vocab))))


def chunk_elements(scored, vocab, rows: int = 1):
    """Logits elements of one chunk when `scored` positions (an array, elementwise) run in `rows`
    rows: rows * logits_chunk(rows, ceil(scored / rows), vocab) * vocab, vectorised (0 for none)."""
    per_row = np.ceil(np.asarray(scored, np.float64) / rows)
    return rows * np.minimum(per_row, logits_chunk(rows, np.inf, vocab)) * float(vocab)
