"""`rpeg plan` a user can believe on any machine (issue 34): an uncalibrated CPU profile is said so
and no utilization above 100% is printed; the layout notation has a legend; a JSONL run's prompts
are priced at the data's longest prompt (as the run renders and tokenizes it), not at the cap."""

import json
import os
import re

import pytest

from rpeg_jax.cli import main as rpeg
from rpeg_jax.config import load_config
from rpeg_jax.costmodel.context import make_context
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.data.pipeline import load_records, with_data_prompt_len
from rpeg_jax.data.tokenizer import load_tokenizer
from rpeg_jax.shapes.buckets import length_bucket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN2 = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2_tiny")


def test_rpeg_plan_on_an_uncalibrated_cpu_says_so_and_stays_under_100_percent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RPEG_CACHE", str(tmp_path / "empty"))
    assert rpeg(["plan", "--config", os.path.join(ROOT, "configs", "default.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"warning: the cpu profile is not calibrated on this machine", out)
    utils = [float(u) for u in re.findall(r" ([\d.]+)%  (?:colocated|split)", out)]
    assert len(utils) >= 3 and all(0 < u <= 100 for u in utils) and ">100%" not in out
    assert "util: the plan's own model FLOPs" in out and "d<data>f<fsdp>t<tensor>" in out  # the legend
    # a 135M model on the placeholder peak: the table and the plan's summary line say ">1?", no number above 1
    assert rpeg(["plan", "--config", os.path.join(ROOT, "configs", "default.yaml"), "model.preset=smollm2-135m"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("predicted: "))
    assert "utilization=>1? (above the peak: calibrate the profile)" in line, line
    assert all(float(u) <= 1.0 for u in re.findall(r"utilization(?:_own_work)?=([\d.]+)", line)), line


def test_a_jsonl_run_is_priced_at_its_datas_longest_prompt(tmp_path):
    data = tmp_path / "train.jsonl"
    questions = ["1+1?", "What is 12 times 7, added to 3?", "ok"]
    data.write_text("".join(json.dumps({"q": q, "a": "#### 2"}) + "\n" for q in questions))
    cfg = load_config(
        None,
        [f"model.path={QWEN2}", "data.task=jsonl", f"data.path={data}", "data.prompt_field=q", "data.answer_field=a"],
    )
    assert cfg.data.max_prompt_len > 64 and cfg.costmodel.prompt_len is None  # the cap the model priced before
    priced = with_data_prompt_len(cfg)
    records, _ = load_records(cfg.data, load_tokenizer(cfg.data), model_path=cfg.model.path)
    longest = max(len(r["prompt_tokens"]) for r in records)  # as the run renders (chat template) and tokenizes
    assert priced.costmodel.prompt_len == longest
    hw = load_hardware("cpu")
    assert make_context(priced, 1, hw).st.P == length_bucket(longest) < make_context(cfg, 1, hw).st.P
    assert with_data_prompt_len(priced) is priced  # a given costmodel.prompt_len is the user's


def test_the_weight_sync_estimate_says_its_bytes_and_link(capsys):
    args = ["plan", "--config", os.path.join(ROOT, "configs", "default.yaml"), "--hardware", "h100", "--gpus", "8"]
    assert rpeg(args + ["model.preset=qwen2-0.5b"]) == 0
    out = capsys.readouterr().out
    line = re.search(
        r"weight sync ([\d.]+) s: ([\d.]+) GB of rollout weights .*, (.*?); of which ([\d.]+) s fixed", out
    )
    assert line, out[-2000:]
    assert float(line.group(2)) == pytest.approx(494e6 * 4 / 1e9, rel=0.05)  # qwen2-0.5b's ~494M params in float32
    assert "reshard" in line.group(3) and float(line.group(4)) < float(line.group(1))
