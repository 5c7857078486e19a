"""Issue 32 with a Qwen2-family checkpoint and the python tool: a small Qwen2 checkpoint
(tests/fixtures/checkpoint.py: the Qwen2.5 chat template, which declares tools, and its byte-level
tokenizer) is taught the call format by SFT on python-tool transcripts, then trained 2 GRPO steps
on tool episodes through `rpeg train` with train.mode=sft_then_rl; the evaluation files show the
episodes' turns: a python call, the sandbox's output as the tool's message, and the answer after it.
(The episode's tokens and loss mask against transformers' own tools= rendering:
tests/test_env_episodes.py.)"""

import json
import os
import random
import subprocess
import sys

import pytest
from fixtures.checkpoint import write_qwen2_checkpoint

from rpeg_jax.env.tools import Python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def write_data(tmp_path, seed: int = 0):
    r = random.Random(seed)
    schema = [Python.schema(Python)]  # the tool's own schema: the SFT prompts render as the RL prompts do
    pairs = [(r.randint(10, 99), r.randint(10, 99)) for _ in range(72)]
    with open(tmp_path / "sft.jsonl", "w") as f:
        for a, b in pairs[:64]:
            messages = [
                {"role": "user", "content": f"What is {a}*{b}?"},
                {"role": "assistant", "content": call(f"print({a}*{b})")},
                {"role": "tool", "content": str(a * b)},
                {"role": "assistant", "content": f"The answer is {a * b}."},
            ]
            f.write(json.dumps({"tools": schema, "messages": messages}) + "\n")
    for name, rows in (("train.jsonl", pairs[:64]), ("eval.jsonl", pairs[64:68])):
        with open(tmp_path / name, "w") as f:
            for a, b in rows:
                prompt = [{"role": "user", "content": f"What is {a}*{b}?"}]
                f.write(json.dumps({"prompt": prompt, "answer": str(a * b)}) + "\n")


@pytest.mark.slow  # SFT of 150 steps and 2 GRPO steps on a 2-layer Qwen2 checkpoint: 21 min on 2 loaded cores
def test_a_qwen2_checkpoint_runs_python_tool_episodes(tmp_path):
    ckpt = write_qwen2_checkpoint(
        tmp_path / "qwen", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=1024
    )
    write_data(tmp_path)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "multihost.py"),
        f"model.path={ckpt}",
        "data.task=jsonl",
        f"data.path={tmp_path / 'train.jsonl'}",
        "data.max_prompt_len=640",  # the tool's schema rendered into the system message
        "data.prompts_per_step=4",
        "rl.group_size=4",
        "rollout.max_new_tokens=96",
        "env.name=tools",
        "env.tools=[python]",
        "env.max_turns=3",
        "train.mode=sft_then_rl",
        f"sft.path={tmp_path / 'sft.jsonl'}",
        "sft.steps=150",
        "sft.batch_size=8",
        "sft.max_len=768",
        "sft.lr=3e-3",
        "train.steps=2",
        f"train.run_dir={run_dir}",
        f"eval.path={tmp_path / 'eval.jsonl'}",
        "eval.every=2",
        "eval.before_train=true",
        "pipeline.plan=manual",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = [json.loads(line) for line in open(run_dir / "rl" / "metrics.jsonl")]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert max(m["env/tool_calls/mean"] for m in metrics if "env/tool_calls/mean" in m) > 0
    lines = [json.loads(line) for line in open(run_dir / "rl" / "eval" / "step_2.jsonl")]
    assert len(lines) == 4
    samples = [messages for line in lines for messages in line["episodes"]]

    def multi_turn(messages):  # a python call, the sandbox's output, then the policy's next turn
        roles = [m["role"] for m in messages]
        if "tool" not in roles or "assistant" not in roles[roles.index("tool") :]:
            return False
        return '"python"' in messages[roles.index("tool") - 1]["content"]

    shown = json.dumps(samples[:4], indent=1)
    assert any(multi_turn(m) for m in samples), shown[:3000]
    assert any("<tool_call>" in c for line in lines for c in line["completions"])  # the text shows the turns
    assert "<tools>" in lines[0]["prompt_text"] and '"name": "python"' in lines[0]["prompt_text"]  # as prefilled
