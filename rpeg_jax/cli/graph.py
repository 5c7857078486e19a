"""`rpeg graph --config X [--format text|dot|mermaid|json] [--before] [--devices N] [k=v ...]`.

Builds the RPEG for the config's algorithm, applies the passes the pipeline section asks for
(or none with --before) and prints it; with --devices N (text format) also the manual plan.
Pure Python: no device is touched.
"""

from __future__ import annotations

import sys

from rpeg_jax.config.run import load_config
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.export import to_dot, to_json, to_mermaid
from rpeg_jax.graph.ir import GraphError
from rpeg_jax.graph.passes import apply_pipeline
from rpeg_jax.graph.plan import plan_from_config

FORMATS = {
    "text": lambda g: g.describe() + "\n",
    "dot": to_dot,
    "mermaid": to_mermaid,
    "json": lambda g: to_json(g) + "\n",
}


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("--format", choices=sorted(FORMATS), default="text")
    p.add_argument("--before", action="store_true", help="the graph as built, before any pass")
    p.add_argument("--devices", type=int, default=None, help="also print the manual plan for N devices")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def run(args) -> int:
    try:
        return _show(args)
    except GraphError as e:  # an illegal pass for this config: one line, like a ConfigError
        print(str(e), file=sys.stderr)
        return 2


def _show(args) -> int:
    cfg = load_config(args.config, args.overrides)
    graph = build_graph(cfg)
    if not args.before:
        graph = apply_pipeline(graph, cfg.pipeline, cfg.rollout.admission, cfg.rollout.decode_ahead)
    print(FORMATS[args.format](graph), end="")
    if args.devices is not None and args.format == "text":
        print(plan_from_config(cfg, args.devices, graph if not args.before else None).describe())
    return 0
