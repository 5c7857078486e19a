"""Chat templates against transformers' own apply_chat_template output (tests/fixtures/chat/expected.json,
written by tests/fixtures/make_hf_fixtures.py --only chat with transformers 5.24.0) for the Qwen2.5,
Llama 3.1 and ChatML families: rendered text, ids (no double bos), message prompts in JSONL files,
data.system_prompt, errors that name the file, line and field, and the jinja sandbox."""

import json
import os
import shutil

import pytest

from rpeg_jax.config import ConfigError, DataConfig
from rpeg_jax.data.chat import ChatTemplate, PromptError, load_prompt_format
from rpeg_jax.data.jsonl import DataError, read_jsonl
from rpeg_jax.data.pipeline import load_records
from rpeg_jax.data.tokenizer import CharTokenizer, HFTokenizer

CHAT = os.path.join(os.path.dirname(__file__), "fixtures", "chat")
with open(os.path.join(CHAT, "expected.json"), encoding="utf-8") as _f:
    EXPECTED = json.load(_f)
FAMILIES = sorted(EXPECTED["families"])
CONVERSATIONS = EXPECTED["conversations"]
CASES = [(fam, name) for fam in FAMILIES for name in CONVERSATIONS]
SYSTEM = CONVERSATIONS["system_user"][0]["content"]


def _tokenizer_path(family):
    return os.path.join(CHAT, family, "tokenizer.json")


def _cfg(family=None, **kw):
    kw.setdefault("tokenizer", _tokenizer_path(family) if family else None)
    return DataConfig(task="jsonl", max_prompt_len=512, **kw)


def _expected(family, name, gen=True):
    return EXPECTED["families"][family]["cases"][name]["generation" if gen else "no_generation"]


def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _read(path, cfg, model_path=None):
    tok = HFTokenizer(cfg.tokenizer) if cfg.tokenizer else CharTokenizer()
    return load_records(DataConfig(**{**cfg.__dict__, "path": path}), tok, model_path=model_path)


def test_fixture_covers_three_families_and_the_template_forms():
    assert FAMILIES == ["chatml", "llama3", "qwen2_5"]
    # qwen keeps chat_template.jinja; llama3 a string in tokenizer_config.json; chatml a list of named ones
    assert os.path.isfile(os.path.join(CHAT, "qwen2_5", "chat_template.jinja"))
    with open(os.path.join(CHAT, "llama3", "tokenizer_config.json")) as f:
        assert isinstance(json.load(f)["chat_template"], str)
    with open(os.path.join(CHAT, "chatml", "tokenizer_config.json")) as f:
        assert [t["name"] for t in json.load(f)["chat_template"]] == ["other", "default"]


@pytest.mark.parametrize("family,name", CASES)
@pytest.mark.parametrize("gen", [True, False])
def test_rendered_text_equals_transformers(family, name, gen):
    fmt = load_prompt_format(_cfg(family))  # data.chat_template=auto, found beside data.tokenizer
    assert fmt.template is not None
    assert fmt.template.render(CONVERSATIONS[name], add_generation_prompt=gen) == _expected(family, name, gen)["text"]


@pytest.mark.parametrize("family,name", CASES)
def test_ids_equal_transformers_and_bos_once(family, name, tmp_path):
    """The pipeline's prompt_tokens for a JSONL line holding the messages are transformers' ids."""
    path = _write(tmp_path, [{"prompt": CONVERSATIONS[name], "answer": "42"}])
    (rec,), _ = _read(path, _cfg(family))
    want = _expected(family, name)
    assert rec["prompt"] == want["text"] and rec["prompt_tokens"] == want["ids"]
    assert rec["prompt_messages"] == CONVERSATIONS[name]
    fam = EXPECTED["families"][family]
    if fam["bos_id"] is not None and family == "llama3":
        # The template writes <|begin_of_text|> and the tokenizer's post-processor would add another one
        # with add_special_tokens=True ("hi" -> [bos, ...]): exactly one bos, first.
        assert fam["hi_with_special_tokens"][0] == fam["bos_id"]
        assert rec["prompt_tokens"][0] == fam["bos_id"] and rec["prompt_tokens"].count(fam["bos_id"]) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_in_text_are_single_ids(family):
    tok = HFTokenizer(_tokenizer_path(family))
    for text, tid in EXPECTED["families"][family]["special_tokens"].items():
        assert tok.encode(text) == [tid]
        # inside other text too: the added token is matched before byte-level BPE splits the rest
        ids = tok.encode(f"ab {text}\nuser")
        assert ids.count(tid) == 1 and tok.decode([i for i in ids if i != tid]) == "ab \nuser"


