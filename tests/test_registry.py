"""One registry type (config/registry.py) for every extension point, and the one `plugins:` key."""

import textwrap

import pytest

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.config.registry import Registry


class Base:
    pass


def test_one_duplicate_rule_and_one_lookup():
    r = Registry("widget", key="section.widget", base=None)

    def a():
        return 1

    def b():
        return 2

    r.register("w", a)
    r.register("w", a)  # the same object again: fine
    with pytest.raises(ConfigError, match=r"plugins='w': widget 'w' is registered twice: by .* and by x.mod"):
        r.register("w", b, origin="x.mod")
    r.register("w", b, overwrite=True)
    assert r.get("w") is b
    with pytest.raises(ConfigError, match=r"section.widget='v': unknown widget; registered: w"):
        r.get("v")
    assert r.get("textwrap:dedent") is textwrap.dedent  # a module:attribute reference
    with pytest.raises(ConfigError, match=r"section.widget='textwrap:nope': cannot load"):
        r.get("textwrap:nope")
    typed = Registry("thing", key="k", base=Base)
    with pytest.raises(ConfigError, match="is not a subclass of"):
        typed.get("textwrap:dedent")


def test_every_registry_is_one(monkeypatch, tmp_path):
    """Rewards, rule presets, tactics, environments, parsers, tools and kernels share the type, and
    a plugin module listed in `plugins:` registers into them when the config is loaded."""
    from rpeg_jax.data.rewards import REWARDS, get_reward
    from rpeg_jax.env.parsers import PARSERS
    from rpeg_jax.env.runner import ENVIRONMENTS
    from rpeg_jax.env.tools import TOOLS
    from rpeg_jax.graph.compile import KernelRegistry
    from rpeg_jax.sharding.rules import PRESETS
    from rpeg_jax.sharding.tactics import TACTICS

    k = KernelRegistry()
    assert all(isinstance(x, Registry) for x in (REWARDS, PRESETS, TACTICS, ENVIRONMENTS, PARSERS, TOOLS, k._single))
    (tmp_path / "my_plugin_mod.py").write_text(
        textwrap.dedent("""
        from rpeg_jax.data.rewards import register_reward
        from rpeg_jax.sharding.rules import register_rules

        @register_reward("plugin_reward")
        def plugin_reward(sample):
            return 1.0

        register_rules("plugin_rules", [["mlp", "tensor"]])
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "plugin_reward" not in REWARDS
    cfg = load_config(
        None, ["plugins=[my_plugin_mod]", "data.reward=plugin_reward", "sharding.train_rules=plugin_rules"]
    )
    assert cfg.plugins == ("my_plugin_mod",) and get_reward("plugin_reward").__module__ == "my_plugin_mod"
    assert "plugin_rules" in PRESETS
    with pytest.raises(ConfigError, match=r"plugins\[0\]='not a module'"):
        load_config(None, ["plugins=[not a module]"])
