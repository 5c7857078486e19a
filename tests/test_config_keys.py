"""Every config key does something: each field of the run config is read, as a field of its own
section, by code outside the config package (rpeg_jax/config only declares and validates). A key
that nothing reads is a key a user sets and is told nothing about, so this test fails for it.

A read of field `f` of section `S` is, in rpeg_jax/ outside rpeg_jax/config/ or in launch/:
- an attribute chain `<x>.S.f`, or `v.f` where `v` is named `S`, was assigned from `<x>.S`, or is
  a parameter annotated with S's class;
- `getattr(<x>.S, name)` in a module whose string constants include `f` (the plan's KNOBS), or the
  dotted string "S.f" (the plan's PLAN_SETTINGS);
- a read of a config method or property (not `validate`) of S or of a class S's class is built on
  that reads `self.f`, e.g. ModelConfig.scanned reading scan_layers, RunConfig.critic_model reading
  critic, or every field of X by `getattr(self, f.name) for f in dataclasses.fields(X)`
  (EngineSettings.engine_settings, which SamplerConfig.from_rollout copies).
A section that reuses another's class (critic: ModelConfig, critic_optim: OptimConfig) is passed on
whole where its twin is: its fields count as read when the section is read and the twin's field is.
LOADER_KEYS act while the config is loaded and are named with the code that consumes them.
"""

import ast
import dataclasses
import os
import typing

from rpeg_jax.config.run import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_DIRS = ("rpeg_jax", "launch")
CONFIG_DIR = os.path.join(ROOT, "rpeg_jax", "config")
LOADER_KEYS = {
    "model.preset": "config/model.resolve_preset merges the named preset under the given fields",
    "critic.preset": "the same, for the critic's shape",
}


def sections_of(cls) -> dict[str, type]:
    """Section name -> its config dataclass, for the run config's direct sections."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        sub = next((a for a in typing.get_args(hints[f.name]) + (hints[f.name],) if dataclasses.is_dataclass(a)), None)
        if sub is not None:
            out[f.name] = sub
    return out


def config_fields(cls) -> list[str]:
    """Dotted `section.field` names of every leaf field of the run config's sections."""
    out = []
    for name, sub in sections_of(cls).items():
        hints = typing.get_type_hints(sub)
        for f in dataclasses.fields(sub):
            nested = next((a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)), None)
            out.append(f"{name}.{f.name}")
            if nested is not None:  # e.g. model.rope_scaling: a nested value, read as a whole
                continue
    return out


class _Reads(ast.NodeVisitor):
    """Qualified reads (section, field) in one module."""

    def __init__(self, sections: dict[str, type]):
        self.sections = sections
        self.by_class = {}
        for name, cls in sections.items():
            self.by_class.setdefault(cls.__name__, []).append(name)
        self.reads: set[tuple[str, str]] = set()
        self.aliases: dict[str, set[str]] = {}
        self.getattr_sections: set[str] = set()
        self.strings: set[str] = set()

    def named(self, node) -> set[str]:
        if isinstance(node, ast.Attribute) and node.attr in self.sections:
            return {node.attr}
        if isinstance(node, ast.Name):
            return ({node.id} & set(self.sections)) | self.aliases.get(node.id, set())
        return set()

    def value_sections(self, value) -> set[str]:
        if isinstance(value, ast.BoolOp):  # `cfg.critic_optim or cfg.optim`
            return set().union(*(self.named(v) for v in value.values))
        return self.named(value)

    def visit_Assign(self, node):
        for t in node.targets:
            pairs = [(t, node.value)]
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                pairs = list(zip(t.elts, node.value.elts))  # `cfg, c = ctx.cfg, ctx.cfg.costmodel`
            for target, value in pairs:
                secs = self.value_sections(value)
                if isinstance(target, ast.Name) and secs:
                    self.aliases.setdefault(target.id, set()).update(secs)
        self.generic_visit(node)

    def visit_arg(self, node):
        ann = node.annotation
        name = ann.id if isinstance(ann, ast.Name) else ann.attr if isinstance(ann, ast.Attribute) else None
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            name = ann.value.split(".")[-1]
        if name in self.by_class:
            self.aliases.setdefault(node.arg, set()).update(self.by_class[name])
        self.generic_visit(node)

    def visit_Attribute(self, node):
        for sec in self.named(node.value):
            self.reads.add((sec, node.attr))
        if node.attr in self.sections:  # the section itself is read (passed on whole)
            self.reads.add(("", node.attr))
        self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            self.getattr_sections |= self.named(node.args[0])
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            self.strings.add(node.value)


def qualified_reads(sources, sections) -> set[tuple[str, str]]:
    out = set()
    for _, text in sources:
        v = _Reads(sections)
        tree = ast.parse(text)
        v.visit(tree)  # first pass: aliases
        v.visit(tree)  # second pass: reads through aliases assigned later in the file
        out |= v.reads
        for sec in v.getattr_sections:
            out |= {(sec, s) for s in v.strings}
        for s in v.strings:
            if s.count(".") == 1 and s.split(".")[0] in sections:
                out.add(tuple(s.split(".")))
    return out


