"""`rpeg plan --config X [--hardware gh200] [--gpus 256] [--processes 64] [--model M] [--json out.json] [k=v ...]`.

Prints the chosen plan (predicted step time, memory per GPU, utilization, per-stage breakdown),
the runners-up, the verl-like and ReaL-like baselines with their ratios, the gain over verl-like
split into systems and algorithmic (staleness, shared backbone: searched only with
`--allow-algorithmic` = costmodel.search_algorithmic=true or when the config pins them), and the
search time;
`--json` writes the same (see costmodel/report.py for the fields), `--save-plan` the chosen
Plan (loadable with `pipeline.plan: <path>`). Defaults are what a run would see: the device
count and kind JAX reports here (1 CPU device for `make run` on a plain CPU) and the shipped
profile of that kind (the one `rpeg calibrate` fitted with `costmodel.calibration=cached`). With
--gpus, the cluster is planned as the processes that launch on it, one per node unless
--processes says otherwise, and only plans the runtime runs with that many processes are searched
(graph/processes.py); the header shows P. With --gpus and --hardware given it imports no JAX and
touches no device.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from rpeg_jax.config.hf import checkpoint_overrides
from rpeg_jax.config.run import load_config
from rpeg_jax.costmodel.devices import resolve
from rpeg_jax.costmodel.planner import search
from rpeg_jax.costmodel.report import render_text, to_json_dict
from rpeg_jax.graph.ir import GraphError


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument(
        "--hardware", default=None, help="profile name (configs/hardware/) or YAML path; default costmodel.hardware"
    )
    p.add_argument(
        "--gpus",
        "--devices",
        dest="gpus",
        type=int,
        default=None,
        help="devices to plan for (default costmodel.num_devices, else the devices JAX sees here)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="JAX processes owning the devices, P (= costmodel.processes; default: one per node of the hardware "
        "profile, or jax.process_count() when planning for the devices JAX sees here); the plan is one the "
        "runtime runs with P processes",
    )
    p.add_argument("--model", default=None, help="model preset, e.g. qwen2-7b (= model.preset=...)")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.add_argument("--save-plan", default=None, help="write the chosen Plan JSON here")
    p.add_argument(
        "--allow-algorithmic",
        action="store_true",
        help="let the search change the algorithm: staleness k up to costmodel.max_staleness and, for PPO, a "
        "shared actor-critic backbone (= costmodel.search_algorithmic=true); the gains are reported by kind either way",
    )
    p.add_argument("--quiet", action="store_true", help="print only the one-line summary")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def run(args) -> int:
    overrides = list(args.overrides)
    if args.model:
        overrides.insert(0, f"model.preset={args.model}")
    if args.allow_algorithmic:
        overrides.append("costmodel.search_algorithmic=true")
    cfg = load_config(args.config, overrides)
    for line in checkpoint_overrides(cfg):  # fields given beside model.path override its config.json
        print(line, file=sys.stderr)
    if cfg.data.task == "jsonl":  # price the data's prompts, not the cap (imports the data pipeline)
        from rpeg_jax.data.pipeline import with_data_prompt_len

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger("rpeg_jax").setLevel(logging.INFO)
        cfg = with_data_prompt_len(cfg)
    try:
        hw, n, procs = resolve(cfg, args.gpus, args.hardware, args.processes)
        res = search(cfg, n, hw, procs)
    except GraphError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.quiet:
        c = res.chosen
        print(
            f"chosen {c.step_time_s:.4g} s/step, {c.memory_per_gpu_gb:.2f} GB/GPU, util {100 * c.utilization:.1f}%; "
            + (
                ", ".join(f"{k} {v.step_time_s / c.step_time_s:.2f}x" for k, v in res.baselines.items())
                or "no baseline fits"
            )
            + (
                f"; gains systems {res.gains['systems']:.2f}x x algorithmic {res.gains['algorithmic']:.2f}x"
                if res.gains.get("systems") is not None and res.gains.get("algorithmic") is not None
                else ""
            )
            + f"; search {res.search_seconds:.2f} s"
        )
    else:
        print(render_text(res), end="")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(to_json_dict(res), f, indent=1)
    if args.save_plan:
        res.chosen.plan.save(args.save_plan)
    return 0
