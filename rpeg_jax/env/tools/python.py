"""The `python` tool: runs the model's code in a confined child process (env/sandbox.py) and returns
what it printed.

The result's content is stdout, then stderr (its tail, where a traceback ends) under a "stderr:"
line, then a status line when the run failed: "[exit status N]", "[killed by signal N]",
"[timed out after S s]" or "[sandbox refused to start: why]". A failed run is an error result
(kind "failed", or "timeout"), which the policy reads and env/tool_errors counts. metadata holds the
sandbox's report (identity, process mode, Landlock ABI, seccomp) and the limits, so a run records
what confined it; docs/agentic.md says what that protects against and what not.

Limits come from the env section: env.tool_timeout_s (wall clock), env.python_cpu_s,
env.python_memory_mb, env.python_file_mb, env.python_max_processes, env.max_tool_output_chars, and
the interpreter from env.python_executable.
"""

from __future__ import annotations

import signal

from rpeg_jax.config.env import EnvConfig
from rpeg_jax.env.sandbox import PythonSandbox, SandboxLimits, SandboxResult
from rpeg_jax.env.tools.base import FAILED, TIMEOUT, Tool, ToolResult


def make_sandbox(cfg: EnvConfig) -> PythonSandbox:
    """The sandbox the env section asks for."""
    limits = SandboxLimits(
        timeout_s=cfg.tool_timeout_s,
        cpu_s=cfg.python_cpu_s,
        memory_mb=cfg.python_memory_mb,
        file_mb=cfg.python_file_mb,
        max_processes=cfg.python_max_processes,
        max_output_chars=cfg.max_tool_output_chars,
    )
    return PythonSandbox(limits, cfg.python_executable)


def render(res: SandboxResult, timeout_s: float) -> ToolResult:
    """The policy's view of a run (module doc)."""
    parts = [res.stdout] if res.stdout else []
    if res.stderr:
        parts.append("stderr:\n" + res.stderr)
    meta = {"report": res.report, "seconds": round(res.seconds, 3), "dropped_chars": res.dropped_chars}
    if "error" in res.report:
        return ToolResult(f"[sandbox refused to start: {res.report['error']}]", FAILED, meta)
    if res.timed_out:
        parts.append(f"[timed out after {timeout_s:g} s]")
        return ToolResult("\n".join(parts), TIMEOUT, meta)
    if res.signal is not None:
        name = signal.Signals(res.signal).name if res.signal in signal.valid_signals() else str(res.signal)
        parts.append(f"[killed by signal {name}]")  # SIGXCPU / SIGKILL: env.python_cpu_s
        return ToolResult("\n".join(parts), FAILED, meta)
    if res.exit_code:
        parts.append(f"[exit status {res.exit_code}]")
        return ToolResult("\n".join(parts), FAILED, meta)
    return ToolResult("\n".join(parts) if parts else "[no output]", None, meta)


class Python(Tool):
    name = "python"
    description = (
        "Run a Python 3 program and return what it prints (stdout, then stderr). No network, no files "
        "outside a fresh empty working directory, limited time and memory; print the values you need."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program's source"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, settings: EnvConfig | None = None):
        super().__init__(settings)
        self.sandbox = make_sandbox(settings or EnvConfig())

    def run(self, arguments: dict) -> ToolResult:
        return render(self.sandbox.run(arguments["code"]), self.sandbox.limits.timeout_s)