def through_config_methods(reads, config_sources, sections) -> set[tuple[str, str]]:
    """`reads` plus the fields that config methods/properties read from `self`, for the methods
    that code outside the config package reads (validation does not count as use)."""
    out = set(reads)
    by_class = {}
    classes = {}
    for name, cls in sections.items():
        for base in cls.__mro__[:-1]:  # a section's methods include its base classes' (RolloutConfig's
            #                            EngineSettings / SamplingSettings)
            by_class.setdefault(base.__name__, []).append(name)
            classes[base.__name__] = base
    by_class.setdefault("RunConfig", []).append("")  # RunConfig's own properties: `cfg.critic_model`
    for _ in range(2):  # a property may use another property
        for _, text in config_sources:
            for cls in (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)):
                for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                    if fn.name.startswith("validate") or fn.name.startswith("_"):
                        continue
                    for sec in by_class.get(cls.name, []):
                        used = (sec, fn.name) in out or (sec == "" and any(f == fn.name for _, f in out))
                        if used:
                            for a in ast.walk(fn):
                                # `getattr(self, f.name) for f in dataclasses.fields(X)`: every field of X
                                if (
                                    isinstance(a, ast.Call)
                                    and getattr(a.func, "attr", getattr(a.func, "id", None)) == "fields"
                                    and a.args
                                    and isinstance(a.args[0], ast.Name)
                                    and a.args[0].id in classes
                                ):
                                    out |= {(sec, f.name) for f in dataclasses.fields(classes[a.args[0].id])}
                                if (
                                    isinstance(a, ast.Attribute)
                                    and isinstance(a.value, ast.Name)
                                    and a.value.id == "self"
                                ):
                                    out.add((sec, a.attr) if sec else ("", a.attr))
    return out


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


def config_sources():
    for f in sorted(os.listdir(CONFIG_DIR)):
        if f.endswith(".py"):
            with open(os.path.join(CONFIG_DIR, f)) as fh:
                yield f, fh.read()


def unread(cls, sources, config=(), loader_keys=()):
    sections = sections_of(cls)
    reads = through_config_methods(qualified_reads(sources, sections), config, sections)
    twins = {}
    for name, sub in sections.items():
        twins.setdefault(sub, []).append(name)
    out = []
    for dotted in config_fields(cls):
        sec, leaf = dotted.split(".")
        ok = (sec, leaf) in reads or dotted in loader_keys
        if not ok and ("", sec) in reads:  # passed on whole: read where its twin's field is read
            ok = any((t, leaf) in reads for t in twins[sections[sec]] if t != sec)
        if not ok:
            out.append(dotted)
    return out


def test_every_config_key_is_read_by_some_code():
    fields = config_fields(RunConfig)
    assert len(fields) > 100 and "train.log_every" in fields and "rl.kl_coef" in fields
    assert unread(RunConfig, list(code_outside_config()), list(config_sources()), LOADER_KEYS) == []


def test_a_key_whose_only_read_is_removed_is_found():
    """Mutation of the real code: without trainer.py's `cfg.train.log_every`, train.log_every is
    unread, although metrics.py has a `self.log_every` of its own."""
    sources = list(code_outside_config())
    trainer = [i for i, (p, _) in enumerate(sources) if p.endswith(os.path.join("runtime", "trainer.py"))]
    assert len(trainer) == 1
    path, text = sources[trainer[0]]
    assert "log_every=cfg.train.log_every" in text
    sources[trainer[0]] = (path, text.replace("log_every=cfg.train.log_every", "log_every=1"))
    sft = [i for i, (p, _) in enumerate(sources) if p.endswith(os.path.join("runtime", "sft.py"))]
    for i in sft:  # SFT's loop (train.mode=sft) reads it too
        sources[i] = (sources[i][0], sources[i][1].replace("log_every=cfg.train.log_every", "log_every=1"))
    assert unread(RunConfig, sources, list(config_sources()), LOADER_KEYS) == ["train.log_every"]


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
    # A field of the same name on some other object is not a read of this section's field.
    assert unread(Config, code + [("other.py", "x.forgotten_knob_xyz\nself.forgotten_knob_xyz")]) == [
        "section.forgotten_knob_xyz"
    ]
    assert unread(Config, code + [("more.py", "s = cfg.section\ns.forgotten_knob_xyz")]) == []
    assert unread(Config, code + [("typed.py", "def g(s: Section):\n    return s.forgotten_knob_xyz")]) == []
    # Read only by validation: still unread. Read by a property that code uses: read.
    validated = [("section.py", "class Section:\n    def validate(self, path):\n        self.forgotten_knob_xyz\n")]
    assert unread(Config, code, validated) == ["section.forgotten_knob_xyz"]
    derived = [("section.py", "class Section:\n    def knob(self):\n        return self.forgotten_knob_xyz\n")]
    assert unread(Config, code, derived) == ["section.forgotten_knob_xyz"]
    assert unread(Config, code + [("user2.py", "cfg.section.knob()")], derived) == []
