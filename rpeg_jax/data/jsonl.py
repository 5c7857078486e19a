"""Prompt records from a JSONL file, one JSON object per line, with configurable field names.

Each good line becomes a record {"id", "prompt", "answer", "prompt_tokens", ...other fields}.
A bad line (not JSON, not an object, a missing or non-text field, a prompt the tokenizer cannot
encode, a prompt longer than data.max_prompt_len tokens) raises a DataError naming the file and
line, or with data.on_bad_record=skip is skipped and counted by reason. An empty file, or one
with no usable line, is always an error. Blank lines are ignored.

Called by: data/pipeline.py.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Callable

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.data import DataConfig

SKIP_REASONS = ("bad_json", "not_object", "missing_field", "bad_type", "bad_text", "too_long")


class DataError(ConfigError):
    """A bad data file or record. One line: "data error: <file>:<line>: <why>". A ConfigError, so the
    CLI exits with status 2 and no traceback."""

    def __init__(self, file: str, line: int | None, why: str):
        self.key, self.value, self.why = "data.path", file, why
        self.file, self.line = file, line
        where = f"{file}:{line}" if line is not None else file
        ValueError.__init__(self, f"data error: {where}: {why}")


class _Bad(Exception):
    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def get_field(obj: dict, dotted: str) -> Any:
    """obj["a"]["b"] for "a.b"; raises KeyError when a part is missing."""
    node: Any = obj
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _text(obj: dict, field: str, what: str, numbers_ok: bool) -> str:
    try:
        value = get_field(obj, field)
    except KeyError:
        raise _Bad("missing_field", f"missing field {field!r} ({what}); keys: {sorted(obj)}") from None
    if isinstance(value, bool) or not isinstance(value, (str, int, float) if numbers_ok else str):
        raise _Bad("bad_type", f"field {field!r} must be text, not {type(value).__name__}")
    return str(value)


def parse_line(text: str, cfg: DataConfig, encode_prompt: Callable[[str], list[int]], default_id: str) -> dict:
    """One JSONL line -> record; raises _Bad(reason, why)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Bad("bad_json", f"invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _Bad("not_object", f"expected a JSON object, got {type(obj).__name__}")
    prompt = _text(obj, cfg.prompt_field, "data.prompt_field", numbers_ok=False)
    answer = _text(obj, cfg.answer_field, "data.answer_field", numbers_ok=True) if cfg.answer_field else None
    rid = _text(obj, cfg.id_field, "data.id_field", numbers_ok=True) if cfg.id_field else default_id
    try:
        tokens = encode_prompt(prompt)
    except ValueError as e:
        raise _Bad("bad_text", f"prompt cannot be tokenized: {e}") from None
    if len(tokens) > cfg.max_prompt_len:
        raise _Bad("too_long", f"prompt is {len(tokens)} tokens, longer than data.max_prompt_len={cfg.max_prompt_len}")
    used = {cfg.prompt_field, cfg.answer_field, cfg.id_field}
    extra = {k: v for k, v in obj.items() if k not in used and k not in ("id", "prompt", "answer", "prompt_tokens")}
    return {**extra, "id": rid, "prompt": prompt, "answer": answer, "prompt_tokens": tokens}


def read_jsonl(
    path: str, cfg: DataConfig, encode_prompt: Callable[[str], list[int]]
) -> tuple[list[dict], dict[str, int]]:
    """(records, skipped counts by reason) of a JSONL prompt file; see the module doc for errors."""
    if not os.path.isfile(path):
        raise DataError(path, None, "file not found (data.path)")
    skipped: collections.Counter[str] = collections.Counter()
    records, lines = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            lines += 1
            try:
                try:
                    raw = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _Bad("bad_text", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
                records.append(parse_line(raw, cfg, encode_prompt, f"{os.path.basename(path)}:{lineno}"))
            except _Bad as bad:
                if cfg.on_bad_record == "error":
                    raise DataError(path, lineno, f"{bad} (or set data.on_bad_record=skip)") from None
                skipped[bad.reason] += 1
    if lines == 0:
        raise DataError(path, None, "the file is empty (no JSON lines)")
    if not records:
        raise DataError(path, None, f"no usable records: all {lines} lines were skipped ({dict(skipped)})")
    return records, {r: skipped.get(r, 0) for r in SKIP_REASONS}
