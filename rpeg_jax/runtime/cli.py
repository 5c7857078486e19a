"""`rpeg train --config X [key=value ...]`: one process, the devices JAX sees (see launch/ for many)."""

from __future__ import annotations

import json
import logging
import sys

from rpeg_jax.config.run import load_config


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rpeg_jax.runtime.trainer import expected_failures, train

    try:
        print(json.dumps(train(cfg)))
    except expected_failures() as e:
        print(f"rpeg train: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
