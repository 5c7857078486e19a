"""Standing check of the cost model's absolute step times against published measurements.

    python bench/costmodel_anchors.py [--hardware h100] [--json out.json]

Every anchor is a published step time whose whole workload is known (model, GPUs, batch, prompt
and response lengths, generation layout). Each anchor's RunConfig is built here from the model
presets plus overrides; nothing is fitted to the anchors (the constants in
configs/hardware/*.yaml come from other sources, cited there). Prints predicted vs published
seconds per step and their ratio; the goal is every ratio within [0.75, 1.25].

How each anchor is predicted (say which when quoting a number): the run as it was run, its
placement and published generation tensor degree, the training layout the model's best of
data x fsdp x tensor (Megatron's published TP/PP/CP are not expressible: no PP or CP here):
  on-policy (colocated, synchronous): costmodel.pricing.price_layout, colocated, k = 0 (the verl-like
    family: NeMo-RL's on-policy runs are colocated vLLM + Megatron). Beside it, the planner's own
    verl-like baseline (costmodel.planner.baseline, its best generation TP too), which is what
    `rpeg plan` compares against; where no layout fits at the published TP, that one is used.
  1-step off-policy (split): costmodel.pricing.price_layout of the published split (generation
    GPUs + training GPUs, generation tensor degree as published), staleness k = 1, step admission
    (generation of step t+1 overlaps training on step t), the best training layout of
    data x fsdp x tensor with the forwards on it. NeMo-RL's async GRPO with
    max_trajectory_age_steps 1 is that schedule (its in-flight weight updates are not modelled).

Source of every anchor: NeMo-RL v0.4 performance table, `NVIDIA-NeMo/RL`
docs/about/performance-summary.md ("Nemo RL v0.4", GRPO on OpenMathInstruct-2, DGX-H100, training
and generation BF16, Megatron-core), for the step times. Workload per the
table: G-GBS 2048 samples per step (64 prompts x 32 generations), T-GBS 512 per
optimizer step (rl.minibatches = 4), T-max sequence length 4096 (prompt 128 + responses up to
3968), KL 0.01 (a reference model), temperature 1 (no truncation). Splits of the off-policy runs:
the recipes examples/configs/recipes/llm/performance/async-grpo-llama3.1-8b-instruct-2n8g.yaml
(8 generation GPUs of 16) and grpo-qwen3-32b-8n8g-async-1off.yaml (32 of 64, vLLM TP 4).
Response lengths: a shifted lognormal (sigma 0.6, the cost model's default shape; an assumption,
NeMo publishes only the mean) whose median is solved so that the mean of 2048 responses is the
table's "G-Average Seq len"; the trainer packs sequences (train.pack_sequences, assumed).

Models: Llama-3.1-8B has the llama3-8b preset's shape (L 32, D 4096, H 32, K 8, F 14336, V 128256;
3.1 changes RoPE scaling and context, not the shape). Qwen3-32B is the qwen2-32b preset with
Qwen3-32B's published dims: 64 heads x head_dim 128, 8 kv heads, F 25600, V 151936, no qkv bias,
untied (32.76B parameters; its q/k RMSNorm is not modelled, it costs no matmul FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.config.pipeline import PipelineConfig  # noqa: E402
from rpeg_jax.costmodel.baselines import baseline  # noqa: E402
from rpeg_jax.costmodel.candidates import layouts  # noqa: E402
from rpeg_jax.costmodel.context import make_context, roles_of  # noqa: E402
from rpeg_jax.costmodel.hardware import load_hardware  # noqa: E402
from rpeg_jax.costmodel.lengths import LengthDist  # noqa: E402
from rpeg_jax.costmodel.pricing import price_layout  # noqa: E402
from rpeg_jax.graph.ir import GraphError  # noqa: E402
from rpeg_jax.graph.plan import knobs_of  # noqa: E402

SOURCE = "NeMo-RL v0.4 docs/about/performance-summary.md (costmodel-review.md §2)"
PROMPT, MAX_SEQ, SIGMA = 128, 4096, 0.6
QWEN3_32B = [
    "model.preset=qwen2-32b",
    "model.num_heads=64",
    "model.num_kv_heads=8",
    "model.head_dim=128",
    "model.intermediate_size=25600",
    "model.vocab_size=151936",
    "model.qkv_bias=false",
]
LLAMA31_8B = ["model.preset=llama3-8b"]


@dataclass
class Anchor:
    name: str
    models: list[str]
    gpus: int
    mean_response: float  # the table's G-Average Seq len
    published_s: float
    split: tuple[int, int] | None = None  # (generation GPUs, training GPUs) of an off-policy run
    gen_tensor: int = 1  # the published generation TP (Generation [TP,PP] column)
    source: str = SOURCE
    extra: list[str] = field(default_factory=list)


ANCHORS = [
    Anchor("llama3.1-8b on-policy", LLAMA31_8B, 16, 1060, 97.7, gen_tensor=1),
    Anchor("llama3.1-8b 1-step-off", LLAMA31_8B, 16, 1129, 74.6, split=(8, 8), gen_tensor=1),
    Anchor("qwen3-32b on-policy", QWEN3_32B, 32, 3206, 393.0, gen_tensor=4),
    Anchor("qwen3-32b 1-step-off", QWEN3_32B, 64, 3207, 215.0, split=(32, 32), gen_tensor=4),
]


def median_for_mean(target: float, cap: int, n: int = 2048) -> float:
    """The lognormal median (min 1, sigma SIGMA, clipped at `cap`) whose mean over n is `target`."""
    lo, hi = 1.0, float(cap)
    for _ in range(60):
        mid = (lo + hi) / 2
        if LengthDist(max_len=cap, min_len=1, median=mid, sigma=SIGMA).mean(n) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def anchor_config(a: Anchor):
    cap = MAX_SEQ - PROMPT
    med = median_for_mean(a.mean_response, cap)
    over = [
        *a.models,
        "model.dtype=bfloat16",
        "model.param_dtype=float32",
        "rl.algorithm=grpo",
        "rl.group_size=32",
        "data.prompts_per_step=64",
        "rl.minibatches=4",
        "rl.kl_coef=0.01",
        f"data.max_prompt_len={PROMPT}",
        f"costmodel.prompt_len={PROMPT}",
        f"rollout.max_new_tokens={cap}",
        "costmodel.response_len_min=1",
        f"costmodel.response_len_median={med:.3f}",
        f"costmodel.response_len_sigma={SIGMA}",
        "train.pack_sequences=true",
        "costmodel.max_staleness=1",
        *a.extra,
    ]
    return load_config(None, over), med


def predict_anchor(a: Anchor, hw) -> dict:
    cfg, med = anchor_config(a)
    ctx = make_context(cfg, a.gpus, hw)
    published_tp = _at_gen_tensor(cfg, ctx, a, hw)
    verl = baseline(ctx, "verl_like", {}) if a.split is None else None
    if published_tp is not None:  # the run as it was run: its placement and generation TP
        pred = published_tp
        how = (
            "price_layout "
            + ("colocated sync" if a.split is None else "split k=1 step admission")
            + ", published gen TP"
        )
    else:  # the model finds no fitting layout at the published TP: the planner's verl-like choice
        pred, how = verl, "planner verl-like (colocated, sync; no layout fits at the published gen TP)"
    if pred is None:
        raise GraphError("anchor", f"{a.name}: no layout fits")
    return {
        "anchor": a.name,
        "gpus": a.gpus,
        "split": a.split,
        "mean_response": a.mean_response,
        "median_response": med,
        "published_s": a.published_s,
        "predicted_s": pred.step_time_s,
        "ratio": pred.step_time_s / a.published_s,
        "predicted_verl_like_s": None if verl is None else verl.step_time_s,
        "verl_like_gen_tensor": None if verl is None else verl.layout["generate"]["tensor"],
        "method": how,
        "stage_s": pred.stage_times_s,
        "layout": pred.layout,
        "source": a.source,
    }


def _at_gen_tensor(cfg, ctx, a: Anchor, hw):
    """The anchor's placement (split k=1 step admission, or colocated sync as verl-like) at the
    published generation tensor degree, over every training layout (forwards on it): the best."""
    if a.split is None:
        ng = nt = a.gpus
        pipe = PipelineConfig(placement="colocated")
        groups = {"all": a.gpus}
    else:
        ng, nt = a.split
        pipe = PipelineConfig(placement="split", staleness=1, split_sizes=(ng, nt), plan="manual")
        groups = {"gen": ng, "train": nt}
    actor = roles_of(ctx, ctx.base).actor
    best = None
    for d, f, t in layouts(nt, ctx.st.B, actor, cfg.costmodel.tensor_sizes).tolist():
        mesh = {"data": d, "fsdp": f, "tensor": t}
        layout = {
            "groups": groups,
            "generate": {"tensor": a.gen_tensor, "admission": "step"},
            "train": dict(mesh),
            "forward": dict(mesh),
        }
        try:
            p = price_layout(cfg, knobs_of(pipe), layout, a.gpus, hw)
        except GraphError:  # no row of that layout fits in memory
            continue
        if best is None or p.step_time_s < best.step_time_s:
            best = p
    return best


def table(rows: list[dict]) -> str:
    head = (
        "| anchor | workload | published s | predicted s | ratio | planner's verl-like choice s | ratio |\n"
        "|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        lay = r["layout"]
        g, t = lay["generate"], lay["train"]
        place = f"split {r['split'][0]}+{r['split'][1]} k=1" if r["split"] else "colocated sync"
        work = (
            f"{r['gpus']} H100, {place}, 64x32 samples, prompt {PROMPT}, mean response {r['mean_response']:.0f} "
            f"(cap {MAX_SEQ - PROMPT}); predicted layout gen tp{g['tensor']}, train "
            f"d{t['data']}f{t['fsdp']}t{t['tensor']} mb{t['micro_batches']} {t['remat']}"
        )
        at = r["predicted_verl_like_s"]
        at_s = (
            f"{at:.1f} (gen tp{r['verl_like_gen_tensor']}) | {at / r['published_s']:.2f}" if at is not None else "- | -"
        )
        out.append(
            f"| {r['anchor']} | {work} | {r['published_s']:.1f} | {r['predicted_s']:.1f} | {r['ratio']:.2f} | {at_s} |"
        )
    return "\n".join(out)


def stages(rows: list[dict]) -> str:
    out = []
    for r in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["stage_s"].items())
        out.append(f"{r['anchor']} ({r['method']}): {parts}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100", help="profile (uncalibrated preset unless a path)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hw = load_hardware(args.hardware, calibrated=False)
    rows = [predict_anchor(a, hw) for a in ANCHORS]
    print(table(rows))
    print()
    print(stages(rows))
    bad = [r["anchor"] for r in rows if not 0.75 <= r["ratio"] <= 1.25]
    print(f"\nwithin 25%: {len(rows) - len(bad)}/{len(rows)}" + (f"; outside: {', '.join(bad)}" if bad else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hw.name, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