@pytest.mark.parametrize("family", FAMILIES)
def test_string_prompt_is_one_user_message(family, tmp_path):
    path = _write(tmp_path, [{"prompt": CONVERSATIONS["user"][0]["content"], "answer": "42"}])
    (rec,), _ = _read(path, _cfg(family))
    assert rec["prompt"] == _expected(family, "user")["text"]
    assert rec["prompt_tokens"] == _expected(family, "user")["ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_system_prompt_added_only_when_none_given(family, tmp_path):
    rows = [
        {"prompt": CONVERSATIONS["system_user"][1:], "answer": "42"},  # no system: data.system_prompt added
        {"prompt": CONVERSATIONS["system_user"][1]["content"], "answer": "42"},  # text: the same
        {"prompt": CONVERSATIONS["system_multi_turn"], "answer": "25"},  # has one: kept, ours not added
    ]
    recs, _ = _read(_write(tmp_path, rows), _cfg(family, system_prompt=SYSTEM))
    assert [r["prompt"] for r in recs[:2]] == [_expected(family, "system_user")["text"]] * 2
    recs2, _ = _read(_write(tmp_path, rows[2:], "b.jsonl"), _cfg(family, system_prompt="IGNORED"))
    assert recs2[0]["prompt"] == _expected(family, "system_multi_turn")["text"] and "IGNORED" not in recs2[0]["prompt"]


BAD_MESSAGES = [
    ([{"role": "bot", "content": "hi"}], r"field 'prompt'\[0\]\.role: unknown role 'bot'; known: system, user"),
    (
        [{"role": "user", "content": "hi"}, {"role": "user", "content": 7}],
        r"field 'prompt'\[1\]\.content must be a string, not int",
    ),
    ([], r"field 'prompt' is an empty list of messages"),
    ([{"role": "user"}], r"field 'prompt'\[0\] has no 'content'; keys: \['role'\]"),
    ([{"role": "user", "content": "a"}, "b"], r"field 'prompt'\[1\] must be an object \{role, content\}, not str"),
    (5, r"field 'prompt' must be text or a list of messages, not int"),
]


@pytest.mark.parametrize("value,why", BAD_MESSAGES)
def test_bad_messages_name_file_line_and_field(tmp_path, value, why):
    good = {"prompt": CONVERSATIONS["user"], "answer": "1"}
    path = _write(tmp_path, [good, {"prompt": value, "answer": "1"}, good])
    with pytest.raises(DataError, match=r"data error: .*data\.jsonl:2: " + why) as err:
        _read(path, _cfg("qwen2_5"))
    assert "\n" not in str(err.value)
    recs, skipped = _read(path, _cfg("qwen2_5", on_bad_record="skip"))
    assert len(recs) == 2 and skipped["bad_type"] == 1 and sum(skipped.values()) == 1


def test_messages_without_a_template_are_refused(tmp_path):
    path = _write(tmp_path, [{"prompt": "raw text", "answer": "1"}, {"prompt": CONVERSATIONS["user"], "answer": "1"}])
    for cfg, why in [
        (
            _cfg("qwen2_5", chat_template="none"),
            r"data\.jsonl:2: field 'prompt' holds messages.*data\.chat_template=none",
        ),
        (_cfg(None), r"data\.jsonl:2: .*auto found none \(looked in nowhere"),
    ]:
        for mode in ("error", "skip"):  # a setting, not a bad record: never skipped
            with pytest.raises(DataError, match=why):
                _read(path, DataConfig(**{**cfg.__dict__, "on_bad_record": mode}))
    # text prompts with chat_template=none are raw text, as before (no bos: this tokenizer has none)
    (rec,), _ = _read(
        _write(tmp_path, [{"prompt": "raw text", "answer": "1"}], "c.jsonl"), _cfg("qwen2_5", chat_template="none")
    )
    tok = HFTokenizer(_tokenizer_path("qwen2_5"))
    assert (
        rec["prompt"] == "raw text" and rec["prompt_tokens"] == tok.encode("raw text") and "prompt_messages" not in rec
    )


def test_system_prompt_needs_a_template():
    with pytest.raises(ConfigError, match=r"data\.system_prompt='Be brief\.': needs a chat template"):
        DataConfig(chat_template="none", system_prompt="Be brief.").validate("data")
    with pytest.raises(ConfigError, match=r"data\.system_prompt=.*needs a chat template.*auto gives none"):
        load_prompt_format(DataConfig(system_prompt="Be brief."))


def _template_file(tmp_path, text, name="tpl.jinja"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_raise_exception_is_one_line_naming_template_and_line(tmp_path):
    tpl = _template_file(tmp_path, "{% if messages|length > 1 %}{{ raise_exception('x') }}{% endif %}{{ 'ok' }}")
    path = _write(tmp_path, [{"prompt": "fine", "answer": "1"}, {"prompt": CONVERSATIONS["multi_turn"], "answer": "1"}])
    with pytest.raises(DataError) as err:
        _read(path, _cfg("chatml", chat_template=tpl))
    msg = str(err.value)
    assert "\n" not in msg and "data.jsonl:2: chat template " + tpl + " failed: TemplateError: x" in msg
    recs, skipped = _read(path, _cfg("chatml", chat_template=tpl, on_bad_record="skip"))
    assert [r["prompt"] for r in recs] == ["ok"] and skipped["bad_text"] == 1


def test_template_syntax_error_is_one_config_line(tmp_path):
    tpl = _template_file(tmp_path, "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError) as err:
        load_prompt_format(_cfg("chatml", chat_template=tpl))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        f"config error: data.chat_template={tpl!r}: the template does not compile"
    )
    assert "line 2" in msg


def test_sandbox_refuses_attribute_access():
    msgs = [{"role": "user", "content": "hi"}]
    # An unsafe attribute is undefined (renders as nothing, not "<class 'str'>") ...
    assert ChatTemplate("t", "[{{ ''.__class__ }}]").render(msgs) == "[]"
    # ... and going further through it raises SecurityError: one line, naming the template.
    for text in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
    ):
        with pytest.raises(PromptError, match=r"chat template t failed: SecurityError") as err:
            ChatTemplate("t", text).render(msgs)
        assert "\n" not in str(err.value)
    # The template cannot modify the messages it is given (immutable sandbox).
    with pytest.raises(PromptError, match="SecurityError"):
        ChatTemplate("t", "{{ messages.append(1) }}").render(msgs)


def test_environment_like_transformers():
    msgs = [{"role": "user", "content": "a<b & 'c'", "name": None}]
    env = ChatTemplate(
        "t",
        "{{ messages[0].content | tojson }}|{{ 'name' in messages[0] }}|{{ bos_token }}|"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
        "{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y') | length }}|{{ add_generation_prompt }}",
        {"bos_token": "<s>"},
    )
    # tojson does not HTML-escape; None-valued keys are dropped; loop controls; {% generation %} renders its body
    assert env.render(msgs) == "\"a<b & 'c'\"|False|<s>|01|gen|4|True"


EXTRA = EXPECTED["extra"]


@pytest.mark.parametrize("template", sorted(EXTRA["templates"]))
@pytest.mark.parametrize("conv", sorted(EXTRA["conversations"]))
@pytest.mark.parametrize("gen", [True, False])
def test_environment_matches_transformers(template, conv, gen):
    """trim_blocks / lstrip_blocks (TinyLlama's template, indented tags), tojson without HTML escaping,
    loop controls, namespace, dict, {% generation %}: as transformers renders them."""
    tokens = load_prompt_format(_cfg(EXTRA["tokenizer"])).template.tokens
    tpl = ChatTemplate("t", EXTRA["templates"][template]["template"], tokens)
    want = EXTRA["templates"][template]["cases"][conv][str(gen).lower()]
    assert tpl.render(EXTRA["conversations"][conv], add_generation_prompt=gen) == want


def test_where_auto_looks_and_path_forms(tmp_path):
    qwen = os.path.join(CHAT, "qwen2_5")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen, ckpt)
    with open(ckpt / "tokenizer_config.json") as f:
        config = json.load(f)
    config["chat_template"] = "STALE"  # chat_template.jinja wins over tokenizer_config.json's
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    want = _expected("qwen2_5", "user")["text"]
    msgs = CONVERSATIONS["user"]
    assert load_prompt_format(_cfg(None, tokenizer=str(ckpt / "tokenizer.json"))).template.render(msgs) == want
    # a tokenizer.json elsewhere (no template beside it): model.path is looked in next
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(ckpt / "tokenizer.json", lone / "tokenizer.json")
    fmt = load_prompt_format(_cfg(None, tokenizer=str(lone / "tokenizer.json")), model_path=str(ckpt))
    assert fmt.template.source == str(ckpt / "chat_template.jinja") and fmt.template.render(msgs) == want
    # PATH: a directory, a template file, a tokenizer_config.json
    for choice in (str(ckpt), str(ckpt / "chat_template.jinja"), os.path.join(CHAT, "llama3", "tokenizer_config.json")):
        fmt = load_prompt_format(_cfg("llama3", chat_template=choice))
        family = "llama3" if choice.endswith(".json") else "qwen2_5"
        assert fmt.template.render(msgs) == _expected(family, "user")["text"]
    with pytest.raises(ConfigError, match=r"data\.chat_template=.*nope\.jinja.*file not found"):
        load_prompt_format(_cfg("llama3", chat_template=str(tmp_path / "nope.jinja")))
    config["chat_template"] = [{"name": "a", "template": "x"}]
    (lone / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"named chat templates \['a'\] but none called 'default'"):
        load_prompt_format(_cfg(None, tokenizer=str(lone / "tokenizer.json")))


