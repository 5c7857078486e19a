"""Host-side stop sequences: multi-token id sequences and (with a tokenizer) stop strings.

Stop token ids are checked on device inside the decode loop; stop *sequences* are checked here by the
Sampler after each chunk (`sampling/sampler.py`). A match truncates the completion right after the
stop sequence (it stays in the output, as stop token ids do) and ends it with reason "stop"; tokens the
device sampled after the match are dropped.
"""

from __future__ import annotations

from typing import Any, Sequence


class StopMatcher:
    def __init__(self, stops: Sequence, tokenizer: Any = None):
        self.token_seqs = [tuple(int(t) for t in s) for s in stops if not isinstance(s, str)]
        self.strings = [s for s in stops if isinstance(s, str)]
        if self.strings and tokenizer is None:
            raise ValueError(
                f"sampling_params.stop={self.strings!r}: stop strings need a tokenizer "
                "(Sampler(model, config, tokenizer=...) with a .decode(ids) method)"
            )
        self.tokenizer = tokenizer

    def __bool__(self) -> bool:
        return bool(self.token_seqs or self.strings)

    def find(self, tokens: list[int], n_new: int) -> int | None:
        """Length to keep if a stop sequence ends within the last n_new tokens (earliest match),
        else None. Earlier tokens were checked when they arrived."""
        if not self or n_new <= 0:
            return None
        first = len(tokens) - n_new
        for end in range(first + 1, len(tokens) + 1):  # keep-length candidates, earliest first
            for q in self.token_seqs:
                if end >= len(q) and tuple(tokens[end - len(q) : end]) == q:
                    return end
        if self.strings:
            decode = self.tokenizer.decode
            if not any(s in decode(tokens) for s in self.strings):
                return None
            for end in range(first + 1, len(tokens) + 1):
                text = decode(tokens[:end])
                if any(s in text for s in self.strings):
                    return end
        return None
