"""Qwen3-30B-A3B on P1's workload (configs/p1.yaml, model only; no device is touched): the planner
with and without expert parallelism (issue 33 item 3).

    python bench/plan_moe_ep.py [--gpus 8 64] [--short]

Variants, each a full search (`rpeg plan --config configs/p1.yaml --hardware gh200 --gpus N
--model qwen3-30b-a3b train.pack_sequences=false`):
  searched   the planner as shipped: expert degree 1 or f (fsdp) per layout, the cheaper wins
  no-EP      expert degree 1 only (the planner before expert parallelism was priced)
  EP-forced  expert degree f on every layout whose fsdp divides the experts (f = 1 layouts stay)
  balanced   what-if, not what the runtime runs: a capacity-bounded dispatch moving and holding
             N·k rows per device per all-to-all (a balanced router, capacity factor 1) instead
             of the runtime's dropless e·N·k (models/moe.py), searched
`--short`: the same on a short-response workload (8 prompts x 4, responses of ~128 tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.costmodel.hardware import load_hardware  # noqa: E402
from rpeg_jax.costmodel.planner import search  # noqa: E402
from rpeg_jax.costmodel.shape import ModelShape  # noqa: E402

BASE = ["model.preset=qwen3-30b-a3b", "train.pack_sequences=false"]
SHORT = [
    "data.prompts_per_step=8",
    "rl.group_size=4",
    "data.max_prompt_len=128",
    "costmodel.prompt_len=128",
    "rollout.max_new_tokens=256",
    "costmodel.response_len_min=64",
    "costmodel.response_len_median=128",
    "costmodel.response_len_sigma=0.3",
]


@contextlib.contextmanager
def patched(variant: str):
    """The ModelShape terms of a variant (module docstring); restored on exit."""
    saved = {n: getattr(ModelShape, n) for n in ("expert_degrees", "a2a_bytes", "act_mlp_width", "a2a_extra_act")}
    orig = dict(saved)
    if variant == "no-EP":
        ModelShape.expert_degrees = lambda self, f: (1,)
    elif variant == "EP-forced":
        ModelShape.expert_degrees = lambda self, f: tuple(e for e in orig["expert_degrees"](self, f) if e == f)
    elif variant == "balanced":
        ModelShape.a2a_bytes = lambda self, tokens, e, ids=False: (
            orig["a2a_bytes"](self, tokens, e, ids) / np.maximum(np.asarray(e, np.float64), 1.0)
        )
        ModelShape.act_mlp_width = lambda self, e=1: orig["act_mlp_width"](self, 1)
        ModelShape.a2a_extra_act = lambda self, e: np.where(  # k rows received + k combined per token
            np.asarray(e) > 1, self.Ls / self.L * 2.0 * self.k * self.D * self.act_bytes_per, 0.0
        )
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ModelShape, n, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--short", action="store_true")
    args = ap.parse_args()
    gh = load_hardware("gh200", calibrated=False)
    over = BASE + (SHORT if args.short else [])
    cfg = load_config("configs/p1.yaml", over)
    print(f"{'GPUs':>4}  {'variant':<10} {'step s':>8} {'update s':>9} {'fwd s':>7} {'GB':>6}  train / forward layout")
    for n in args.gpus:
        for variant in ("searched", "no-EP", "EP-forced", "balanced"):
            with patched(variant):
                res = search(cfg, n, gh)
            p = res.chosen
            st = p.stage_times_s
            upd = sum(v for k, v in st.items() if "update" in k)
            fwd = sum(v for k, v in st.items() if "forward" in k)
            tr, fw = p.layout["train"], p.layout["forward"]
            lay = (
                f"d{tr['data']}f{tr['fsdp']}t{tr['tensor']}e{tr['experts']} mb{tr['micro_batches']} {tr['remat']} / "
                f"d{fw['data']}f{fw['fsdp']}t{fw['tensor']}e{fw['experts']} mb{fw['micro_batches']}"
            )
            gb = p.memory_per_gpu_gb
            print(f"{n:>4}  {variant:<10} {p.step_time_s:>8.1f} {upd:>9.1f} {fwd:>7.1f} {gb:>6.1f}  {lay}")


if __name__ == "__main__":
    main()
