"""`rpeg config --config X [key=value ...]`: validate and print the resolved config (YAML)."""

from __future__ import annotations

from rpeg_jax.config.run import dump_yaml, load_config


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    print(dump_yaml(cfg), end="")
    return 0
