"""`rpeg config --config X [key=value ...]`: validate and print the resolved config (YAML); fields
given beside `model.path` that override its config.json are listed on stderr."""

from __future__ import annotations

import sys

from rpeg_jax.config.hf import checkpoint_overrides, pretrained_warnings
from rpeg_jax.config.run import dump_yaml, load_config


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    for line in checkpoint_overrides(cfg):  # fields given beside model.path override its config.json
        print(line, file=sys.stderr)
    for line in pretrained_warnings(cfg):
        print(f"warning: {line}", file=sys.stderr)
    print(dump_yaml(cfg), end="")
    return 0