def test_special_token_variables_from_config_and_overrides():
    # Llama 3's config writes bos as an AddedToken dict; the template reads it as text.
    fmt = load_prompt_format(_cfg("llama3"))
    assert fmt.template.tokens["bos_token"] == "<|begin_of_text|>" and fmt.template.tokens["eos_token"] == "<|eot_id|>"
    assert "bos_token" not in load_prompt_format(_cfg("qwen2_5")).template.tokens  # bos_token: null
    fmt = load_prompt_format(_cfg("llama3", bos_token="<|end_of_text|>"))  # data.bos_token overrides
    assert fmt.template.render(CONVERSATIONS["user"]).startswith("<|end_of_text|><|start_header_id|>")


def test_builtin_task_prompts_are_rendered_too():
    cfg = DataConfig(task="reverse", tokenizer=_tokenizer_path("chatml"), num_examples=4, max_prompt_len=64)
    tok = HFTokenizer(cfg.tokenizer)
    recs, _ = load_records(cfg, tok)
    raw, _ = load_records(DataConfig(**{**cfg.__dict__, "chat_template": "none"}), tok)
    for r, q in zip(recs, raw):
        assert r["prompt"] == f"<|im_start|>user\n{q['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        assert r["prompt_tokens"] == tok.encode(r["prompt"]) and q["prompt_tokens"][0] == tok.bos_id


