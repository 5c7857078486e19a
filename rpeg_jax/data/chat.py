"""Chat templates: a prompt (a string or a list of {role, content} messages) -> the text an instruct
model was trained on, rendered exactly as Hugging Face transformers' `apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)` renders it.

    fmt = load_prompt_format(cfg.data, model_path=cfg.model.path)   # before any record is read
    text, messages = fmt.render_prompt(record_value, "prompt")      # raises PromptError (one line)

Where the template comes from (data.chat_template):
  auto  the first of <dir>/chat_template.jinja, then <dir>/tokenizer_config.json's "chat_template",
        for <dir> = the directory of data.tokenizer, then model.path. None found: no template.
  none  no template.
  PATH  a template file; a tokenizer_config.json (its "chat_template"); or a directory (looked up as
        auto looks in one).
tokenizer_config.json's "chat_template" may be a string or a list of {"name", "template"}; of a list,
"default" is used (as transformers does when no tools are passed). chat_template.jinja wins over
tokenizer_config.json, as in transformers >= 4.43.

Rules (verl applies the tokenizer's chat template to every prompt's messages; so do we):
  - with a template, every prompt is rendered: a list of messages as given, a string as one user
    message; data.system_prompt is prepended as a system message when no message is a system one;
  - without a template, a string prompt is used as raw text and a list of messages is an error
    (naming where templates were looked for), as is data.system_prompt.
Rendered text is tokenized WITHOUT adding special tokens (transformers' apply_chat_template does the
same): the template writes the bos token itself where the model expects one (Llama 3), so data.add_bos
applies to raw-text prompts only. Special tokens written in the text (<|im_start|>, <|eot_id|>) are the
tokenizer's added tokens and encode to their single ids (data/tokenizer.py HFTokenizer).

The environment is transformers' (src/transformers/utils/chat_template_utils.py,
`_cached_compile_jinja_template`, Apache-2.0; adapted, not copied): jinja2's
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols extension, a
`tojson` filter that does not HTML-escape, `raise_exception` and `strftime_now` globals, a `namespace`
that refuses underscore names, and `{% generation %}` blocks rendered as their body. Templates are
untrusted code: the sandbox refuses attribute access such as `''.__class__`. Variables: messages,
tools (None unless the caller passes schemas), documents=None, add_generation_prompt, and the special
tokens of tokenizer_config.json
(bos_token, eos_token, ...; data.bos_token/eos_token/pad_token override them), as transformers passes
its special_tokens_map.

Called by: data/pipeline.py (load_records), data/jsonl.py (parse_line); the eval part writes the
rendered text (a record's "prompt") out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.data import DataConfig

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a template may read.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class PromptError(ValueError):
    """A prompt that cannot be turned into text: bad messages (reason "bad_type"), a template that
    fails on it ("bad_text"), or messages with no template in effect ("no_template": a setting, not a
    bad record, so never skipped). data/jsonl.py adds the file and line."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"__type": "AddedToken", "content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("data.chat_template", path, f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("data.chat_template", path, f"{CONFIG_FILE} is not a JSON object")
    return data


def _config_template(path: str) -> str | None:
    """tokenizer_config.json's chat_template (a string, or the "default" of a list of named ones)."""
    value = _read_config(path).get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and "name" in t and "template" in t for t in value):
        named = {t["name"]: t["template"] for t in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ConfigError(
            "data.chat_template", path, f"has named chat templates {sorted(named)} but none called 'default'"
        )
    raise ConfigError("data.chat_template", path, "chat_template must be a string or a list of {name, template}")


def _from_dir(d: str) -> tuple[str, str, str] | None:
    """(source, template text, directory) from a checkpoint directory, or None."""
    jinja = os.path.join(d, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        return jinja, _read_text(jinja), d
    config = os.path.join(d, CONFIG_FILE)
    if os.path.isfile(config):
        text = _config_template(config)
        if text is not None:
            return f"{config}:chat_template", text, d
    return None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("data.chat_template", path, f"cannot read the template: {e}") from None


def search_dirs(cfg: DataConfig, model_path: str | None) -> list[str]:
    """Directories data.chat_template=auto looks in, in order."""
    dirs = []
    if cfg.tokenizer is not None:
        dirs.append(os.path.dirname(os.path.abspath(cfg.tokenizer)))
    if model_path is not None:
        dirs.append(os.path.abspath(model_path))
    return list(dict.fromkeys(dirs))


def find_template(cfg: DataConfig, model_path: str | None) -> tuple[str, str, str] | None:
    """(source, template text, its directory) that data.chat_template asks for, or None for none."""
    choice = cfg.chat_template
    if choice == "none":
        return None
    if choice == "auto":
        for d in search_dirs(cfg, model_path):
            found = _from_dir(d)
            if found is not None:
                return found
        return None
    if os.path.isdir(choice):
        found = _from_dir(choice)
        if found is None:
            why = f"the directory has neither {TEMPLATE_FILE} nor a {CONFIG_FILE} with a chat_template"
            raise ConfigError("data.chat_template", choice, why)
        return found
    if not os.path.isfile(choice):
        raise ConfigError("data.chat_template", choice, "file not found (auto, none, or a template path)")
    if os.path.basename(choice).endswith(".json"):
        text = _config_template(choice)
        if text is None:
            raise ConfigError("data.chat_template", choice, "has no chat_template")
        return f"{choice}:chat_template", text, os.path.dirname(os.path.abspath(choice))
    return choice, _read_text(choice), os.path.dirname(os.path.abspath(choice))


def special_tokens(cfg: DataConfig, dirs: list[str]) -> dict[str, str]:
    """Template variables bos_token, eos_token, ...: the first tokenizer_config.json found in `dirs`,
    then data.bos_token / eos_token / pad_token where given (as transformers' kwargs override)."""
    out: dict[str, str] = {}
    for d in dirs:
        path = os.path.join(d, CONFIG_FILE)
        if os.path.isfile(path):
            data = _read_config(path)
            out = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(data.get(k))) is not None}
            break
    for name in ("bos_token", "eos_token", "pad_token"):
        if getattr(cfg, name) is not None:
            out[name] = getattr(cfg, name)
    return out


