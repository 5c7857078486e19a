"""The `rpeg` command: train, eval, export, plan, calibrate, graph, shardings, config.

One module per subcommand in this package, imported only when that subcommand runs, so
`rpeg plan` initialises no device and `rpeg --help` is instant. This package and launch/ are the
only code that may import every other package (tests/test_layers.py).

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
Bad configs exit with status 2 and one line naming the key and the value (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rpeg_jax.config.base import ConfigError

# name -> one-line help; the module is rpeg_jax.cli.<name>
SUBCOMMANDS: dict[str, str] = {
    "train": "run RL training on one process or many (--local-processes, --coordinator; = launch/multihost.py)",
    "eval": "evaluate a run's checkpoint (or the initial model) on eval.path: val-core metrics",
    "plan": "predict step time and memory of candidate plans; print the best and baselines",
    "calibrate": "measure this machine and fit the cost model's efficiency factors",
    "graph": "show the RPEG before and after passes (dot | mermaid | json)",
    "shardings": "print every parameter's shape, logical axes and partition per stage",
    "config": "validate a config and print it fully resolved",
    "export": "write a run's trained policy (a checkpoint's actor) as a Hugging Face checkpoint",
}


def _load(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["train"], ["eval"]):  # before any import starts a thread (runtime/host_memory.py)
        from rpeg_jax.runtime import host_memory

        try:
            host_memory.keep_freed_memory()
        except ValueError as e:
            print(f"rpeg {argv[0]}: {e}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="rpeg", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv[:1] == [name]:  # only the chosen subcommand's module is imported
            _load(name).add_arguments(p)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    try:
        return int(_load(args.command).run(args) or 0)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
