"""Tools an environment runs by name: the Tool interface (base.py) and the built-ins.

    calculator  arithmetic through a whitelist of ast nodes (calculator.py)
    python      code in a confined child process (python.py, env/sandbox.py)

A tool of your own is `env.tools=[my_module:MyTool]` (a Tool subclass; base.py shows one).
"""

from __future__ import annotations

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.env import EnvConfig
from rpeg_jax.config.registry import Registry
from rpeg_jax.env.tools.base import Tool, ToolResult, check_arguments
from rpeg_jax.env.tools.calculator import Calculator
from rpeg_jax.env.tools.python import Python

TOOLS = Registry("tool", key="env.tools", base=Tool)  # config/registry.py
TOOLS.register("calculator", Calculator)
TOOLS.register("python", Python)


def make_tools(cfg: EnvConfig) -> dict[str, Tool]:
    """name -> tool for env.tools (built-ins by name, others as module:Class), each built once."""
    out: dict[str, Tool] = {}
    for i, spec in enumerate(cfg.tools):
        cls = TOOLS.get(spec, f"env.tools[{i}]")
        tool = cls(cfg)
        if not tool.name:
            raise ConfigError(f"env.tools[{i}]", spec, "the tool has no name")
        if tool.name in out:
            raise ConfigError(f"env.tools[{i}]", spec, f"a tool named {tool.name!r} is listed already")
        out[tool.name] = tool
    return out


__all__ = ["TOOLS", "Calculator", "Python", "Tool", "ToolResult", "check_arguments", "make_tools"]