def _environment():
    """transformers' chat-template environment (see the module doc)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks; here just its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        # Namespaces refuse underscore names, so a template cannot reach CPython internals through one.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class Dict:
        # `dict(...)` and `dict.fromkeys(...)` only, not the type itself.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes (<, >, &, '); chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    return env


class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with."""

    def __init__(self, source: str, text: str, tokens: dict[str, str] | None = None):
        import jinja2

        self.source, self.text, self.tokens = source, text, dict(tokens or {})
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(
                "data.chat_template", source, f"the template does not compile: line {e.lineno}: {e.message}"
            ) from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The conversation as text; a jinja error (raise_exception included) -> PromptError("bad_text").
        tools: function schemas the template shows the model (transformers' `tools=`; env/session.py)."""
        import jinja2

        # transformers drops None-valued keys (templates test for a key, not for None).
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokens,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            what = type(e).__name__
            raise PromptError("bad_text", f"chat template {self.source} failed: {what}: {e}") from None


def check_messages(value: Any, field: str) -> list[dict]:
    """A prompt field's list of messages, validated; PromptError("bad_type") naming field[i].key."""
    if not isinstance(value, list):
        raise PromptError("bad_type", f"field {field!r} must be text or a list of messages, not {type(value).__name__}")
    if not value:
        raise PromptError("bad_type", f"field {field!r} is an empty list of messages")
    for i, m in enumerate(value):
        at = f"field {field!r}[{i}]"
        if not isinstance(m, dict):
            raise PromptError("bad_type", f"{at} must be an object {{role, content}}, not {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise PromptError("bad_type", f"{at} has no {key!r}; keys: {sorted(m)}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise PromptError("bad_type", f"{at}.role: unknown role {role!r}; known: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise PromptError("bad_type", f"{at}.content must be a string, not {type(content).__name__}")
    return value


@dataclass(frozen=True)
class PromptFormat:
    """How prompt values become text: through a chat template, or raw (template None)."""

    template: ChatTemplate | None
    system_prompt: str | None = None
    choice: str = "auto"  # data.chat_template, for the "no template" error
    looked_in: tuple[str, ...] = ()  # where auto searched

    def messages(self, value: Any, field: str) -> list[dict]:
        """The conversation a prompt value stands for (system prompt added; see the module doc)."""
        msgs = [{"role": "user", "content": value}] if isinstance(value, str) else check_messages(value, field)
        if self.system_prompt is not None and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def render_prompt(self, value: Any, field: str) -> tuple[str, list[dict] | None]:
        """(prompt text, the messages rendered or None for a raw-text prompt)."""
        if self.template is None:
            if isinstance(value, str):
                return value, None
            check_messages(value, field)
            if self.choice == "none":
                why = "data.chat_template=none"
            else:
                where = ", ".join(self.looked_in) or "nowhere: data.tokenizer and model.path are unset"
                why = f"data.chat_template=auto found none (looked in {where})"
            raise PromptError(
                "no_template",
                f"field {field!r} holds messages, which need a chat template, but {why}; "
                "set data.chat_template=PATH or give the prompt as text",
            )
        msgs = self.messages(value, field)
        return self.template.render(msgs), msgs


def load_prompt_format(cfg: DataConfig, model_path: str | None = None) -> PromptFormat:
    """The prompt format a data config asks for; template errors (not found, does not compile, a
    system prompt without a template) are ConfigErrors raised here, before any record is read."""
    dirs = search_dirs(cfg, model_path)
    found = find_template(cfg, model_path)
    if found is None:
        if cfg.system_prompt is not None:
            raise ConfigError(
                "data.system_prompt",
                cfg.system_prompt,
                f"needs a chat template, and data.chat_template={cfg.chat_template} gives none"
                + (f" (looked in: {', '.join(dirs)})" if cfg.chat_template == "auto" else ""),
            )
        return PromptFormat(None, None, cfg.chat_template, tuple(dirs))
    source, text, template_dir = found
    tokens = special_tokens(cfg, list(dict.fromkeys([*dirs, template_dir])))
    return PromptFormat(ChatTemplate(source, text, tokens), cfg.system_prompt, cfg.chat_template, tuple(dirs))


__all__ = [
    "ROLES",
    "ChatTemplate",
    "PromptError",
    "PromptFormat",
    "check_messages",
    "find_template",
    "load_prompt_format",
    "special_tokens",
]
