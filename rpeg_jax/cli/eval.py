"""`rpeg eval --config X [--step N] [--out FILE] [key=value ...]`: held-out evaluation alone.

Evaluates the policy of a run's checkpoint (train.run_dir/checkpoints; the newest without --step;
only the actor's params are read), or, where the run has no checkpoint (or with --step 0), the
initial model (model.path, else the random init of train.seed), exactly as the run evaluates in
flight (runtime/evaluation.py): the same eval file, sampler settings, seed and layout (the run's
plan.json when there is one), so a checkpoint's evaluation reproduces the run's at that step. The
per-prompt results go to --out (default: <run_dir>/eval/step_<N>.rpeg_eval.jsonl, beside the run's
own step_<N>.jsonl, which it never overwrites); the metrics are printed
as one JSON line. A missing checkpoint, step or eval file is one line, exit 2.
"""

from __future__ import annotations

import json
import logging
import sys

from rpeg_jax.config.run import load_config


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset of the run (or its config.yaml)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest; 0: initial)")
    p.add_argument("--out", default=None, help="per-prompt results (default: <run_dir>/eval/step_<N>.rpeg_eval.jsonl)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")


def run(args) -> int:
    from rpeg_jax.runtime.checkpoint_eval import evaluate_checkpoint
    from rpeg_jax.runtime.trainer import expected_failures

    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        step, metrics = evaluate_checkpoint(cfg, args.step, args.out)
    except expected_failures() as e:  # e.g. a reward that raises with data.reward_on_error=stop
        print(f"rpeg eval: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"step": step, **metrics}, sort_keys=True))
    return 0
