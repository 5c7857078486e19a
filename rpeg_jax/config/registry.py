"""One registry type for every extension point, and one `plugins:` key that imports the user's modules.

    REWARDS = Registry("reward", key="data.reward")
    @REWARDS.register("my_reward")            # or register_reward("my_reward") (data/rewards.py)
    def my_reward(sample): ...
    REWARDS.get("my_reward")                  # a registered name
    REWARDS.get("my_pkg.rewards:exact")       # or module:attribute, imported now

The registries: rewards (data/rewards.py), stage kernels (graph/compile.KernelRegistry), sharding
rule presets and tactics (sharding/rules.py, tactics.py), environments, tool parsers and tools
(env/). Each follows the same rules:

- a name registered again with the same object, or by the same module (a module imported twice),
  replaces quietly; another object under a taken name is one ConfigError line naming both modules,
  unless `overwrite=True`;
- `get(name)` answers a registered name, else a `module:attribute` reference (imported then, and
  checked against the registry's `base` class when it has one), else one ConfigError line naming the
  config key, the value and the registered names (with the nearest one suggested).

`plugins:` (a top-level list of module names in the run config) is imported when the config is
loaded (config/run.from_dict), before anything looks a name up: a plugin module registers its
rewards, rules, tactics, environments, tools and kernels by importing this package's decorators.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable, Iterator

from rpeg_jax.config.base import ConfigError, suggest


class Registry:
    def __init__(self, what: str, *, key: str, base: type | None = None):
        self.what, self.key, self.base = what, key, base
        self._items: dict[Any, Any] = {}
        self._origin: dict[Any, str] = {}

    # ---- registering ------------------------------------------------------------------------
    def register(self, name, obj: Any = None, *, overwrite: bool = False, origin: str | None = None):
        """Register `obj` under `name` (returns it); without `obj`, a decorator."""
        if obj is None:
            return lambda fn: self.register(name, fn, overwrite=overwrite, origin=origin)
        where = origin or getattr(obj, "__module__", None) or _caller()
        if name in self._items and not overwrite:
            same = self._items[name] is obj or self._origin.get(name) == where
            if not same:
                raise ConfigError(
                    "plugins",
                    name,
                    f"{self.what} {name!r} is registered twice: by {self._origin.get(name)} and by {where} "
                    "(pass overwrite=True to replace it)",
                )
        self._items[name], self._origin[name] = obj, where
        return obj

    # ---- looking up ---------------------------------------------------------------------------
    def get(self, name, key: str | None = None) -> Any:
        """The object `name` stands for (module docstring); ConfigError naming `key` otherwise."""
        key = key or self.key
        if name in self._items:
            return self._items[name]
        if isinstance(name, str) and ":" in name:
            return self.load(name, key)
        known = [str(n) for n in self._items]
        raise ConfigError(
            key, name, f"unknown {self.what}; registered: {', '.join(sorted(known))}" + suggest(str(name), known)
        )

    def load(self, spec: str, key: str | None = None) -> Any:
        """The attribute `module:attr` names, imported now (checked against `base`)."""
        key = key or self.key
        mod, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except Exception as e:  # any failure is the user's module: one line
            raise ConfigError(key, spec, f"cannot load: {type(e).__name__}: {e}") from None
        if self.base is not None and not (isinstance(obj, type) and issubclass(obj, self.base)):
            raise ConfigError(key, spec, f"is not a subclass of {self.base.__module__}.{self.base.__name__}")
        return obj

    def origin(self, name) -> str | None:
        return self._origin.get(name)

    # ---- a mapping's reads ----------------------------------------------------------------------
    def names(self) -> list:
        return list(self._items)

    def __contains__(self, name) -> bool:
        return name in self._items

    def __getitem__(self, name):
        return self._items[name]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def values(self):
        return self._items.values()

    def items(self):
        return self._items.items()

    def keys(self):
        return self._items.keys()


def load_plugins(modules, key: str = "plugins") -> None:
    """Import each plugin module (their imports register what they provide); one line per failure."""
    for i, mod in enumerate(modules):
        if mod in sys.modules:
            continue
        try:
            importlib.import_module(mod)
        except ConfigError:
            raise
        except Exception as e:  # the plugin's own error, reported with the module's name
            raise ConfigError(f"{key}[{i}]", mod, f"cannot import plugin: {type(e).__name__}: {e}") from None


def _caller() -> str:
    for frame in inspect.stack()[2:]:
        name = frame.frame.f_globals.get("__name__", "")
        if name != __name__:
            return name
    return "?"


Decorator = Callable[[Any], Any]
