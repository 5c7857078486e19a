"""Every config key does something: each field of the run config is read by code outside the
config package (rpeg_jax/config only declares and validates). A key that nothing reads is a key a
user sets and is told nothing about, so this test fails for it.

"Read" is decided from the source: an attribute access `.name`, or the name as a string constant
(the plan's KNOBS / PLAN_SETTINGS tuples name fields they then getattr), anywhere in rpeg_jax/
outside rpeg_jax/config/ or in launch/; or a read by a config method or property (not `validate`)
that such code uses, e.g. ModelConfig.scanned reading scan_layers. LOADER_KEYS act while the
config is loaded and are named with the code that consumes them.
"""

import ast
import dataclasses
import os
import typing

from rpeg_jax.config.run import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_DIRS = ("rpeg_jax", "launch")
CONFIG_DIR = os.path.join(ROOT, "rpeg_jax", "config")
LOADER_KEYS = {"preset": "config/model.resolve_preset merges the named preset under the given fields"}


def config_fields(cls, prefix=""):
    """Dotted names of every field of a config dataclass tree."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = next((a for a in typing.get_args(tp) + (tp,) if dataclasses.is_dataclass(a)), None)
        dotted = f"{prefix}{f.name}"
        if sub is not None:
            out += config_fields(sub, dotted + ".")
        else:
            out.append(dotted)
    return out


def names_read(sources):
    """Attribute names accessed and string constants used in the given (path, text) sources."""
    seen = set()
    for _, text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                seen.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                seen.add(node.value)
                seen.update(node.value.split("."))
    return seen


def code_outside_config():
    for top in CODE_DIRS:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            if os.path.relpath(d, ROOT).split(os.sep)[:2] == ["rpeg_jax", "config"]:
                continue
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    with open(path) as fh:
                        yield path, fh.read()


def through_config_methods(seen, config_sources):
    """`seen` plus the fields that config methods/properties read from `self`, for those methods
    that code outside the config package uses (validation does not count as use)."""
    out = set(seen)
    for _, text in config_sources:
        for cls in (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                if fn.name in seen and not fn.name.startswith("validate"):
                    out.update(
                        a.attr
                        for a in ast.walk(fn)
                        if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"
                    )
    return out


def config_sources():
    for f in sorted(os.listdir(CONFIG_DIR)):
        if f.endswith(".py"):
            with open(os.path.join(CONFIG_DIR, f)) as fh:
                yield f, fh.read()


def unread(cls, sources, config=(), loader_keys=()):
    seen = through_config_methods(names_read(sources), config) | set(loader_keys)
    return [dotted for dotted in config_fields(cls) if dotted.rsplit(".", 1)[-1] not in seen]


def test_every_config_key_is_read_by_some_code():
    fields = config_fields(RunConfig)
    assert len(fields) > 100 and "train.log_every" in fields and "rl.kl_coef" in fields
    assert unread(RunConfig, list(code_outside_config()), list(config_sources()), LOADER_KEYS) == []


def test_the_check_finds_a_key_nothing_reads():
    @dataclasses.dataclass(frozen=True)
    class Section:
        used_knob: int = 0
        forgotten_knob_xyz: int = 0

    @dataclasses.dataclass(frozen=True)
    class Config:
        section: Section = Section()

    code = [("user.py", "def f(cfg):\n    return cfg.section.used_knob\n")]
    assert unread(Config, code) == ["section.forgotten_knob_xyz"]
    assert unread(Config, code + [("more.py", "getattr(s, 'forgotten_knob_xyz')")]) == []
    # Read only by validation: still unread. Read by a property that code uses: read.
    validated = [("section.py", "class Section:\n    def validate(self, path):\n        self.forgotten_knob_xyz\n")]
    assert unread(Config, code, validated) == ["section.forgotten_knob_xyz"]
    derived = [("section.py", "class Section:\n    def knob(self):\n        return self.forgotten_knob_xyz\n")]
    assert unread(Config, code, derived) == ["section.forgotten_knob_xyz"]
    assert unread(Config, code + [("user2.py", "cfg.section.knob()")], derived) == []
