"""Chat transcripts for SFT (train.mode=sft; issue 32 item 6): a JSONL conversation -> token ids and a
loss mask that is 1 on the assistant's tokens only.

    ex = encode_conversation(template, tokenizer, messages, tools)   # Example(ids, mask)
    examples, skipped = read_transcripts(cfg, template, tokenizer)   # the sft.path file

A record is {"messages": [{role, content}, ...], "tools": [...]?} (sft.messages_field, sft.tools_field).
An assistant message may carry OpenAI-style "tool_calls" (rendered by the template, as transformers
passes them) or write its calls in its content in the template's own format (`<tool_call>{json}</tool_call>`,
as an RL episode's turns are: env/session.py); `tool` messages hold tool results.

Which tokens are trained: the conversation is cut, by rendering its prefixes with the template, into
context pieces and assistant pieces. Assistant message i's piece is the text that
render(messages[:i+1], add_generation_prompt=False) adds to render(messages[:i], add_generation_prompt=True):
its content (and calls) and whatever the template closes the turn with. In that piece the tokens up to
and including the first eos token (Qwen's <|im_end|>) are trained, the rest (the newline the template
writes after it) is context, as it is in an RL episode, where the turn ends at eos and the template's
glue after it is an observation. Everything else (system, user and tool messages, the assistant header)
is context (mask 0). Each piece is tokenized on its own, as an episode's prompt, turns and observations
are, and the pieces joined are the template's rendering of the whole conversation; a template that
rewrites earlier turns when later ones are added (Qwen3 drops old reasoning) breaks that and the record
is refused (bad_text), naming the message.

The mask is of target tokens: mask[t] = 1 means the model is trained to predict ids[t] from ids[:t]
(runtime/sft.py shifts it). tests/test_sft.py checks it token by token against transformers'
apply_chat_template(..., return_assistant_tokens_mask=True) on a template with {% generation %} blocks.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass
from typing import Any

from rpeg_jax.config.sft import SFTConfig
from rpeg_jax.data.chat import ROLES, ChatTemplate, PromptError
from rpeg_jax.data.jsonl import DataError, get_field

SKIP_REASONS = ("bad_json", "not_object", "missing_field", "bad_type", "bad_text", "too_long")


@dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]
    mask: tuple[int, ...]  # 1: a trained target token (assistant), 0: context

    def __len__(self) -> int:
        return len(self.ids)


def check_conversation(value: Any, field: str) -> list[dict]:
    """A transcript's messages, validated (PromptError("bad_type") naming field[i].key). Like
    data/chat.check_messages, but an assistant message may have "tool_calls" and null content."""
    if not isinstance(value, list) or not value:
        raise PromptError("bad_type", f"field {field!r} must be a non-empty list of messages")
    for i, m in enumerate(value):
        at = f"field {field!r}[{i}]"
        if not isinstance(m, dict):
            raise PromptError("bad_type", f"{at} must be an object {{role, content}}, not {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise PromptError("bad_type", f"{at}.role: {m.get('role')!r} is not one of {', '.join(ROLES)}")
        content, calls = m.get("content"), m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise PromptError("bad_type", f"{at}.tool_calls must be a list, on an assistant message")
        if not isinstance(content, str) and not (content is None and calls):
            raise PromptError("bad_type", f"{at}.content must be a string (null only beside tool_calls)")
    if not any(m["role"] == "assistant" for m in value):
        raise PromptError("bad_type", f"field {field!r} has no assistant message: nothing to train on")
    return value


def _pieces(template: ChatTemplate, messages: list[dict], tools) -> list[tuple[bool, str]]:
    """[(assistant?, text)] in order; joined, the template's rendering of the whole conversation."""
    out: list[tuple[bool, str]] = []
    done = ""  # text rendered so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, tools=tools) if i else ""
        upto = template.render(messages[: i + 1], add_generation_prompt=False, tools=tools)
        if not before.startswith(done) or not upto.startswith(before):
            raise PromptError(
                "bad_text",
                f"message {i}: the chat template renders the conversation before it differently once it is "
                "followed by more (it rewrites earlier turns, or its generation prompt is not how it opens an "
                "assistant turn), so the assistant's tokens cannot be cut out of one rendering",
            )
        out += [(False, before[len(done) :]), (True, upto[len(before) :])]
        done = upto
    full = template.render(messages, add_generation_prompt=False, tools=tools)
    if not full.startswith(done):
        raise PromptError("bad_text", "the chat template rewrites earlier turns when later ones follow")
    out.append((False, full[len(done) :]))
    return [(a, t) for a, t in out if t]


