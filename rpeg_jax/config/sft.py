"""SFT section: supervised fine-tuning on chat transcripts (issue 32 item 6), run by `rpeg train`
with train.mode=sft (or sft_then_rl: SFT, then RL from the SFT policy).

    train: {mode: sft_then_rl}
    sft:
      path: transcripts.jsonl     # one conversation a line: {"messages": [{role, content}, ...]}
      steps: 300
      batch_size: 16              # conversations per optimizer step
      max_len: 256                # tokens of a packed row (and the longest conversation)

Each conversation is rendered with the run's chat template (data.chat_template; jinja2 sandbox,
data/chat.py), tokenized with data.tokenizer, and trained on its assistant tokens only
(data/sft.py says exactly which); conversations are packed into rows of sft.max_len tokens
(first-fit-decreasing, a segment each). Optimizer settings are the optim section's, with sft.lr
in place of optim.lr when given. Read by runtime/sft.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    path: str | None = None  # JSONL of chat transcripts (train.mode=sft / sft_then_rl)
    messages_field: str = "messages"  # JSONL key of a record's list of messages ("a.b" nests)
    tools_field: str | None = "tools"  # JSONL key of a record's tool schemas (rendered as the template's
    #                                    tools=), absent or null: none
    steps: int = 100  # optimizer steps (the most, with stop_loss)
    batch_size: int = 16  # conversations per optimizer step (over all processes)
    max_len: int = 256  # tokens of a packed row; a longer conversation is an error (or skipped)
    lr: float | None = None  # peak learning rate of SFT; null: optim.lr
    on_bad_record: Literal["error", "skip"] = "error"  # a line that is not a conversation, or too long
    shuffle: bool = True  # conversations reshuffled every epoch (seed: train.seed)
    checkpoint_every: int = 0  # SFT steps between checkpoints (0: the final one only)
    eval_every: int = 0  # SFT steps between held-out evaluations (eval.path; 0: after the last step only)
    stop_loss: float | None = None  # stop (checkpoint, evaluation, export as after the last step) at the first
    #                                 step where the mean sft/loss of the last 10 steps is below this; null:
    #                                 run sft.steps (runtime/sft.py: STOP_WINDOW)

    def validate(self, path: str) -> None:
        for name in ("steps", "batch_size", "max_len"):
            v = getattr(self, name)
            check(v >= 1, key(path, name), v, "must be >= 1")
        for name in ("checkpoint_every", "eval_every"):
            v = getattr(self, name)
            check(v >= 0, key(path, name), v, "must be >= 0")
        if self.stop_loss is not None:
            check(self.stop_loss > 0, key(path, "stop_loss"), self.stop_loss, "must be > 0 (null: run sft.steps)")
        if self.lr is not None:
            check(self.lr > 0, key(path, "lr"), self.lr, "must be > 0 (null: optim.lr)")
        for name in ("messages_field", "tools_field"):
            v = getattr(self, name)
            if v is not None:
                check(bool(v) and all(v.split(".")), key(path, name), v, "must be a non-empty (dotted) key")
        if self.path is not None:
            check(bool(self.path), key(path, "path"), self.path, "must not be empty")
