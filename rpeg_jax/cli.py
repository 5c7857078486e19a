"""The `rpeg` command: train, plan, calibrate, graph, shardings, config.

Each subcommand lives in the package that owns it and is imported lazily,
so `rpeg plan` runs without initialising any device and `rpeg --help` is instant.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
Bad configs exit with status 2 and one line naming the key and the value (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("rpeg_jax.runtime.cli", "run RL training (the same as launch/multihost.py on one process)"),
    "plan": ("rpeg_jax.costmodel.cli", "predict step time and memory of candidate plans; print the best and baselines"),
    "calibrate": ("rpeg_jax.costmodel.calibrate", "measure this machine and fit the cost model's efficiency factors"),
    "graph": ("rpeg_jax.graph.cli", "show the RPEG before and after passes (dot | mermaid | json)"),
    "shardings": ("rpeg_jax.sharding.cli", "print every parameter's shape, logical axes and partition per stage"),
    "config": ("rpeg_jax.config.cli", "validate a config and print it fully resolved"),
}


def _load(name: str):
    module, _ = SUBCOMMANDS[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rpeg", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_name=name)
        mod = _load(name) if (argv or sys.argv[1:])[:1] == [name] else None
        if mod is not None:
            mod.add_arguments(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    mod = _load(args.command)
    if mod is None:
        print(f"rpeg {args.command}: not built yet ({SUBCOMMANDS[args.command][0]} is missing)", file=sys.stderr)
        return 1
    from rpeg_jax.config.base import ConfigError

    try:
        return int(mod.run(args) or 0)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