def test_read_jsonl_default_is_raw_text(tmp_path):
    """read_jsonl without a prompt format keeps its old behaviour: text prompts, messages refused."""
    path = _write(tmp_path, [{"prompt": "1+1", "answer": "2"}])
    tok = CharTokenizer()
    (rec,), _ = read_jsonl(path, DataConfig(task="jsonl", path=path), tok.encode)
    assert rec["prompt"] == "1+1" and rec["prompt_tokens"] == tok.encode("1+1")


def test_cli_one_line_exit_2(tmp_path, capsys):
    """`rpeg train` stops before compiling anything: one line naming file:line and the field, exit 2."""
    from rpeg_jax.cli import main

    tpl = _template_file(tmp_path, "{{ raise_exception('roles must alternate') }}")
    bad_role = _write(tmp_path, [{"prompt": [{"role": "bot", "content": "hi"}], "answer": "1"}], "a.jsonl")
    good = _write(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}], "b.jsonl")
    common = ["train", "data.task=jsonl", "data.max_prompt_len=64", "train.steps=1"]
    for path, choice, why in [
        (bad_role, os.path.join(CHAT, "templates", "chatml.jinja"), "field 'prompt'[0].role: unknown role 'bot'"),
        (good, tpl, f"chat template {tpl} failed: TemplateError: roles must alternate"),
    ]:
        assert main([*common, f"data.path={path}", f"data.chat_template={choice}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"data error: {path}:1: ") and why in err
