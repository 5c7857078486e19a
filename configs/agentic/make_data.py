"""Writes the files of configs/agentic.yaml (the learnable agentic preset, issue 32), deterministically:

    python configs/agentic/make_data.py [DIR]    # (re)writes the files below (default: here); tests/test_sft.py
                                                 # checks the committed ones are what it writes

- tokenizer.json: one token per character (newline and printable ASCII), the chat markers <|im_start|>,
  <|im_end|> (eos) and <|endoftext|> (pad) as special tokens, and <tool_call>, </tool_call>,
  <tool_response>, </tool_response> as added (not special: they decode back, so the tool parser sees
  them) tokens: 102 ids, model T's vocab (128).
- tokenizer_config.json: the special tokens' names.
- chat_template.jinja: a compact ChatML template (user / assistant / tool messages, the tools' names in a
  system line when an episode offers tools), calls in the hermes format <tool_call>{json}</tool_call>
  (env.tool_parser=auto finds it), a tool's result inside <tool_response>...</tool_response> (as
  Qwen2.5's and Hermes' templates wrap it), assistant text in {% generation %} blocks. The wrap matters
  for learning: the answer's first digit copies the token after the one <tool_response>; with the
  result right after "tool\n" the model had to tell that newline from every other one, and SFT on 512
  transcripts guessed the first digit from the operands instead (bench/NOTES.md, session 23).
- train.jsonl: RL prompts "a*b" of two 3-digit numbers whose product has 6 digits, answer a*b (2048
  records). Only 6-digit products: model T copies the tool's result at a fixed distance, learned from
  the common length; a 5-digit result (17% of all products) was then never copied right, a ceiling
  no RL signal reaches (bench/NOTES.md, session 23).
- eval.jsonl: 32 held-out prompts of the same kind (none in train.jsonl).
- sft.jsonl: SFT transcripts (2048; 512 were memorised, answers and all): the user's "a*b", the
  assistant's calculator call, the tool's result, the assistant's answer: the same conversation an RL
  episode of the tools environment renders.

Model T cannot multiply 3-digit numbers; with the calculator it only has to copy digits.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
SYSTEM = "You can call tools."
SFT_RECORDS = 2048

TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\ntools:' }}
{%- for t in tools %}
{{- ' ' + (t.function.name if t.function is defined else t.name) }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}
{%- if m.content %}
{{- m.content }}
{%- endif %}
{%- for tc in m.tool_calls or [] %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- '<tool_call>' + {'name': f.name, 'arguments': f.arguments} | tojson + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}
{%- endgeneration %}
{{- '\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>tool\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}
{%- elif m.role != 'system' or not tools %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def tokenizer_json() -> dict:
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t in SPECIAL,
        }
        for i, t in enumerate(SPECIAL)
    ]
    n = len(vocab)
    for k, t in enumerate(ADDED):
        vocab[t] = n + k
        added.append(
            {
                "id": n + k,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<|endoftext|>"},
    }


def transcript(a: int, b: int) -> dict:
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return {
        "tools": [{"type": "function", "function": {"name": "calculator"}}],  # the template shows names only
        "messages": [
            {"role": "user", "content": f"{a}*{b}"},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ],
    }


def pairs(rng: random.Random, n: int, seen: set) -> list[tuple[int, int]]:
    out = []
    while len(out) < n:
        p = (rng.randint(100, 999), rng.randint(100, 999))
        if p not in seen and p[0] * p[1] >= 100000:  # 6-digit products: one copy distance (module doc)
            seen.add(p)
            out.append(p)
    return out


def _write(name: str, text: str, out: str = HERE) -> None:
    with open(os.path.join(out, name), "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def main(out: str = HERE) -> None:
    """Writes every file into `out` (default: this directory)."""
    write = functools.partial(_write, out=out)
    write("tokenizer.json", json.dumps(tokenizer_json(), indent=1) + "\n")
    write(
        "tokenizer_config.json",
        json.dumps({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1) + "\n",
    )
    write("chat_template.jinja", TEMPLATE)
    rng, seen = random.Random(32), set()
    held_out = pairs(rng, 32, seen)
    train = pairs(rng, 2048, seen)
    sft = pairs(rng, SFT_RECORDS, seen)
    write("eval.jsonl", lines({"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in held_out))
    write("train.jsonl", lines({"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in train))
    write("sft.jsonl", lines(transcript(a, b) for a, b in sft))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