def encode_conversation(template: ChatTemplate, tokenizer, messages: list[dict], tools=None) -> Example:
    """The conversation's ids and assistant-token mask (module doc)."""
    ids: list[int] = []
    mask: list[int] = []
    for assistant, text in _pieces(template, messages, tools):
        try:
            piece = tokenizer.encode(text)
        except ValueError as e:  # the character tokenizer: a character it does not have
            raise PromptError("bad_text", str(e)) from None
        ids += piece
        if not assistant:
            mask += [0] * len(piece)
            continue
        end = piece.index(tokenizer.eos_id) + 1 if tokenizer.eos_id in piece else len(piece)
        mask += [1] * end + [0] * (len(piece) - end)
    return Example(tuple(ids), tuple(mask))


class _Bad(Exception):
    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def parse_transcript(line: str, cfg: SFTConfig, template: ChatTemplate, tokenizer, max_len: int) -> Example:
    """One JSONL line -> its Example; _Bad(reason, why) for a bad line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _Bad("bad_json", f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _Bad("not_object", f"a line must be a JSON object, not {type(obj).__name__}")
    try:
        value = get_field(obj, cfg.messages_field)
    except KeyError:
        raise _Bad("missing_field", f"no field {cfg.messages_field!r} (sft.messages_field)") from None
    tools = None
    if cfg.tools_field is not None:
        try:
            tools = get_field(obj, cfg.tools_field)
        except KeyError:
            tools = None
        if tools is not None and not isinstance(tools, list):
            raise _Bad("bad_type", f"field {cfg.tools_field!r} must be a list of tool schemas (sft.tools_field)")
    try:
        ex = encode_conversation(template, tokenizer, check_conversation(value, cfg.messages_field), tools or None)
    except PromptError as e:
        raise _Bad(e.reason, str(e)) from None
    if len(ex) > max_len:
        raise _Bad("too_long", f"the conversation is {len(ex)} tokens, more than sft.max_len={max_len}")
    if not any(ex.mask):
        raise _Bad("bad_text", "no assistant token survives the rendering: nothing to train on")
    return ex


def read_transcripts(cfg: SFTConfig, template: ChatTemplate, tokenizer) -> tuple[list[Example], dict[str, int]]:
    """(examples, skipped counts by reason) of the sft.path file (cfg: the sft section). A bad line is a
    DataError naming file:line, or skipped and counted with sft.on_bad_record=skip."""
    path = cfg.path
    if not os.path.isfile(path):
        raise DataError(path, None, "file not found (sft.path)")
    skipped: collections.Counter[str] = collections.Counter()
    out, lines = [], 0
    with open(path, encoding="utf-8", errors="strict") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            lines += 1
            try:
                out.append(parse_transcript(raw, cfg, template, tokenizer, cfg.max_len))
            except _Bad as bad:
                if cfg.on_bad_record == "error":
                    raise DataError(path, lineno, f"{bad} (or set sft.on_bad_record=skip)") from None
                skipped[bad.reason] += 1
    if not out:
        raise DataError(path, None, f"no usable conversations ({lines} lines; skipped {dict(skipped)})")
    return out, {r: skipped.get(r, 0) for r in SKIP_REASONS}


__all__ = ["Example", "check_conversation", "encode_conversation", "parse_transcript", "read_transcripts"]
