"""Env section: the environment an episode runs in (agentic RL), its tools and their limits.

    env:
      name: tools                 # single_turn (today's behaviour) | tools | my_module:MyEnv
      tools: [calculator, python] # built-ins, or my_module:MyTool
      max_turns: 4

Read by rpeg_jax/env (make_environment, the tool-using environment, the python tool's sandbox, the
session that turns episodes into tokens). docs/agentic.md documents every key with a worked example.
Pure Python: the built-in names below are repeated from rpeg_jax/env (tests/test_env_episodes.py
keeps them in step) so that validating a config never imports the env package.
"""

from __future__ import annotations

from dataclasses import dataclass

from rpeg_jax.config.base import check, key, suggest

BUILTIN_ENVS = ("single_turn", "tools")  # rpeg_jax/env/__init__.py ENVIRONMENTS
BUILTIN_TOOLS = ("calculator", "python")  # rpeg_jax/env/tools/__init__.py TOOLS
BUILTIN_PARSERS = ("auto", "hermes")  # rpeg_jax/env/parsers.py PARSERS (+ auto)


def _plugin(name: str) -> bool:
    """`module:Class` (a dotted module, a class name)."""
    mod, sep, cls = name.partition(":")
    return bool(sep) and bool(cls) and all(p.isidentifier() for p in mod.split(".")) and cls.isidentifier()


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    name: str = "single_turn"  # single_turn | tools | module:Class (an env.base.Environment subclass)
    tools: tuple[str, ...] = ()  # tools of env.name=tools: calculator, python, or module:Class (env.tools.Tool)
    tool_parser: str = "auto"  # how tool calls are written: auto (from the chat template) | hermes | module:Class
    stop_at_call: bool = True  # a policy turn ends at the parser's call close (</tool_call>): one call per
    #                            turn; false: at eos only, every call of the turn runs in order
    max_turns: int = 4  # assistant turns per episode (the last one is not answered)
    max_tool_calls: int = 8  # tool calls per episode; a turn that would exceed it ends the episode
    tool_timeout_s: float = 10.0  # wall-clock seconds of one tool call (the python tool's process is killed)
    max_concurrent_tools: int = 8  # turn ends (and their tool calls) run at once on the host
    max_tool_output_chars: int = 4096  # a tool result's text beyond this is cut (marked in the text)
    python_executable: str | None = None  # the python tool's interpreter; null: the trainer's own
    python_cpu_s: int = 10  # RLIMIT_CPU of the python tool's process (seconds)
    python_memory_mb: int = 1024  # RLIMIT_AS of each of its processes (MiB)
    python_file_mb: int = 16  # RLIMIT_FSIZE: the largest file it writes, its output included (MiB)
    python_max_processes: int = 16  # RLIMIT_NPROC (tasks: processes and threads) in its own user
    #                                 namespace; where it cannot have one, it may start no process

    def validate(self, path: str) -> None:
        ok = self.name in BUILTIN_ENVS or _plugin(self.name)
        check(
            ok,
            key(path, "name"),
            self.name,
            f"must be one of {', '.join(BUILTIN_ENVS)} or module:Class" + suggest(self.name, list(BUILTIN_ENVS)),
        )
        for i, t in enumerate(self.tools):
            check(
                t in BUILTIN_TOOLS or _plugin(t),
                f"{key(path, 'tools')}[{i}]",
                t,
                f"must be one of {', '.join(BUILTIN_TOOLS)} or module:Class" + suggest(t, list(BUILTIN_TOOLS)),
            )
        check(len(set(self.tools)) == len(self.tools), key(path, "tools"), list(self.tools), "names a tool twice")
        if self.name == "tools":
            check(bool(self.tools), key(path, "tools"), [], "env.name=tools needs at least one tool")
        check(
            self.tool_parser in BUILTIN_PARSERS or _plugin(self.tool_parser),
            key(path, "tool_parser"),
            self.tool_parser,
            f"must be one of {', '.join(BUILTIN_PARSERS)} or module:Class",
        )
        for name in (
            "max_turns",
            "max_tool_calls",
            "max_concurrent_tools",
            "max_tool_output_chars",
            "python_cpu_s",
            "python_memory_mb",
            "python_file_mb",
            "python_max_processes",
        ):
            v = getattr(self, name)
            check(v >= 1, key(path, name), v, "must be >= 1")
        check(self.tool_timeout_s > 0, key(path, "tool_timeout_s"), self.tool_timeout_s, "must be > 0 (seconds)")
        if self.python_executable is not None:
            check(bool(self.python_executable), key(path, "python_executable"), "", "must be a path (null: default)")
