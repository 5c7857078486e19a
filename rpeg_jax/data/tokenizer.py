"""Tokenizers behind one small interface: a character tokenizer for the built-in tasks and
Hugging Face `tokenizer.json` files through the `tokenizers` library.

    tok = load_tokenizer(cfg.data)          # CharTokenizer when data.tokenizer is None
    ids = tok.encode("12+34=")              # no special tokens added; the pipeline adds bos
    text = tok.decode(ids)                  # special tokens (pad/bos/eos) are dropped

Called by: data/pipeline.py (prompts -> ids), data/rewards.py (completion ids -> text), the
runtime (pad/eos ids for the sampler).
"""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence, runtime_checkable

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.data import DataConfig

# Looked up (in this order) when neither data.*_token nor tokenizer_config.json names a token.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>", "<|eot_id|>", "[SEP]")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the pipeline, rewards and runtime need from a tokenizer."""

    vocab_size: int  # ids are in [0, vocab_size)
    pad_id: int
    bos_id: int | None  # None: the tokenizer has no bos token (e.g. Qwen2); prompts start bare
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens (pad/bos/eos) dropped."""
        ...


class CharTokenizer:
    """One id per character, as model T of bench/WORKLOADS.md expects: vocab 128, pad 0, bos 1, eos 2.

    Printable ASCII (32..126), tab and newline map to their code points, which never collide
    with the special ids. Any other id decodes to U+FFFD, so a random model's junk tokens can
    never read as digits (a reward that compares characters gives them no credit).
    """

    vocab_size = 128
    pad_id, bos_id, eos_id = 0, 1, 2
    REPLACEMENT = "\ufffd"

    @staticmethod
    def encodable(ch: str) -> bool:
        return 32 <= ord(ch) <= 126 or ch in "\t\n"

    def encode(self, text: str) -> list[int]:
        for i, ch in enumerate(text):
            if not self.encodable(ch):
                raise ValueError(
                    f"character {ch!r} (U+{ord(ch):04X}) at position {i} is not in the "
                    "character tokenizer's vocabulary (printable ASCII, tab, newline)"
                )
        return [ord(ch) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (self.pad_id, self.bos_id, self.eos_id):
                continue
            ch = chr(i) if 0 <= i < 128 else ""
            out.append(ch if ch and self.encodable(ch) else self.REPLACEMENT)
        return "".join(out)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (BPE, WordPiece, Unigram, ...) via `tokenizers`.

    Special tokens come from (first found wins): the explicit names given here (data.bos_token,
    data.eos_token, data.pad_token), a `tokenizer_config.json` beside the file, the common names
    above. eos is required; pad falls back to eos; bos may be absent.
    """

    def __init__(
        self, path: str, *, bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None
    ):
        from tokenizers import Tokenizer as _HF

        if not os.path.isfile(path):
            raise ConfigError("data.tokenizer", path, "file not found")
        try:
            self._tok = _HF.from_file(path)
        except Exception as e:  # the library raises its own exception type for malformed files
            raise ConfigError("data.tokenizer", path, f"cannot load tokenizer.json: {e}") from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        hinted = _config_tokens(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
        self.bos_id = self._find("bos_token", bos_token, hinted.get("bos_token"), BOS_NAMES)
        eos = self._find("eos_token", eos_token, hinted.get("eos_token"), EOS_NAMES)
        if eos is None:
            raise ConfigError("data.eos_token", eos_token, f"no eos token found in {path}; set data.eos_token")
        self.eos_id = eos
        pad = self._find("pad_token", pad_token, hinted.get("pad_token"), PAD_NAMES)
        self.pad_id = eos if pad is None else pad

    def _find(self, field: str, explicit: str | None, hinted: str | None, names: tuple[str, ...]) -> int | None:
        if explicit is not None:
            tid = self._tok.token_to_id(explicit)
            if tid is None:
                raise ConfigError(f"data.{field}", explicit, f"not a token of {self.path}")
            return tid
        for name in ((hinted,) if hinted else ()) + names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        specials = {self.pad_id, self.eos_id} | ({self.bos_id} if self.bos_id is not None else set())
        return self._tok.decode([int(i) for i in ids if int(i) not in specials], skip_special_tokens=True)


def _config_tokens(path: str) -> dict[str, str]:
    """bos/eos/pad token names from a Hugging Face tokenizer_config.json, if present."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for name in ("bos_token", "eos_token", "pad_token"):
        v = data.get(name)
        if isinstance(v, dict):  # {"content": "<s>", ...} (AddedToken form)
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer a data config asks for (the character tokenizer when data.tokenizer is None)."""
    if cfg.tokenizer is None:
        return CharTokenizer()
    return HFTokenizer(cfg.tokenizer, bos_token=cfg.bos_token, eos_token=cfg.eos_token, pad_token=cfg.pad_token)


def completion_ids(ids: Sequence[int], eos_id: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """A completion's ids before the first eos (or stop id); what rewards score."""
    stops = {int(eos_id), *map(int, stop_ids)}
    out = []
    for i in ids:
        if int(i) in stops:
            break
        out.append(int(i))
    return out
