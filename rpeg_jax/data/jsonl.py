"""Prompt records from a JSONL file, one JSON object per line, with configurable field names.

Each good line becomes a record {"id", "prompt", "answer", "prompt_tokens", ...other fields}.
The prompt field holds text or a list of {role, content} messages; with a chat template in effect
(data/chat.py) the record's "prompt" is the text as rendered (what the model is conditioned on, the
eval's prompt_text), its "prompt_messages" the conversation rendered (system prompt included), and
"prompt_tokens" the rendered text's ids with no special tokens added.
A bad line (not JSON, not an object, a missing or non-text field, bad messages (reason bad_type), a
prompt the tokenizer cannot encode or the template fails on (bad_text), a prompt longer than
data.max_prompt_len tokens) raises a DataError naming the file and line, or with
data.on_bad_record=skip is skipped and counted by reason. Messages with no chat template in effect,
an empty file, or one with no usable line, are always an error. Blank lines are ignored.

Called by: data/pipeline.py.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Callable

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.data import DataConfig
from rpeg_jax.data.chat import PromptError, PromptFormat

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


RESERVED = ("id", "prompt", "answer", "prompt_tokens", "prompt_messages")  # record keys this module sets
RAW = PromptFormat(None, None, "none")  # no chat template: text prompts as they are, messages refused


def _prompt(obj: dict, cfg: DataConfig, fmt: PromptFormat) -> tuple[str, list[dict] | None]:
    try:
        value = get_field(obj, cfg.prompt_field)
    except KeyError:
        why = f"missing field {cfg.prompt_field!r} (data.prompt_field); keys: {sorted(obj)}"
        raise _Bad("missing_field", why) from None
    looks_like_messages = isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
    if fmt.template is None and not (isinstance(value, str) or looks_like_messages):
        raise _Bad("bad_type", f"field {cfg.prompt_field!r} must be text, not {type(value).__name__}")
    return fmt.render_prompt(value, cfg.prompt_field)  # PromptError


def parse_line(
    text: str,
    cfg: DataConfig,
    encode_prompt: Callable[[str], list[int]],
    default_id: str,
    fmt: PromptFormat = RAW,
    encode_rendered: Callable[[str], list[int]] | None = None,
) -> dict:
    """One JSONL line -> record; raises _Bad(reason, why) or PromptError("no_template").
    encode_prompt encodes raw text (bos first when the pipeline adds one), encode_rendered a chat
    template's output (no special tokens added; default encode_prompt)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Bad("bad_json", f"invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _Bad("not_object", f"expected a JSON object, got {type(obj).__name__}")
    try:
        prompt, messages = _prompt(obj, cfg, fmt)
    except PromptError as e:
        if e.reason == "no_template":
            raise
        raise _Bad(e.reason, str(e)) from None
    answer = _text(obj, cfg.answer_field, "data.answer_field", numbers_ok=True) if cfg.answer_field else None
    rid = _text(obj, cfg.id_field, "data.id_field", numbers_ok=True) if cfg.id_field else default_id
    encode = encode_prompt if messages is None else (encode_rendered or encode_prompt)
    try:
        tokens = encode(prompt)
    except ValueError as e:
        raise _Bad("bad_text", f"prompt cannot be tokenized: {e}") from None
    if len(tokens) > cfg.max_prompt_len:
        raise _Bad("too_long", f"prompt is {len(tokens)} tokens, longer than data.max_prompt_len={cfg.max_prompt_len}")
    used = {cfg.prompt_field, cfg.answer_field, cfg.id_field}
    extra = {k: v for k, v in obj.items() if k not in used and k not in RESERVED}
    rec = {**extra, "id": rid, "prompt": prompt, "answer": answer, "prompt_tokens": tokens}
    if messages is not None:
        rec["prompt_messages"] = messages
    return rec


def read_jsonl(
    path: str,
    cfg: DataConfig,
    encode_prompt: Callable[[str], list[int]],
    fmt: PromptFormat = RAW,
    encode_rendered: Callable[[str], list[int]] | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """(records, skipped counts by reason) of a JSONL prompt file; see the module doc for errors and
    parse_line for the encoders. fmt: data/chat.py load_prompt_format (default: raw text only)."""
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
                rid = f"{os.path.basename(path)}:{lineno}"
                records.append(parse_line(raw, cfg, encode_prompt, rid, fmt, encode_rendered))
            except PromptError as e:  # messages without a template: a setting, never skipped
                raise DataError(path, lineno, str(e)) from None
            except _Bad as bad:
                if cfg.on_bad_record == "error":
                    raise DataError(path, lineno, f"{bad} (or set data.on_bad_record=skip)") from None
                skipped[bad.reason] += 1
    if lines == 0:
        raise DataError(path, None, "the file is empty (no JSON lines)")
    if not records:
        raise DataError(path, None, f"no usable records: all {lines} lines were skipped ({dict(skipped)})")
    return records, {r: skipped.get(r, 0) for r in SKIP_REASONS}
