"""P1 of bench/WORKLOADS.md: planning at scale (model only; no device is touched).

    python bench/plan_scale.py --json out.json [--quick]
    python bench/plan_scale.py --gains [--json out.json]   # 64/128/256 GH200 x 1.5B/7B/32B GRPO: baselines
                                                           # and the gain split into systems x algorithmic

For 64/128/256 GH200 (4 per node) and 8-GPU H100/H200 nodes, Qwen2-shaped 1.5B/7B/32B/72B,
GRPO (G=16) and PPO, prompt 512, responses 4k-16k tokens long-tailed (4096 + lognormal, median
6144, clipped at 16384), global batch 512 sequences: the chosen plan with its predicted step
time, memory per GPU and utilization; the verl-like and ReaL-like baselines (each the best of
its family on the same hardware) and their ratios; and the search time on one core. Each cluster
is planned as the processes that launch on it, one per node (P: 16 for 64 GH200), so only plans
the runtime runs with P processes are searched; a workload P processes cannot run at all (32
prompts on 64 processes) is reported as refused, with the key.
The planner searches rollout.admission (step | continuous) and k like its other knobs; "async"
is the part of the chosen plan's gain over the verl-like plan that comes from asynchrony (the
chosen layout priced at k = 0 with step admission: speedup = async x the rest). Our sampler's KV
page pool is split per replica over the generation group's data axis (rollout.kv_pool=replicated
prices a pool replicated on every device instead). The baselines are priced with their own
engines (one KV pool per replica).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.costmodel.devices import resolve  # noqa: E402
from rpeg_jax.costmodel.hardware import load_hardware  # noqa: E402
from rpeg_jax.costmodel.planner import search  # noqa: E402
from rpeg_jax.graph.ir import GraphError  # noqa: E402
from rpeg_jax.graph.processes import NotRunnable  # noqa: E402

MODELS = {"1.5B": "qwen2-1.5b", "7B": "qwen2-7b", "32B": "qwen2-32b", "72B": "qwen2-72b"}
WORKLOAD = [
    "model.dtype=bfloat16",
    "model.param_dtype=float32",
    "data.max_prompt_len=512",
    "costmodel.prompt_len=512",
    "rollout.max_new_tokens=16384",
    "costmodel.response_len_min=4096",
    "costmodel.response_len_median=6144",
    "costmodel.response_len_sigma=0.8",
    "train.pack_sequences=true",
    "rl.kl_coef=0.001",
]
ALGOS = {
    "GRPO": ["rl.algorithm=grpo", "rl.group_size=16", "data.prompts_per_step=32"],
    "PPO": ["rl.algorithm=ppo", "rl.group_size=1", "data.prompts_per_step=512"],
}
MACHINES = [("gh200", 64), ("gh200", 128), ("gh200", 256), ("h100", 8), ("h200", 8)]


def one(hw_name: str, gpus: int, model: str, algo: str) -> dict:
    return _search(hw_name, gpus, model, algo, [])


def _failed(e: GraphError) -> dict:
    short = f"refused: {e.key}={e.value}" if isinstance(e, NotRunnable) else "no layout fits in memory"
    return {"fits": False, "reason": str(e), "short": short}


def _search(hw_name: str, gpus: int, model: str, algo: str, extra: list[str]) -> dict:
    cfg = load_config(None, [f"model.preset={MODELS[model]}", *WORKLOAD, *ALGOS[algo], *extra])
    hw = load_hardware(hw_name, calibrated=False)
    row = {"hardware": hw_name, "gpus": gpus, "processes": resolve(cfg, gpus, hw, None)[2]}
    row.update(model=model, algorithm=algo)
    t0 = time.perf_counter()
    try:
        res = search(cfg, gpus, hw)
    except GraphError as e:
        row.update(_failed(e), search_seconds=time.perf_counter() - t0)
        return row
    c = res.chosen
    row.update(
        fits=True,
        search_seconds=res.search_seconds,
        evaluations=res.evaluations,
        plans_considered=res.plans_considered,
        chosen={
            "step_time_s": c.step_time_s,
            "utilization": c.utilization,
            "memory_per_gpu_gb": c.memory_per_gpu_gb,
            "knobs": c.knobs,
            "layout": c.layout,
            "stage_times_s": c.stage_times_s,
        },
        asynchrony=res.asynchrony,
    )
    for name, b in res.baselines.items():
        row[name] = {
            "step_time_s": b.step_time_s,
            "utilization": b.utilization,
            "memory_per_gpu_gb": b.memory_per_gpu_gb,
            "ratio": b.step_time_s / c.step_time_s,
            "layout": b.layout,
        }
    return row


def gains_row(gpus: int, model: str) -> dict:
    """P1 GRPO with the algorithmic knobs searched (k <= 2, costmodel.search_algorithmic): both
    baselines, the chosen plan, the best plan at the synchronous algorithm and the gains by kind."""
    extra = ["costmodel.max_staleness=2", "costmodel.search_algorithmic=true"]
    cfg = load_config(None, [f"model.preset={MODELS[model]}", *WORKLOAD, *ALGOS["GRPO"], *extra])
    hw = load_hardware("gh200", calibrated=False)
    row = {"hardware": "gh200", "gpus": gpus, "processes": resolve(cfg, gpus, hw, None)[2], "model": model}
    row["algorithm"] = "GRPO"
    try:
        res = search(cfg, gpus, hw)
    except GraphError as e:
        return {**row, **_failed(e)}

    def fields(p):
        return {
            "step_time_s": p.step_time_s,
            "utilization": p.utilization,
            "utilization_own_work": p.utilization_own_work,
            "memory_per_gpu_gb": p.memory_per_gpu_gb,
            "knobs": p.knobs,
            "layout": p.layout,
        }

    return {
        **row,
        "fits": True,
        "search_seconds": res.search_seconds,
        "chosen": fields(res.chosen),
        "equal_algorithm": fields(res.equal_algorithm) if res.equal_algorithm else None,
        "baselines": {k: fields(v) for k, v in res.baselines.items()},
        "gains": res.gains,
    }


def gains_table(rows: list[dict]) -> str:
    head = (
        "| GH200 | P | model | verl-like s / util | ReaL-like s / util (calls) | best k=0 s / util | chosen s / util "
        "(own) / GB | chosen plan | systems | algorithmic | total | search s |"
    )
    out = [head, "|" + "---|" * 12]
    for r in rows:
        if not r["fits"]:
            out.append(f"| {r['gpus']} | {r['processes']} | {r['model']} | {r['short']} |" + " |" * 8)
            continue
        b, c, e, g = r["baselines"], r["chosen"], r["equal_algorithm"], r["gains"]

        def su(p):
            return f"{p['step_time_s']:.1f} / {100 * p['utilization']:.1f}%" if p else "no fit"

        real = b.get("real_like")
        calls = ""
        if real and real["layout"].get("concurrent"):
            calls = (
                " ("
                + " ‖ ".join(f"{k.split('_')[0]} {v['devices']}" for k, v in real["layout"]["concurrent"].items())
                + ")"
            )
        k, gen = c["knobs"], c["layout"]["generate"]
        adm = gen.get("admission", "step")
        plan = f"{k['placement'][:5]} k={k['staleness']} {adm} gen tp{gen['tensor']}x{gen['replicas']}"

        def x(v):
            return f"{v:.2f}x" if v is not None else "-"

        out.append(
            f"| {r['gpus']} | {r['processes']} | {r['model']} | {su(b.get('verl_like'))} | {su(real)}{calls} | "
            f"{su(e)} | "
            f"{c['step_time_s']:.1f} / {100 * c['utilization']:.1f}% ({100 * c['utilization_own_work']:.1f}%) / "
            f"{c['memory_per_gpu_gb']:.1f} | {plan} | {x(g['systems'])} | {x(g['algorithmic'])} | {x(g['total'])} | "
            f"{r['search_seconds']:.2f} |"
        )
    return "\n".join(out)


def describe(row: dict) -> str:
    c = row["chosen"]
    k, lay = c["knobs"], c["layout"]
    groups = "+".join(str(v) for v in lay["groups"].values())
    g, t = lay["generate"], lay["train"]
    return (
        f"{k['placement'][:5]} {groups} k={k['staleness']}{' cont' if g.get('admission') == 'continuous' else ''}"
        f"{' share' if k['share_actor_critic'] else ''} "
        f"gen tp{g['tensor']} train d{t['data']}f{t['fsdp']}t{t['tensor']}"
    )


def table(rows: list[dict]) -> str:
    head = (
        f"{'hw':<6}{'gpus':>5}{'P':>4} {'model':<5} {'algo':<5} {'chosen plan':<44}{'step s':>8}{'util':>7}{'GB':>6}"
        f"{'verl s':>9}{'x':>6}{'ReaL s':>9}{'x':>6}{'search s':>9}{'async':>7}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        pre = f"{r['hardware']:<6}{r['gpus']:>5}{r['processes']:>4} {r['model']:<5} {r['algorithm']:<5} "
        if not r["fits"]:
            out.append(pre + f"{r['short'][:43]:<44}" + f"{'':>56}{r['search_seconds']:>9.2f}")
            continue
        c = r["chosen"]
        base = ""
        for name in ("verl_like", "real_like"):
            b = r.get(name)
            base += f"{b['step_time_s']:>9.1f}{b['ratio']:>6.2f}" if b else f"{'no fit':>9}{'-':>6}"
        a = r.get("asynchrony")
        extra = f"{a['asynchrony']:>7.2f}" if a else f"{'1.00':>7}"
        out.append(
            pre + f"{describe(r):<44}{c['step_time_s']:>8.1f}{100 * c['utilization']:>6.1f}%"
            f"{c['memory_per_gpu_gb']:>6.1f}{base}{r['search_seconds']:>9.2f}{extra}"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="only 7B GRPO on 256 GH200 and one H100 node")
    ap.add_argument(
        "--gains", action="store_true", help="the baselines and gains table (GH200 64/128/256 x 1.5B/7B/32B)"
    )
    args = ap.parse_args()
    if args.gains:
        rows = [gains_row(n, m) for n in (64, 128, 256) for m in ("1.5B", "7B", "32B")]
        print(gains_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workload": "P1 GRPO", "rows": rows}, f, indent=1)
        return 0
    jobs = [(h, n, m, a) for h, n in MACHINES for m in MODELS for a in ALGOS]
    if args.quick:
        jobs = [("gh200", 256, "7B", "GRPO"), ("h100", 8, "7B", "GRPO")]
    rows = []
    for job in jobs:
        rows.append(one(*job))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    big = [r["search_seconds"] for r in rows if r["gpus"] == 256]
    summary = {
        "max_search_seconds_256": max(big) if big else None,
        "max_search_seconds": max(r["search_seconds"] for r in rows),
        "target_search_seconds_256": 60.0,
    }
    print(f"\nlongest search at 256 GPUs: {summary['max_search_seconds_256']:.2f} s (target < 60 s, one core)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "P1", "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
