"""JSONL prompt files: configurable fields, errors naming file:line, skip-and-count, empty files."""

import json

import pytest

from rpeg_jax.config import ConfigError, DataConfig
from rpeg_jax.data.jsonl import DataError, read_jsonl
from rpeg_jax.data.pipeline import load_records
from rpeg_jax.data.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _encode(text):
    return [TOK.bos_id] + TOK.encode(text)


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _cfg(path, **kw):
    return DataConfig(task="jsonl", path=path, max_prompt_len=12, **kw)


GOOD = json.dumps({"question": "1+1?", "meta": {"gold": 2}, "source": "x"})


def test_configurable_fields_and_extras(tmp_path):
    path = _write(tmp_path, [GOOD, "", json.dumps({"question": "2+2?", "meta": {"gold": "4"}, "uid": 9})])
    records, skipped = read_jsonl(path, _cfg(path, prompt_field="question", answer_field="meta.gold"), _encode)
    assert [r["prompt"] for r in records] == ["1+1?", "2+2?"]
    assert [r["answer"] for r in records] == ["2", "4"]  # numbers become text
    assert records[0]["id"] == "data.jsonl:1" and records[1]["id"] == "data.jsonl:3"  # blank line 2 ignored
    assert records[0]["prompt_tokens"] == [1, 49, 43, 49, 63] and records[0]["source"] == "x"
    assert sum(skipped.values()) == 0
    records, _ = read_jsonl(path, _cfg(path, prompt_field="question", answer_field=None, id_field="meta.gold"), _encode)
    assert [r["id"] for r in records] == ["2", "4"] and records[0]["answer"] is None


BAD = [
    ("{not json", "bad_json", r"invalid JSON"),
    ("[1, 2]", "not_object", r"expected a JSON object, got list"),
    (json.dumps({"prompt": "hi"}), "missing_field", r"missing field 'answer'"),
    (json.dumps({"answer": "1"}), "missing_field", r"missing field 'prompt'"),
    (json.dumps({"prompt": ["x"], "answer": "1"}), "bad_type", r"field 'prompt' must be text, not list"),
    (json.dumps({"prompt": "caf\u00e9", "answer": "1"}), "bad_text", r"prompt cannot be tokenized: character 'é'"),
    (
        json.dumps({"prompt": "x" * 12, "answer": "1"}),
        "too_long",
        r"prompt is 13 tokens, longer than data.max_prompt_len=12",
    ),
]


@pytest.mark.parametrize("line,reason,why", BAD)
def test_bad_line_names_file_and_line(tmp_path, line, reason, why):
    ok = json.dumps({"prompt": "ok", "answer": "1"})
    path = _write(tmp_path, [ok, ok, line, ok])
    with pytest.raises(DataError, match=rf"^data error: .*data\.jsonl:3: {why}") as info:
        read_jsonl(path, _cfg(path), _encode)
    assert info.value.line == 3 and info.value.file == path
    assert isinstance(info.value, ConfigError) and "\n" not in str(info.value)  # CLI: one line, exit 2
    records, skipped = read_jsonl(path, _cfg(path, on_bad_record="skip"), _encode)
    assert len(records) == 3 and skipped[reason] == 1 and sum(skipped.values()) == 1


def test_skip_counts_each_reason(tmp_path):
    ok = json.dumps({"prompt": "ok", "answer": "1"})
    path = _write(tmp_path, [line for line, _, _ in BAD] + [ok, "{", ok])
    records, skipped = read_jsonl(path, _cfg(path, on_bad_record="skip"), _encode)
    assert len(records) == 2
    assert skipped == {"bad_json": 2, "not_object": 1, "missing_field": 2, "bad_type": 1, "bad_text": 1, "too_long": 1}


def test_not_utf8_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"bin\.jsonl:2: not UTF-8"):
        read_jsonl(str(path), _cfg(str(path)), _encode)


def test_empty_missing_and_all_skipped(tmp_path):
    empty = _write(tmp_path, ["", "  "], name="empty.jsonl")
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=r"empty\.jsonl: the file is empty"):
            read_jsonl(empty, _cfg(empty, on_bad_record=mode), _encode)
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        read_jsonl(str(tmp_path / "nope.jsonl"), _cfg("nope.jsonl"), _encode)
    bad = _write(tmp_path, ["{", "[]"], name="bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable records: all 2 lines were skipped"):
        read_jsonl(bad, _cfg(bad, on_bad_record="skip"), _encode)


def test_builtin_task_prompt_too_long_is_a_config_error():
    cfg = DataConfig(task="add", min_digits=3, max_digits=3, max_prompt_len=6, num_examples=4)
    with pytest.raises(ConfigError, match=r"data.max_prompt_len=6: task 'add' .* prompts of 9 tokens"):
        load_records(cfg, TOK)  # bos + "123+456=" is 9 tokens
